"""A step's scheduled chunks flattened into model inputs and attention metadata.

The model runner builds these for the target and a model-running draft proposer
(tandem/spec/paged_draft.py) builds them for its own forwards over the same requests, so they
live here, below both. A step's chunks become one flat token stream, decodes (one token each)
first and prefill chunks after, with positions, slot mapping and block tables for the
attention backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.kernels.base import AttentionMetadata, PrefillSpan
from tandem.types import SamplingParams


@dataclass(slots=True)
class RequestState:
    """What the runner knows of one request, built from the scheduler's plain messages."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[int]
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self, start: int, count: int) -> list[int]:
        """Tokens [start, start + count) of prompt + output, without concatenating them."""
        prompt_len = len(self.prompt_token_ids)
        if start + count <= prompt_len:
            return self.prompt_token_ids[start : start + count]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : start - prompt_len + count]
        return self.prompt_token_ids[start:] + self.output_token_ids[: start + count - prompt_len]


@dataclass(slots=True)
class ScheduledChunk:
    """The slice of one request that runs this step, as the batch builder needs it."""

    request_id: str
    token_ids: list[int]
    start: int  # first position computed this step
    block_ids: list[int]
    samples: bool  # reaches the end of the known tokens, so produces the next token
    state: RequestState | None = field(default=None, repr=False)
    draft_token_ids: list[int] = field(default_factory=list)  # the chunk's last tokens: guesses to verify
    # Run each token as a decode row even without drafts (a proposer's short catch-up).
    rows_as_decodes: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_sample_rows(self) -> int:
        """Rows whose logits are needed: the last real token's and one per draft."""
        return len(self.draft_token_ids) + 1 if self.samples else 0


@dataclass(slots=True)
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # indices into the flat batch whose logits are needed
    sample_chunks: list[ScheduledChunk]
    sample_rows_in_order: bool = False  # every row is sampled, in order: no gather needed
    # request id -> the flat rows of its chunk's tokens, in token order
    rows_of: dict[str, Sequence[int]] = field(default_factory=dict)


@dataclass
class TargetStep:
    """What the target's step leaves for a model-running proposer (tandem/spec/paged_draft.py):
    each chunk, the tokens each request kept, the guesses the scheduler wants, and for EAGLE
    the target's aux hidden states with the flat rows of each chunk's tokens."""

    chunks: list[ScheduledChunk]
    kept: dict[str, list[int]]
    lookahead: dict[str, int]
    aux_hidden: torch.Tensor | None = None
    rows_of: dict[str, Sequence[int]] | None = None


def _decodes_a_row_each(chunk: ScheduledChunk) -> bool:
    """A one-token step over cached context, or a verification of drafts: each of its tokens
    attends like a decode (its context is the cache up to its own position), so it runs
    through the decode kernel as that many rows sharing one block table instead of as a
    prefill chunk (one gather of the context and one SDPA per request per layer)."""
    return chunk.start > 0 and (chunk.num_tokens == 1 or bool(chunk.draft_token_ids) or chunk.rows_as_decodes)


def prepare_batch(chunks: list[ScheduledChunk], block_size: int, device: torch.device | None = None) -> PreparedBatch:
    """Flatten chunks (decode rows first) into the model inputs and attention metadata, on
    `device` (default: the CPU) in one copy; prefill spans' block lists stay on the host."""
    decodes = [c for c in chunks if _decodes_a_row_each(c)]
    prefills = [c for c in chunks if not _decodes_a_row_each(c)]
    # Decode rows ordered by context length: the attention backend pads similar lengths together.
    rows = sorted(((c.start + j, c, j) for c in decodes for j in range(c.num_tokens)), key=lambda r: r[0])

    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    sample_chunks: list[ScheduledChunk] = []
    spans: list[PrefillSpan] = []
    row_of: dict[int, list[int]] = {id(c): [] for c in decodes}  # chunk -> its rows, in token order
    for position, chunk, j in rows:
        row_of[id(chunk)].append(len(input_ids))
        input_ids.append(chunk.token_ids[j])
        positions.append(position)
        slots.append(chunk.block_ids[position // block_size] * block_size + position % block_size)
    rows_of: dict[str, Sequence[int]] = {c.request_id: row_of[id(c)] for c in decodes}
    for chunk in sorted(decodes, key=lambda c: c.start):
        if chunk.samples:
            sample_rows.extend(row_of[id(chunk)][chunk.num_tokens - chunk.num_sample_rows :])
            sample_chunks.append(chunk)
    for chunk in prefills:
        q_start = len(input_ids)
        input_ids.extend(chunk.token_ids)
        chunk_positions = range(chunk.start, chunk.start + chunk.num_tokens)
        positions.extend(chunk_positions)
        blocks = chunk.block_ids
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in chunk_positions)
        if chunk.samples:
            sample_rows.extend(range(len(input_ids) - chunk.num_sample_rows, len(input_ids)))
            sample_chunks.append(chunk)
        rows_of[chunk.request_id] = range(q_start, len(input_ids))
        context_len = chunk.start + chunk.num_tokens
        num_blocks = -(-context_len // block_size)
        spans.append(PrefillSpan(q_start, chunk.num_tokens, context_len, torch.tensor(blocks[:num_blocks])))

    context_lens = [position + 1 for position, _, _ in rows]
    max_blocks = max((len(c.block_ids) for c in decodes), default=0)
    # One tensor built from one list, then split into views: each torch.tensor() call and
    # each row assignment costs microseconds, and at batch 1 they add up to a real share of
    # a step the model itself spends ~20 ms on.
    table_rows = [b for _, c, _ in rows for b in (*c.block_ids, *(0,) * (max_blocks - len(c.block_ids)))]
    sizes = [len(input_ids), len(positions), len(slots), len(sample_rows), len(context_lens), len(table_rows)]
    flat = torch.tensor(input_ids + positions + slots + sample_rows + context_lens + table_rows, dtype=torch.long)
    if device is not None and device.type != "cpu":
        # From pinned memory, without waiting: a copy from pageable memory synchronizes with
        # the stream, which under asynchronous scheduling holds the step before this one.
        flat = flat.pin_memory().to(device, non_blocking=True)
    ids_t, positions_t, slots_t, rows_t, lens_t, table_t = flat.split(sizes)
    meta = AttentionMetadata(
        slot_mapping=slots_t,
        num_decode_tokens=len(rows),
        decode_block_tables=table_t.view(len(rows), max_blocks),
        decode_context_lens=lens_t,
        decode_max_context_len=max(context_lens, default=0),
        prefills=spans,
        block_size=block_size,
    )
    return PreparedBatch(
        input_ids=ids_t,
        positions=positions_t,
        meta=meta,
        sample_rows=rows_t,
        sample_chunks=sample_chunks,
        sample_rows_in_order=sample_rows == list(range(len(input_ids))),
        rows_of=rows_of,
    )

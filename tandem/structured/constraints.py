"""The engine core's matchers: one per constrained sequence, beside the scheduler.

The scheduler asks this object four things (tandem/engine/scheduler.py): is a request's
grammar compiled yet (admission waits for it, so the engine never blocks on a compile); which
of a request's draft tokens the grammar allows (a draft it forbids is dropped before the
target verifies it); the masks of a scheduled step (filled on a helper thread, overlapped with
the forward: masks.py); and, with each kept token, whether the grammar took it, has ended the
output, or forces the next tokens (jump-forward: appended without sampling and computed in
the next forward with the sampled one).

A sequence that arrives with output already generated (a PD decode worker's handed tokens, a
migrated stream, a preempted request) has its matcher advanced over that output first, so it
continues where the grammar was. Compiled grammars are cached by text: an agent sends the same
tool schemas every turn, and a copy of a compiled matcher costs microseconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from tandem.structured.grammar import GrammarError, grammar_text
from tandem.structured.masks import MaskRows, PendingMasks
from tandem.types import Request

logger = logging.getLogger(__name__)

_COMPILED_CACHE = 64  # compiled grammars kept for reuse
_LOG_LIMIT = 0  # llguidance's own warnings: off (a client's grammar is not the operator's log)


@dataclass
class ConstraintStats:
    """Cumulative counters, reported in the engine's load (EngineLoad.structured)."""

    requests: int = 0
    compile_errors: int = 0
    compile_seconds: float = 0.0
    mask_rows: int = 0
    mask_seconds: float = 0.0
    forced_tokens: int = 0  # appended by jump-forward, without sampling
    drafts_rejected: int = 0  # draft tokens the grammar forbade before verification

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Sequence:
    matcher: llguidance.LLMatcher | None = None
    pending: Future | None = None
    error: str | None = None
    consumed: int = 0  # output tokens the matcher has taken
    reported: bool = False  # its compile error went out


@dataclass
class TokenizerSource:
    """How to build llguidance's view of the vocabulary: the model directory's tokenizer, the
    model's vocabulary width (its logits may be wider than the tokenizer) and its end tokens."""

    hf_dir: Path
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)


class GrammarConstraints:
    """Per-sequence matchers and the batch's masks. Built with the engine; the tokenizer view
    (0.5-3 s for a large vocabulary) is built on a helper thread at once, and a constrained
    request waits for it like for its compile."""

    def __init__(self, source: TokenizerSource, jump_forward: bool = True, threads: int | None = None) -> None:
        self.vocab_size = source.vocab_size
        self.jump_forward = jump_forward
        self.stats = ConstraintStats()
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._executor = llguidance.LLExecutor(num_threads=threads)
        self._tokenizer: Future[llguidance.LLTokenizer] = self._compiler.submit(self._build_tokenizer, source)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._compiled_lock = threading.Lock()
        self._sequences: dict[str, _Sequence] = {}

    @staticmethod
    def _build_tokenizer(source: TokenizerSource) -> llguidance.LLTokenizer:
        from tandem.loader.tokenizer import load_tokenizer

        started = time.perf_counter()
        tokenizer_json = load_tokenizer(source.hf_dir).backend_tokenizer.to_str()
        tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=source.vocab_size,
                                           eos_token=list(source.eos_token_ids) or None)
        logger.info("structured outputs: vocabulary of %d tokens indexed in %.2f s", source.vocab_size,
                    time.perf_counter() - started)
        return tokenizer

    # --- requests -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Start compiling a constrained request's grammar (nothing for a free one)."""
        guided = request.sampling_params.guided
        if guided is None:
            return
        self.stats.requests += 1
        sequence = _Sequence()
        sequence.pending = self._compiler.submit(self._compile, guided)
        self._sequences[request.request_id] = sequence

    def _compile(self, guided: Any) -> llguidance.LLMatcher:
        started = time.perf_counter()
        text = grammar_text(guided)
        with self._compiled_lock:
            template = self._compiled.get(text)
            if template is not None:
                self._compiled.move_to_end(text)
        if template is None:
            template = llguidance.LLMatcher(self._tokenizer.result(), text, log_level=_LOG_LIMIT)
            if template.is_error():
                raise GrammarError(template.get_error())
            with self._compiled_lock:
                self._compiled[text] = template
                while len(self._compiled) > _COMPILED_CACHE:
                    self._compiled.popitem(last=False)
        self.stats.compile_seconds += time.perf_counter() - started
        return template.deep_copy()

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._sequences

    def ready(self, request: Request) -> bool:
        """Whether the request may be scheduled: free, or its matcher compiled and caught up
        with the output it arrived with. A failed one never is: `failures` reports it once and
        the engine ends it with the error."""
        sequence = self._sequences.get(request.request_id)
        if sequence is None:
            return True
        if sequence.matcher is None and sequence.error is None:
            assert sequence.pending is not None
            if not sequence.pending.done():
                return False
            try:
                sequence.matcher = sequence.pending.result()
            except Exception as exc:  # GrammarError, or llguidance refusing the grammar
                self.stats.compile_errors += 1
                sequence.error = str(exc) or type(exc).__name__
            sequence.pending = None
            if sequence.matcher is not None:
                self._catch_up(request, sequence)
        return sequence.error is None

    def _catch_up(self, request: Request, sequence: _Sequence) -> None:
        """Advance over output generated before this engine saw the request."""
        assert sequence.matcher is not None
        behind = request.output_token_ids[sequence.consumed:]
        if behind and not sequence.matcher.consume_tokens(behind):
            sequence.error = f"the output it arrived with does not match its grammar ({sequence.matcher.get_error()})"
        sequence.consumed = request.num_output_tokens

    def wait_for_compile(self, timeout: float) -> bool:
        """Wait up to `timeout` s for a pending compile to end (the engine has nothing else
        to do); False when none is pending."""
        pending = [s.pending for s in self._sequences.values() if s.pending is not None and s.matcher is None]
        if not pending:
            return False
        wait(pending, timeout, return_when=FIRST_COMPLETED)
        return True

    def failures(self) -> list[tuple[str, str]]:
        """(request id, why) for each constrained request whose grammar failed, once each."""
        failed = []
        for request_id, sequence in self._sequences.items():
            if sequence.error is not None and not sequence.reported:
                sequence.reported = True
                failed.append((request_id, sequence.error))
        return failed

    def forget(self, request_id: str) -> None:
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None and sequence.pending is not None:
            sequence.pending.cancel()

    # --- a step ---------------------------------------------------------------------
    def valid_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar allows after the request's output."""
        matcher = self._matcher(request.request_id)
        if matcher is None or not drafts:
            return drafts
        keep = matcher.validate_tokens(drafts)
        self.stats.drafts_rejected += len(drafts) - keep
        return drafts[:keep]

    def masks(self, sampling: list[tuple[str, list[int]]]) -> PendingMasks | None:
        """Masks for the constrained requests among `sampling` ((request id, drafts to verify)),
        filled on the helper thread; None when none is constrained."""
        work = []
        row = 0
        for request_id, drafts in sampling:
            matcher = self._matcher(request_id)
            if matcher is not None:
                work.append((request_id, matcher, row, list(drafts)))
                row += len(drafts) + 1
        if not work:
            return None
        return PendingMasks(self._filler.submit(self._fill, work, row))

    def _fill(self, work: list[tuple[str, llguidance.LLMatcher, int, list[int]]], num_rows: int) -> MaskRows:
        started = time.perf_counter()
        bitmask = llg_numpy.allocate_token_bitmask(num_rows, self.vocab_size)
        if any(drafts for *_, drafts in work):
            llg_numpy.fill_next_token_bitmask_par_with_draft_tokens(
                self._executor, [(matcher, row, drafts) for _, matcher, row, drafts in work], bitmask)
        else:
            llg_numpy.fill_next_token_bitmask_par(self._executor, [(matcher, row) for _, matcher, row, _ in work],
                                                 bitmask)
        rows = {request_id: bitmask[row:row + len(drafts) + 1] for request_id, _, row, drafts in work}
        self.stats.mask_rows += num_rows
        self.stats.mask_seconds += time.perf_counter() - started
        return rows

    def accept(self, request: Request) -> str | None:
        """Advance over the request's new output tokens. None: go on; "stop": the grammar is
        complete (the output ends here); otherwise why the grammar refused a token."""
        sequence = self._sequences.get(request.request_id)
        if sequence is None or sequence.matcher is None:
            return None
        new = request.output_token_ids[sequence.consumed:]
        sequence.consumed = request.num_output_tokens
        matcher = sequence.matcher
        if new and not matcher.consume_tokens(new):
            return f"a token the grammar does not allow was generated ({matcher.get_error()})"
        return "stop" if matcher.is_stopped() else None

    def forced_tokens(self, request: Request, limit: int) -> list[int]:
        """Tokens the grammar allows no alternative to, next (at most `limit`): jump-forward."""
        if not self.jump_forward or limit <= 0:
            return []
        matcher = self._matcher(request.request_id)
        if matcher is None:
            return []
        forced = matcher.compute_ff_tokens()[:limit]
        if forced:
            self.stats.forced_tokens += len(forced)
        return forced

    def _matcher(self, request_id: str) -> llguidance.LLMatcher | None:
        sequence = self._sequences.get(request_id)
        if sequence is None or sequence.error is not None:
            return None
        return sequence.matcher

    def shutdown(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)
        self._filler.shutdown(wait=False, cancel_futures=True)


def mask_allows(rows: np.ndarray, token_id: int) -> bool:
    """Whether a mask row allows `token_id` (tests and checks)."""
    return bool((int(rows[token_id // 32]) >> (token_id % 32)) & 1)

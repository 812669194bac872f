"""Scheduled chunks flattened into one batch: which run as decode rows, which rows sample."""

from __future__ import annotations

from tandem.batch.prepared import ScheduledChunk, prepare_batch


def test_a_verification_runs_as_decode_rows_and_samples_its_own_rows_in_order() -> None:
    block = 4
    decode = ScheduledChunk("d", [7], 9, [0, 1, 2], True)  # one token at position 9
    verify = ScheduledChunk("v", [5, 50, 51], 4, [3, 4], True, draft_token_ids=[50, 51])  # positions 4..6
    prompt = ScheduledChunk("p", [1, 2, 3], 0, [5], True)
    batch = prepare_batch([decode, verify, prompt], block)
    meta = batch.meta
    # Every verification token is a decode row with its own context, sorted with the others.
    assert meta.num_decode_tokens == 4
    assert batch.positions.tolist() == [4, 5, 6, 9, 0, 1, 2]
    assert meta.decode_context_lens.tolist() == [5, 6, 7, 10]
    assert batch.input_ids.tolist() == [5, 50, 51, 7, 1, 2, 3]
    assert meta.decode_block_tables.tolist() == [[3, 4, 0], [3, 4, 0], [3, 4, 0], [0, 1, 2]]
    assert batch.meta.slot_mapping.tolist()[:4] == [4 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2, 2 * 4 + 1]  # position // 4 -> block
    assert [(s.q_start, s.q_len) for s in meta.prefills] == [(4, 3)]
    # Rows to sample: the verification's three in token order, then the decode's, then the prompt's last.
    assert [c.request_id for c in batch.sample_chunks] == ["v", "d", "p"]
    assert batch.sample_rows.tolist() == [0, 1, 2, 3, 6]
    assert not batch.sample_rows_in_order
    only_decodes = prepare_batch([ScheduledChunk("a", [1], 5, [0, 1], True), ScheduledChunk("b", [2], 3, [2], True)], block)
    assert only_decodes.sample_rows_in_order and [c.request_id for c in only_decodes.sample_chunks] == ["b", "a"]


def test_a_proposers_short_catch_up_runs_as_decode_rows() -> None:
    """Without drafts a chunk of several tokens is a prefill span, unless the proposer asks
    for decode rows (its 1-2 token catch-up after a step)."""

    plain = prepare_batch([ScheduledChunk("c", [5, 6], 8, [0, 1, 2], True)], 4)
    assert plain.meta.num_decode_tokens == 0 and len(plain.meta.prefills) == 1
    rows = prepare_batch([ScheduledChunk("c", [5, 6], 8, [0, 1, 2], True, rows_as_decodes=True)], 4)
    assert rows.meta.num_decode_tokens == 2 and not rows.meta.prefills
    assert rows.meta.decode_context_lens.tolist() == [9, 10]
    assert rows.sample_rows.tolist() == [1]  # only the last token's logits

"""The offline replay: verification steps counted as the engine's greedy verification would."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from tandem.bench.spec_replay import (
    Recorded,
    ReplayStats,
    common_prefix,
    main,
    read_outputs,
    replay,
)
from tandem.spec.ngram import NgramProposer
from tandem.spec.proposer import TokenProposer


class Oracle(TokenProposer):
    """Proposes the true continuation (or a wrong token at `wrong_at` of each draft)."""

    name = "oracle"

    def __init__(self, outputs: dict[int, list[int]], wrong_at: int | None = None) -> None:
        self.outputs = outputs
        self.wrong_at = wrong_at
        self.calls: list[tuple[str, int, int]] = []
        self.finished: list[str] = []

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                max_tokens: int) -> list[int]:
        self.calls.append((request_id, len(token_ids), max_tokens))
        output = self.outputs[num_prompt_tokens]
        drafts = list(output[len(token_ids) - num_prompt_tokens:][:max_tokens])
        if self.wrong_at is not None and self.wrong_at < len(drafts):
            drafts[self.wrong_at] = -1
        return drafts

    def request_finished(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.finished.append(request_id)


class Silent(TokenProposer):
    name = "silent"

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                max_tokens: int) -> list[int]:
        return []


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1]) == 1


def test_no_drafts_is_one_step_per_token() -> None:
    stats = replay(Silent(), [Recorded([1, 2, 3], list(range(10, 20)))], k=4)
    assert (stats.steps, stats.output_tokens, stats.drafted_steps) == (10, 10, 0)
    assert stats.steps_ratio == 1.0
    assert stats.predicted_speedup(0.01) == pytest.approx(1.0)


def test_right_drafts_land_k_plus_one_tokens_per_step_after_the_prompts_step() -> None:
    output = list(range(100, 121))  # 21 tokens
    oracle = Oracle({3: output})
    stats = replay(oracle, [Recorded([1, 2, 3], output)], k=4, max_tokens=128)
    assert stats.steps == 1 + 4  # the prompt's step samples 1 token, then 5 tokens a step
    assert stats.accepted_tokens == 16 and stats.draft_tokens == 16
    assert stats.acceptance_length == 5.0 and stats.acceptance_rate == 1.0
    assert oracle.calls[0] == ("replay-0", 4, 4)  # the prompt and the first sampled token
    assert stats.step_sizes == {1: 1, 5: 4}
    assert oracle.finished == ["replay-0"]


def test_a_wrong_draft_keeps_the_prefix_before_it_plus_the_targets_token() -> None:
    output = list(range(100, 113))  # 13 tokens
    stats = replay(Oracle({2: output}, wrong_at=2), [Recorded([1, 2], output)], k=4)
    assert stats.steps == 1 + 4  # then 3 tokens a step
    assert stats.accepted_tokens == 8 and stats.draft_tokens == 4 + 4 + 4 + 3  # the answer ends


def test_drafts_stop_at_max_tokens_and_at_the_end_of_the_answer() -> None:
    output = list(range(100, 110))  # 10 tokens, max_tokens 10: 1 output, then at most 8 drafts
    oracle = Oracle({1: output})
    stats = replay(oracle, [Recorded([1], output)], k=16, max_tokens=10)
    assert oracle.calls == [("replay-0", 2, 8)] and stats.steps == 2
    oracle = Oracle({1: output})
    stats = replay(oracle, [Recorded([1], output)], k=4, max_tokens=10)
    assert oracle.calls == [("replay-0", 2, 4), ("replay-0", 7, 3)]  # 1 + 5 tokens, then room for 3 + 1
    assert stats.steps == 3
    # An answer that ended early (a stop token): drafts past it count for nothing.
    short = [5, 6, 7]
    stats = replay(Oracle({1: short + [8, 9, 10]}), [Recorded([1], short)], k=8)
    assert stats.steps == 2 and stats.accepted_tokens == 1 and stats.output_tokens == 3


def test_requests_run_one_after_another_on_one_proposer() -> None:
    a, b = list(range(50, 60)), list(range(60, 70))
    oracle = Oracle({2: a, 3: b})
    stats = replay(oracle, [Recorded([1, 2], a), Recorded([1, 2, 3], b)], k=9)
    assert stats.requests == 2 and stats.steps == 2 + 2 and stats.output_tokens == 20
    assert oracle.finished == ["replay-0", "replay-1"]


def test_adaptive_k_verifies_fewer_wrong_guesses() -> None:
    output = list(range(100, 164))
    fixed = replay(Oracle({1: output}, wrong_at=0), [Recorded([1], output)], k=16)
    adaptive = replay(Oracle({1: output}, wrong_at=0), [Recorded([1], output)], k=16, adaptive=True)
    assert fixed.steps == adaptive.steps == 64  # every guess wrong: one token a step
    assert adaptive.draft_tokens < fixed.draft_tokens / 4


def test_a_real_proposer_copies_a_quoted_block() -> None:
    block = list(range(200, 240))
    stats = replay(NgramProposer(2, 5), [Recorded([1, *block, 2], [3, *block])], k=8)
    assert stats.steps_ratio > 3.0


def test_bad_k_is_refused() -> None:
    with pytest.raises(ValueError):
        replay(Silent(), [], k=0)


def test_stats_on_nothing_are_zero() -> None:
    stats = ReplayStats()
    assert stats.steps_ratio == stats.acceptance_length == stats.mean_k == stats.propose_us == 0.0


def _outputs_jsonl(tmp_path: Path, with_prompts: bool = True) -> Path:
    path = tmp_path / "outputs.jsonl"
    rows = [
        {"group": "g", "label": "baseline", "kind": "code", "batch": 1, "texts": ["x", "y"],
         "outputs": [[7, 8, 9, 7, 8, 9], [4, 4, 4]], "base_outputs": None},
        {"group": "g", "label": "baseline", "kind": "code", "batch": 8, "texts": ["z"],
         "outputs": [[1]], "base_outputs": None},
        {"group": "g", "label": "ngram k=4", "kind": "code", "batch": 1, "texts": ["x", "y"],
         "outputs": [[7, 8, 9, 7, 8, 9], [4, 4, 4]], "base_outputs": [[7, 8, 9, 7, 8, 9], [4, 4, 4]]},
    ]
    if with_prompts:
        for row in rows:
            row["prompt_token_ids"] = [[1, 7, 8, 9, 2], [5, 4]][:len(row["outputs"])]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_read_outputs_takes_the_batch_1_baseline(tmp_path: Path) -> None:
    found = read_outputs(_outputs_jsonl(tmp_path))
    assert list(found) == ["code"]
    assert found["code"] == [Recorded([1, 7, 8, 9, 2], [7, 8, 9, 7, 8, 9]), Recorded([5, 4], [4, 4, 4])]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        read_outputs(_outputs_jsonl(tmp_path, with_prompts=False))


def test_the_command_prints_a_row_per_configuration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(_outputs_jsonl(tmp_path)), "--methods", "ngram,suffix", "--ks", "2,4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + 2 * 3  # header; 2 methods x (k=2, k=4, adaptive)
    assert any(line.split()[1:3] == ["ngram", "k=4"] for line in lines)

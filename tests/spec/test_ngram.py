"""Prompt lookup: the longest recent n-gram seen before proposes what followed it."""

from __future__ import annotations

import pytest

from tandem.spec.ngram import NgramProposer


def test_the_longest_suffix_match_proposes_what_followed() -> None:
    proposer = NgramProposer(min_n=2, max_n=4)
    tokens = [1, 2, 3, 4, 5, 6, 9, 2, 3, 4]
    assert proposer.propose("a", tokens, 6, 3) == [5, 6, 9]
    # A longer match wins over a more recent shorter one.
    tokens = [7, 8, 9, 50, 8, 9, 60, 7, 8, 9]
    assert proposer.propose("b", tokens, 6, 2) == [50, 8]


def test_the_earliest_occurrence_of_the_longest_match_wins() -> None:
    proposer = NgramProposer(min_n=2, max_n=2)
    tokens = [1, 2, 10, 0, 1, 2, 20, 0, 1, 2]
    assert proposer.propose("a", tokens, 3, 1) == [10]


def test_no_match_shorter_than_min_n_and_the_token_limit() -> None:
    proposer = NgramProposer(min_n=3, max_n=5)
    assert proposer.propose("a", [1, 2, 9, 8, 1, 2], 3, 4) == []  # only a 2-gram repeats
    assert proposer.propose("b", [1, 2, 3, 4, 5, 1, 2, 3], 3, 0) == []
    assert proposer.propose("c", [1, 2, 3, 4, 5, 1, 2, 3], 3, 1) == [4]


def test_byte_search_never_matches_across_token_boundaries() -> None:
    # 0x0100 and 0x0001 packed little-endian contain the bytes of 0x00010000 at an odd offset.
    proposer = NgramProposer(min_n=1, max_n=1)
    tokens = [0x0100, 0x0001, 7, 0x00010000]
    assert proposer.propose("a", tokens, 4, 2) == []


def test_incremental_indexing_matches_a_fresh_proposer() -> None:
    growing = NgramProposer(2, 5)
    tokens = [5, 6, 7, 8]
    for token in [5, 6, 7, 9, 5, 6, 7, 8, 5, 6]:
        tokens.append(token)
        assert growing.propose("a", tokens, 4, 3) == NgramProposer(2, 5).propose("fresh", tokens, 4, 3)
    growing.request_finished("a", tokens, 4)
    assert growing.propose("a", [1, 2, 1], 1, 2) == []  # its old bytes are gone


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


def _reference_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[int, list[int]]:
    """The definition, by brute force: the longest n whose tail occurs earlier (ending before
    the last token), and what followed its earliest occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == tail:
                return n, tokens[start + n:start + n + k]
    return 0, []


def test_lookup_reports_the_match_length() -> None:
    proposer = NgramProposer(2, 24)
    block = list(range(100, 130))
    tokens = [1, *block, 2, *block[:12]]
    assert proposer.lookup("a", tokens, 5) == (12, block[12:17])
    assert proposer.lookup("b", [1, 2, 3, 4], 5) == (0, [])


def test_the_bisection_finds_the_longest_match_as_a_linear_search_would() -> None:
    import random

    rng = random.Random(7)
    for trial in range(400):
        vocab = rng.choice([2, 3, 5, 40])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        if rng.random() < 0.5 and len(tokens) > 8:  # a copy in progress
            cut = rng.randrange(2, len(tokens) // 2)
            tokens = tokens + tokens[:cut]
        min_n = rng.choice([1, 2, 3])
        max_n = rng.choice([min_n, 5, 12, 24])
        expected = _reference_lookup(tokens, min_n, max_n, 6)
        assert NgramProposer(min_n, max_n).lookup(f"r{trial}", tokens, 6) == expected, (tokens, min_n, max_n)

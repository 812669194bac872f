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

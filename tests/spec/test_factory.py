"""The engine core's proposer from `--speculative-config`: the keys reach the proposer."""

from __future__ import annotations

import pytest

from tandem.config import SpeculativeConfig
from tandem.spec.factory import make_token_proposer
from tandem.spec.ngram import NgramProposer
from tandem.spec.suffix import SuffixProposer


def test_ngram_takes_the_prompt_lookup_keys() -> None:
    proposer = make_token_proposer(SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 3, "prompt_lookup_max": 7}'))
    assert isinstance(proposer, NgramProposer)
    assert (proposer.min_n, proposer.max_n) == (3, 7)


def test_suffix_looks_up_the_request_first_by_default() -> None:
    proposer = make_token_proposer(SpeculativeConfig.from_json('{"method": "suffix", "num_speculative_tokens": 8}'))
    assert isinstance(proposer, SuffixProposer)
    assert proposer.config.prompt_lookup and proposer.config.lookup_min == 2
    seq = [2, 3, 4, 5, 0, 2, 3, 9, 8, 0, 2, 3, 9, 8, 7, 2, 3]
    assert proposer.draft("r", seq, 8).source == "lookup"


def test_suffix_keys_reach_the_suffix_config() -> None:
    config = SpeculativeConfig.from_json(
        '{"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_prompt_lookup": false, '
        '"suffix_decoding_max_tree_depth": 16, "suffix_decoding_max_cached_requests": 5, '
        '"suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_min_token_prob": 0.2, "prompt_lookup_min": 3}')
    proposer = make_token_proposer(config)
    assert isinstance(proposer, SuffixProposer)
    c = proposer.config
    assert (c.prompt_lookup, c.max_tree_depth, c.max_cached_requests, c.max_spec_factor, c.min_token_prob,
            c.lookup_min) == (False, 16, 5, 2.0, 0.2, 3)


@pytest.mark.parametrize(("keys", "message"), [
    ('"suffix_decoding_prompt_lookup": "yes"', "suffix_decoding_prompt_lookup must be true or false"),
    ('"suffix_decoding_prompt_lookup": 1', "suffix_decoding_prompt_lookup must be true or false"),
    ('"prompt_lookup_min": 5, "prompt_lookup_max": 9, "suffix_decoding_max_tree_depth": 4',
     "prompt_lookup_min (5) must be <= suffix_decoding_max_tree_depth (4)"),
])
def test_bad_suffix_lookup_settings_are_refused(keys: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.from_json(f'{{"method": "suffix", "num_speculative_tokens": 4, {keys}}}')


def test_a_deep_prompt_lookup_min_is_fine_without_lookup_or_for_ngram() -> None:
    SpeculativeConfig.from_json('{"method": "suffix", "num_speculative_tokens": 4, "prompt_lookup_min": 5, '
                                '"prompt_lookup_max": 9, "suffix_decoding_max_tree_depth": 4, '
                                '"suffix_decoding_prompt_lookup": false}')
    SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, '
                                '"prompt_lookup_max": 9, "suffix_decoding_max_tree_depth": 4}')

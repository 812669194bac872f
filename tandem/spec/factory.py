"""Build the engine core's speculator from `--speculative-config`. Torch-free."""

from __future__ import annotations

from tandem.config import SpeculativeConfig
from tandem.spec.ngram import NgramProposer
from tandem.spec.proposer import TokenProposer
from tandem.spec.speculator import Speculator


def make_token_proposer(config: SpeculativeConfig) -> TokenProposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        from tandem.spec.suffix import SuffixConfig, SuffixProposer

        return SuffixProposer(SuffixConfig(
            max_tree_depth=config.suffix_decoding_max_tree_depth,
            max_cached_requests=config.suffix_decoding_max_cached_requests,
            max_spec_factor=config.suffix_decoding_max_spec_factor,
            min_token_prob=config.suffix_decoding_min_token_prob,
            prompt_lookup=config.suffix_decoding_prompt_lookup,
            lookup_min=config.prompt_lookup_min,
        ))
    raise ValueError(f"speculative method {config.method!r} does not run in the engine core")


WORKER_METHODS = ("draft_model", "eagle3")  # proposers that run a model, on the worker


def make_speculator(config: SpeculativeConfig, role: str = "both") -> Speculator | None:
    """None when speculation is off, or on a prefill worker: it samples one token per
    request, so there is nothing to guess (a draft model would only cost memory)."""
    if not config.enabled or role == "prefill":
        return None
    if config.method in WORKER_METHODS:
        return Speculator(config, None)
    return Speculator(config, make_token_proposer(config))

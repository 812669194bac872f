"""`tandem bench perplexity`: the flags and the handler, apart from the torch code they run.

`tandem.bench.perplexity` imports torch and the engine at module level; building the CLI parser
(which `tandem route` does too, and it must stay torch-free) only needs this module. The heavy
module is imported when the command actually runs.
"""

from __future__ import annotations

import argparse

from tandem.flags.table import Command, Flag, FlagTable

# key -> (label, LLM keywords); the first is the baseline every other is compared with.
MODES: dict[str, tuple[str, dict[str, str]]] = {
    "fp32": ("fp32 (exact)", {"dtype": "float32", "decode_weights": "none"}),
    "fp32+fp16": ("fp32 + fp16 decode weights", {"dtype": "float32", "decode_weights": "float16"}),
    "fp32+bf16": ("fp32 + bf16 decode weights", {"dtype": "float32", "decode_weights": "bfloat16"}),
    "fp32+int4": ("fp32 + int4 decode weights", {"dtype": "float32", "decode_weights": "int4"}),
    "fp32+fp32": ("fp32 + fp32 decode weights", {"dtype": "float32", "decode_weights": "float32"}),
    "bf16": ("bf16", {"dtype": "bfloat16"}),
    "bf16+int4": ("bf16 + int4 decode weights", {"dtype": "bfloat16", "decode_weights": "int4"}),
    "fp32+int8": ("fp32 + int8 (W8A8)", {"dtype": "float32", "quantization": "int8"}),
    "bf16+int8": ("bf16 + int8 (W8A8)", {"dtype": "bfloat16", "quantization": "int8"}),
}


PERPLEXITY_FLAGS = FlagTable(None, (
    Flag("model", nargs="?", help="model (default: smollm2-135m)"),
    Flag(
        "--modes", metavar="KEYS",
        help=f"comma-separated subset of {','.join(MODES)} (default: all); exact fp32 "
        "always runs, as the baseline",
    ),
))


def add_perplexity_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "perplexity",
        help="perplexity of a fixed text: exact fp32 vs the fast weight formats",
        description="Perplexity of ~3,700 tokens of standard-library docstrings, fed one token per "
        "step (the decode path, which --decode-weights copies serve) and in 64-token chunks (the "
        "prefill path), in exact fp32, with fp16, bf16, int4 and fp32-GEMV decode weights, in bf16 "
        "(alone and with int4 decode weights) and with 8-bit weights and activations "
        "(--quantization int8). Every mode beside exact fp32. Takes about fifteen minutes on two "
        "cores for all of them.",
    )
    PERPLEXITY_FLAGS.add_to(parser)
    Command(run_perplexity, check_perplexity).install(parser)


def _chosen_modes(keys: str | None) -> list[tuple[str, dict[str, str]]]:
    if keys is None:
        return list(MODES.values())
    wanted = [key.strip() for key in keys.split(",") if key.strip()]
    unknown = [key for key in wanted if key not in MODES]
    if unknown:
        raise ValueError(f"--modes: unknown mode {', '.join(unknown)}; choose from {', '.join(MODES)}")
    return [MODES["fp32"], *(MODES[key] for key in wanted if key != "fp32")]


def check_perplexity(args: argparse.Namespace) -> None:
    """An unknown --modes key fails at parse time, before any model loads."""
    _chosen_modes(args.modes)


def run_perplexity(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tandem.bench.perplexity import long_text, perplexity
    from tandem.llm import LLM

    modes = _chosen_modes(args.modes)
    # The 272-token passage this used to decode could not resolve 1%: its perplexity moved by
    # up to 3% with unrelated last-bit changes. Both paths now read the same long text.
    results = []
    for label, kwargs in tqdm(modes, desc="perplexity", unit="mode"):
        llm = LLM(args.model, kv_cache_memory="256MiB", **kwargs)
        tokens = llm.tokenizer.encode(long_text())[:4000]
        results.append((label, perplexity(llm.engine, tokens, step_tokens=1),
                        perplexity(llm.engine, tokens, step_tokens=64)))
        del llm
    base, chunked_base = results[0][1], results[0][2]
    print(f"perplexity of {len(tokens)} tokens of standard-library docstrings, one token per step (the "
          "decode path) and in 64-token chunks (the prefill path)")
    print(f"  {'mode':<30} {'one token per step':>20}   {'64-token chunks':>20}")
    for label, value, chunked in results:
        print(f"  {label:<30} {value:9.4f} ({(value / base - 1) * 100:+6.2f}%)   "
              f"{chunked:9.4f} ({(chunked / chunked_base - 1) * 100:+6.2f}%)")
    return 0

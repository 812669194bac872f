"""`tandem bench perplexity`: the flags and the handler, apart from the torch code they run.

`tandem.bench.perplexity` imports torch and the engine at module level; building the CLI parser
(which `tandem route` does too, and it must stay torch-free) only needs this module. The heavy
module is imported when the command actually runs.
"""

from __future__ import annotations

import argparse


def add_perplexity_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "perplexity",
        help="perplexity of a fixed text: exact fp32 vs the fast weight formats",
        description="Perplexity of a fixed passage, fed one token per step (the decode path), and "
        "of ~3,700 tokens of standard-library docstrings in 64-token chunks (the prefill path), "
        "in exact fp32, with fp16, bf16 and int4 decode weights (--decode-weights), in bf16 "
        "(alone and with int4 decode weights) and with 8-bit weights and activations "
        "(--quantization int8).",
    )
    parser.add_argument("model", nargs="?", default=None, help="model (default: smollm2-135m)")
    parser.set_defaults(handler=run_perplexity)


def run_perplexity(args: argparse.Namespace) -> int:
    from tandem.bench.perplexity import REFERENCE_TEXT, long_text, perplexity
    from tandem.llm import LLM

    modes = [
        ("fp32 (exact)", {"dtype": "float32", "decode_weights": "none"}),
        ("fp32 + fp16 decode weights", {"dtype": "float32", "decode_weights": "float16"}),
        ("fp32 + bf16 decode weights", {"dtype": "float32", "decode_weights": "bfloat16"}),
        ("fp32 + int4 decode weights", {"dtype": "float32", "decode_weights": "int4"}),
        ("bf16", {"dtype": "bfloat16"}),
        ("bf16 + int4 decode weights", {"dtype": "bfloat16", "decode_weights": "int4"}),
        ("fp32 + int8 (W8A8)", {"dtype": "float32", "quantization": "int8"}),
        ("bf16 + int8 (W8A8)", {"dtype": "bfloat16", "quantization": "int8"}),
    ]
    results = []
    for label, kwargs in modes:
        llm = LLM(args.model, kv_cache_memory="256MiB", **kwargs)
        tokens = llm.tokenizer.encode(REFERENCE_TEXT)
        long_tokens = llm.tokenizer.encode(long_text())[:4000]
        results.append((label, perplexity(llm.engine, tokens, step_tokens=1),
                        perplexity(llm.engine, long_tokens, step_tokens=64)))
        del llm
    base, long_base = results[0][1], results[0][2]
    print(f"perplexity of a fixed {len(tokens)}-token passage, one token per step (the decode path), and of "
          f"{len(long_tokens)} tokens of standard-library docstrings in 64-token chunks (the prefill path)")
    for label, value, long_value in results:
        print(f"  {label:<30} {value:8.4f} ({(value / base - 1) * 100:+.2f}%)   "
              f"{long_value:8.4f} ({(long_value / long_base - 1) * 100:+.2f}%)   vs fp32")
    return 0

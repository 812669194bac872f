"""`tandem bench perplexity`: the flags and the handler, apart from the torch code they run.

`tandem.bench.perplexity` imports torch and the engine at module level; building the CLI parser
(which `tandem route` does too, and it must stay torch-free) only needs this module. The heavy
module is imported when the command actually runs.
"""

from __future__ import annotations

import argparse

from tandem.flags.table import Command, Flag, FlagTable

# kvcache/codec.py's, but the cache's own bytes; and fp8, the fp8 cache's rounding with the
# worker's per-layer scales, applied to the cached values of a model's-dtype cache
KV_DTYPES = ("bfloat16", "int8", "int4", "fp8")
KV_CACHE_DTYPES_MEASURED = ("int8", "bfloat16", "fp8")  # --kv-cache-dtype values a CPU run can measure

# key -> (label, LLM keywords); the first is the baseline every other is compared with. Every
# mode names all three settings, so none takes the CPU's default mode's `auto`; "default" is
# that mode itself (platform/cpu_modes.py), whatever this CPU makes of it.
def _mode(dtype: str, decode_weights: str = "none", quantization: str = "none") -> dict[str, str]:
    return {"dtype": dtype, "decode_weights": decode_weights, "quantization": quantization}


MODES: dict[str, tuple[str, dict[str, str]]] = {
    "fp32": ("fp32 (exact)", _mode("float32")),
    "fp32+fp16": ("fp32 + fp16 decode weights", _mode("float32", "float16")),
    "fp32+bf16": ("fp32 + bf16 decode weights", _mode("float32", "bfloat16")),
    "fp32+int4": ("fp32 + int4 decode weights", _mode("float32", "int4")),
    "fp32+fp32": ("fp32 + fp32 decode weights", _mode("float32", "float32")),
    "bf16": ("bf16", _mode("bfloat16")),
    "bf16+int4": ("bf16 + int4 decode weights", _mode("bfloat16", "int4")),
    "fp32+int8": ("fp32 + int8 (W8A8)", _mode("float32", quantization="int8")),
    "bf16+int8": ("bf16 + int8 (W8A8)", _mode("bfloat16", quantization="int8")),
    "fp32+int8+int4": ("fp32 + int8 + int4 decode", _mode("float32", "int4", "int8")),
    "bf16+int8+int4": ("bf16 + int8 + int4 decode", _mode("bfloat16", "int4", "int8")),
    "bf16+w8a16": ("bf16 + 8-bit weights (W8A16)", _mode("bfloat16", quantization="w8a16")),
    "bf16+w8a16+int4": ("bf16 + W8A16 + int4 decode", _mode("bfloat16", "int4", "w8a16")),
    "default": ("this CPU's default mode", {}),
}


PERPLEXITY_FLAGS = FlagTable(None, (
    Flag("model", nargs="?", help="model (default: smollm2-135m)"),
    Flag(
        "--modes", metavar="KEYS",
        help=f"comma-separated subset of {','.join(MODES)} (default: all); exact fp32 "
        "always runs, as the baseline",
    ),
    Flag(
        "--kv-dtypes", metavar="KEYS",
        help="instead of the weight modes, the KV codecs of the transfer and tier flags, and fp8, "
        "an fp8 cache's rounding with the per-layer scales the worker measures "
        f"(comma-separated of {','.join(KV_DTYPES)}): perplexity with every cached value "
        "through the codec, and greedy agreement (prompts whose continuation is token for token "
        "the exact cache's) with the prompt's KV through it (a handoff or a tier load) and with "
        "all of it (a cache of that dtype), on the model's own dtype",
    ),
    Flag(
        "--kv-cache-dtypes", metavar="KEYS",
        help=f"with --kv-dtypes: also the cache itself in these dtypes (comma-separated of "
        f"{','.join(KV_CACHE_DTYPES_MEASURED)}; default: int8; 'none' for none): perplexity through "
        "the engine, and greedy agreement of `generate` against the model's-dtype cache's",
        default="int8",
    ),
    Flag("--agreement-prompts", "prompts for the greedy agreement (default: 16)", 16, type=int, metavar="N"),
    Flag("--agreement-tokens", "tokens each continuation runs for (default: 256)", 256, type=int, metavar="N"),
))


def add_perplexity_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "perplexity",
        help="perplexity of a fixed text: exact fp32 vs the fast weight formats",
        description="Perplexity of ~3,700 tokens of standard-library docstrings, fed one token per "
        "step (the decode path, which --decode-weights copies serve) and in 64-token chunks (the "
        "prefill path), in exact fp32, with fp16, bf16, int4 and fp32-GEMV decode weights, in bf16 "
        "(alone and with int4 decode weights) and with 8-bit weights and activations "
        "(--quantization int8), those combined, and this CPU's default mode: every mode beside "
        "exact fp32, with the share of greedy continuations (one prompt at a time) identical to "
        "exact fp32's. Takes about half an hour on two cores for all of them.",
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


def _chosen_kv_dtypes(keys: str) -> list[str]:
    wanted = [key.strip() for key in keys.split(",") if key.strip()]
    unknown = [key for key in wanted if key not in KV_DTYPES]
    if unknown or not wanted:
        raise ValueError(f"--kv-dtypes: unknown KV dtype {', '.join(unknown) or '(none)'}; choose from "
                         f"{', '.join(KV_DTYPES)}")
    return wanted


def _chosen_cache_dtypes(keys: str) -> list[str]:
    wanted = [key.strip() for key in keys.split(",") if key.strip() and key.strip() != "none"]
    unknown = [key for key in wanted if key not in KV_CACHE_DTYPES_MEASURED]
    if unknown:
        raise ValueError(f"--kv-cache-dtypes: unknown cache dtype {', '.join(unknown)}; choose from "
                         f"{', '.join(KV_CACHE_DTYPES_MEASURED)} or none")
    return wanted


def check_perplexity(args: argparse.Namespace) -> None:
    """An unknown --modes or --kv-dtypes key fails at parse time, before any model loads."""
    _chosen_modes(args.modes)
    _chosen_cache_dtypes(args.kv_cache_dtypes)
    if args.kv_dtypes is not None:
        _chosen_kv_dtypes(args.kv_dtypes)
        if args.modes is not None:
            raise ValueError("--kv-dtypes measures the KV codecs on the model's own dtype: leave out --modes")
    if args.agreement_prompts < 1 or args.agreement_tokens < 1:
        raise ValueError("--agreement-prompts and --agreement-tokens must be at least 1")


def run_perplexity(args: argparse.Namespace) -> int:
    if args.kv_dtypes is not None:
        return run_kv_quality(args)
    from tqdm import tqdm

    from tandem.bench.perplexity import long_text, perplexity
    from tandem.llm import LLM
    from tandem.types import SamplingParams

    modes = _chosen_modes(args.modes)
    # The 272-token passage this used to decode could not resolve 1%: its perplexity moved by
    # up to 3% with unrelated last-bit changes. Both paths now read the same long text.
    results, outs = [], []
    params = SamplingParams(temperature=0, max_tokens=args.agreement_tokens, ignore_eos=True)
    for label, kwargs in tqdm(modes, desc="perplexity", unit="mode"):
        llm = LLM(args.model, kv_cache_memory="256MiB", **kwargs)
        try:
            tokens = llm.tokenizer.encode(long_text())[:4000]
            prompts = _agreement_prompts(tokens, args.agreement_prompts)
            load = llm.engine.config.load
            results.append((label, load.mode_line() if not kwargs else "", perplexity(llm.engine, tokens, step_tokens=1),
                            perplexity(llm.engine, tokens, step_tokens=64)))
            # One prompt at a time: a single stream's steps, which the decode weights serve.
            outs.append([list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids)
                         for p in prompts])
        finally:
            llm.shutdown()
    base, chunked_base = results[0][2], results[0][3]
    print(f"perplexity of {len(tokens)} tokens of standard-library docstrings, one token per step (the "
          "decode path) and in 64-token chunks (the prefill path); greedy agreement with exact fp32: "
          f"{args.agreement_prompts} prompts of 192 tokens, {args.agreement_tokens} tokens each, one at a time")
    print(f"  {'mode':<30} {'one token per step':>20}   {'64-token chunks':>20}   {'agreement (first miss)':>22}")
    for (label, line, value, chunked), mine in zip(results, outs, strict=True):
        same, first = _agreement(outs[0], mine)
        print(f"  {label:<30} {value:9.4f} ({(value / base - 1) * 100:+6.2f}%)   "
              f"{chunked:9.4f} ({(chunked / chunked_base - 1) * 100:+6.2f}%)   {same * 100:12.1f}% ({first:5.1f})")
        if line:
            print(f"  {'':<30} {line}")
    return 0


def _agreement_prompts(tokens: list[int], count: int, prompt_len: int = 192) -> list[list[int]]:
    """`count` prompts of `prompt_len` tokens spread over the text."""
    stride = max(1, (len(tokens) - prompt_len) // count)
    return [tokens[i * stride : i * stride + prompt_len] for i in range(count)]


def run_kv_quality(args: argparse.Namespace) -> int:
    """Perplexity and greedy agreement of each KV codec against the exact cache."""
    import torch
    from tqdm import tqdm

    from tandem.bench.perplexity import (
        Fp8Rounding,
        greedy_tokens,
        long_text,
        measured_fp8_scales,
        perplexity,
    )
    from tandem.kvcache.codec import KVCodec
    from tandem.llm import LLM

    names = _chosen_kv_dtypes(args.kv_dtypes)
    llm = LLM(args.model, kv_cache_memory="512MiB", exact=True)  # the KV's loss alone, on exact fp32
    engine = llm.engine
    tokens = llm.tokenizer.encode(long_text())[:4000]
    prompt_len, count, steps = 192, args.agreement_prompts, args.agreement_tokens
    prompts = _agreement_prompts(tokens, count, prompt_len)
    runs = 1 + 2 * len(names)
    bar = tqdm(total=runs * (count + 1), desc="kv quality", unit="run")

    fp8 = measured_fp8_scales(engine, []) if "fp8" in names else None

    def measure(codec: KVCodec | Fp8Rounding | None, prompt_only: bool) -> tuple[float | None, list[list[int]]]:
        value = None
        if not prompt_only:
            value = perplexity(engine, tokens, step_tokens=64, kv_codec=codec)
        bar.update(1)
        outs = []
        for prompt in prompts:
            outs.append(greedy_tokens(engine, prompt, steps, kv_codec=codec, prompt_only=prompt_only))
            bar.update(1)
        return value, outs

    base_ppl, base_outs = measure(None, False)
    cache = engine.runner.kv_cache
    chunk = (*cache.shape[:3], 16, *cache.shape[4:])  # a tier chunk's 16 blocks (int4 keys group tokens)
    bf16_bytes = KVCodec("raw").payload_bytes(chunk, torch.bfloat16)
    rows = []
    for name in names:
        codec = fp8 if name == "fp8" and fp8 is not None else KVCodec(name)  # fp8 is set when named
        ppl, all_outs = measure(codec, False)
        _, handoff_outs = measure(codec, True)
        nbytes = codec.payload_bytes(chunk, cache.dtype)
        rows.append((name, nbytes / bf16_bytes, ppl, _agreement(base_outs, handoff_outs), _agreement(base_outs, all_outs)))
    bar.close()
    assert base_ppl is not None
    cache_rows = _measure_cache_dtypes(args, tokens, prompts, steps, cache.shape[-1])
    print(f"{args.model or 'smollm2-135m'} ({cache.dtype}), {len(tokens)} tokens of standard-library docstrings in "
          f"64-token chunks; greedy agreement: {count} prompts of {prompt_len} tokens, {steps} tokens each")
    print(f"  {'KV':<11} {'bytes vs bf16':>13} {'perplexity':>20} {'agreement, prompt KV':>22} "
          f"{'agreement, all KV':>19}")
    print(f"  {'exact':<11} {'':>13} {base_ppl:9.4f}{'':>11}")
    for name, ratio, ppl, handoff, whole in rows:
        print(f"  {name:<11} {ratio:12.3f}x {ppl:9.4f} ({(ppl / base_ppl - 1) * 100:+6.2f}%) "
              f"{handoff[0] * 100:8.1f}% (first miss {handoff[1]:5.1f}) {whole[0] * 100:6.1f}% ({whole[1]:5.1f})")
    for name, ratio, ppl, base_cache_ppl, agreement in cache_rows:
        print(f"  {name + ' cache':<11} {ratio:12.3f}x {ppl:9.4f} ({(ppl / base_cache_ppl - 1) * 100:+6.2f}%) "
              f"{'':>22} {agreement[0] * 100:6.1f}% ({agreement[1]:5.1f})")
    if fp8 is not None:
        from tandem.worker.kv_scales import describe

        print(f"  fp8: float8 e4m3 rounding with the worker's per-layer scales ({describe(list(fp8.scales))}), "
              "on this cache (the 'fp8 cache' row, where measured, is the cache itself)")
    print("  agreement: share of continuations token for token the exact cache's; first miss: the mean "
          "position of the first differing token (the run's length where none differs)")
    if cache_rows:
        print("  a '... cache' row is --kv-cache-dtype itself: perplexity through the engine beside the "
              "model's-dtype cache's, greedy agreement of generate() against generate() on that cache")
    llm.shutdown()
    return 0


def _measure_cache_dtypes(args: argparse.Namespace, tokens: list[int], prompts: list[list[int]], steps: int,
                          head_dim: int) -> list[tuple[str, float, float, float, tuple[float, float]]]:
    """Each --kv-cache-dtypes cache measured whole, through the engine's own paths: perplexity
    in 64-token chunks, and greedy `generate` (the scheduler, the C decode kernel) against the
    same on the model's-dtype cache. (name, bytes vs bf16, perplexity, the base's, agreement)."""
    names = _chosen_cache_dtypes(args.kv_cache_dtypes)
    if not names:
        return []
    import torch

    from tandem.bench.perplexity import perplexity
    from tandem.kernels.kv_format import stored_row_width
    from tandem.llm import LLM
    from tandem.types import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]

    def run(kv_cache_dtype: str) -> tuple[float, list[list[int]]]:
        llm = LLM(args.model, kv_cache_memory="512MiB", kv_cache_dtype=kv_cache_dtype, exact=True)
        try:
            value = perplexity(llm.engine, tokens, step_tokens=64)
            outs = [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]
        finally:
            llm.shutdown()
        return value, outs

    base_ppl, base_outs = run("auto")
    rows = []
    for name in names:
        ppl, outs = run(name)
        cache = {"int8": torch.uint8, "fp8": torch.float8_e4m3fn}.get(name, torch.bfloat16)
        ratio = stored_row_width(head_dim, cache) * cache.itemsize / (2 * head_dim)  # vs bf16 rows
        rows.append((name, ratio, ppl, base_ppl, _agreement(base_outs, outs)))
    return rows


def _agreement(base: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(share of identical continuations, mean position of the first difference)."""
    same, firsts = 0, []
    for a, b in zip(base, other, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        same += first == len(a)
        firsts.append(first)
    return same / len(base), sum(firsts) / len(firsts)

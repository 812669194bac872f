"""The command line as a user runs it: real processes on the default model.

Greedy (temperature 0) completions of the default model are checked word for word: they are
the same on every machine the README's examples came from, and a change in them means a
change in what the engine computes.
"""

from __future__ import annotations

import re
import subprocess
import sys

TANDEM = [sys.executable, "-m", "tandem.cli.main"]
# 64 MiB of float32 KV for SmolLM2-135M (30 layers x 3 KV heads x 64 dims, K and V):
# 2,949,120 bytes a block of 64 tokens (a CPU's default), so 22 whole blocks.
KV_LINE = re.compile(r"KV cache: 22 blocks = 1408 tokens \(0\.06 GiB, float32\); max model len 1408; "
                     r"(cpu|torch) attention; 1 rank; ready in \d+\.\d s")


def _run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(TANDEM + args, input=stdin, capture_output=True, text=True, timeout=300)


def _commands(help_text: str) -> list[str]:
    """The subcommands a --help lists (argparse indents each name by four spaces)."""
    return re.findall(r"^    ([\w-]+)(?: |$)", help_text, re.MULTILINE)


def test_help_lists_commands() -> None:
    result = _run(["--help"])
    assert result.returncode == 0
    assert _commands(result.stdout) == ["up", "serve", "route", "keys", "generate", "chat", "bench", "plan", "spec"]
    assert "    generate            complete prompts offline and print the text\n" in result.stdout
    bench = _run(["bench", "--help"])
    assert bench.returncode == 0 and _commands(bench.stdout) == ["chaos", "cold-start", "gpu", "kv-tiers", "offline", "overhead", "perplexity", "plan", "serve", "spec", "tools"]


def test_generate_prints_completion_and_reports_kv_cache() -> None:
    result = _run(["--log-level", "INFO", "generate", "-p", "def fibonacci(n):", "--max-tokens", "12",
                   "--kv-cache-memory", "64MiB"])
    assert result.returncode == 0, result.stderr
    assert KV_LINE.search(result.stderr), result.stderr
    # the README's example, cut at 12 tokens
    assert result.stdout == "\n    if n == 0:\n        return 1\n   \n"


def test_chat_answers_each_line_with_the_conversation_so_far() -> None:
    lines = "What is the capital of France?\nAnd of Italy?\n/reset\nWhat is the capital of France?\n"
    result = _run(["chat", "--max-tokens", "20", "--temperature", "0", "--kv-cache-memory", "64MiB"],
                  stdin=lines)
    assert result.returncode == 0, result.stderr
    # "And of Italy?" is answered from the history; after /reset the first answer comes again.
    assert result.stdout.split("you> ") == [
        "",
        "assistant> The capital of France is Paris.\n",
        "assistant> The capital of Italy is Rome.\n",
        "",  # /reset prints nothing
        "assistant> The capital of France is Paris.\n",
        "",  # end of input
    ]
    assert "type a message, /reset to start over, Ctrl-D to quit." in result.stderr


def test_bad_value_is_a_clear_error() -> None:
    result = _run(["generate", "-p", "hi", "--top-p", "1.5", "--kv-cache-memory", "64MiB"])
    assert result.returncode == 2
    assert "top_p must be in (0, 1]" in result.stderr
    missing = _run(["generate", "/no/such/model", "-p", "hi"])
    assert missing.returncode == 2 and "not found" in missing.stderr


def test_model_may_be_given_as_a_flag_too() -> None:
    """`tandem up --model qwen2.5-coder-0.5b`, as vLLM users type it, is the positional MODEL."""
    from tandem.cli.main import build_parser
    from tandem.flags.engine import settle_model

    parser = build_parser()
    for argv in (["up", "--model", "qwen2.5-coder-0.5b"], ["up", "qwen2.5-coder-0.5b"],
                 ["serve", "qwen2.5-coder-0.5b", "--model", "qwen2.5-coder-0.5b"]):
        args = parser.parse_args(argv)
        settle_model(args)
        assert args.model == "qwen2.5-coder-0.5b", argv
    result = _run(["up", "smollm2-135m-x", "--model", "qwen2.5-coder-0.5b"])
    assert result.returncode == 2 and "two models given" in result.stderr

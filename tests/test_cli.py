"""The command line as a user runs it: real processes on the default model."""

from __future__ import annotations

import subprocess
import sys

TANDEM = [sys.executable, "-m", "tandem.cli"]


def _run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(TANDEM + args, input=stdin, capture_output=True, text=True, timeout=300)


def test_help_lists_commands() -> None:
    result = _run(["--help"])
    assert result.returncode == 0
    for command in ("generate", "chat", "bench"):
        assert command in result.stdout


def test_generate_prints_completion_and_reports_kv_cache() -> None:
    result = _run(["--log-level", "INFO", "generate", "-p", "def fibonacci(n):", "--max-tokens", "12",
                   "--kv-cache-memory", "64MiB"])
    assert result.returncode == 0, result.stderr
    assert "blocks =" in result.stderr and "tokens" in result.stderr
    assert result.stdout.strip()


def test_chat_answers_each_line_of_input() -> None:
    result = _run(["chat", "--max-tokens", "8", "--temperature", "0", "--kv-cache-memory", "64MiB"],
                  stdin="Hello!\nWhat is 2+2?\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("assistant>") == 2


def test_bad_value_is_a_clear_error() -> None:
    result = _run(["generate", "-p", "hi", "--top-p", "1.5", "--kv-cache-memory", "64MiB"])
    assert result.returncode == 2
    assert "top_p must be in (0, 1]" in result.stderr
    missing = _run(["generate", "/no/such/model", "-p", "hi"])
    assert missing.returncode == 2 and "not found" in missing.stderr

"""Configs and splits that cannot run: one clear line at start, no traceback, nothing left."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tandem.sizing.examples import EXAMPLES_DIR as CONFIGS

MINI = str(CONFIGS / "deepseek-v3-mini")


@pytest.mark.parametrize("args, message", [
    ([str(CONFIGS / "deepseek-v3")], "rank 0 would hold 2499.8 GiB of float32 weights, but this host has"),
    ([MINI, "--tensor-parallel-size", "3"], "--tensor-parallel-size 3 does not divide the model's attention heads (128)"),
    ([MINI, "--pipeline-parallel-size", "5"], "--pipeline-parallel-size 5 exceeds the model's 4 layers"),
    ([MINI, "--enable-expert-parallel"], "--enable-expert-parallel shards the experts over the tensor-parallel ranks"),
    ([MINI, "--world-size", "3", "--tensor-parallel-size", "2"], "the world is their product, 2 ranks"),
    ([MINI, "--pipeline-parallel-size", "2", "--node-rank", "1", "--nnodes", "2", "--master-port", "29800"], "only node 0 runs the engine"),
], ids=["too-big", "tp-heads", "pp-layers", "ep-without-tp", "world", "node-rank"])
def test_a_split_that_cannot_run_is_refused_at_start(args: list[str], message: str) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    done = subprocess.run([sys.executable, "-m", "tandem", "generate", *args, "--load-format", "dummy",
                           "--kv-cache-memory", "64MiB", "-p", "hi"], capture_output=True, text=True, timeout=180,
                          check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tandem: error: ") and message in last, last
    assert "Traceback" not in done.stderr
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and {p.pid for p in psutil.Process().children(recursive=True)} - before:
        time.sleep(0.1)
    assert not {p.pid for p in psutil.Process().children(recursive=True)} - before


def test_an_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((CONFIGS / "deepseek-v3-mini" / "config.json").read_text()
                                          .replace("DeepseekV3ForCausalLM", "FooForCausalLM"))
    done = subprocess.run([sys.executable, "-m", "tandem", "generate", str(tmp_path), "--load-format", "dummy",
                           "-p", "hi"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "unsupported architecture ['FooForCausalLM']; supported: LlamaForCausalLM" in done.stderr
    assert "DeepseekV3ForCausalLM" in done.stderr and "Traceback" not in done.stderr

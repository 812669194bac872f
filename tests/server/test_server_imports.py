"""The API process of `tandem serve` never imports torch (nor transformers).

HTTP, chat templates, tokenization and detokenization run in the API process; the model runs
in the engine core, a separate process. Keeping torch out of the API process keeps its start
fast and its memory small, and is the layering rule of docs/architecture.md. The probe serves real
requests (a chat completion with tools, /tokenize, /detokenize) in a fresh interpreter, so
lazy imports on the request path count too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tandem.platform.ports import free_port

MODEL = "smollm2-135m"
PROBE = Path(__file__).with_name("api_process_probe.py")


def test_api_process_imports_no_torch() -> None:
    result = subprocess.run([sys.executable, str(PROBE), str(free_port()), MODEL, "256MiB"],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["statuses"] == [200, 200, 200, 200], report
    choice = report["chat"]["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    assert report["chat_prompt_tokens"] > 0 and report["detokenized"] == "Hello, wörld 🤖"
    for package in ("torch", "transformers"):
        stack = report["first_imported_by"].get(package, [])
        ours = [frame for frame in stack if "/tandem/" in frame]  # which of our modules pulled it in
        chain = "\n".join([*ours, "...", *stack[-3:]])
        assert not report["modules"][package], f"the API process imported {package}, first from:\n{chain}"

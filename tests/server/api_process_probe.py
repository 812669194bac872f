"""Run the API process of `tandem serve` here, use it, and report what it imported.

    python api_process_probe.py PORT MODEL KV_CACHE_MEMORY

The app is the one `tandem serve` runs (`build_app`), under uvicorn in a thread of this
process; its engine core is a spawned process of its own, which may import torch. Once the
server is healthy the probe sends a chat completion with tools (template + tool-call path),
`/tokenize` (chat and prompt) and `/detokenize`, shuts the server down, and prints one JSON
line: whether torch / transformers are in this process's `sys.modules`, and, for each, the
tandem frames of the stack that first imported it. Not a test module (no `test_` prefix):
tests/server/test_server_imports.py runs it in a fresh interpreter.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from typing import Any

WATCHED = ("torch", "transformers")


class FirstImports:
    """A meta-path finder that finds nothing: it records who first imported a watched package."""

    def __init__(self) -> None:
        self.stacks: dict[str, list[str]] = {}

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        root = name.partition(".")[0]
        if root in WATCHED and root not in self.stacks:
            frames = traceback.extract_stack()[:-1]
            self.stacks[root] = [f"{f.filename}:{f.lineno} {f.line}" for f in frames if "importlib" not in f.filename]
        return None


def main(port: int, model: str, kv_memory: str) -> dict[str, Any]:
    watch = FirstImports()
    sys.meta_path.insert(0, watch)

    import httpx
    import uvicorn

    from tandem.config import CacheConfig, EngineConfig, ServerConfig, parse_memory_size
    from tandem.server.app import build_app

    engine = EngineConfig(model=model, cache=CacheConfig(kv_cache_memory_bytes=parse_memory_size(kv_memory)))
    config = ServerConfig(port=port, log_level="warning")
    server = uvicorn.Server(uvicorn.Config(build_app(engine, config), host=config.host, port=port,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    report: dict[str, Any] = {}
    try:
        _wait_healthy(url, thread)
        tool = {"type": "function", "function": {
            "name": "get_weather", "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
        messages = [{"role": "user", "content": "What's the weather in Tokyo?"}]
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "model": model, "messages": messages, "tools": [tool], "max_tokens": 24, "temperature": 0})
        tokenized_chat = httpx.post(f"{url}/tokenize", timeout=60, json={"messages": messages, "tools": [tool]})
        tokenized = httpx.post(f"{url}/tokenize", timeout=60, json={"prompt": "Hello, wörld 🤖"})
        detokenized = httpx.post(f"{url}/detokenize", timeout=60, json={"tokens": tokenized.json().get("tokens", [])})
        report["statuses"] = [r.status_code for r in (chat, tokenized_chat, tokenized, detokenized)]
        report["chat"] = chat.json()
        report["chat_prompt_tokens"] = tokenized_chat.json().get("count")
        report["detokenized"] = detokenized.json().get("prompt")
    finally:
        server.should_exit = True
        thread.join(120)
    report["modules"] = {root: root in sys.modules for root in WATCHED}
    report["first_imported_by"] = watch.stacks
    return report


def _wait_healthy(url: str, thread: threading.Thread, timeout: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not thread.is_alive():
            raise RuntimeError("the server thread exited before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"not healthy after {timeout:.0f} s")


if __name__ == "__main__":  # guarded: the engine core's spawn re-imports this file
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2], sys.argv[3])), flush=True)

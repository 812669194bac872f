"""A real prefill/decode cluster for a test module: two `tandem serve` workers (one prefill,
one decode, with the test cluster secret) behind an in-process `tandem route` that splits
every request; and a chat stream read into its reasoning and its answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tandem.router.config import HealthPolicy, RouterConfig, WorkerSpec
from tandem.router.http.app import build_app
from tests.support.live_server import TEST_SECRET, LiveServer, start_server, stop_server
from tests.support.router_helpers import MODEL_TIMEOUTS, ThreadServer


@dataclass
class PdCluster:
    prefill: LiveServer
    decode: LiveServer
    url: str  # the router's


@contextmanager
def pd_cluster(logs: Path, *worker_args: str) -> Iterator[PdCluster]:
    started: list[LiveServer] = []
    router: ThreadServer | None = None
    try:
        started.append(start_server(logs / "prefill.log", "--role", "prefill", *worker_args, secret=TEST_SECRET))
        started.append(start_server(logs / "decode.log", "--role", "decode", *worker_args, secret=TEST_SECRET))
        prefill, decode = started
        config = RouterConfig(
            workers=(WorkerSpec(prefill.url, "prefill"), WorkerSpec(decode.url, "decode")),
            health=HealthPolicy(interval_s=0.5, timeout_s=5.0), timeouts=MODEL_TIMEOUTS,
            pd_min_prompt_tokens=0, cluster_secret=TEST_SECRET)
        router = ThreadServer(build_app(config)).start(timeout=60)
        yield PdCluster(prefill, decode, router.url)
    finally:
        if router is not None:
            router.stop()
        for server in started:
            assert not stop_server(server)


def streamed_reasoning_and_content(url: str, body: dict[str, Any]) -> tuple[str, str]:
    """A streamed chat completion's `reasoning_content` and `content`, each joined up."""
    reasoning, content = [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=300) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    reasoning.append(choice["delta"].get("reasoning_content", ""))
                    content.append(choice["delta"].get("content", ""))
    return "".join(reasoning), "".join(content)

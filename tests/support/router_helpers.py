"""Router test helpers: ASGI apps on real ports (uvicorn in a thread) and a scriptable fake worker.

The fake worker produces what a real worker cannot on demand (500s, hangs, a stream cut in
the middle, a 400) and speaks the prefill/decode protocol with canned tokens, so the merge
can be checked token by token: the client must see every token once, whichever hop sent it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from tandem.platform.ports import free_port
from tandem.router.config import HealthPolicy, Timeouts, WorkerSpec
from tandem.router.pd.merge import sse
from tandem.router.workers.registry import LoadSnapshot, WorkerEndpoint

PROMPT_TOKENS = 50

# In front of a real model on a loaded CI box a first byte can take many seconds: a router over
# real workers must not time a hop out at the fixture's one second (FAST_TIMEOUTS in conftest).
MODEL_TIMEOUTS = Timeouts(connect_s=5.0, first_byte_s=180.0, idle_s=180.0)


def healthy_worker(url: str, role: str = "decode", **load: int) -> WorkerEndpoint:
    """A worker that passed its first health probe, with `load` (GET /load fields) polled."""
    worker = WorkerEndpoint(WorkerSpec(url, role), HealthPolicy())  # type: ignore[arg-type]
    worker.health.record(True)
    if load:
        worker.on_load(LoadSnapshot.from_json(load), poll_started_at=0.0, reflect_delay_s=0.25)
    return worker





class ThreadServer:
    """uvicorn serving `app` on 127.0.0.1 from a daemon thread (lifespan included)."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            timeout_graceful_shutdown=1,
            lifespan="on",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout: float = 15.0) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


FIRST_TOKEN_ID = 7


@dataclass
class Behaviour:
    mode: str = "ok"  # ok | error500 | busy429 | draining | hang | drop | bad_request
    health_status: int = 200
    pd: bool = True  # answers prefill hops with kv_transfer_params
    tokens: tuple[str, ...] = ("Hello", " there", ",", " friend", ".")
    prefill_cached: int = 32
    decode_cached: int = 48
    hang_s: float = 4.0
    queue_s: float = 0.0  # a stream's first token waits this long after its role chunk
    token_gap_s: float = 0.01  # and each later token this long after the one before
    waiting_prefill_tokens: int = 0
    running_kv_tokens: int = 0


@dataclass
class FakeWorker:
    name: str
    behaviour: Behaviour = field(default_factory=Behaviour)
    requests: list[dict[str, Any]] = field(default_factory=list)
    authorization: list[str | None] = field(default_factory=list)
    disconnects: int = 0
    releases: list[str] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=self.behaviour.health_status)

        @app.get("/load")
        async def load() -> dict[str, Any]:
            return {
                "num_waiting_requests": 0,
                "num_running_requests": 0,
                "num_waiting_prefill_tokens": self.behaviour.waiting_prefill_tokens,
                "running_kv_tokens": self.behaviour.running_kv_tokens,
                "kv_blocks_total": 100,
                "block_size": 16,
                "kv_usage": 0.0,
            }

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {
                "object": "list",
                "data": [{"id": "fake", "object": "model", "owned_by": self.name}],
            }

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            self.authorization.append(request.headers.get("authorization"))
            return await self._serve(await request.json(), "chat")

        @app.post("/kv/release")
        async def release(request: Request) -> dict[str, bool]:
            self.releases.append((await request.json())["transfer_id"])
            return {"released": True}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            self.authorization.append(request.headers.get("authorization"))
            return await self._serve(await request.json(), "completion")

        return app

    async def _serve(self, body: dict[str, Any], kind: str) -> Response:
        self.requests.append(body)
        mode = self.behaviour.mode
        refusals = {
            "error500": (500, f"{self.name} broke", "server_error", None, {}),
            "busy429": (429, f"{self.name} is full", "rate_limit_error", "overloaded",
                        {"Retry-After": "2"}),
            "draining": (503, f"{self.name} is shutting down", "server_error", "draining",
                         {"Retry-After": "1"}),
            "bad_request": (400, "bad temperature", "invalid_request_error", "invalid_value", {}),
        }
        if mode in refusals:
            status, message, kind, code, headers = refusals[mode]
            param = "temperature" if mode == "bad_request" else None
            error = {"message": message, "type": kind, "param": param, "code": code}
            return JSONResponse({"error": error}, status_code=status, headers=headers)
        if mode == "hang":
            await asyncio.sleep(self.behaviour.hang_s)
        kv = body.get("kv_transfer_params") or {}
        tokens = list(self.behaviour.tokens)
        max_tokens = body.get("max_tokens") or len(tokens)
        if kv.get("do_remote_decode"):
            return JSONResponse(self._prefill_reply(kind, tokens[0], len(tokens) == 1))
        output = tokens[:max_tokens]
        # Token i has id FIRST_TOKEN_ID + i. A decode hop continues after the tokens it is
        # given: a prefill's first token, or all a broken stream had sent (migration).
        prior = kv.get("first_token_ids") or [] if kv.get("do_remote_prefill") else []
        skip = len(prior) if not kv.get("emit_first_token") else 0
        cached = self.behaviour.decode_cached if kv else 0
        usage = {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": len(output),
            "total_tokens": PROMPT_TOKENS + len(output),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        reason = "length" if len(output) < len(tokens) else "stop"
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(
                self._stream(
                    kind,
                    output[skip:],
                    reason,
                    usage,
                    include_usage,
                    drop=mode == "drop",
                    first_id=FIRST_TOKEN_ID + skip if body.get("return_token_ids") else None,
                ),
                media_type="text/event-stream",
            )
        reply = _reply(self.name, kind, "".join(output), reason, usage)
        if kv.get("do_remote_prefill"):
            reply["kv_transfer_params"] = {"adopted_blocks": 3}
        return JSONResponse(reply)

    def _prefill_reply(self, kind: str, first: str, stops: bool) -> dict[str, Any]:
        usage = {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": 1,
            "total_tokens": PROMPT_TOKENS + 1,
            "prompt_tokens_details": {"cached_tokens": self.behaviour.prefill_cached},
        }
        reply = _reply(self.name, kind, first, "stop" if stops else "length", usage)
        if self.behaviour.pd:
            reply["kv_transfer_params"] = (
                None
                if stops
                else {
                    "first_token_ids": [FIRST_TOKEN_ID],
                    "transfer_id": f"{self.name}-t1",
                    "host": "127.0.0.1",
                    "port": 1,
                }
            )
        return reply

    async def _stream(
        self,
        kind: str,
        pieces: list[str],
        reason: str,
        usage: dict[str, Any],
        include_usage: bool,
        drop: bool,
        first_id: int | None = None,
    ) -> Any:
        base = {
            "id": f"{self.name}-stream",
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": 1,
            "model": "fake",
        }
        if include_usage:
            base["usage"] = None
        try:
            if kind == "chat":
                yield sse(
                    {
                        **base,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                )
            await asyncio.sleep(self.behaviour.queue_s)
            for i, piece in enumerate(pieces):
                if drop and i == 2:
                    raise RuntimeError("the fake worker dies mid-stream")
                end = reason if i == len(pieces) - 1 else None
                choice = (
                    {
                        "index": 0,
                        "delta": {"content": piece},
                        "logprobs": None,
                        "finish_reason": end,
                    }
                    if kind == "chat"
                    else {
                        "index": 0,
                        "text": piece,
                        "logprobs": None,
                        "finish_reason": end,
                        "stop_reason": None,
                    }
                )
                if first_id is not None:
                    choice["token_ids"] = [first_id + i]
                yield sse({**base, "choices": [choice]})
                await asyncio.sleep(self.behaviour.token_gap_s)
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.disconnects += 1
            raise


def _reply(name: str, kind: str, text: str, reason: str, usage: dict[str, Any]) -> dict[str, Any]:
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": reason,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": None,
        }
        obj = "text_completion"
    return {
        "id": f"{name}-reply",
        "object": obj,
        "created": 1,
        "model": "fake",
        "choices": [choice],
        "usage": usage,
    }


def read_stream(
    url: str, body: dict[str, Any], path: str = "/v1/chat/completions", timeout: float = 60.0
) -> list[dict[str, Any] | str]:
    """A stream's events in order: chunk dicts, and the string "[DONE]"."""
    events: list[dict[str, Any] | str] = []
    with httpx.stream(
        "POST", f"{url}{path}", json={**body, "stream": True}, timeout=timeout
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream_text(events: list[dict[str, Any] | str]) -> str:
    text = ""
    for event in events:
        if isinstance(event, dict):
            for choice in event.get("choices") or []:
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples `name` (`tandem_router_requests_total`, `..._seconds_count`) whose
    labels include `labels`, parsed from Prometheus text; 0.0 when there is none.

    Finding a metric's name in the text proves nothing: its `# HELP` and `# TYPE` lines are
    printed whatever the value, and an unlabelled histogram prints its zero samples too.
    """
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())

"""An asyncio load client for any OpenAI-compatible server: tandem, a peer's, or a router.

``run_load(base_url, workload, config)`` sends a workload (see ``serve_workloads``) as
streaming requests and returns a ``RunResult`` with one ``RequestRecord`` per request. It
knows nothing about who serves the URL, so the same call measures a tandem worker, vLLM's
OpenAI server, or a router in front of a pool of workers under different policies.

Measurement, per request (all from the client's clock, ``time.perf_counter``):

- TTFT: from sending the request to the first SSE chunk that carries output (content, text,
  reasoning or tool calls); the role-only first chunk of a chat stream does not count, since
  a server can send it before running the model.
- ITL: the gaps between later output chunks (one chunk may carry several tokens, e.g. with
  speculative decoding; the gap is still what a user sees).
- end-to-end latency: from sending to ``data: [DONE]``.
- tokens: ``usage`` of the final chunk (``stream_options.include_usage``), including
  ``prompt_tokens_details.cached_tokens``; a server that leaves it out is recorded as such,
  not as zero hits.

Load: ``concurrency`` N is a closed loop (N sessions in flight, the next one starts when one
ends); ``request_rate`` R is an open loop (sessions start at seeded Poisson arrival times,
R per second, optionally capped by ``max_concurrency``). A session's turns always run one
after another: turn k+1 sends the history including the server's actual reply to turn k.
Failures (HTTP status, exceptions, timeouts) are recorded, never raised; a session stops at
its first failed turn and its remaining turns count as skipped.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from tandem.bench.protocol_wire import PATHS, PROTOCOLS, read_event, request_body
from tandem.bench.serve_workloads import ServeWorkload, Session, Turn

logger = logging.getLogger(__name__)

ENDPOINTS = ("auto", "chat", "completions")
SESSION_HEADER = "x-session-affinity"
_ERROR_BODY_CHARS = 500


@dataclass(frozen=True)
class TrafficConfig:
    """How to send a workload: traffic shape (closed or open loop), request options, client
    limits. (How the model's weights load is tandem.config.LoadConfig.)"""

    concurrency: int | None = None  # closed loop: sessions in flight
    request_rate: float | None = None  # open loop: session arrivals per second (Poisson)
    max_concurrency: int | None = None  # cap on sessions in flight in the open loop
    seed: int = 0  # Poisson arrival times
    endpoint: str = "auto"  # auto: completions for one-turn prompts, chat for conversations
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    session_header: bool = False  # send x-session-affinity: <session id>
    request_timeout_s: float = 600.0
    ignore_eos: bool = True  # every request generates exactly max_tokens on every server
    temperature: float = 0.0
    warmup_requests: int = 1
    # chat | messages | responses: the wire protocol of conversation turns (protocol_wire.py)
    protocol: str = "chat"

    def validate(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("give exactly one of concurrency and request_rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be >= 1, got {self.max_concurrency}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(
                f"unknown endpoint {self.endpoint!r}; choose from {', '.join(ENDPOINTS)}"
            )
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {self.protocol!r}; choose from {', '.join(PROTOCOLS)}")
        if self.protocol != "chat" and self.endpoint == "completions":
            raise ValueError(f"the {self.protocol} protocol is a conversation: it needs the chat endpoint")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request timeout must be > 0, got {self.request_timeout_s}")

    def describe(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        cap = f", at most {self.max_concurrency} in flight" if self.max_concurrency else ""
        return f"{self.request_rate:g} sessions/s (Poisson){cap}"


@dataclass
class RequestRecord:
    """What one request measured. Times are seconds; ``start_s`` is since the run began."""

    session_id: str
    turn: int
    endpoint: str
    max_tokens: int
    new_prompt_len: int  # the turn's new text, by the workload's sizer (history not included)
    protocol: str = "chat"  # the wire protocol it was sent in
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # None: the server did not report it
    usage_reported: bool = False
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None
    output_text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunResult:
    """A workload run against one target."""

    target: str
    base_url: str
    model: str
    workload: str
    load: TrafficConfig
    started_at: str
    duration_s: float
    records: list[RequestRecord]
    skipped_requests: int = 0
    server_models: list[str] = field(default_factory=list)

    def to_json(self, include_records: bool = True) -> dict[str, Any]:
        out = {
            "target": self.target,
            "base_url": self.base_url,
            "model": self.model,
            "workload": self.workload,
            "load": asdict(self.load) | {"api_key": None},
            "started_at": self.started_at,
            "duration_s": self.duration_s,
            "skipped_requests": self.skipped_requests,
            "server_models": self.server_models,
        }
        if include_records:
            out["records"] = [r.to_json() for r in self.records]
        return out


class StreamMeter:
    """Reads the SSE lines of one streamed response and times its output chunks.

    Pure logic (no I/O): ``feed`` gets each line with the time it arrived, so tests can drive
    it with made-up streams and timings.
    """

    def __init__(self, start: float, protocol: str = "chat") -> None:
        self.start = start
        self.protocol = protocol
        self.first_output_at: float | None = None
        self.last_output_at: float | None = None
        self.itl: list[float] = []
        self.chunks = 0
        self.parts: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.done = False

    def feed(self, line: str, now: float) -> bool:
        """Take one line; True once the stream is over (chat's ``[DONE]``, the protocol's
        last event, or an error event)."""
        line = line.strip()
        if not line.startswith("data:"):
            return False  # blank separators, ": comments", "event:" / "id:" fields
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.done = True
            return True
        try:
            data = json.loads(payload)
        except json.JSONDecodeError:
            self.error = f"bad SSE data: {payload[:200]!r}"
            return True
        if not isinstance(data, dict):
            self.error = f"bad SSE data: {payload[:200]!r}"
            return True
        event = read_event(self.protocol, data)
        if event.error is not None:
            self.error = event.error
            return True
        if event.usage is not None:
            self.usage = event.usage
        if event.finish_reason:
            self.finish_reason = event.finish_reason
        if event.text:
            self._output(event.text, now)
        if event.done:
            self.done = True
        return event.done

    def _output(self, text: str, now: float) -> None:
        if self.first_output_at is None:
            self.first_output_at = now
        else:
            self.itl.append(now - self.last_output_at)  # type: ignore[operator]
        self.last_output_at = now
        self.chunks += 1
        self.parts.append(text)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def fill(self, record: RequestRecord, end: float) -> None:
        """Copy the measurements into ``record`` (``end``: when the stream was over)."""
        record.e2e_s = end - self.start
        record.ttft_s = None if self.first_output_at is None else self.first_output_at - self.start
        record.itl_s = list(self.itl)
        record.output_chunks = self.chunks
        record.output_text = self.text
        record.finish_reason = self.finish_reason
        usage = self.usage or {}
        record.usage_reported = self.usage is not None
        record.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
        record.completion_tokens = _int_or_none(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        record.cached_tokens = (
            _int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None
        )
        if self.error is not None:
            record.error = self.error
        elif not self.done:
            record.error = "stream ended before data: [DONE]"
        elif self.first_output_at is None and not record.completion_tokens:
            record.error = "no output in the stream"


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _error_message(status: int, body: bytes) -> str:
    text = body.decode(errors="replace")
    try:
        error = json.loads(text).get("error")
        if isinstance(error, dict) and error.get("message"):
            text = str(error["message"])
        elif isinstance(error, str):
            text = error
    except (json.JSONDecodeError, AttributeError):
        pass
    return f"HTTP {status}: {text.strip()[:_ERROR_BODY_CHARS]}"


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Seconds from the run start at which each of ``count`` sessions starts."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def resolve_endpoint(endpoint: str, workload: ServeWorkload, protocol: str = "chat") -> str:
    """chat or completions; a protocol other than chat sends even one-turn prompts as a
    conversation (Messages and Responses have no completions endpoint)."""
    protocols = {protocol} | {s.protocol for s in workload.sessions if s.protocol is not None}
    if endpoint == "auto":
        return "chat" if workload.chat_only or protocols != {"chat"} else "completions"
    if endpoint == "completions" and protocols != {"chat"}:
        raise ValueError(f"the {', '.join(sorted(protocols - {'chat'}))} protocol is a conversation: "
                         "it needs the chat endpoint")
    if endpoint == "completions" and workload.chat_only:
        raise ValueError(
            f"the {workload.name} workload is a conversation: it needs the chat endpoint"
        )
    return endpoint


class _Runner:
    """One run's state: the HTTP client, the request settings and the records so far."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        workload: ServeWorkload,
        config: TrafficConfig,
        model: str,
        endpoint: str,
        on_record: Callable[[RequestRecord], None] | None,
    ) -> None:
        self.client = client
        self.workload = workload
        self.config = config
        self.model = model
        self.endpoint = endpoint
        self.on_record = on_record
        self.records: list[RequestRecord] = []
        self.skipped = 0
        self.t0 = time.perf_counter()

    def protocol(self, session: Session) -> str:
        """The session's wire protocol (completions requests are read as chat streams)."""
        if self.endpoint != "chat":
            return "chat"
        return session.protocol or self.config.protocol

    def body(self, messages: list[dict[str, Any]], turn: Turn, protocol: str) -> dict[str, Any]:
        if self.endpoint == "chat":
            return request_body(protocol, self.model, messages, turn.max_tokens,
                                self.config.temperature, self.config.ignore_eos)
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": turn.prompt,
            "max_tokens": turn.max_tokens,
            "temperature": self.config.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        return body

    def headers(self, session: Session) -> dict[str, str]:
        return {SESSION_HEADER: session.session_id} if self.config.session_header else {}

    async def send(
        self, body: dict[str, Any], record: RequestRecord, headers: dict[str, str]
    ) -> None:
        """Send one streamed request and fill ``record``; never raises (except cancellation)."""
        path = PATHS[record.protocol] if self.endpoint == "chat" else "/v1/completions"
        start = time.perf_counter()
        record.start_s = start - self.t0
        meter = StreamMeter(start, record.protocol)
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                async with self.client.stream("POST", path, json=body, headers=headers) as response:
                    record.status = response.status_code
                    if response.status_code != 200:
                        record.error = _error_message(response.status_code, await response.aread())
                        record.e2e_s = time.perf_counter() - start
                        return
                    async for line in response.aiter_lines():
                        if meter.feed(line, time.perf_counter()):
                            break
            meter.fill(record, time.perf_counter())
        except TimeoutError:
            meter.fill(record, time.perf_counter())
            record.error = f"timed out after {self.config.request_timeout_s:g} s"
        except httpx.HTTPError as exc:
            meter.fill(record, time.perf_counter())
            record.error = f"{type(exc).__name__}: {exc}"[:_ERROR_BODY_CHARS]
        except Exception as exc:  # a measurement must survive anything a server sends
            logger.debug("request failed", exc_info=True)
            meter.fill(record, time.perf_counter())
            record.error = f"{type(exc).__name__}: {exc}"[:_ERROR_BODY_CHARS]

    async def run_session(self, session: Session, record_results: bool = True) -> None:
        """Run a session's turns in order; warm-up sessions (``record_results`` False) leave
        out the shared system message, so they do not fill the prefix cache for the run."""
        messages: list[dict[str, Any]] = []
        if self.workload.system is not None and record_results:
            messages.append({"role": "system", "content": self.workload.system})
        protocol = self.protocol(session)
        for index, turn in enumerate(session.turns):
            messages.append({"role": "user", "content": turn.prompt})
            record = RequestRecord(
                session.session_id, index, self.endpoint, turn.max_tokens, turn.prompt_len, protocol=protocol
            )
            body = self.body(messages, turn, protocol)
            if session.cache_salt is not None:
                body["cache_salt"] = session.cache_salt
            await self.send(body, record, self.headers(session))
            if record_results:
                self.records.append(record)
                if self.on_record is not None:
                    self.on_record(record)
            if not record.ok:
                logger.debug("%s turn %d failed: %s", session.session_id, index, record.error)
                if record_results:
                    self.skipped += len(session.turns) - index - 1
                return
            messages.append({"role": "assistant", "content": record.output_text})

    async def closed_loop(self, concurrency: int) -> None:
        queue: asyncio.Queue[Session] = asyncio.Queue()
        for session in self.workload.sessions:
            queue.put_nowait(session)

        async def worker() -> None:
            while True:
                try:
                    session = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await self.run_session(session)

        await asyncio.gather(
            *(worker() for _ in range(min(concurrency, len(self.workload.sessions))))
        )

    async def open_loop(self, rate: float, max_concurrency: int | None, seed: int) -> None:
        limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        arrivals = poisson_arrivals(len(self.workload.sessions), rate, seed)

        async def start(session: Session, at: float) -> None:
            await asyncio.sleep(max(0.0, self.t0 + at - time.perf_counter()))
            if limit is None:
                await self.run_session(session)
                return
            async with limit:
                await self.run_session(session)

        await asyncio.gather(
            *(start(s, t) for s, t in zip(self.workload.sessions, arrivals, strict=True))
        )


async def list_models(client: httpx.AsyncClient) -> list[str]:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return [str(m["id"]) for m in response.json().get("data", []) if "id" in m]


async def run_load_async(
    base_url: str,
    workload: ServeWorkload,
    config: TrafficConfig,
    *,
    target: str = "",
    warmup: Sequence[Turn] = (),
    on_record: Callable[[RequestRecord], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> RunResult:
    """Run ``workload`` against the server at ``base_url`` (``http://host:port``, no /v1).

    ``warmup`` turns go out first, one at a time and unrecorded (the first request of a
    server often pays one-time costs). ``on_record`` sees every record as it completes (a
    progress bar). ``transport`` replaces the network (tests).
    """
    config.validate()
    endpoint = resolve_endpoint(config.endpoint, workload, config.protocol)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    in_flight = config.concurrency or config.max_concurrency or 64
    limits = httpx.Limits(max_connections=in_flight + 4, max_keepalive_connections=in_flight + 4)
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        headers=headers,
        timeout=timeout,
        limits=limits,
        transport=transport,
    ) as client:
        models: list[str] = []
        try:
            models = await list_models(client)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            if config.model is None:
                raise ValueError(
                    f"{base_url}: GET /v1/models failed ({exc}); give the model name"
                ) from exc
        model = config.model or (models[0] if models else "")
        if not model:
            raise ValueError(f"{base_url}: GET /v1/models lists no model; give the model name")
        runner = _Runner(client, workload, config, model, endpoint, on_record)
        for i, turn in enumerate(warmup[: config.warmup_requests]):
            await runner.run_session(Session(f"warmup-{i}", (turn,)), record_results=False)
        started_at = dt.datetime.now().isoformat(timespec="seconds")
        runner.t0 = time.perf_counter()
        if config.concurrency is not None:
            await runner.closed_loop(config.concurrency)
        else:
            await runner.open_loop(config.request_rate or 1.0, config.max_concurrency, config.seed)
        duration = time.perf_counter() - runner.t0
    return RunResult(
        target or base_url,
        base_url,
        model,
        workload.name,
        config,
        started_at,
        duration,
        runner.records,
        runner.skipped,
        models,
    )


def run_load(
    base_url: str, workload: ServeWorkload, config: TrafficConfig, **kwargs: Any
) -> RunResult:
    """``run_load_async`` in a fresh event loop (for callers that are not async)."""
    return asyncio.run(run_load_async(base_url, workload, config, **kwargs))

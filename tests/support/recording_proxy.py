"""A pass-through HTTP proxy that records what a real client sends and what it got back
(`tests.support.recording_proxy`).

The agent-harness tests (OpenCode, Claude Code, Codex) put it between the harness and
`tandem up`'s router: the harness and the cluster are both real, and the test reads each
request's method, path, query, headers and body and the exact bytes of each answer. Responses
are relayed chunk by chunk as they arrive (nothing is buffered), so streaming behaves as it
would without the proxy.

When the upstream cannot be reached the proxy answers 502 itself (and records it), so a
harness pointed at nothing still gets an answer and its first request can be captured.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx

_HOP_BY_HOP = {"host", "content-length", "connection", "transfer-encoding", "keep-alive",
               "accept-encoding"}
# Headers whose values are credentials: `redacted_headers` blanks them out for fixtures.
SECRET_HEADERS = {"authorization", "x-api-key", "proxy-authorization", "cookie", "set-cookie",
                  "api-key", "openai-api-key", "anthropic-api-key"}


@dataclass(frozen=True)
class SSEFrame:
    """One server-sent event: its `event:` name (None when absent) and its joined `data:` lines."""

    event: str | None
    data: str

    def json(self) -> Any:
        return json.loads(self.data)


def parse_sse(raw: bytes) -> list[SSEFrame]:
    """The events of an SSE body, split as the spec says: on blank lines, `data:` lines joined
    with newlines, comments (`:`) ignored. A trailing event without its blank line is kept, so
    a truncated stream shows up as one (a test then sees it is not well-formed)."""
    frames: list[SSEFrame] = []
    event: str | None = None
    data: list[str] = []
    seen = False
    for line in raw.decode("utf-8", errors="replace").replace("\r\n", "\n").split("\n"):
        if not line:
            if seen:
                frames.append(SSEFrame(event, "\n".join(data)))
            event, data, seen = None, [], False
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            event, seen = value, True
        elif name == "data":
            data.append(value)
            seen = True
    if seen:
        frames.append(SSEFrame(event, "\n".join(data)))
    return frames


@dataclass
class Exchange:
    """One request and the answer relayed for it."""

    method: str
    path: str  # without the query string
    query: str  # the raw query string ("" when none)
    headers: dict[str, str]
    body: bytes
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    response: bytearray = field(default_factory=bytearray)
    upstream_error: str | None = None  # set when the upstream could not be reached

    @property
    def target(self) -> str:
        """Path and query, as the client sent them."""
        return f"{self.path}?{self.query}" if self.query else self.path

    def query_params(self) -> dict[str, list[str]]:
        return parse_qs(self.query, keep_blank_values=True)

    def json(self) -> Any:
        return json.loads(self.body)

    def response_json(self) -> Any:
        return json.loads(self.response)

    def header(self, name: str) -> str | None:
        """A request header, by case-insensitive name."""
        wanted = name.lower()
        return next((v for k, v in self.headers.items() if k.lower() == wanted), None)

    def redacted_headers(self) -> dict[str, str]:
        """The request headers, lower-cased, credentials replaced by "<redacted>"."""
        return {k.lower(): ("<redacted>" if k.lower() in SECRET_HEADERS else v)
                for k, v in self.headers.items()}

    @property
    def is_stream(self) -> bool:
        content_type = next((v for k, v in self.response_headers.items()
                             if k.lower() == "content-type"), "")
        return content_type.startswith("text/event-stream")

    def sse_frames(self) -> list[SSEFrame]:
        """The raw events of a streamed answer, names kept."""
        return parse_sse(bytes(self.response))

    def sse_events(self) -> list[dict[str, Any]]:
        """The `data:` payloads of a streamed answer as JSON, without a final `[DONE]`."""
        return [frame.json() for frame in self.sse_frames() if frame.data and frame.data != "[DONE]"]


class RecordingProxy:
    """Serves on 127.0.0.1:<free port> and relays everything to `upstream`."""

    def __init__(self, upstream: str) -> None:
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        client = httpx.Client(base_url=upstream, timeout=httpx.Timeout(None, connect=10.0))
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                del format, args

            def _read_body(self) -> bytes:
                if "chunked" in (self.headers.get("transfer-encoding") or "").lower():
                    body = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return bytes(body)
                        body.extend(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("content-length") or 0))

            def _answer_locally(self, exchange: Exchange, error: Exception) -> None:
                exchange.upstream_error = f"{type(error).__name__}: {error}"
                body = json.dumps({"error": {"type": "upstream_unreachable",
                                             "message": exchange.upstream_error}}).encode()
                exchange.status = 502
                exchange.response_headers = {"content-type": "application/json"}
                exchange.response.extend(body)
                self.send_response(502)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _relay(self) -> None:
                split = urlsplit(self.path)
                exchange = Exchange(self.command, split.path, split.query, dict(self.headers.items()),
                                    self._read_body())
                with proxy._lock:
                    proxy.exchanges.append(exchange)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                request = client.build_request(self.command, self.path, headers=headers,
                                               content=exchange.body)
                try:
                    reply = client.send(request, stream=True)
                except httpx.TransportError as error:
                    self._answer_locally(exchange, error)
                    return
                try:
                    exchange.status = reply.status_code
                    exchange.response_headers = dict(reply.headers.items())
                    self.send_response(reply.status_code)
                    for key, value in reply.headers.items():
                        if key.lower() not in _HOP_BY_HOP:
                            self.send_header(key, value)
                    if self.command == "HEAD":
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for chunk in reply.iter_raw():
                        exchange.response.extend(chunk)
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                finally:
                    reply.close()

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _relay  # noqa: N815

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._client = client

    def snapshot(self) -> list[Exchange]:
        """The exchanges recorded so far (a copy of the list; the exchanges themselves are live)."""
        with self._lock:
            return list(self.exchanges)

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._client.close()

"""A pass-through HTTP proxy that records what a real client sends and what it got back
(`tests.support.recording_proxy`).

The OpenCode test puts it between the agent harness and `tandem up`'s router: the harness
and the cluster are both real, and the test reads each request's headers and body and the
exact bytes of each streamed answer. Responses are relayed chunk by chunk as they arrive,
so streaming behaves as it would without the proxy.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

_HOP_BY_HOP = {"host", "content-length", "connection", "transfer-encoding", "keep-alive",
               "accept-encoding"}


@dataclass
class Exchange:
    """One request and the answer relayed for it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int = 0
    response: bytearray = field(default_factory=bytearray)

    def json(self) -> Any:
        return json.loads(self.body)

    def sse_events(self) -> list[dict[str, Any]]:
        """The `data:` payloads of a streamed answer, without the final `[DONE]`."""
        events = []
        for line in self.response.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
        return events


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

            def _relay(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                exchange = Exchange(self.command, self.path, dict(self.headers.items()),
                                    self.rfile.read(length))
                with proxy._lock:
                    proxy.exchanges.append(exchange)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                request = client.build_request(self.command, self.path, headers=headers,
                                               content=exchange.body)
                reply = client.send(request, stream=True)
                try:
                    exchange.status = reply.status_code
                    self.send_response(reply.status_code)
                    for key, value in reply.headers.items():
                        if key.lower() not in _HOP_BY_HOP:
                            self.send_header(key, value)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for chunk in reply.iter_raw():
                        exchange.response.extend(chunk)
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                finally:
                    reply.close()

            do_GET = do_POST = _relay  # noqa: N815

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._client = client

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._client.close()

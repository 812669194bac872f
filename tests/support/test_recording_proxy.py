"""The recording proxy the agent-harness tests stand between a harness and `tandem up`: what it
records, that it relays a stream event by event (not buffered), and that it answers 502 itself
when the upstream is not there."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from tests.support.recording_proxy import RecordingProxy, SSEFrame, parse_sse


class _Upstream:
    """Answers POST /stream with two SSE events, the second only once `release` is set; any
    other request with a JSON echo of what it received."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.second_sent = threading.Event()
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                del format, args

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.path.startswith("/stream"):
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    for number, event in enumerate((b"event: one\ndata: {\"n\": 1}\n\n",
                                                    b"event: two\ndata: {\"n\": 2}\n\n")):
                        if number == 1:
                            upstream.release.wait(20)
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                        self.wfile.flush()
                    upstream.second_sent.set()
                    self.wfile.write(b"0\r\n\r\n")
                    return
                echo = json.dumps({"path": self.path, "body": body.decode(),
                                   "x-test": self.headers.get("x-test")}).encode()
                self.send_response(201)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(echo)))
                self.end_headers()
                self.wfile.write(echo)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def upstream() -> Iterator[_Upstream]:
    server = _Upstream()
    yield server
    server.release.set()
    server.server.shutdown()
    server.server.server_close()


def test_records_method_path_query_headers_body_and_answer(upstream: _Upstream) -> None:
    with RecordingProxy(upstream.url) as proxy:
        reply = httpx.post(f"{proxy.url}/v1/messages?beta=true&x=1", content=b'{"a": 1}',
                           headers={"x-test": "yes", "x-api-key": "secret", "content-type": "application/json"})
        exchanges = proxy.snapshot()
    assert reply.status_code == 201
    assert reply.json() == {"path": "/v1/messages?beta=true&x=1", "body": '{"a": 1}', "x-test": "yes"}
    [exchange] = exchanges
    assert (exchange.method, exchange.path, exchange.query) == ("POST", "/v1/messages", "beta=true&x=1")
    assert exchange.target == "/v1/messages?beta=true&x=1"
    assert exchange.query_params() == {"beta": ["true"], "x": ["1"]}
    assert exchange.json() == {"a": 1} and exchange.header("X-Test") == "yes"
    assert exchange.status == 201 and exchange.response_json()["x-test"] == "yes"
    assert exchange.redacted_headers()["x-api-key"] == "<redacted>"
    assert exchange.redacted_headers()["x-test"] == "yes"
    assert not exchange.is_stream and exchange.upstream_error is None


def test_a_chunked_request_body_is_read_whole(upstream: _Upstream) -> None:
    with RecordingProxy(upstream.url) as proxy:
        reply = httpx.post(f"{proxy.url}/echo", content=iter([b'{"a": ', b"2}"]))
        [exchange] = proxy.snapshot()
    assert reply.json()["body"] == '{"a": 2}' and exchange.json() == {"a": 2}


def test_a_stream_is_relayed_event_by_event(upstream: _Upstream) -> None:
    with RecordingProxy(upstream.url) as proxy, httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{proxy.url}/stream") as reply:
            lines = reply.iter_lines()
            # The upstream holds its second event back until the first has come through.
            assert next(lines) == "event: one"
            assert next(lines) == 'data: {"n": 1}'
            assert not upstream.second_sent.is_set(), "the first event waited for the whole answer"
            upstream.release.set()
            rest = list(lines)
        [exchange] = proxy.snapshot()
    assert 'data: {"n": 2}' in rest
    assert exchange.is_stream
    assert exchange.sse_frames() == [SSEFrame("one", '{"n": 1}'), SSEFrame("two", '{"n": 2}')]
    assert exchange.sse_events() == [{"n": 1}, {"n": 2}]


def test_an_unreachable_upstream_gets_a_recorded_502() -> None:
    with RecordingProxy("http://127.0.0.1:9") as proxy:  # the discard port: nothing listens
        reply = httpx.post(f"{proxy.url}/v1/responses", json={"model": "m"})
        [exchange] = proxy.snapshot()
    assert reply.status_code == 502 and "error" in reply.json()
    assert exchange.status == 502 and exchange.upstream_error
    assert exchange.json() == {"model": "m"}


def test_parse_sse_follows_the_spec() -> None:
    raw = (b": a comment\r\nevent: a\r\ndata: 1\r\n\r\n"
           b"data: x\ndata: y\n\n"
           b"event: cut\ndata: {\"trunc")
    assert parse_sse(raw) == [SSEFrame("a", "1"), SSEFrame(None, "x\ny"), SSEFrame("cut", '{"trunc')]

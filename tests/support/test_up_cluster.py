"""RouterLog, how the agent-harness tests read what a shared cluster's router did while each
ran: only the lines after the mark, each PD line's workers, status and placement rules."""

from __future__ import annotations

import logging
from pathlib import Path

from tests.support.up_cluster import Routed, RouterLog

# The router's own format (tandem/router/http/bookkeeping.py), filled in as it fills it in.
_FORMAT = ("%s %s route=%s (%s) prefill=%s decode=%s prompt_tokens=%s ttft=%s e2e=%.3fs "
           "retries=%d migrations=%d status=%d placement=%s")


def _line(route: str, reason: str, prefill: str, decode: str, status: int, placement: str) -> str:
    record = logging.LogRecord("tandem.router", logging.INFO, __file__, 1, _FORMAT,
                               ("chat", "stream", route, reason, prefill, decode, "7231", "85.1s",
                                90.0, 0, 0, status, placement), None)
    return f"2026-01-01 00:00:00 INFO tandem.router.http.bookkeeping: {record.getMessage()}\n"


def test_router_log_reads_the_pd_lines_after_its_mark(tmp_path: Path) -> None:
    path = tmp_path / "router.log"
    path.write_text(_line("pd", "long prompt", "http://a", "http://d", 200, "prefill:session,decode:session"))
    log = RouterLog(path)
    log.mark()
    with path.open("a") as out:
        out.write(_line("direct", "short prompt", "-", "http://d", 200, "decode:least_tokens"))
        out.write(_line("pd", "long prompt", "http://b", "http://d", 200,
                        "prefill:kv_aware(3/4 cpu:40, best 5: load),decode:least_tokens"))
        out.write(_line("pd", "long prompt", "http://a", "http://d", 503, "prefill:session(+1),decode:session"))
        out.write(_line("pd", "done at prefill", "http://a", "-", 200, "prefill:session,decode:session"))
    assert log.pd_routes() == [
        Routed("stream", "http://b", "http://d", 200, "prefill:kv_aware(3/4 cpu:40, best 5: load),decode:least_tokens",
               "long prompt"),
        Routed("stream", "http://a", "http://d", 503, "prefill:session(+1),decode:session", "long prompt"),
        Routed("stream", "http://a", "-", 200, "prefill:session,decode:session", "done at prefill"),
    ]
    assert [route.decoded for route in log.pd_routes()] == [True, True, False]


def test_router_log_before_the_file_exists(tmp_path: Path) -> None:
    log = RouterLog(tmp_path / "router.log")
    log.mark()
    (tmp_path / "router.log").write_text(_line("pd", "long prompt", "http://a", "http://d", 200, "prefill:session"))
    assert [route.prefill for route in log.pd_routes()] == ["http://a"]

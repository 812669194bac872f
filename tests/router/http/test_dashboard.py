"""GET /dashboard in a real headless Chromium (Playwright), over a real router and two real
workers: the page loads and keeps polling, its numbers are what the /metrics text it fetched
says, and a worker killed shows as down."""

from __future__ import annotations

import math
import re
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.live_server import LiveServer, start_router, start_server, stop_server

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
SYSTEM = "You are a careful assistant for a software team. " * 12


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise RuntimeError("chromium is not installed: scripts/setup.sh installs it with apt (as root)")
    return path


@contextmanager
def _dashboard(url: str, tmp_path: Path) -> Iterator:
    """The router's /dashboard open in headless Chromium; the page."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=_chromium(), headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page()
            page.goto(f"{url}/dashboard")
            yield page
        finally:
            browser.close()


@pytest.fixture
def cluster(tandem_server_process: LiveServer, tmp_path: Path) -> Iterator[tuple[str, LiveServer, LiveServer]]:
    second = start_server(tmp_path / "second.log", "--kv-cache-memory", "64MiB")
    url, router = start_router(tmp_path / "route.log", "--worker", tandem_server_process.url, "--worker", second.url,
                               "--health-interval", "0.5", "--down-after", "2")
    try:
        yield url, tandem_server_process, second
    finally:
        router.terminate()
        router.wait(timeout=30)
        if second.process.poll() is None:
            stop_server(second)


def _families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


# The figures on screen and the /metrics text the page computed them from, read in one step of
# the page's JavaScript: a poll writes both at once, so they always belong together (a second
# fetch of /metrics by the test could land on either side of a poll).
_READ_PAGE = """() => ({
    metrics: window.tandemSnapshot && window.tandemSnapshot.metrics,
    shown: Object.fromEntries(["requests-total", "protocols", "cached-ratio", "tokens", "ttft", "tpot"]
        .map(id => [id, document.getElementById(id).textContent])),
})"""


def _rendered(page, settled: Callable[[dict[str, list]], bool],
              timeout: float = 30.0) -> tuple[dict[str, str], dict[str, list]]:
    """What the page shows and the metrics it rendered them from, once those satisfy `settled`
    (the router records a stream's timings as it closes, a moment after the client's last byte)."""
    deadline = time.monotonic() + timeout
    while True:
        read = page.evaluate(_READ_PAGE)
        metrics = _families(read["metrics"] or "")
        if read["metrics"] and settled(metrics):
            return read["shown"], metrics
        assert time.monotonic() < deadline, f"the page never rendered settled metrics: {read}"
        page.wait_for_timeout(250)


def _sum(samples: list, name: str) -> float:
    return sum(s.value for s in samples if s.name == name)


def _quantile(q: float, samples: list) -> float | None:
    """Prometheus's histogram_quantile over every label set's buckets summed by `le`."""
    counts: dict[float, float] = {}
    for s in samples:
        if s.name.endswith("_bucket"):
            le = math.inf if s.labels["le"] == "+Inf" else float(s.labels["le"])
            counts[le] = counts.get(le, 0.0) + s.value
    total = counts.get(math.inf, 0.0)
    if not total:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in sorted(counts):
        if counts[le] >= rank:
            if le == math.inf:
                return lower
            inside = counts[le] - below
            return lower + (le - lower) * (rank - below) / inside if inside > 0 else le
        lower, below = le, counts[le]
    return lower


def _seconds(value: float | None) -> str:
    """As the page writes them: JavaScript's toFixed rounds the double's exact value half up,
    where Python's format rounds half to even (92.5 ms is "93 ms" on the page)."""
    if value is None:
        return "–"

    def fixed(x: float, places: str) -> str:
        return str(Decimal(x).quantize(Decimal(places), ROUND_HALF_UP))

    return f"{fixed(value * 1000, '1')} ms" if value < 1 else f"{fixed(value, '0.01')} s"


def test_dashboard_shows_what_metrics_say_and_a_killed_worker(cluster: tuple[str, LiveServer, LiveServer],
                                                              tmp_path: Path) -> None:
    url, _, second = cluster
    for turn in range(3):  # one session: the later turns read the shared prefix from cache
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, headers={"x-session-affinity": "s1"}, json={
            "model": "smollm2-135m", "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {turn}?"}]})
        assert reply.status_code == 200
    # One streamed request in each agent protocol: the page counts requests by protocol.
    for path, body in (("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/responses", {"max_output_tokens": 8, "input": "Hi", "store": False})):
        reply = httpx.post(f"{url}{path}", timeout=120, json={"model": "smollm2-135m", "stream": True, **body})
        assert reply.status_code == 200, reply.text
    with _dashboard(url, tmp_path) as page:
        page.wait_for_function("Number(document.body.dataset.polls || 0) >= 2", timeout=30_000)
        shown, metrics = _rendered(page, settled=lambda m: _sum(
            m["tandem_router_time_per_output_token_seconds"],
            "tandem_router_time_per_output_token_seconds_count") == 5)  # each stream, recorded
        requests = metrics["tandem_router_requests"]
        prompt = _sum(metrics["tandem_router_prompt_tokens"], "tandem_router_prompt_tokens_total")
        cached = _sum(metrics["tandem_router_cached_prompt_tokens"], "tandem_router_cached_prompt_tokens_total")
        output = _sum(metrics["tandem_router_generation_tokens"], "tandem_router_generation_tokens_total")
        ttft = metrics["tandem_router_time_to_first_token_seconds"]
        tpot = metrics["tandem_router_time_per_output_token_seconds"]
        assert cached > 0, "the session's later turns should hit the prefix cache"
        assert shown["requests-total"] == f"{_sum(requests, 'tandem_router_requests_total'):,.0f}"
        by_protocol: dict[str, float] = {}
        for sample in requests:
            if sample.name == "tandem_router_requests_total":
                by_protocol[sample.labels["endpoint"]] = by_protocol.get(sample.labels["endpoint"], 0) + sample.value
        assert by_protocol == {"chat": 3, "messages": 1, "responses": 1}
        assert shown["protocols"] == " · ".join(f"{p} {by_protocol[p]:,.0f}" for p in sorted(by_protocol))
        assert shown["cached-ratio"] == f"{100 * cached / prompt:.1f}%"
        assert shown["tokens"] == f"{prompt:,.0f} / {cached:,.0f} / {output:,.0f}"
        assert shown["ttft"] == f"{_seconds(_quantile(0.5, ttft))} / {_seconds(_quantile(0.9, ttft))}"
        assert shown["tpot"] == f"{_seconds(_quantile(0.5, tpot))} / {_seconds(_quantile(0.9, tpot))}"
        assert page.text_content("#cost-per-million") != "–"
        rows = page.locator("#workers tr")
        assert rows.count() == 2
        assert page.locator(f'tr[data-worker="{second.url}"] td.health').text_content() == "up"

        for process in [*psutil.Process(second.process.pid).children(recursive=True), second.process]:
            process.send_signal(signal.SIGKILL)
        second.process.wait(timeout=30)
        page.wait_for_selector(f'tr[data-worker="{second.url}"][data-healthy="false"]', timeout=30_000)
        assert page.locator(f'tr[data-worker="{second.url}"] td.health').text_content() == "down"
        assert re.fullmatch(r"up", page.locator("#workers tr").first.locator("td.health").text_content() or "")
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)


def test_with_keys_on_the_page_asks_for_the_admin_key(tandem_server_process: LiveServer, tmp_path: Path) -> None:
    """/metrics and /workers close once a key is on: the page (which holds no data) asks for the
    admin key, and reads them with it."""
    url, router = start_router(tmp_path / "route.log", "--worker", tandem_server_process.url,
                               "--admin-key", "dash-admin-key")
    try:
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401
        with _dashboard(url, tmp_path) as page:
            page.wait_for_selector("#key-form:not([hidden])", timeout=30_000)
            assert (page.get_attribute("body", "data-polls") or "0") == "0"
            page.fill("#key-input", "wrong")
            page.click("#key-form button")
            page.wait_for_selector("#key-form:not([hidden])", timeout=30_000)
            page.fill("#key-input", "dash-admin-key")
            page.click("#key-form button")
            page.wait_for_function("Number(document.body.dataset.polls || 0) >= 1", timeout=30_000)
            assert page.locator("#workers tr").count() == 1
            assert page.is_hidden("#key-form")
    finally:
        router.terminate()
        router.wait(timeout=30)

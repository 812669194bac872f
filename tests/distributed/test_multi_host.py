"""Ranks on two hosts: node 0 (the engine) in one network namespace, node 1 (`tandem serve
--headless`) in another, joined only through node 0's --master-addr on a bridge, as two
machines would be. A pipeline split sends hidden states between the hosts every step; a
tensor split all-reduces across them every layer. Both must give one rank's tokens. And the
failures at start: a node that never comes, or a host that cannot reach node 0, end with the
address tried and leave nothing running. Needs root (CI runs as root).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tandem import LLM, SamplingParams
from tests.support.netns_hosts import Hosts, make_hosts, needs_netns

pytestmark = needs_netns

PROMPT = "The capital of France is"
ENGINE = ("--threads", "1", "--kv-cache-memory", "64MiB")


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with make_hosts(["node0", "node1"], "mh") as made:
        yield made


@pytest.fixture(scope="module")
def expected() -> str:
    with LLM(kv_cache_memory="64MiB", num_threads=1) as llm:
        return llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text


def _tandem(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem", *args]


def _children_left(before: set[int]) -> set[int]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = {p.pid for p in psutil.Process().children(recursive=True)} - before
        if not left:
            return left
        time.sleep(0.2)
    return left


@pytest.mark.parametrize("split", [("--pipeline-parallel-size", "2"), ("--tensor-parallel-size", "2")],
                         ids=["pp-across-hosts", "tp-across-hosts"])
def test_two_hosts_give_one_rank_s_tokens(split: tuple[str, str], hosts: Hosts, expected: str,
                                          tmp_path: Path) -> None:
    master, port = hosts.addresses["node0"], "29710" if split[0].startswith("--pipe") else "29720"
    meet = ("--nnodes", "2", "--master-addr", master, "--master-port", port, *split, *ENGINE)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with (tmp_path / "node1.log").open("wb") as log:
        node1 = subprocess.Popen([*hosts.exec("node1"), *_tandem("serve", "--headless", "--node-rank", "1", *meet)],
                                 stdout=log, stderr=subprocess.STDOUT)
    try:
        node0 = subprocess.run([*hosts.exec("node0"), *_tandem("generate", "-p", PROMPT, "--max-tokens", "12", *meet)],
                               capture_output=True, text=True, timeout=240, check=False)
        assert node0.returncode == 0, node0.stderr[-3000:]
        assert node0.stdout.rstrip("\n") == expected
        assert "rank 1 on " in node0.stderr and f"({hosts.addresses['node1']})" in node0.stderr
        assert node1.wait(timeout=30) == 0  # the engine shut its remote rank down cleanly
    finally:
        if node1.poll() is None:
            node1.kill()
    log = (tmp_path / "node1.log").read_text()
    assert "joining the engine at " + master in log
    assert not _children_left(before)


def test_a_node_that_never_comes_fails_start_up_naming_the_address(hosts: Hosts) -> None:
    master = hosts.addresses["node0"]
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    done = subprocess.run([*hosts.exec("node0"), *_tandem(
        "generate", "-p", PROMPT, "--max-tokens", "2", "--pipeline-parallel-size", "2", "--nnodes", "2",
        "--master-addr", master, "--master-port", "29730", "--join-timeout", "5", *ENGINE)],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"ranks [1] did not join in 5 s (rank 1 at tcp://{master}:29732)" in done.stderr
    assert "Traceback" not in done.stderr
    assert not _children_left(before)


def test_a_host_that_cannot_reach_node_0_gives_up_naming_the_address(hosts: Hosts, tmp_path: Path) -> None:
    nowhere = hosts.addresses["node0"]  # nothing listens there: node 0 is not running
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    done = subprocess.run([*hosts.exec("node1"), *_tandem(
        "serve", "--headless", "--node-rank", "1", "--pipeline-parallel-size", "2", "--nnodes", "2",
        "--master-addr", nowhere, "--master-port", "29740", "--join-timeout", "5", *ENGINE)],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    assert f"heard nothing from the engine at tcp://{nowhere}:29742 in 5 s" in done.stderr
    assert not _children_left(before)


def _revision(target: Path, extra: dict) -> Path:
    """The default model's files, linked, with config.json changed: to the fingerprint another
    checkpoint (tests/security/test_fingerprint_integrity.py)."""
    import json

    from tandem.loader.resolve import resolve_model

    source = resolve_model("smollm2-135m", "float32").hf_dir
    target.mkdir(parents=True)
    for path in source.iterdir():
        if path.name not in ("config.json", "tandem_source.json"):
            (target / path.name).symlink_to(path)
    (target / "config.json").write_text(json.dumps({**json.loads((source / "config.json").read_text()), **extra}))
    return target


def test_ranks_that_loaded_different_checkpoints_refuse_to_start(hosts: Hosts, tmp_path: Path) -> None:
    """Every host loads node 0's MODEL path from its own disk: a host holding another revision
    there (the same layout, so every tensor fits) would compute garbage in every collective.
    The ranks compare their fingerprints before serving, and the engine refuses to start.

    Two hosts with different files at one path, on one machine: `ip netns exec` bind-mounts
    /etc/netns/NS/X over /etc/X for processes in namespace NS, so node 1 sees another directory
    at the path node 0 names."""
    import shutil
    import uuid

    name = f"tandem-test-revision-{uuid.uuid4().hex[:8]}"
    shown = Path("/etc") / name
    node1_view = Path("/etc/netns") / f"{hosts.prefix}node1" / name
    try:
        _revision(shown, {"tandem_test_revision": "a"})
        _revision(node1_view, {"tandem_test_revision": "b"})
        master = hosts.addresses["node0"]
        meet = ("--nnodes", "2", "--master-addr", master, "--master-port", "29750", "--tensor-parallel-size", "2",
                "--join-timeout", "60", *ENGINE)
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        with (tmp_path / "node1.log").open("wb") as log:
            node1 = subprocess.Popen([*hosts.exec("node1"), *_tandem("serve", "--headless", "--node-rank", "1", *meet)],
                                     stdout=log, stderr=subprocess.STDOUT)
        try:
            node0 = subprocess.run([*hosts.exec("node0"), *_tandem("generate", str(shown), "-p", PROMPT,
                                                                   "--max-tokens", "2", *meet)],
                                   capture_output=True, text=True, timeout=240, check=False)
            assert node0.returncode != 0, node0.stdout
            assert "ranks loaded different models" in node0.stderr, node0.stderr[-3000:]
            node1.wait(timeout=60)
        finally:
            if node1.poll() is None:
                node1.kill()
        assert not _children_left(before)
    finally:
        shutil.rmtree(shown, ignore_errors=True)
        shutil.rmtree(node1_view.parent, ignore_errors=True)

"""The cluster tier's store on Mooncake, against a real mooncake_master and real clients: round
trips, overwrite (upsert) semantics, values too large for the transfer buffer, a master that is
not there (fast failure), one that stops mid-run, and the real use: another process reading
what this one wrote and writing what this one reads."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.kvcache.tiers.mooncake_store import MooncakeConfig, MooncakeStore, import_client
from tandem.kvcache.tiers.store import ChunkStoreError
from tandem.launch.mooncake_master import MooncakeMaster, find_mooncake_master
from tandem.platform.ports import free_port

ROOT = Path(__file__).resolve().parents[3]


def _mooncake_missing() -> str | None:
    if importlib.util.find_spec("mooncake") is None:
        return ("the mooncake package is not installed "
                "(pip install mooncake-transfer-engine-non-cuda)")
    try:
        import_client()  # loads the native client and its system libraries (quietly)
    except ChunkStoreError as exc:
        return str(exc)
    if find_mooncake_master() is None:
        return "the mooncake package has no mooncake_master binary"
    return None


_MISSING = _mooncake_missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as server:
        yield server


@pytest.fixture(scope="module")
def store(master: MooncakeMaster) -> Iterator[MooncakeStore]:
    client = MooncakeStore(master.url + "?segment=256MiB&buffer=32MiB&prefix=test:")
    yield client
    client.close()



def test_url_options() -> None:
    config = MooncakeConfig.from_url(
        "mooncake://10.0.0.5:50052?segment=2GiB&buffer=16MiB&protocol=rdma"
        "&metadata=http://10.0.0.5:8080/metadata&local_hostname=10.0.0.7&prefix=p:")
    assert config.master_addr == "10.0.0.5:50052"
    assert (config.segment_bytes, config.buffer_bytes) == (2 << 30, 16 << 20)
    assert (config.protocol, config.metadata) == ("rdma", "http://10.0.0.5:8080/metadata")
    assert (config.local_hostname, config.prefix) == ("10.0.0.7", "p:")
    default = MooncakeConfig.from_url("mooncake://master")
    assert (default.port, default.segment_bytes, default.buffer_bytes) == (50051, 1 << 30, 64 << 20)
    assert (default.metadata, default.protocol) == ("P2PHANDSHAKE", "tcp")
    assert default.prefix == "tandem:kv:"
    with pytest.raises(ValueError, match="unknown option 'segmnet'"):
        MooncakeConfig.from_url("mooncake://master:1?segmnet=1GiB")
    with pytest.raises(ValueError, match="not a Mooncake URL"):
        MooncakeConfig.from_url("redis://master:1")


def test_round_trip(store: MooncakeStore) -> None:
    before = store.stats()
    store.put("a1", b"x" * 1000)
    assert store.get("a1") == b"x" * 1000
    assert store.exists(["a1", "nope"]) == [True, False]
    assert store.exists([]) == []
    assert store.get("nope") is None  # a miss is None, not an error
    store.delete("a1")  # just read, so under a lease, which delete overrides
    store.delete("a1")  # absent: a no-op
    assert store.get("a1") is None and store.exists(["a1"]) == [False]
    store.put("mv", memoryview(b"abc"))
    store.put("ba", bytearray(b"def"))
    assert (store.get("mv"), store.get("ba")) == (b"abc", b"def")
    after = store.stats()
    assert after["puts"] - before["puts"] == 3 and after["hits"] - before["hits"] == 3
    assert after["bytes_written"] - before["bytes_written"] == 1006
    assert after["errors"] == before["errors"]


def test_put_overwrites(store: MooncakeStore) -> None:
    store.put("k", b"first")
    assert store.get("k") == b"first"  # the read takes a lease; the overwrite still lands
    store.put("k", b"second, longer")
    assert store.get("k") == b"second, longer"


def test_a_value_larger_than_the_buffer_is_an_error(store: MooncakeStore) -> None:
    errors = store.stats()["errors"]
    with pytest.raises(ChunkStoreError, match=r"-600 \(INVALID_PARAMS"):
        store.put("huge", bytes(33 << 20))  # the buffer is 32 MiB
    assert store.stats()["errors"] == errors + 1
    assert store.exists(["huge"]) == [False]
    store.put("after", b"ok")  # the client still works
    assert store.get("after") == b"ok"


def test_a_prober_checks_existence_only(master: MooncakeMaster, store: MooncakeStore) -> None:
    store.put("seen", b"1")
    prober = MooncakeStore.prober(master.url + "?prefix=test:")
    try:
        assert prober.exists(["seen", "unseen"]) == [True, False]
        with pytest.raises(ChunkStoreError, match="cannot read or write"):
            prober.put("x", b"1")
    finally:
        prober.close()


def test_an_unreachable_master_fails_fast() -> None:
    # refused at once, and a TEST-NET address that never answers (bounded by the connect timeout)
    for url in (f"mooncake://127.0.0.1:{free_port()}", "mooncake://192.0.2.1:50051"):
        started = time.monotonic()
        with pytest.raises(ChunkStoreError, match="no Mooncake master at"):
            MooncakeStore(url)
        assert time.monotonic() - started < 3


_PEER = textwrap.dedent("""
    import hashlib, sys
    from tandem.kvcache.tiers.mooncake_store import MooncakeStore
    store = MooncakeStore(sys.argv[1])  # the cluster's only segment
    print("ready", flush=True)
    sys.stdin.readline()
    value = store.get("from-parent")
    print(hashlib.sha256(value).hexdigest() if value else "miss", flush=True)
    store.put("from-peer", b"peer:" + bytes(range(256)) * 4096)
    print("stored", flush=True)
    sys.stdin.readline()
    store.close()
""")


def test_another_process_reads_what_this_one_wrote(tmp_path: Path) -> None:
    """The parent contributes no memory, so what it writes lands in the peer's segment; each
    reads what the other wrote, and when the peer leaves, its segment's values go with it."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    log = tmp_path / "peer.log"
    with MooncakeMaster() as master, open(log, "w") as stderr:
        peer = subprocess.Popen(
            [sys.executable, "-c", _PEER, master.url + "?segment=64MiB&buffer=32MiB"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
            env={**os.environ, "PYTHONPATH": path})
        store = None
        try:
            assert peer.stdout.readline().strip() == "ready", log.read_text()
            store = MooncakeStore(master.url + "?segment=0&buffer=32MiB")
            value = os.urandom(12 << 20)
            store.put("from-parent", value)
            peer.stdin.write("\n")
            peer.stdin.flush()
            digest = hashlib.sha256(value).hexdigest()
            assert peer.stdout.readline().strip() == digest, log.read_text()
            assert peer.stdout.readline().strip() == "stored", log.read_text()
            assert store.get("from-peer") == b"peer:" + bytes(range(256)) * 4096
            peer.stdin.write("\n")
            peer.stdin.flush()
            assert peer.wait(timeout=10) == 0, log.read_text()
            assert store.exists(["from-parent", "from-peer"]) == [False, False]  # gone with it
            assert store.get("from-parent") is None
        finally:
            if peer.poll() is None:
                peer.kill()
                peer.wait()
            if store is not None:
                store.close()


def test_a_master_stopped_mid_run_is_an_error_then_recovers() -> None:
    master = MooncakeMaster().start()
    port = master.port
    store = MooncakeStore(master.url + "?segment=64MiB&buffer=16MiB", backoff_s=0.5)
    try:
        store.put("a", b"1")
        master.stop()
        started = time.monotonic()
        with pytest.raises(ChunkStoreError, match="unreachable"):
            store.get("a")
        with pytest.raises(ChunkStoreError, match="backing off"):
            store.exists(["a"])
        time.sleep(0.6)
        with pytest.raises(ChunkStoreError, match="unreachable"):  # re-probed, no RPC timeout
            store.exists(["a"])
        # Bounded (the client's RPC timeout is about 4 s), not the 90 s of a setup retrying.
        assert time.monotonic() - started < 12
        with MooncakeMaster(port=port):  # a fresh, empty master: the client mounts again
            deadline = time.monotonic() + 15
            while True:
                try:
                    store.put("a", b"2")
                    break
                except ChunkStoreError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert store.get("a") == b"2"
            store.close()
    finally:
        store.close()
        master.stop()


def test_a_master_that_cannot_start_reports_its_log() -> None:
    with pytest.raises(RuntimeError, match="unknown command line flag 'no_such_flag'"):
        MooncakeMaster(extra_args=["--no_such_flag=1"]).start()


def test_the_http_metadata_mode_and_the_master_is_gone_after_stop() -> None:
    master = MooncakeMaster(http_metadata=True).start()
    pid = master.process.pid
    try:
        assert "?metadata=http://127.0.0.1:" in master.url
        store = MooncakeStore(master.url + "&segment=64MiB&buffer=16MiB")
        try:
            store.put("h", b"via the HTTP metadata server")
            assert store.get("h") == b"via the HTTP metadata server"
        finally:
            store.close()
    finally:
        master.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)

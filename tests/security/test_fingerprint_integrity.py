"""KV is rooted in the checkpoint that computed it: a live engine's hash root and the headers of
the chunks its tiers write change with the checkpoint, so two revisions of one model (one layout,
one vocabulary) never share KV, on disk or anywhere else.

Found by breaking the code: a worker that passed a constant as its fingerprint left every test
green. Here two engines run two revisions of the default model (the same files, one with a
changed config.json: to the fingerprint, another checkpoint) against one disk-tier directory,
one after the other; the second must find nothing of the first's, and must say why.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem import LLM
from tandem.config import KVTiersConfig
from tandem.kvcache.tiers.disk import DiskStore
from tandem.loader.resolve import resolve_model
from tandem.types import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0)
PROMPT = "The keeper of the lighthouse wrote in the log every evening. " * 12


def _revision(tmp: Path, name: str, extra: dict | None) -> Path:
    """The default model's converted files, linked; config.json copied, changed when `extra`."""
    source = resolve_model("smollm2-135m", "float32").hf_dir
    target = tmp / name
    target.mkdir()
    for path in source.iterdir():
        if path.name in ("config.json", "tandem_source.json"):
            continue
        (target / path.name).symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **(extra or {})}))
    return target


@pytest.fixture(scope="module")
def revisions(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("revisions")
    return _revision(tmp, "rev-a", None), _revision(tmp, "rev-b", {"tandem_test_revision": "b"})


def _run(model: Path, disk: Path) -> tuple[int, str, int, dict]:
    """Serve the prompt with a disk tier; its root hash, fingerprint, cached tokens and counters."""
    with LLM(str(model), kv_cache_memory=32 << 20, max_num_batched_tokens=512, block_size=16,  # chunks of 64 tokens
             kv_tiers=KVTiersConfig(disk_path=str(disk), disk_bytes=1 << 30, chunk_blocks=4, admit_after=1)) as llm:
        core = llm.engine.core
        out = llm.generate([PROMPT], GREEDY)[0]
        connector = llm.engine.scheduler.connector
        while connector._pending:  # the chunks land on disk
            core.step()
        return core.root_hash, core.fingerprint, out.num_cached_tokens, dict(core.load().connector("kv_tiers"))


def test_a_revision_shares_no_kv_with_another(revisions: tuple[Path, Path], tmp_path: Path) -> None:
    rev_a, rev_b = revisions
    disk = tmp_path / "kv"
    root_a, fingerprint_a, cached, _ = _run(rev_a, disk)
    assert cached == 0
    headers = _chunk_fingerprints(disk)
    assert headers == {fingerprint_a}  # every chunk names the checkpoint that computed it
    root_again, _, cached_again, _ = _run(rev_a, disk)  # the same checkpoint: its chunks come back
    assert root_again == root_a and cached_again > 0
    root_b, fingerprint_b, cached_b, _ = _run(rev_b, disk)
    assert fingerprint_b != fingerprint_a and root_b != root_a
    assert cached_b == 0  # another revision finds none of them
    assert _chunk_fingerprints(disk) == {fingerprint_a, fingerprint_b}


def _chunk_fingerprints(disk: Path) -> set[str]:
    found = set()
    for path in disk.rglob("*.kv"):
        value = path.read_bytes()
        head_len = int.from_bytes(value[6:10], "little")
        found.add(json.loads(value[10:10 + head_len])["fingerprint"])
    assert found, f"no chunk on disk under {disk}"
    return found


def test_the_disk_store_owns_what_both_revisions_wrote(revisions: tuple[Path, Path], tmp_path: Path) -> None:
    """Both engines claim the one directory (its marker): it stays theirs alone."""
    disk = tmp_path / "kv"
    _run(revisions[0], disk)
    assert (disk / ".tandem-kv-tier.json").is_file()
    assert DiskStore(disk, 1 << 30).stats()["num_chunks"] > 0

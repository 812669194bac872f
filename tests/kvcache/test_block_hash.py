"""The block hash chain: the contract shared by the prefix cache, the KV tiers and the router."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from tandem.kvcache.block_hash import block_hashes, chain_hash, root_hash

B = 16
REPO = Path(__file__).resolve().parents[2]


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run code in a fresh interpreter that imports this checkout's tandem."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": path, **env},
    )


def reference_root(model_id: str, kv_dtype: str, block_size: int, extra_keys=()) -> int:
    """h0 as the module docstring defines it, written out independently."""
    payload = json.dumps([model_id, kv_dtype, block_size, list(extra_keys)]).encode("utf-8")
    return xxhash.xxh3_64(payload).intdigest()


def reference_chain(tokens: list[int], block_size: int, root: int) -> list[int]:
    """h_i = xxh3_64(h_{i-1} as 8 LE bytes ‖ block i as LE uint32), full blocks only."""
    hashes, parent = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        payload = parent.to_bytes(8, "little") + b"".join(struct.pack("<I", t) for t in block)
        parent = xxhash.xxh3_64(payload).intdigest()
        hashes.append(parent)
    return hashes


TOKENS = [(i * 7919 + 13) % 50_000 for i in range(5 * B + 7)]


def test_root_matches_reference() -> None:
    assert root_hash("org/model", "bfloat16", B) == reference_root("org/model", "bfloat16", B)
    assert root_hash("m", "float32", 4, ["lora:a", "mm:b"]) == reference_root(
        "m", "float32", 4, ["lora:a", "mm:b"]
    )
    assert root_hash("m", "float32", 4, ("x",)) == root_hash("m", "float32", 4, ["x"])


def test_chain_is_pinned() -> None:
    """Other processes (router, KV store, other versions) key blocks by these exact numbers."""
    root = root_hash("org/model", "bfloat16", 16)
    assert root == xxhash.xxh3_64_intdigest(b'["org/model", "bfloat16", 16, []]')
    assert root == 13535759987905250566
    assert block_hashes(list(range(32)), 16, root) == [13907266579368830687, 10366621476527191447]


def test_chain_matches_reference() -> None:
    root = root_hash("org/model", "float16", B)
    assert block_hashes(TOKENS, B, root) == reference_chain(TOKENS, B, root)
    assert chain_hash(root, TOKENS[:B]) == reference_chain(TOKENS[:B], B, root)[0]


def test_chain_hash_payload_layout() -> None:
    parent = 0x0123456789ABCDEF
    payload = bytes.fromhex("efcdab8967452301") + bytes.fromhex("01000000ffffffff00000100")
    assert chain_hash(parent, [1, 0xFFFFFFFF, 0x10000]) == xxhash.xxh3_64_intdigest(payload)


def test_hashes_are_64_bit_ints() -> None:
    for h in [root_hash("m", "float32", B), *block_hashes(TOKENS, B, 0)]:
        assert isinstance(h, int)
        assert 0 <= h < 2**64


@pytest.mark.parametrize("length", [0, 1, B - 1])
def test_partial_block_is_not_hashed(length: int) -> None:
    assert block_hashes(TOKENS[:length], B, 123) == []


@pytest.mark.parametrize("length", [B, B + 1, 2 * B - 1, 2 * B, 5 * B + 7])
def test_only_full_blocks_are_hashed(length: int) -> None:
    hashes = block_hashes(TOKENS[:length], B, 123)
    assert len(hashes) == length // B


def test_trailing_partial_block_does_not_change_hashes() -> None:
    root = root_hash("m", "float32", B)
    full = block_hashes(TOKENS[: 2 * B], B, root)
    assert block_hashes(TOKENS[: 2 * B + 5], B, root) == full
    assert block_hashes(TOKENS[: 2 * B] + [999] * (B - 1), B, root) == full


def test_prefix_property() -> None:
    """A prompt's chain starts with the chain of each of its block-aligned prefixes."""
    root = root_hash("m", "float32", B)
    full = block_hashes(TOKENS, B, root)
    for k in range(len(full) + 1):
        assert block_hashes(TOKENS[: k * B], B, root) == full[:k]


@pytest.mark.parametrize("start_block", [0, 1, 2, 4, 5])
def test_incremental_extension_equals_full_recomputation(start_block: int) -> None:
    root = root_hash("m", "float32", B)
    full = block_hashes(TOKENS, B, root)
    parent = full[start_block - 1] if start_block else None
    assert block_hashes(TOKENS, B, root, start_block, parent) == full[start_block:]


def test_extension_as_tokens_arrive() -> None:
    """Extending one token at a time (as decode does) gives the same chain as one pass."""
    root = root_hash("m", "float32", B)
    chain: list[int] = []
    for n in range(len(TOKENS) + 1):
        parent = chain[-1] if chain else None
        chain.extend(block_hashes(TOKENS[:n], B, root, len(chain), parent))
        assert chain == block_hashes(TOKENS[:n], B, root)


def test_start_past_the_end_hashes_nothing() -> None:
    assert block_hashes(TOKENS[: 2 * B], B, 1, start_block=3, parent_hash=7) == []


def test_sequence_types_agree() -> None:
    root = root_hash("m", "float32", B)
    assert block_hashes(tuple(TOKENS), B, root) == block_hashes(list(TOKENS), B, root)


def test_position_and_parent_matter() -> None:
    """The same tokens in another block, or after another prefix, hash differently."""
    root = root_hash("m", "float32", B)
    block = TOKENS[:B]
    h = block_hashes(block * 3, B, root)
    assert len(set(h)) == 3
    other_prefix = block_hashes(TOKENS[B : 2 * B] + block, B, root)
    assert other_prefix[1] != h[1]


def test_any_token_change_changes_the_rest_of_the_chain() -> None:
    root = root_hash("m", "float32", B)
    full = block_hashes(TOKENS, B, root)
    changed = list(TOKENS)
    changed[B + 3] += 1
    other = block_hashes(changed, B, root)
    assert other[0] == full[0]
    assert all(a != b for a, b in zip(other[1:], full[1:], strict=True))


def test_token_ids_are_uint32() -> None:
    """Ids are packed as uint32: large vocabularies work, out-of-range ids are refused."""
    root = root_hash("m", "float32", 2)
    assert len(block_hashes([0, 2**32 - 1], 2, root)) == 1
    assert block_hashes([0, 2**16], 2, root) != block_hashes([0, 0], 2, root)
    with pytest.raises(struct.error):
        block_hashes([0, 2**32], 2, root)
    with pytest.raises(struct.error):
        block_hashes([0, -1], 2, root)


@pytest.mark.parametrize(
    "other",
    [
        ("other/model", "bfloat16", 16, ()),
        ("org/model", "float16", 16, ()),
        ("org/model", "float32", 16, ()),
        ("org/model", "bfloat16", 32, ()),
        ("org/model", "bfloat16", 16, ("lora:x",)),
    ],
)
def test_different_model_dtype_block_size_or_keys_give_different_roots(other) -> None:
    base = root_hash("org/model", "bfloat16", 16)
    assert root_hash(*other) != base
    # ...and so every block of the same tokens lands under a different key.
    a = block_hashes(TOKENS, 16, base)
    b = block_hashes(TOKENS, 16, root_hash(*other))
    assert not set(a) & set(b)


def test_root_fields_do_not_run_together() -> None:
    """The JSON framing keeps ("ab", "c") and ("a", "bc") apart."""
    assert root_hash("ab", "c", 16) != root_hash("a", "bc", 16)
    assert root_hash("m", "float32", 16, ["a", "b"]) != root_hash("m", "float32", 16, ["a,b"])


def test_hash_is_stable_across_processes() -> None:
    """No dependence on Python's per-process string hashing (PYTHONHASHSEED)."""
    code = (
        "from tandem.kvcache.block_hash import block_hashes, root_hash\n"
        "r = root_hash('org/model', 'bfloat16', 4)\n"
        "print(r, block_hashes(list(range(12)), 4, r))\n"
    )
    results = set()
    for seed in ("1", "2"):
        proc = run_python(code, PYTHONHASHSEED=seed)
        assert proc.returncode == 0, proc.stderr
        results.add(proc.stdout)
    root = root_hash("org/model", "bfloat16", 4)
    assert results == {f"{root} {block_hashes(list(range(12)), 4, root)}\n"}


def test_engine_core_imports_no_torch() -> None:
    """The router and the KV store import these modules: they must never pull in torch."""
    code = (
        "import sys\n"
        "import tandem.kvcache.block_hash, tandem.engine.block_pool\n"
        "import tandem.engine.kv_cache_manager, tandem.engine.scheduler\n"
        "import tandem.types, tandem.config\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'transformers'))\n"
        "assert 'torch' not in sys.modules, heavy\n"
        "print(heavy)\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"

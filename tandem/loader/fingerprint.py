"""A model's fingerprint: what the KV block-hash chain is rooted in.

KV computed by one model is garbage to another, and to another revision of the same model.
The chain's root (tandem/kvcache/block_hash.py) therefore hashes a fingerprint naming the
architecture, the dtype and a digest of the weights' identity, so stale or foreign KV can
never match, in this engine's prefix cache, in a handoff or in a shared KV store.

The digest must be cheap at start-up, even for a checkpoint of hundreds of gigabytes, yet
change with any revision. It reads each weight file's size, its head (a GGUF header and
tensor index, or a safetensors JSON header with every tensor's offsets) and its tail (the
last tensors' bytes), plus the index and config files whole: a few MiB however large the
model. Torch-free.
"""

from __future__ import annotations

from pathlib import Path

import xxhash

HEAD_BYTES = 4 << 20  # a GGUF/safetensors header and the first tensors
TAIL_BYTES = 1 << 20
_SMALL_FILES = ("config.json", "model.safetensors.index.json", "generation_config.json")


def head_tail_digest(path: Path, head: int = HEAD_BYTES, tail: int = TAIL_BYTES) -> str:
    """xxh64 of a file's size, first `head` and last `tail` bytes: distinct files differ."""
    size = path.stat().st_size
    digest = xxhash.xxh64()
    with path.open("rb") as handle:
        digest.update(handle.read(head))
        if size > head:
            handle.seek(max(head, size - tail))
            digest.update(handle.read(tail))
    digest.update(f"|{size}".encode())
    return digest.hexdigest()


def weights_digest(source: Path) -> str:
    """The identity of a checkpoint: a .gguf file or an HF directory (config + safetensors)."""
    digest = xxhash.xxh64()
    if source.is_file():
        digest.update(f"gguf:{head_tail_digest(source)}".encode())
        return digest.hexdigest()
    for name in _SMALL_FILES:
        path = source / name
        if path.is_file():
            digest.update(name.encode() + b"=" + xxhash.xxh64(path.read_bytes()).digest())
    for path in sorted(source.glob("*.safetensors")) + sorted(source.glob("*.bin")):
        digest.update(f"{path.name}={head_tail_digest(path)}".encode())
    return digest.hexdigest()


def model_fingerprint(architecture: str, dtype: str, source: Path, load_format: str = "auto",
                      seed: int = 0) -> str:
    """A readable fingerprint, e.g. ``LlamaForCausalLM/float32/3f0c9a1e2b4d5f60``.

    Random ("dummy") weights depend on the seed, not on any file, so the seed stands in for
    the digest: two dummy engines share KV only when their weights really are the same.
    """
    if load_format == "dummy":
        config = source / "config.json" if source.is_dir() else source
        weights = f"dummy-seed{seed}-{head_tail_digest(config)}"
    else:
        weights = weights_digest(source)
    return f"{architecture}/{dtype}/{weights}"

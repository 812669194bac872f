"""Build a model from its config and fill it: safetensors (mmap), or dummy random weights.

Weights are read straight from mmap'd safetensors (`safetensors_mmap`): every tensor reaches
the model as a zero-copy view of the file, each layer narrows it to its tensor-parallel slice
(still a view) and copies that into its parameter, so only the slice's pages are read from
disk. The files (big ones cut into spans of consecutive tensors) are loaded by a pool of
threads: torch's copies release the GIL, so one thread's page faults overlap another's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.config import ModelConfig
from tandem.distributed.expert_parallel import ExpertParallel
from tandem.distributed.pipeline_parallel import PipelineStage
from tandem.distributed.tensor_parallel import SINGLE_RANK, TensorParallel
from tandem.kernels.base import AttentionBackend
from tandem.layers.int4_experts import Int4Experts
from tandem.loader.copy_pipeline import (
    ReadAhead,
    ReadShare,
    SplitCopies,
    map_ahead,
    read_share_ahead,
)
from tandem.loader.device_copy import StagedDeviceCopies
from tandem.loader.safetensors_mmap import PrefetchReads, SafetensorsFile
from tandem.models.registry import model_class

logger = logging.getLogger(__name__)


def read_model_config(hf_dir: Path) -> ModelConfig:
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {hf_dir}")
    hf = json.loads(config_path.read_text())
    generation = hf_dir / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        if eos is not None:
            base = hf.get("eos_token_id")
            merged = set(base if isinstance(base, list) else [] if base is None else [base])
            merged |= set(eos if isinstance(eos, list) else [eos])
            hf["eos_token_id"] = sorted(merged)
    return ModelConfig.from_hf(hf)


def weight_files(hf_dir: Path) -> list[Path]:
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {hf_dir} (use load_format='dummy' for random weights)")
    return files


def open_checkpoint(hf_dir: Path) -> list[SafetensorsFile]:
    """Every weight file of `hf_dir`, mapped; a tensor named in two files is refused."""
    opened = [SafetensorsFile(path) for path in weight_files(hf_dir)]
    seen: dict[str, Path] = {}
    for file in opened:
        for name in file.tensors:
            if name in seen:
                raise ValueError(f"{name} is in both {seen[name].name} and {file.path.name} (in {hf_dir})")
            seen[name] = file.path
    return opened


def iter_safetensors(hf_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, zero-copy view) of every checkpoint tensor, file by file in file order."""
    for file in open_checkpoint(hf_dir):
        yield from file.items()


@dataclass(frozen=True)
class ReadSpan:
    """Consecutive tensors of one file, loaded by one thread."""

    file: SafetensorsFile
    names: tuple[str, ...]
    nbytes: int


_MIN_SPAN = 1 << 30
# Each loading thread pins two staging buffers of this size for a GPU load.
_STAGING_CHUNK = 32 << 20


def read_spans(files: list[SafetensorsFile], workers: int, min_span: int | None = None) -> list[ReadSpan]:
    """Cut the files into spans of whole tensors, one thread's work each: a file is one span,
    unless the checkpoint has fewer files than `workers`, when files are cut into spans of
    about 1/`workers` of the checkpoint, but never under `min_span` (1 GiB). Measured on a
    2-core VM's virtio disk: a 0.54 GB file read by one sequential stream loads at dd's
    speed, by two to four streams 15-60% slower; several files in parallel do not lose."""
    total = sum(info.nbytes for file in files for info in file.tensors.values())
    target = max(-(-total // max(workers, 1)), _MIN_SPAN if min_span is None else min_span)
    spans = []
    for file in files:
        names: list[str] = []
        size = 0
        for info in file.tensors.values():
            names.append(info.name)
            size += info.nbytes
            if size >= target:
                spans.append(ReadSpan(file, tuple(names), size))
                names, size = [], 0
        if names:
            spans.append(ReadSpan(file, tuple(names), size))
    return spans


def default_load_workers() -> int:
    return min(16, max(4, 2 * (os.cpu_count() or 1)))


def build_model(
    config: ModelConfig, backend: AttentionBackend, max_positions: int, dtype: torch.dtype,
    tp: TensorParallel = SINGLE_RANK, stage: PipelineStage | None = None, ep: ExpertParallel | None = None,
    device: torch.device | None = None,
) -> torch.nn.Module:
    """The model for this rank: the whole of it, or its tensor-parallel share of each layer
    under `tp`, only its pipeline stage's layers under `stage`, and only its share of the
    experts (whole) under `ep`; on `device` (default: the CPU)."""
    cls = model_class(config.architecture)
    model = cls(config, backend, max_positions, dtype, tp=tp, stage=stage, ep=ep)
    if device is not None and device.type != "cpu":
        return place_on_device(model, device, dtype).eval()
    return model.to(dtype).eval()


_KEEP_VALUES_BYTES = 1 << 20


def place_on_device(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Move a freshly built model to `device` in `dtype` without reading its big parameters.

    They were made with `torch.empty`, whose pages the host never commits until written; the
    loader overwrites them anyway, so each gets an empty tensor on the device instead of a
    copy (a Llama-3.1-8B built in fp32 would otherwise be 32 GB touched on the host and a
    conversion). Buffers (the rotary tables) and small parameters (norm weights, biases: the
    values their constructors set) are copied. A tied parameter stays one tensor.
    """
    for module in model.modules():
        if isinstance(module, Int4Experts):  # the Triton kernel's layout, made on the device
            module.use_packed_words(device)
    placed: dict[int, torch.Tensor] = {}

    def place(tensor: torch.Tensor, keep_values: bool) -> torch.Tensor:
        if id(tensor) not in placed:
            target = dtype if tensor.is_floating_point() else tensor.dtype
            if keep_values or tensor.numel() * tensor.element_size() < _KEEP_VALUES_BYTES:
                moved = tensor.detach().to(device=device, dtype=target)
            else:
                moved = torch.empty(tensor.shape, dtype=target, device=device)
            placed[id(tensor)] = moved
        return placed[id(tensor)]

    params: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                if id(param) not in params:
                    params[id(param)] = torch.nn.Parameter(place(param, False), requires_grad=False)
                module._parameters[name] = params[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = place(buffer, True)
    return model


def load_weights(model: torch.nn.Module, hf_dir: Path, workers: int | None = None,
                 device: torch.device | None = None, share: ReadShare | None = None) -> int:
    """Fill `model` (this rank's share of it) from the safetensors in `hf_dir`.

    Each file (`read_spans`: a big one may be cut into spans) is one stream of tensors in file
    order, and `workers` threads (default: two per core, 4 to 16) feed the streams to
    `model.load_weights` at once. Every tensor goes to its own parameter slice, so the threads
    never write the same memory. Each stream maps its file again, so has its own readahead.

    A rank that keeps the whole checkpoint gives each stream one copying thread and a
    `ReadAhead` thread mapping the file in order ahead of it: one sequential reader per file,
    the access dd makes (on this project's 2-core VM two to four readers through one file were
    15-60% slower). A rank that keeps part of it (tensor-parallel slices, a pipeline stage, a
    share of the experts) loads under `PrefetchReads`, every
    copy first asking the kernel for exactly the pages it reads, so the other ranks' bytes are
    never read; those reads start only when the copy does, so a stream gets several threads,
    one copying while another waits for the disk. When the ranks of one machine together keep
    every byte (`share`: all of a model's ranks on this host), each stream also reads its share
    of the file forward ahead of the copies, so the disk sees the files read once in order
    (two ranks on the 2-core VM: ~6%, docs/performance.md "Cold start"). Either way
    `SplitCopies` has a helper fault in half of each large destination while the copy fills
    the other (copy_pipeline). Torch's
    intra-op threads are held at one meanwhile: a copy split over cores only splits its page
    faults into competing streams.

    A model on a GPU (`device`) gets its tensors through `StagedDeviceCopies` instead of
    `SplitCopies`: each thread stages chunks in two pinned buffers and sends one to the
    device while it fills the other from the file. Returns the bytes staged (0 on the CPU).
    """
    files = open_checkpoint(hf_dir)
    workers = workers or default_load_workers()
    spans = read_spans(files, workers)
    del files  # each span maps its file again; a mapping goes with its last view
    # A rank that keeps part of the checkpoint (tensor-parallel slices, a pipeline stage's
    # layers, a share of the experts) reads exactly what it keeps; the rest is never touched.
    stage = getattr(model, "stage", None)
    exact = getattr(model, "tp", SINGLE_RANK).split or bool(stage is not None and stage.split)
    per_span = max(1, workers // len(spans)) if exact and spans else 1
    streams = [_Stream(span, read_ahead=not exact, share=share if exact else None) for span in spans]
    helpers = ThreadPoolExecutor(max(1, min(4, (os.cpu_count() or 2) - 1)), thread_name_prefix="load-populate")

    def load(stream: _Stream) -> set[str]:
        with contextlib.ExitStack() as modes:
            modes.callback(stream.close)
            if exact:
                modes.enter_context(PrefetchReads(stream.file))
            if on_device:
                staged = modes.enter_context(StagedDeviceCopies(device, chunk_bytes=_STAGING_CHUNK))
                modes.callback(lambda: staged_bytes.append(staged.bytes_staged))
            else:
                modes.enter_context(SplitCopies(helpers))
            return model.load_weights(stream)

    on_device = device is not None and device.type != "cpu"
    staged_bytes: list[int] = []
    jobs = [stream for stream in streams for _ in range(per_span)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if workers == 1 or len(jobs) == 1:
            loaded = set().union(*map(load, jobs))
        else:
            with ThreadPoolExecutor(min(workers, len(jobs)), thread_name_prefix="load-weights") as pool:
                loaded = set().union(*pool.map(load, jobs))
    finally:
        torch.set_num_threads(threads)
        helpers.shutdown()
    missing = model.expected_weight_names() - loaded
    if missing:
        raise ValueError(f"checkpoint in {hf_dir} lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
    return sum(staged_bytes)


class _Stream:
    """A span's (name, view) pairs in file order, handed out one at a time to whichever of its
    threads asks next; iterating it gives each thread its own iterator over the same stream.
    With `read_ahead`, a `ReadAhead` maps the whole span ahead of the tensor last handed out;
    with `share`, one reads this process's pieces of it (`ReadShare`) ahead of the same
    position; either from the first tensor on until `close()`."""

    def __init__(self, span: ReadSpan, read_ahead: bool, share: ReadShare | None = None) -> None:
        self.file = span.file.remap()
        self._names = iter(span.names)
        self._span = span if read_ahead or share is not None else None
        self._share = share
        self._read_ahead: ReadAhead | None = None
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            with self._lock:
                name = next(self._names, None)
                if name is not None and self._span is not None:
                    info = self.file.tensors[name]
                    if self._read_ahead is None:
                        self._read_ahead = self._start_read_ahead(info.start)
                    self._read_ahead.advance(info.start)
            if name is None:
                return
            yield name, self.file.tensor(name)

    def _start_read_ahead(self, start: int) -> ReadAhead:
        assert self._span is not None
        end = self.file.tensors[self._span.names[-1]].end
        if self._share is None:
            return ReadAhead(map_ahead(self.file.address), start, end)
        return ReadAhead(read_share_ahead(self._share, self.file.read_ahead), start, end, chunk=self._share.unit)

    def close(self) -> None:
        """Stop reading ahead; a share's pieces are asked for to the end first, since this
        process's peers count on finding them in the page cache (asking returns at once)."""
        with self._lock:
            if self._read_ahead is not None:
                if self._share is not None:
                    self._read_ahead.finish()
                else:
                    self._read_ahead.stop()
                self._read_ahead = None
            self._span = None


def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights of the right scale, for performance work on configs we have no weights for.
    On a GPU the draws come from the device's generator: the same seed gives the same weights
    on the same kind of device."""
    generators: dict[torch.device, torch.Generator] = {}
    for module in model.modules():
        if isinstance(module, Int4Experts):  # packed levels and scales: buffers, not parameters
            device = module.w13.device
            generators.setdefault(device, torch.Generator(device).manual_seed(seed))
            module.init_dummy_(generators[device])
    for name, param in model.named_parameters():
        if param.device not in generators:
            generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        generator = generators[param.device]
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith(".bias"):
            param.data.zero_()
        else:
            # In place, in the run dtype: no float32 temporary as large as the tensor (an
            # expert stack of a DeepSeek-V3 layer is 3.5 GB in float32).
            param.data.normal_(0.0, 0.02, generator=generator)

"""Loading from mmap'd safetensors: a tensor-parallel rank reads only its shard of the file
(checked in the page cache), and several files, read by several threads, load exactly what one
file read the old way (safetensors' own full reads) does."""

from __future__ import annotations

import functools
import json
import mmap
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.distributed.tensor_parallel import TensorParallel
from tandem.kernels.torch_attention import TorchAttentionBackend
from tandem.loader import model_loader, page_cache
from tandem.loader.copy_pipeline import ReadShare
from tandem.loader.model_loader import build_model, load_weights, read_model_config, read_spans
from tandem.loader.safetensors_mmap import SafetensorsFile

# The vocabulary (embedding and head, split by rows) dominates, so a rank's share is about
# half the file; o_proj and down_proj (split by columns, rows of 1 and 4 KiB) are read whole,
# since half a row is less than a page.
CONFIG = transformers.LlamaConfig(
    vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
)
PAGE = mmap.PAGESIZE


def _state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(CONFIG)
    return {name: tensor.contiguous() for name, tensor in model.state_dict().items()}


def _save(directory: Path, tensors: dict[str, torch.Tensor], files: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**CONFIG.to_dict(), "architectures": ["LlamaForCausalLM"]}))
    names = sorted(tensors)
    for index in range(files):
        part = {name: tensors[name] for name in names[index::files]}
        save_file(part, str(directory / f"model-{index + 1:05d}-of-{files:05d}.safetensors"))
    return directory


def _build(directory: Path, tp: TensorParallel) -> torch.nn.Module:
    return build_model(read_model_config(directory), TorchAttentionBackend(), 128, torch.float32, tp)


def _cold(path: Path) -> None:
    left = page_cache.make_cold(path)
    if left is None:
        pytest.skip("mincore cannot see this file's page cache")
    if left > 2 * PAGE:
        pytest.skip(f"{path.parent} keeps its pages cached after POSIX_FADV_DONTNEED (tmpfs?)")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_reads_only_its_shard_of_the_file(tmp_path: Path, rank: int) -> None:
    tensors = _state_dict()
    directory = _save(tmp_path, tensors)
    (path,) = directory.glob("*.safetensors")
    _cold(path)
    model = _build(directory, TensorParallel(rank, 2))
    load_weights(model, directory, workers=3)
    read = page_cache.resident_bytes(path)
    # What the rank holds of each split tensor (a contiguous block of rows, so whole pages
    # but the two at its ends), plus the tensors read whole: columns of o/down, the norms.
    whole = {n for n in tensors if n.endswith(("o_proj.weight", "down_proj.weight", "norm.weight"))}
    held = sum(p.numel() * 4 for n, p in model.named_parameters()
               if not n.endswith(("o_proj.weight", "down_proj.weight", "norm.weight")))
    expected = held + sum(tensors[n].numel() * 4 for n in whole)
    slack = 2 * PAGE * len(tensors) + 16 * PAGE  # partial pages at each tensor's ends; the header
    assert expected - slack <= read <= expected + slack, (read, expected)
    assert read < 0.6 * path.stat().st_size  # about half the file
    _cold(path)
    load_weights(_build(directory, TensorParallel(0, 1)), directory, workers=3)
    assert page_cache.resident_bytes(path) >= path.stat().st_size - PAGE  # unsplit: all of it


@pytest.mark.parametrize("stage", [0, 1])
def test_a_pipeline_stage_reads_only_its_layers(tmp_path: Path, stage: int) -> None:
    """Stage 0 keeps layer 0 and the embedding, stage 1 layer 1, the final norm and the head;
    neither reads a byte of the other's tensors."""
    from tandem.distributed.pipeline_parallel import PipelineStage

    tensors = _state_dict()
    directory = _save(tmp_path, tensors)
    (path,) = directory.glob("*.safetensors")
    _cold(path)
    config = read_model_config(directory)
    model = build_model(config, TorchAttentionBackend(), 128, torch.float32, TensorParallel(),
                        PipelineStage(stage, 2, stage, stage + 1))
    load_weights(model, directory, workers=3)
    kept = model.expected_weight_names()
    assert kept and all(model.holds_weight(n) for n in kept)
    expected = sum(tensors[n].numel() * 4 for n in kept)
    slack = 2 * PAGE * len(tensors) + 16 * PAGE
    read = page_cache.resident_bytes(path)
    assert expected - slack <= read <= expected + slack, (read, expected)
    assert read < 0.6 * path.stat().st_size


def _reference_load(model: torch.nn.Module, directory: Path) -> None:
    """What loading did before mmap views: safetensors' full read of every tensor."""
    def tensors():
        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, handle.get_tensor(name)

    loaded = model.load_weights(tensors())
    assert loaded >= model.expected_weight_names()


@pytest.mark.parametrize("tp", [TensorParallel(0, 1), TensorParallel(1, 2)])
def test_several_files_load_what_one_file_loads(tmp_path: Path, tp: TensorParallel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_loader, "_MIN_SPAN", 1 << 20)  # so one file is cut into spans too
    tensors = _state_dict()
    tensors = {n: t.bfloat16() if "mlp" in n else t for n, t in tensors.items()}  # converted on copy
    one, three = _save(tmp_path / "one", tensors), _save(tmp_path / "three", tensors, files=3)
    reference = _build(one, tp)
    _reference_load(reference, one)
    for directory, workers in [(one, 1), (one, 4), (three, 1), (three, 3)]:
        model = _build(directory, tp)
        load_weights(model, directory, workers=workers)
        got = dict(model.named_parameters())
        for name, param in reference.named_parameters():
            assert torch.equal(got[name], param), (directory.name, workers, name)


def test_files_are_cut_into_spans_only_when_there_are_fewer_than_workers(tmp_path: Path) -> None:
    directory = _save(tmp_path, _state_dict(), files=2)
    files = model_loader.open_checkpoint(directory)
    assert [len(span.names) for span in read_spans(files, 8)] == [len(f.tensors) for f in files]  # < 1 GiB
    spans = read_spans(files, 8, min_span=1 << 20)
    assert len(spans) > len(files)  # cut (a tensor is never split, so not always into 8)
    assert [n for span in spans for n in span.names] == [n for f in files for n in f.names()]  # file order
    assert all(span.nbytes == sum(span.file.tensors[n].nbytes for n in span.names) for span in spans)


def test_a_tensor_in_two_files_is_refused(tmp_path: Path) -> None:
    tensors = _state_dict()
    directory = _save(tmp_path, tensors, files=2)
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, str(directory / "extra.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight is in both"):
        load_weights(_build(directory, TensorParallel(0, 1)), directory)


def test_ranks_of_one_host_split_a_forward_read_and_load_what_they_would_alone(tmp_path: Path) -> None:
    """With a `ReadShare`, a rank reads its pieces of the whole file ahead of its copies (the
    others' rows too, which its peers on the host need) and still gets exactly its own slices;
    the two ranks' reads together are the whole file, each piece read once."""
    tensors = _state_dict()
    directory = _save(tmp_path, tensors)
    (path,) = directory.glob("*.safetensors")
    unit = 64 * PAGE
    ranks = []
    for rank in (0, 1):
        alone = _build(directory, TensorParallel(rank, 2))
        load_weights(alone, directory, workers=3)
        _cold(path)
        shared = _build(directory, TensorParallel(rank, 2))
        load_weights(shared, directory, workers=3, share=ReadShare(rank, 2, unit=unit))
        got = dict(shared.named_parameters())
        for name, param in alone.named_parameters():
            assert torch.equal(got[name], param), (rank, name)
        # every piece it owns was asked for before the load returned; the reads themselves
        # finish in the background (mincore counts a page once it has arrived)
        ranks.append(_when_own_pieces_arrive(path, rank, unit))
    size = path.stat().st_size
    for rank, pieces in enumerate(ranks):
        others = sum(sum(piece) for index, piece in enumerate(pieces) if index % 2 != rank)
        assert others * PAGE < 0.9 * size / 2, (rank, others)  # not the other half read whole


def _when_own_pieces_arrive(path: Path, rank: int, unit: int, seconds: float = 120.0) -> list[list[bool]]:
    """The file's pages by piece once all of `rank`'s pieces (past the header's) are in the
    page cache; fails if they are not within `seconds` (a loaded box's disk, not a race)."""
    size = path.stat().st_size
    deadline = time.monotonic() + seconds
    while True:
        resident = page_cache.resident_pages(path)
        assert resident is not None
        pieces = [resident[start // PAGE:(start + unit) // PAGE] for start in range(0, size, unit)]
        own = [piece for index, piece in enumerate(pieces) if index % 2 == rank and index > 0]
        if own and all(all(piece) for piece in own):
            return pieces
        assert time.monotonic() < deadline, (rank, [sum(piece) for piece in own])
        time.sleep(0.05)


def test_a_shared_stream_asks_for_all_its_pieces_when_it_closes(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """However far the copies got: a rank that finishes first still reads its share for its peers."""
    directory = _save(tmp_path, _state_dict())
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(SafetensorsFile, "read_ahead", lambda self, start, end: asked.append((start, end)))
    (span,) = read_spans(model_loader.open_checkpoint(directory), 1)
    unit = 64 * PAGE
    # a lead of one piece: the copies alone would have it ask for a piece or two
    monkeypatch.setattr(model_loader, "ReadAhead", functools.partial(model_loader.ReadAhead, lead=unit))
    stream = model_loader._Stream(span, read_ahead=False, share=ReadShare(0, 2, unit=unit))
    next(iter(stream))  # one tensor handed out: the read-ahead starts at the file's first tensor
    stream.close()
    first = span.file.tensors[span.names[0]].start
    end = span.file.tensors[span.names[-1]].end
    owned = [start for start in range(first - first % unit, end, unit) if start // unit % 2 == 0]
    assert sorted({start - start % unit for start, _ in asked}) == owned

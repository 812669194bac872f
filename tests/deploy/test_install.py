"""tandem installed as a user installs it: a wheel built from the sources the image copies, put
into a fresh virtual environment, and run from outside the repository.

Everything else in the suite imports tandem from the checkout, where files the wheel leaves out
(package data not declared in pyproject.toml, a path that climbs out of the package) are still
on disk. Here the only tandem is the installed one: the commands must start, answer --help, find
their shipped files (a model config for the planner, the C kernels' sources, the dashboard) and
run the default model.

The environment reuses this one's third-party packages (torch and the rest, through a path
file) so that nothing is downloaded; tandem itself comes from the wheel alone, which the first
test checks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What the wheel is built from: what deploy/Dockerfile copies into the image before its
# `pip install .`, so the image holds what the wheel holds.
SOURCES = ("pyproject.toml", "README.md", "tandem")

# Every command path of the installed parser, `tandem bench serve` as ["bench", "serve"].
_COMMANDS = """
import argparse, json
from tandem.cli.main import build_parser

def walk(parser, path):
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, [*path, name])

print(json.dumps(list(walk(build_parser(), []))))
"""


@dataclass(frozen=True)
class Installed:
    python: Path
    tandem: Path
    site_packages: Path
    cwd: Path  # outside the repository
    env: dict[str, str]  # no PYTHONPATH: nothing points back at the checkout

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.tandem), *args], cwd=self.cwd, env=self.env, capture_output=True,
                              text=True, timeout=timeout)

    def python_code(self, code: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.python), "-c", code], cwd=self.cwd, env=self.env, capture_output=True,
                              text=True, timeout=300)


def _clean_env(venv: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    if venv is not None:
        env["VIRTUAL_ENV"] = str(venv)
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    root = tmp_path_factory.mktemp("install")
    source, dist, venv, cwd = root / "source", root / "dist", root / "venv", root / "elsewhere"
    cwd.mkdir()
    source.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--no-index", "-w", str(dist), str(source)],
                           cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = dist.glob("tandem_serve-*.whl")

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                   check=True, cwd=cwd, env=_clean_env(), timeout=120)
    python = venv / "bin" / "python"
    site_packages = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, cwd=cwd, env=_clean_env(venv), capture_output=True, text=True).stdout.strip())
    # This environment's packages as plain paths: their .pth files (this checkout's editable
    # install among them) are not run, so the only tandem on the new interpreter's path is
    # the one the wheel puts into its own site-packages, which comes first.
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site_packages / "outer-environment.pth").write_text("".join(f"{path}\n" for path in sorted(ours)))
    # pip from this environment, installing into the new one (the interpreter running it);
    # --ignore-installed: it neither looks at nor uninstalls the checkout's editable install.
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index",
                              "--ignore-installed", str(wheel)],
                             cwd=cwd, env=_clean_env(venv), capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    yield Installed(python, venv / "bin" / "tandem", site_packages, cwd, _clean_env(venv))


@pytest.mark.slow
def test_tandem_comes_from_the_wheel_with_its_package_data(installed: Installed) -> None:
    probe = installed.python_code(
        "import json, tandem, tandem.router.http, tandem.kernels\n"
        "from pathlib import Path\n"
        "print(json.dumps({'tandem': tandem.__file__,\n"
        "  'dashboard': (Path(tandem.router.http.__file__).parent / 'dashboard.html').is_file(),\n"
        "  'csrc': sorted(p.name for p in (Path(tandem.kernels.__file__).parent / 'csrc').glob('*.c'))}))")
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert Path(found["tandem"]).is_relative_to(installed.site_packages), found
    assert not Path(found["tandem"]).is_relative_to(REPO), found
    assert found["dashboard"] and found["csrc"], found


@pytest.mark.slow
def test_every_command_answers_help(installed: Installed) -> None:
    listed = installed.python_code(_COMMANDS)
    assert listed.returncode == 0, listed.stderr
    commands = json.loads(listed.stdout)
    assert ["bench", "serve"] in commands and ["plan", "memory"] in commands, commands

    def help_of(path: list[str]) -> tuple[list[str], subprocess.CompletedProcess]:
        return path, installed.run(*path, "--help", timeout=120)

    with ThreadPoolExecutor(4) as pool:
        for path, result in pool.map(help_of, commands):
            shown = " ".join(["tandem", *path, "--help"])
            assert result.returncode == 0, f"{shown}: {result.stderr[-2000:]}"
            assert result.stdout.startswith("usage: tandem"), f"{shown}: {result.stdout[:500]}"


@pytest.mark.slow
def test_plan_memory_reads_a_shipped_example_config(installed: Installed) -> None:
    """`kimi-k2` is a config shipped with tandem: the installed planner finds and reads it (on
    the default single H100 it does not fit, so the plan asks for eight H200s)."""
    result = installed.run("plan", "memory", "kimi-k2", "--devices", "8xH200", "--tp", "8")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("kimi-k2 (DeepseekV3ForCausalLM)\n"), result.stdout


@pytest.mark.slow
def test_generate_runs_the_default_model(installed: Installed) -> None:
    result = installed.run("generate", "-p", "def fibonacci(n):", "--max-tokens", "12",
                           "--kv-cache-memory", "64MiB")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "\n    if n == 0:\n        return 1\n   \n"  # as from the checkout


def test_the_image_installs_what_the_wheel_is_built_from() -> None:
    """deploy/Dockerfile copies the wheel's sources, nothing else of the repository, and
    installs them as a package (`pip install .`, package data included)."""
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    copied = []
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            *sources, _ = line.split()[1:]
            copied += sources
    assert sorted(copied) == sorted(SOURCES)
    assert re.search(r"^RUN pip install --no-cache-dir \. ", dockerfile, re.MULTILINE), dockerfile

"""Freezing the start-up objects: run in a fresh interpreter each, since a freeze in pytest's
own process would keep its garbage for good (which is why only tandem's own processes freeze)."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

_CYCLE = """
import gc, weakref
from tandem.platform.collector import freeze_start_up_objects
class Node: pass
node = Node(); node.me = node  # a cycle: only the collector frees it
alive = weakref.ref(node)
del node
frozen = freeze_start_up_objects(collect={collect})
gc.collect()
print(frozen > 1000, gc.get_freeze_count() == frozen, alive() is not None)
"""


@pytest.mark.parametrize(("collect", "kept"), [(False, True), (True, False)])
def test_a_freeze_takes_every_object_and_collects_first_only_when_asked(collect: bool, kept: bool) -> None:
    out = subprocess.run([sys.executable, "-c", _CYCLE.format(collect=collect)], capture_output=True,
                         text=True, check=True).stdout.split()
    # everything tracked is frozen; garbage frozen with it is never freed, unless collected first
    assert out == ["True", "True", str(kept)]


def test_an_engine_in_the_callers_process_freezes_nothing(tmp_path) -> None:
    from tandem.config import EngineConfig
    from tandem.executor.factory import make_executor

    before = gc.get_freeze_count()
    executor = make_executor(EngineConfig("m"))
    assert executor.owns_process is False  # tandem.LLM's executor: a worker that never freezes
    assert gc.get_freeze_count() == before

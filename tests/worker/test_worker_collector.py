"""A worker freezes the cycle collector's start-up objects only in a process tandem started
for it (platform/collector.py): each case runs an engine core in a fresh interpreter, so
pytest's own process is never frozen."""

from __future__ import annotations

import subprocess
import sys

import pytest

_ENGINE = """
import gc
from tandem.config import CacheConfig, EngineConfig, LoadConfig
from tandem.engine.engine_core import EngineCore
from tandem.executor.factory import make_executor
config = EngineConfig("smollm2-135m", load=LoadConfig(load_format="dummy"),
                      cache=CacheConfig(kv_cache_memory_bytes=32 << 20))
core = EngineCore(config, make_executor(config, owns_process={owns}))
model = core.executor.worker._model
walked = {{id(o) for o in gc.get_objects()}}  # what collections walk: the frozen are not there
print(gc.get_freeze_count(), id(model) in walked, id(next(model.modules())) in walked)
core.shutdown()
"""


@pytest.mark.parametrize("owns", [True, False])
def test_a_worker_freezes_its_start_up_objects_only_in_its_own_process(owns: bool) -> None:
    result = subprocess.run([sys.executable, "-c", _ENGINE.format(owns=owns)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    frozen, model_walked, module_walked = result.stdout.split()[-3:]
    if owns:  # the imports and then the model (its modules too) are out of every collection's walk
        assert int(frozen) > 10_000 and model_walked == module_walked == "False"
    else:  # a caller's process (tandem.LLM): nothing frozen
        assert int(frozen) == 0 and model_walked == "True"

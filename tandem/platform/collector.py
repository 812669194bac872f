"""Python's cycle collector told that what a worker holds from start-up lives for good.

A worker process has imported torch and the engine before it builds anything: about 170,000
objects tracked by the collector. A full collection walks every one of them, and the next one
comes once enough new objects have outlived two younger ones, which building a model (hundreds
of modules and parameters) does: on the 2-core AVX-512 EPYC that collection was 65 ms of the
default model's 80 ms `build_model`, paid by every rank of a cold start
(docs/performance.md, "Cold start"). Once the model is built its objects are frozen too, so
a later full collection walks only what serving made since (in a 64-sequence decode run none
came either way: serving makes few objects that live).

`gc.freeze()` moves every tracked object into a generation no collection looks at (vLLM and
SGLang freeze their start-up heap too). Frozen objects are still freed by reference counting;
only a cycle among them is never found. So the first freeze, after the imports, collects
nothing first (a collection is the cost being avoided; the imports leave a few hundred
objects of garbage), and the one after the model is built does (`collect`): the loaders'
garbage may hold tensors, and with the imports frozen that collection walks only the objects
made since.

Only a process tandem started for the engine may freeze: in a caller's process (`tandem.LLM`)
a previous engine left as garbage, with its KV cache, would be frozen for good.
"""

from __future__ import annotations

import gc


def freeze_start_up_objects(collect: bool = False) -> int:
    """Freeze every object the collector tracks now, after a collection with `collect`;
    returns how many are frozen in all."""
    if collect:
        gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

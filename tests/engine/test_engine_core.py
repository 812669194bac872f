"""The engine core on the default model: per-step deltas stay the same size however long the
sequence grows, and the plain data it hands its executor does too."""

from __future__ import annotations

import pickle

from tandem.config import CacheConfig, EngineConfig
from tandem.engine.engine_core import EngineCore, EngineCoreRequest
from tandem.engine.messages import CoreOutputs
from tandem.types import SamplingParams


def test_bytes_per_step_do_not_grow_with_sequence_length() -> None:
    core = EngineCore(EngineConfig("smollm2-135m", cache=CacheConfig(kv_cache_memory_bytes=64 << 20)))
    sent_to_workers: list[int] = []
    execute = core.executor.execute_model

    def recording(out):  # noqa: ANN001, ANN202 - the executor's own signature
        sent_to_workers.append(len(pickle.dumps(out)))
        return execute(out)

    core.executor.execute_model = recording  # type: ignore[method-assign]
    try:
        params = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True, logprobs=2)
        core.add_request(EngineCoreRequest("long", list(range(100, 140)), params))
        sent_to_core: list[int] = []
        while core.has_unfinished():
            deltas = core.step()
            assert len(deltas) == 1 and len(deltas[0].sequences) == 1
            assert len(deltas[0].sequences[0].token_ids) == 1  # only the new token
            sent_to_core.append(len(pickle.dumps(CoreOutputs(deltas=deltas))))
    finally:
        core.shutdown()
    assert len(sent_to_core) == 160
    decode_out, decode_in = sent_to_core[1:-1], sent_to_workers[1:-1]  # not the prefill, not the end
    # Token ids of different sizes pickle in 1, 2 or 4 bytes; nothing else may vary.
    assert max(decode_out) - min(decode_out) <= 16, (min(decode_out), max(decode_out))
    assert max(decode_in) - min(decode_in) <= 16, (min(decode_in), max(decode_in))
    assert decode_out[-1] <= decode_out[0] + 16 and decode_in[-1] <= decode_in[0] + 16
    assert sent_to_workers[0] > max(decode_in)  # the prompt crossed once, at the start

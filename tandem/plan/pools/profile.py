"""`tandem plan profile`: measure what engine steps cost on this machine, and fit a CostModel.

The engine runs in this process with the flags a worker would get (model, dtype, threads,
max_num_batched_tokens); each timed call is one `engine.step()`, so the figures include the
scheduler, sampling and Python around the forward pass: what a worker's step really costs.

- prefill steps: one prompt of n new tokens after c cached ones (c = 0: the prefix cache is
  emptied first), for a grid of n and c;
- decode steps: B sequences decoding at context about C, for a grid of B and C (the median
  of several steps, after the prompts' own prefill steps);
- KV handoff: bytes per token from the model's config, over the bandwidth of a memory copy
  on this host (a same-host handoff copies through shared memory), or a network rate you
  give (`--transfer-gbps`); plus one HTTP round trip;
- HTTP: the round trip of a small JSON request to a local FastAPI server, per hop.

Loads torch and the model (only this module of tandem.plan does).
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.plan.pools.costs import CostModel, Measurement, StepShape

# (new tokens, cached context) and (batch, context): enough spread to separate the six costs,
# small enough to measure in a few minutes on one CPU core
DEFAULT_PREFILL_GRID = ((32, 0), (128, 0), (512, 0), (1024, 0), (128, 1024), (512, 1024), (128, 2048))
DEFAULT_DECODE_GRID = ((1, 128), (4, 128), (16, 128), (1, 2048), (4, 2048), (16, 512), (32, 256))


@dataclass(frozen=True)
class ProfileSettings:
    model: str | None = None
    dtype: str = "auto"
    threads: int | None = None
    max_num_batched_tokens: int = 2048
    kv_cache_memory: str = "1GiB"
    prefill_grid: tuple[tuple[int, int], ...] = DEFAULT_PREFILL_GRID
    decode_grid: tuple[tuple[int, int], ...] = DEFAULT_DECODE_GRID
    repeats: int = 3
    transfer_gbps: float | None = None  # None: measure a memory copy (same-host handoff)
    seed: int = 0


def _random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def _timed_step(engine: Any) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def _drain(engine: Any) -> None:
    while engine.has_unfinished():
        engine.step()


def measure_prefill(engine: Any, n: int, context: int, rng: random.Random, vocab: int,
                    block: int) -> float:
    """Seconds of the one step that computes n new tokens after `context` cached ones."""
    from tandem.types import SamplingParams

    context = context // block * block
    prefix = _random_ids(rng, context, vocab)
    engine.core.reset_prefix_cache()
    if context:
        engine.add_request(None, None, SamplingParams(max_tokens=1, temperature=0), prefix + [7])
        _drain(engine)
    engine.add_request(None, None, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                       prefix + _random_ids(rng, n, vocab))
    seconds = _timed_step(engine)
    _drain(engine)
    return seconds


def measure_decode(engine: Any, batch: int, context: int, rng: random.Random, vocab: int,
                   steps: int = 8) -> tuple[float, float]:
    """(median seconds of a decode step of `batch` sequences, their mean context then)."""
    from tandem.types import SamplingParams

    engine.core.reset_prefix_cache()
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(None, None, params, _random_ids(rng, context, vocab))
    # the prompts' prefill steps (chunked when they exceed the budget), then two to settle
    generated = 0
    while engine.core.scheduler.waiting or _any_prefilling(engine):
        engine.step()
    for _ in range(2):
        engine.step()
        generated += 1
    times = []
    for _ in range(steps):
        times.append(_timed_step(engine))
        generated += 1
    _drain(engine)
    return statistics.median(times), context + 1 + generated - steps / 2


def _any_prefilling(engine: Any) -> bool:
    scheduler = engine.core.scheduler
    return any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running)


def http_round_trip_s(requests: int = 200) -> float:
    """Median round trip of a small JSON POST to a FastAPI app on 127.0.0.1 (uvicorn)."""
    import httpx
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/echo")
    async def echo(body: dict[str, Any]) -> dict[str, Any]:
        return body

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", access_log=False)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        times = []
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            payload = {"model": "m", "messages": [{"role": "user", "content": "x" * 512}], "max_tokens": 16}
            for _ in range(requests):
                start = time.perf_counter()
                client.post("/echo", json=payload).raise_for_status()
                times.append(time.perf_counter() - start)
        return statistics.median(times[requests // 10:])
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def kv_bytes_per_token(hf_dir: Path, kv_dtype: str) -> int:
    from tandem.sizing.kv import kv_bytes_per_token as per_token
    from tandem.sizing.shape import read_shape

    shape = read_shape(json.loads((hf_dir / "config.json").read_text()))
    return per_token(shape, 1, shape.num_layers, kv_dtype)


def measure_profile(settings: ProfileSettings, progress: Callable[[str], None] = lambda _: None) -> tuple[
        CostModel, list[Measurement]]:
    """Measure the grids and the handoff; returns the fitted model and what it was fitted to."""
    from tandem.llm import LLM

    rng = random.Random(settings.seed)
    measurements: list[Measurement] = []
    with LLM(settings.model, dtype=settings.dtype, num_threads=settings.threads,
             max_num_batched_tokens=settings.max_num_batched_tokens,
             kv_cache_memory=settings.kv_cache_memory) as llm:
        engine = llm.engine
        vocab = engine.model_config.vocab_size
        block = engine.core.block_size  # cached contexts are whole blocks of it
        measure_prefill(engine, 64, 0, rng, vocab, block)  # warm up kernels and allocator
        for n, context in settings.prefill_grid:
            if n > settings.max_num_batched_tokens:
                continue
            runs = [measure_prefill(engine, n, context, rng, vocab, block) for _ in range(settings.repeats)]
            context = context // block * block
            measurements.append(Measurement(StepShape(((n, context),)), statistics.median(runs)))
            progress(f"prefill {n} tokens after {context}: {statistics.median(runs) * 1e3:.1f} ms")
        for batch, context in settings.decode_grid:
            runs = [measure_decode(engine, batch, context, rng, vocab) for _ in range(settings.repeats)]
            seconds = statistics.median(r[0] for r in runs)
            mean_context = round(statistics.mean(r[1] for r in runs))
            measurements.append(Measurement(StepShape((), (mean_context,) * batch), seconds))
            progress(f"decode batch {batch} at context {mean_context}: {seconds * 1e3:.1f} ms")
        hf_dir = Path(engine.core.hf_dir)
        dtype = str(engine.core.config.load.dtype)
        from tandem.platform.machine import memory_copy_bytes_per_s
    kv_per_token = kv_bytes_per_token(hf_dir, "float32" if dtype in ("auto", "float32") else dtype)
    bandwidth = settings.transfer_gbps * 1e9 / 8 if settings.transfer_gbps else memory_copy_bytes_per_s(256 << 20)
    http = http_round_trip_s()
    progress(f"KV handoff: {kv_per_token} bytes a token at {bandwidth / 1e9:.1f} GB/s; HTTP round trip "
             f"{http * 1e3:.2f} ms")
    meta = {"model": settings.model or "smollm2-135m", "dtype": dtype, "threads": settings.threads,
            "max_num_batched_tokens": settings.max_num_batched_tokens, "block_size": block,
            "kv_bytes_per_token": kv_per_token,
            "transfer_bytes_per_s": bandwidth, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": _machine()}
    model = CostModel.fit(measurements, transfer_s_per_token=kv_per_token / bandwidth,
                          transfer_fixed_s=http, http_overhead_s=http, meta=meta)
    model.meta["fit_errors"] = [round(e, 4) for e in model.relative_errors(measurements)]
    model.meta["measurements"] = [{"prefill": list(map(list, m.shape.prefill)),
                                   "decode_contexts": len(m.shape.decode_contexts),
                                   "decode_context": m.shape.decode_contexts[0] if m.shape.decode_contexts else 0,
                                   "seconds": m.seconds} for m in measurements]
    return model, measurements


def _machine() -> dict[str, Any]:
    from tandem.platform.machine import host_info

    return host_info()


def format_profile(model: CostModel, measurements: Sequence[Measurement]) -> str:
    lines = [f"step = {model.fixed_s * 1e3:.2f} ms + {model.per_prompt_token_s * 1e6:.1f} us/prompt token + "
             f"{model.per_decode_token_s * 1e6:.1f} us/decode token + {model.per_sequence_s * 1e6:.1f} us/sequence",
             f"       + {model.per_prompt_pair_s * 1e9:.1f} ns/prompt attention pair + "
             f"{model.per_decode_pair_s * 1e9:.1f} ns/decode attention pair",
             f"KV handoff = {model.transfer_fixed_s * 1e3:.2f} ms + {model.transfer_s_per_token * 1e6:.2f} us/token; "
             f"HTTP hop {model.http_overhead_s * 1e3:.2f} ms",
             "", f"{'step':<34} {'measured':>10} {'fitted':>10} {'error':>7}"]
    for m, error in zip(measurements, model.relative_errors(measurements), strict=True):
        if m.shape.prefill:
            (n, context), = m.shape.prefill
            what = f"prefill {n} after {context}"
        else:
            what = f"decode x{len(m.shape.decode_contexts)} at {m.shape.decode_contexts[0]}"
        lines.append(f"{what:<34} {m.seconds * 1e3:>8.1f}ms {model.step_s(m.shape) * 1e3:>8.1f}ms {error:>+7.1%}")
    return "\n".join(lines)

"""The KV tiers on the default model, with a real disk and a real redis-server: a prefix evicted
from the device pool comes back from CPU memory, from disk and from Redis with the same greedy
tokens, counted as cached; a fresh engine serves it from the cluster store; corrupt values and
a stopped Redis are recomputes, never wrong tokens; every pool returns to idle."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem import LLM
from tandem.config import KVTiersConfig
from tandem.launch.redis_server import RedisServer
from tandem.types import RequestOutput, SamplingParams

BLOCK_BYTES = 30 * 2 * 3 * 16 * 64 * 4  # SmolLM2-135M, fp32, 16-token blocks (each engine here asks for them)
GREEDY = SamplingParams(max_tokens=12, temperature=0)
SHARED = "The history of the old harbour town is long and full of stories about ships. " * 24
FILLERS = [f"Filler document {i}: " + f"an unrelated passage about topic {i} and more words. " * 30
           for i in range(3)]


def evict_shared_prefix(llm: LLM) -> None:
    """Fill the device pool with other prompts so the shared prefix's blocks are reused."""
    llm.generate(FILLERS, SamplingParams(max_tokens=1, temperature=0))


def assert_idle(llm: LLM) -> None:
    """After the engine ran its pending KV work (a finished request's tail is held until the
    next step has copied it out), nothing is held, loading or used."""
    engine = llm.engine
    deadline = time.monotonic() + 20
    while engine.core.pending_kv_work() is not None and time.monotonic() < deadline:
        engine.core.step()
    assert engine.block_pool.num_used_blocks == 0
    assert engine.scheduler.num_held_blocks == 0
    assert not engine.scheduler.connector._loads and not engine.scheduler.connector._inflight


@pytest.fixture(scope="module")
def cold_outputs() -> list[str]:
    with LLM(block_size=16, kv_cache_memory=512 * BLOCK_BYTES, max_num_batched_tokens=512) as llm:
        return [o.outputs[0].text for o in llm.generate([SHARED + "Question: who built it?"], GREEDY)]


@pytest.fixture(scope="module")
def cpu_llm() -> Iterator[LLM]:
    llm = LLM(block_size=16, kv_cache_memory=64 * BLOCK_BYTES, max_num_batched_tokens=512,
              kv_tiers=KVTiersConfig(cpu_bytes=256 << 20, chunk_blocks=4))
    yield llm
    llm.shutdown()


def test_prefix_comes_back_from_cpu(cpu_llm: LLM, cold_outputs: list[str]) -> None:
    prompt = SHARED + "Question: who built it?"
    first = cpu_llm.generate([prompt], GREEDY)[0]
    assert first.outputs[0].text == cold_outputs[0]
    evict_shared_prefix(cpu_llm)
    assert cpu_llm.engine.kv_manager.cached_prefix_blocks(_request(cpu_llm, prompt)) == 0
    loaded_before = cpu_llm.engine.scheduler.stats.num_loaded_tokens
    again = cpu_llm.generate([prompt], GREEDY)[0]
    assert again.outputs[0].text == cold_outputs[0]
    loaded = cpu_llm.engine.scheduler.stats.num_loaded_tokens - loaded_before
    assert loaded >= 16 * 4 * (len(again.prompt_token_ids) // 64 - 1)
    assert again.num_cached_tokens >= loaded
    tiers = cpu_llm.engine.core.load().connector("kv_tiers")
    assert tiers["loads"] >= 1 and tiers["media"]["cpu"]["chunk_hits"] >= 1
    assert tiers["load_seconds"]["cpu"]["count"] >= 1
    assert_idle(cpu_llm)


def drain_writes(llm: LLM, timeout: float = 20.0) -> None:
    """Step the idle engine until the slow-tier writer has confirmed every write."""
    connector = llm.engine.scheduler.connector
    deadline = time.monotonic() + timeout
    while connector._pending:
        assert time.monotonic() < deadline, "tier writes never confirmed"
        llm.engine.core.step()
        time.sleep(0.01)


def evict_from_device(llm: LLM) -> None:
    assert llm.engine.core.reset_prefix_cache()


def tier_llm(kv_cache_dtype: str = "auto", **tiers) -> LLM:
    return LLM(block_size=16, kv_cache_memory=64 * BLOCK_BYTES, max_num_batched_tokens=512, kv_cache_dtype=kv_cache_dtype,
               kv_tiers=KVTiersConfig(chunk_blocks=4, admit_after=1, **tiers))


PROMPT = SHARED + "Question: who built it?"


def serve_twice(llm: LLM) -> tuple[RequestOutput, RequestOutput]:
    """Compute the prompt, let the writes land, evict it from the device, ask again."""
    first = llm.generate([PROMPT], GREEDY)[0]
    drain_writes(llm)
    evict_from_device(llm)
    return first, llm.generate([PROMPT], GREEDY)[0]


def test_prefix_comes_back_from_disk(tmp_path: Path, cold_outputs: list[str]) -> None:
    with tier_llm(disk_path=str(tmp_path)) as llm:
        first, again = serve_twice(llm)
        assert first.outputs[0].text == again.outputs[0].text == cold_outputs[0]
        assert again.num_cached_tokens >= 64 * (len(again.prompt_token_ids) // 64 - 1)
        tiers = llm.engine.core.load().connector("kv_tiers")
        assert tiers["media"]["disk"]["chunk_hits"] >= 1 and tiers["media"]["disk"]["blocks"] > 0
        assert tiers["codec"] == "raw" and tiers["bytes_per_token"] == BLOCK_BYTES / 16  # the fp32 cache's
        assert_idle(llm)


def test_int4_chunks_take_a_quarter_of_the_bytes_and_any_reader_decodes_them(tmp_path: Path) -> None:
    """--kv-tier-dtype int4: every chunk on disk is its blocks' 4-bit levels, the values' fp32
    scales and the keys' channel minima and steps (0.14x of the fp32 cache's bytes, plus a
    header), a prefix comes back from it as cached tokens, and an engine that keeps its own
    chunks raw reads it all the same."""
    import torch

    from tandem.kvcache.codec import KVCodec

    with tier_llm(disk_path=str(tmp_path), codec="int4") as llm:
        first, again = serve_twice(llm)
        assert again.num_cached_tokens >= 64 * (len(again.prompt_token_ids) // 64 - 1)
        assert len(again.outputs[0].token_ids) == len(first.outputs[0].token_ids) == 12
        tiers = llm.engine.core.load().connector("kv_tiers")
        assert tiers["media"]["disk"]["chunk_hits"] >= 1
        # /load and /metrics report what a token costs in the tiers: 30 layers x 3 heads x
        # (values: 32 bytes of nibbles + a 4-byte scale; keys: 32 bytes of nibbles + a 6-byte
        # minimum and step per channel, shared by the chunk's 64 tokens)
        assert tiers["codec"] == "int4" and tiers["bytes_per_token"] == 30 * 3 * (32 + 4 + 32 + 6)
        assert_idle(llm)
    def packed(blocks: int) -> int:  # blocks of SmolLM2-135M's fp32 cache, in 4 bits
        return KVCodec("int4").payload_bytes((30, 2, 3, blocks, 16, 64), torch.float32)

    assert packed(4) / (4 * BLOCK_BYTES) == pytest.approx((32 + 4 + 32 + 6) / 512)
    files = list(tmp_path.rglob("*.kv"))  # one per chunk (a prompt's tail: fewer blocks)
    sizes = [(int(f.name.split("-")[1].rstrip("b")), f.stat().st_size) for f in files]
    assert any(n == 4 for n, _ in sizes)
    assert all(packed(n) < size < packed(n) + 4096 for n, size in sizes)
    with tier_llm(disk_path=str(tmp_path)) as raw_reader:  # codec raw: decodes what the chunk says
        out = raw_reader.generate([PROMPT], GREEDY)[0]
        assert out.num_cached_tokens >= 64 * (len(out.prompt_token_ids) // 64 - 1)
        assert raw_reader.engine.scheduler.stats.num_loaded_tokens == out.num_cached_tokens
        assert_idle(raw_reader)


def test_an_int8_cache_stores_its_rows_and_4_bit_chunks(tmp_path: Path) -> None:
    """--kv-cache-dtype int8 with the tiers: chunks of its rows (values and scales) come back
    byte for byte, so the answer is the one the int8 cache computed; with --kv-tier-dtype int4
    the chunks hold 4-bit values (no scale rows among them) that a reader rounds into rows
    again, at 36 (values) or 38 (keys) bytes a row of 64 against the cache's 68. A worker with an fp32 cache reads
    the int8 chunks too: the same key, its own rows made of theirs."""
    with tier_llm("int8", disk_path=str(tmp_path / "raw")) as llm:
        first, again = serve_twice(llm)
        assert again.num_cached_tokens >= 64 * (len(again.prompt_token_ids) // 64 - 1)
        assert again.outputs[0].text == first.outputs[0].text
        tiers = llm.engine.core.load().connector("kv_tiers")
        assert tiers["media"]["disk"]["chunk_hits"] >= 1 and tiers["bytes_per_token"] == 30 * 2 * 3 * 68
        assert_idle(llm)
    with tier_llm(disk_path=str(tmp_path / "raw")) as fresh:  # an fp32 cache reads the int8 rows
        out = fresh.generate([PROMPT], GREEDY)[0]
        assert out.num_cached_tokens >= 64 * (len(out.prompt_token_ids) // 64 - 1)
        assert fresh.engine.scheduler.stats.num_loaded_tokens == out.num_cached_tokens
        disk = fresh.engine.core.load().connector("kv_tiers")["media"]["disk"]
        assert disk["chunk_hits"] >= 1 and not disk.get("corrupt"), disk
        assert_idle(fresh)
    with tier_llm("int8", disk_path=str(tmp_path / "int4"), codec="int4") as llm:
        first, again = serve_twice(llm)
        assert again.num_cached_tokens >= 64 * (len(again.prompt_token_ids) // 64 - 1)
        assert len(again.outputs[0].token_ids) == 12
        tiers = llm.engine.core.load().connector("kv_tiers")
        assert tiers["media"]["disk"]["chunk_hits"] >= 1 and tiers["bytes_per_token"] == 30 * 3 * (36 + 38)
        assert_idle(llm)


def test_an_fp8_cache_stores_its_values_and_8_bit_chunks(tmp_path: Path) -> None:
    """--kv-cache-dtype fp8 with the tiers: its chunks hold its e4m3 bytes, 64 a row of 64 (half a
    bf16 row), its layers' scales in the chunk's header, and come back as the same bytes, so the
    answer is the one the fp8 cache computed; with --kv-tier-dtype int8 the chunks are 68 bytes
    a row, rounded into fp8 again by the reader. An fp32 worker reads the fp8 worker's chunks:
    the same key, its own rows made of the bytes times their scales."""
    with tier_llm("fp8", disk_path=str(tmp_path / "raw")) as llm:
        first, again = serve_twice(llm)
        assert again.num_cached_tokens >= 64 * (len(again.prompt_token_ids) // 64 - 1)
        assert again.outputs[0].text == first.outputs[0].text
        tiers = llm.engine.core.load().connector("kv_tiers")
        assert tiers["media"]["disk"]["chunk_hits"] >= 1 and tiers["bytes_per_token"] == 30 * 2 * 3 * 64
        assert_idle(llm)
    with tier_llm(disk_path=str(tmp_path / "raw")) as fresh:  # an fp32 cache reads the fp8 worker's values
        out = fresh.generate([PROMPT], GREEDY)[0]
        assert out.num_cached_tokens >= 64 * (len(out.prompt_token_ids) // 64 - 1)
        disk = fresh.engine.core.load().connector("kv_tiers")["media"]["disk"]
        assert disk["chunk_hits"] >= 1 and not disk.get("corrupt"), disk
        assert_idle(fresh)
    with tier_llm("fp8", disk_path=str(tmp_path / "int8"), codec="int8") as llm:
        first, again = serve_twice(llm)
        assert again.num_cached_tokens >= 64 * (len(again.prompt_token_ids) // 64 - 1)
        assert len(again.outputs[0].token_ids) == 12
        tiers = llm.engine.core.load().connector("kv_tiers")
        assert tiers["media"]["disk"]["chunk_hits"] >= 1 and tiers["bytes_per_token"] == 30 * 2 * 3 * 68
        assert_idle(llm)


def test_a_bf16_cache_under_an_fp32_model_stores_and_reads_its_rows(tmp_path: Path) -> None:
    """--kv-cache-dtype bfloat16 under the fp32 model with the tiers: chunks of its bf16 rows (128
    bytes a row of 64, half an fp32 cache's) come back byte for byte, and an fp32 worker widens
    them into its own rows."""
    with tier_llm("bfloat16", disk_path=str(tmp_path)) as llm:
        first, again = serve_twice(llm)
        assert again.num_cached_tokens >= 64 * (len(again.prompt_token_ids) // 64 - 1)
        assert again.outputs[0].text == first.outputs[0].text
        tiers = llm.engine.core.load().connector("kv_tiers")
        assert tiers["media"]["disk"]["chunk_hits"] >= 1 and tiers["bytes_per_token"] == 30 * 2 * 3 * 64 * 2
        assert_idle(llm)
    with tier_llm(disk_path=str(tmp_path)) as fresh:
        out = fresh.generate([PROMPT], GREEDY)[0]
        assert out.num_cached_tokens >= 64 * (len(out.prompt_token_ids) // 64 - 1)
        disk = fresh.engine.core.load().connector("kv_tiers")["media"]["disk"]
        assert disk["chunk_hits"] >= 1 and not disk.get("corrupt"), disk
        assert_idle(fresh)


def test_prefix_comes_back_from_redis_and_a_fresh_engine_reads_it(redis_server: RedisServer,
                                                                   cold_outputs: list[str]) -> None:
    _flush(redis_server)
    with tier_llm(store_url=redis_server.url) as llm:
        first, again = serve_twice(llm)
        assert first.outputs[0].text == again.outputs[0].text == cold_outputs[0]
        assert again.num_cached_tokens > 0
        assert llm.engine.core.load().connector("kv_tiers")["media"]["cluster"]["chunk_hits"] >= 1
        assert_idle(llm)
    with tier_llm(store_url=redis_server.url) as fresh:  # never saw the prompt
        out = fresh.generate([PROMPT], GREEDY)[0]
        assert out.outputs[0].text == cold_outputs[0]
        assert out.num_cached_tokens >= 64 * (len(out.prompt_token_ids) // 64 - 1)
        assert fresh.engine.scheduler.stats.num_loaded_tokens == out.num_cached_tokens
        assert_idle(fresh)


def test_a_second_sighting_on_another_engine_admits_a_prefix_to_the_cluster_store(
        redis_server: RedisServer, cold_outputs: list[str]) -> None:
    _flush(redis_server)
    tiers = KVTiersConfig(chunk_blocks=4, admit_after=2, store_url=redis_server.url)
    first = LLM(block_size=16, kv_cache_memory=64 * BLOCK_BYTES, max_num_batched_tokens=512, kv_tiers=tiers)
    second = LLM(block_size=16, kv_cache_memory=64 * BLOCK_BYTES, max_num_batched_tokens=512, kv_tiers=tiers)
    try:
        first.generate([PROMPT], GREEDY)  # first sighting anywhere: nothing stored
        drain_writes(first)
        assert first.engine.core.load().connector("kv_tiers")["media"]["cluster"].get("puts", 0) == 0
        out = second.generate([PROMPT], GREEDY)[0]  # the second, on another engine: stored
        drain_writes(second)
        assert out.outputs[0].text == cold_outputs[0]
        assert second.engine.core.load().connector("kv_tiers")["media"]["cluster"]["puts"] > 0
        evict_from_device(first)
        again = first.generate([PROMPT], GREEDY)[0]
        assert again.outputs[0].text == cold_outputs[0] and again.num_cached_tokens > 0
        assert_idle(first)
        assert_idle(second)
    finally:
        first.shutdown()
        second.shutdown()


def test_a_conversations_next_turn_on_another_engine_reads_this_turn_from_the_cluster_store(
        redis_server: RedisServer) -> None:
    """Round-robin routing: turn 1 runs on one engine, turn 2 on another that never saw it. With
    the default admission (second sighting), turn 1's new chunks and its tail still reach the
    store at once, because turn 1 continues a known prefix (the shared system prompt)."""
    _flush(redis_server)
    tiers = KVTiersConfig(chunk_blocks=4, admit_after=2, store_url=redis_server.url)
    first = LLM(block_size=16, kv_cache_memory=64 * BLOCK_BYTES, max_num_batched_tokens=512, kv_tiers=tiers)
    second = LLM(block_size=16, kv_cache_memory=64 * BLOCK_BYTES, max_num_batched_tokens=512, kv_tiers=tiers)
    try:
        system = first.engine.tokenize(SHARED)
        first.generate([system + first.engine.tokenize(" Another session's question?")], GREEDY)
        turn1 = system + first.engine.tokenize(" " + FILLERS[0])  # the shared prefix, then new text
        reply = first.generate([turn1], GREEDY)[0]
        drain_writes(first)
        turn2 = turn1 + list(reply.outputs[0].token_ids) + second.engine.tokenize(" And then what?")
        out = second.generate([turn2], GREEDY)[0]
        with LLM(block_size=16, kv_cache_memory=512 * BLOCK_BYTES, max_num_batched_tokens=512) as plain:
            assert out.outputs[0].token_ids == plain.generate([turn2], GREEDY)[0].outputs[0].token_ids
        # Everything turn 1 computed, in whole blocks (its reply's last token was never fed back).
        assert out.num_cached_tokens == (len(turn1) + len(reply.outputs[0].token_ids) - 1) // 16 * 16
        assert second.engine.scheduler.stats.num_loaded_tokens == out.num_cached_tokens
        assert_idle(first)
        assert_idle(second)
    finally:
        first.shutdown()
        second.shutdown()


def test_corrupt_bytes_on_disk_are_a_recompute(tmp_path: Path, cold_outputs: list[str]) -> None:
    with tier_llm(disk_path=str(tmp_path)) as llm:
        llm.generate([PROMPT], GREEDY)
        drain_writes(llm)
        files = sorted(tmp_path.rglob("*.kv"))
        assert files
        for path in files:  # flip one payload byte in every chunk
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        evict_from_device(llm)
        again = llm.generate([PROMPT], GREEDY)[0]
        assert again.outputs[0].text == cold_outputs[0]
        tiers = llm.engine.core.load().connector("kv_tiers")
        assert tiers["loads_failed"] >= 1 and tiers["media"]["disk"]["corrupt"] >= 1
        assert llm.engine.scheduler.stats.num_failed_loads >= 1
        assert_idle(llm)


def test_a_chunk_with_a_nan_scale_and_a_valid_digest_is_a_recompute(tmp_path: Path,
                                                                   cold_outputs: list[str]) -> None:
    """A well-formed int8 chunk, digest and all, whose last scale is NaN (what a forger or a
    bad writer could store): its blocks would read back as NaN keys and values, so the reader
    refuses it as corrupt ('values'), deletes it and recomputes the prefix."""
    import json
    import struct

    from tandem.kvcache.tiers.chunk import ChunkHeader, encode_chunk

    with tier_llm(disk_path=str(tmp_path), codec="int8") as llm:
        llm.generate([PROMPT], GREEDY)
        drain_writes(llm)
        files = sorted(tmp_path.rglob("*.kv"))
        assert files
        for path in files:
            value = path.read_bytes()
            _, _, head_len = struct.unpack_from("<4sHI", value)
            head = json.loads(value[10:10 + head_len])
            assert head["codec"] == "int8"
            payload = bytearray(value[10 + head_len:-16])
            payload[-4:] = struct.pack("<f", float("nan"))
            header = ChunkHeader(**{**head, "shape": tuple(head["shape"]), "token_ids": tuple(head["token_ids"])})
            path.write_bytes(encode_chunk(header, bytes(payload)))
        evict_from_device(llm)
        again = llm.generate([PROMPT], GREEDY)[0]
        assert again.outputs[0].text == cold_outputs[0]
        assert again.num_cached_tokens == 0
        disk = llm.engine.core.load().connector("kv_tiers")["media"]["disk"]
        assert disk.get("corrupt_values", 0) >= 1, disk
        assert_idle(llm)


def test_corrupt_and_foreign_values_in_redis_are_a_recompute(redis_server: RedisServer,
                                                            cold_outputs: list[str]) -> None:
    import redis

    _flush(redis_server)
    client = redis.Redis.from_url(redis_server.url)
    with tier_llm(store_url=redis_server.url) as llm:
        llm.generate([PROMPT], GREEDY)
        drain_writes(llm)
        keys = sorted(client.keys("tandem:kv:*"))
        assert len(keys) >= 4
        for n, key in enumerate(keys):
            value = client.get(key)
            kind = n % 4
            if kind == 0:  # truncated
                value = value[: len(value) // 2]
            elif kind == 1:  # the digest's last byte
                value = value[:-1] + bytes([value[-1] ^ 1])
            elif kind == 2:  # a byte of the KV payload itself, in the middle of the value
                middle = len(value) // 2
                value = value[:middle] + bytes([value[middle] ^ 0xFF]) + value[middle + 1:]
            else:  # a well-formed chunk with a valid digest, written by another model's revision
                value = _refingerprinted(value, "LlamaForCausalLM/float32/another-revision")
            client.set(key, value)
        evict_from_device(llm)
        again = llm.generate([PROMPT], GREEDY)[0]
        assert again.outputs[0].text == cold_outputs[0]
        media = llm.engine.core.load().connector("kv_tiers")["media"]["cluster"]
        assert media["corrupt"] >= 1
        # The first chunk decides: it was truncated; make each kind the first in turn below.
        assert_idle(llm)
        for kind, reason in ((2, "checksum"), (3, "foreign")):
            llm.generate([PROMPT], GREEDY)
            drain_writes(llm)
            for key in sorted(client.keys("tandem:kv:*")):
                value = client.get(key)
                if kind == 2:
                    middle = len(value) // 2
                    value = value[:middle] + bytes([value[middle] ^ 0xFF]) + value[middle + 1:]
                else:
                    value = _refingerprinted(value, "LlamaForCausalLM/float32/another-revision")
                client.set(key, value)
            before = llm.engine.core.load().connector("kv_tiers")["media"]["cluster"].get(f"corrupt_{reason}", 0)
            evict_from_device(llm)
            again = llm.generate([PROMPT], GREEDY)[0]
            assert again.outputs[0].text == cold_outputs[0]
            assert again.num_cached_tokens == 0  # nothing was taken from a bad value
            after = llm.engine.core.load().connector("kv_tiers")["media"]["cluster"].get(f"corrupt_{reason}", 0)
            assert after >= before + 1, (reason, llm.engine.core.load().connector("kv_tiers")["media"]["cluster"])
            assert_idle(llm)
    client.close()


def _refingerprinted(value: bytes, fingerprint: str) -> bytes:
    """The same chunk, re-encoded (valid digest) as if another model had written it."""
    import json
    import struct

    from tandem.kvcache.tiers.chunk import ChunkHeader, encode_chunk

    _, _, head_len = struct.unpack_from("<4sHI", value)
    head = json.loads(value[10:10 + head_len])
    header = ChunkHeader(fingerprint, head["layout"], tuple(head["shape"]), head["num_blocks"],
                         tuple(head["token_ids"]), head.get("rank", 0), head.get("world_size", 1))
    return encode_chunk(header, value[10 + head_len:-16])


def test_redis_stopping_mid_run_is_a_recompute(cold_outputs: list[str]) -> None:
    server = RedisServer().start()
    try:
        with tier_llm(store_url=server.url) as llm:
            llm.generate([PROMPT], GREEDY)
            drain_writes(llm)
            server.stop()
            evict_from_device(llm)
            started = time.monotonic()
            again = llm.generate([PROMPT], GREEDY)[0]
            assert time.monotonic() - started < 30
            assert again.outputs[0].text == cold_outputs[0]
            assert again.num_cached_tokens == 0
            tiers = llm.engine.core.load().connector("kv_tiers")
            assert tiers["probe_errors"] >= 1
            # Writes while it is down fail and are counted; serving goes on.
            llm.generate([PROMPT + " Another question?"], GREEDY)
            drain_writes(llm)
            assert_idle(llm)
    finally:
        server.stop()


def _flush(server: RedisServer) -> None:
    import redis

    client = redis.Redis.from_url(server.url)
    client.flushall()
    client.close()


def _request(llm: LLM, prompt: str):
    from tandem.types import Request

    ids = llm.engine.tokenizer.encode(prompt)
    req = Request("probe", ids, GREEDY)
    llm.engine.kv_manager.update_block_hashes(req)
    return req


def test_prefix_comes_back_from_mooncake_and_another_engine_reads_it(cold_outputs: list[str]) -> None:
    mooncake = pytest.importorskip("tandem.kvcache.tiers.mooncake_store")
    from tandem.launch.mooncake_master import MooncakeMaster, find_mooncake_master

    try:
        mooncake.import_client()
    except Exception as exc:  # noqa: BLE001 - the reason is the skip message
        pytest.skip(f"Mooncake Store is not installed here: {exc}")
    if find_mooncake_master() is None:
        pytest.skip("the mooncake_master binary is not installed")
    with MooncakeMaster() as master:
        url = master.url + "?segment=512MiB"
        with tier_llm(store_url=url) as llm:
            first, again = serve_twice(llm)
            assert first.outputs[0].text == again.outputs[0].text == cold_outputs[0]
            assert llm.engine.core.load().connector("kv_tiers")["media"]["cluster"]["chunk_hits"] >= 1
            # Values live in the segments of running clients: read them from another engine
            # while this one still holds its segment.
            with tier_llm(store_url=url) as other:
                out = other.generate([PROMPT], GREEDY)[0]
                assert out.outputs[0].text == cold_outputs[0] and out.num_cached_tokens > 0
                assert_idle(other)
            assert_idle(llm)

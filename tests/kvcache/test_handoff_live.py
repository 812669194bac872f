"""The prefill/decode handoff between two live `tandem serve` workers, without a router.

The test plays the router: it asks the prefill worker for the first token with
`do_remote_decode`, then gives the decode worker the handle, signing its requests with the
cluster secret as the router does (a worker takes the handoff fields from peers only). The decode worker must really
fetch the KV (its received-block counter moves) and must produce exactly what one worker
produces alone; every failure of the fetch must end in the same output, computed locally.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.support.live_server import TEST_SECRET, LiveServer, start_server, stop_server

MODEL = "smollm2-135m"
BLOCK = 16  # tokens per KV block: the counts below are in blocks of the workers' --block-size
WORKER_ARGS = ("--kv-cache-memory", "256MiB", "--threads", "1", "--block-size", str(BLOCK))
SYSTEM = "You are a helpful assistant who answers questions about cities briefly and precisely. " * 6


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, LiveServer]]:
    logs = tmp_path_factory.mktemp("handoff")
    prefill = start_server(logs / "prefill.log", "--role", "prefill", "--kv-transfer-shm",
                           "--kv-transfer-hold-timeout", "3", *WORKER_ARGS, secret=TEST_SECRET)
    try:
        decode = start_server(logs / "decode.log", "--role", "decode", "--kv-transfer-fetch-timeout", "3",
                              *WORKER_ARGS, secret=TEST_SECRET)
    except Exception:
        stop_server(prefill)
        raise
    yield prefill, decode
    for server in (prefill, decode):
        assert not stop_server(server)


def _messages(question: str) -> list[dict[str, str]]:
    """A system prompt unique to the question, so no test finds another's blocks cached."""
    return [{"role": "system", "content": f"[{question}] {SYSTEM}"}, {"role": "user", "content": question}]


def _post(server: LiveServer, body: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
    """POST, signed as the router would, and expect 200."""
    response = server.post(path, body)
    assert response.status_code == 200, response.text
    return response.json()


def _prefill(server: LiveServer, body: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
    reply = _post(server, {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}, path)
    handle = reply["kv_transfer_params"]
    assert handle is not None and len(handle["first_token_ids"]) == 1 and handle["block_hashes"]
    return reply


def _counters(server: LiveServer) -> dict[str, float]:
    return server.load()["kv_transfer"]


def test_decode_continues_from_transferred_kv(workers: tuple[LiveServer, LiveServer]) -> None:
    prefill, decode = workers
    body = {"model": MODEL, "messages": _messages("Tell me about Lisbon."), "temperature": 0, "max_tokens": 24}
    alone = _post(prefill, body)  # one worker doing everything: the reference
    before = _counters(decode)
    first = _prefill(prefill, body)
    handle = first["kv_transfer_params"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the reference warmed it
    reply = _post(decode, {**body, "kv_transfer_params": {**handle, "do_remote_prefill": True,
                                                          "emit_first_token": True}})
    after = _counters(decode)
    assert reply["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] == alone["usage"]["completion_tokens"]
    # The decode worker fetched every prompt block instead of computing the prompt, and used
    # them: its prefix cache served exactly the handed-over tokens.
    handed = len(handle["block_hashes"])
    assert after["blocks_received"] - before["blocks_received"] == handed
    assert after["pulls"] - before["pulls"] == 1
    assert reply["kv_transfer_params"]["adopted_blocks"] == handed
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == handed * BLOCK
    assert after["pull_failures"] == before["pull_failures"]
    assert prefill.wait_idle()["kv_blocks_used"] == 0 and prefill.load()["kv_transfer"]["held"] == 0
    assert decode.wait_idle()["kv_blocks_used"] == 0


def test_streamed_continuation_starts_after_the_first_token(workers: tuple[LiveServer, LiveServer]) -> None:
    prefill, decode = workers
    body = {"model": MODEL, "messages": _messages("Tell me about Oslo."), "temperature": 0, "max_tokens": 20}
    alone = _post(prefill, body)["choices"][0]["message"]["content"]
    first = _prefill(prefill, body)
    handle = dict(first["kv_transfer_params"])
    before = _counters(decode)
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True},
                   "kv_transfer_params": {**handle, "do_remote_prefill": True, "emit_first_token": False}}
    text, usage = "", None
    with decode.client() as client, client.stream("POST", "/v1/chat/completions", json=stream_body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    text += choice["delta"].get("content") or ""
    assert first["choices"][0]["message"]["content"] + text == alone
    assert usage["completion_tokens"] == 20
    # The blocks moved and the decode worker used them, as for a whole reply.
    after = _counters(decode)
    assert after["blocks_received"] - before["blocks_received"] == len(handle["block_hashes"])
    assert after["pull_failures"] == before["pull_failures"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(handle["block_hashes"]) * BLOCK
    assert decode.wait_idle()["kv_blocks_used"] == 0 and prefill.wait_idle()["kv_blocks_used"] == 0


def test_decode_worker_fetches_only_what_it_lacks(workers: tuple[LiveServer, LiveServer]) -> None:
    """A decode worker that already caches part of the prompt receives only the rest."""
    prefill, decode = workers
    shared = "[partial] " + SYSTEM
    warm = {"model": MODEL, "prompt": shared + " The capital of Spain is", "temperature": 0, "max_tokens": 4}
    _post(decode, warm, "/v1/completions")  # the decode worker now caches the shared prefix
    italy = (" Italy has many old cities: Rome, Milan, Naples, Turin, Florence, Venice, Bologna and Genoa,"
             " each with a long history. The capital of Italy is")
    body = {"model": MODEL, "prompt": shared + italy, "temperature": 0, "max_tokens": 6}
    ours = _post(decode, {"model": MODEL, "prompt": body["prompt"]}, "/tokenize")["tokens"]
    theirs = _post(decode, {"model": MODEL, "prompt": warm["prompt"]}, "/tokenize")["tokens"]
    common = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
    already = common // BLOCK
    alone = _post(prefill, body, "/v1/completions")["choices"][0]["text"]
    handle = _prefill(prefill, body, "/v1/completions")["kv_transfer_params"]
    handed = len(handle["block_hashes"])
    assert 0 < already < handed
    before = _counters(decode)
    reply = _post(decode, {**body, "kv_transfer_params": {**handle, "do_remote_prefill": True,
                                                          "emit_first_token": True}}, "/v1/completions")
    after = _counters(decode)
    assert reply["choices"][0]["text"] == alone
    assert after["blocks_already_cached"] - before["blocks_already_cached"] == already
    assert after["blocks_received"] - before["blocks_received"] == handed - already
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == handed * BLOCK
    assert decode.wait_idle()["kv_blocks_used"] == 0 and prefill.wait_idle()["kv_blocks_used"] == 0


def test_completions_handoff(workers: tuple[LiveServer, LiveServer]) -> None:
    prefill, decode = workers
    body = {"model": MODEL, "prompt": SYSTEM + " The capital of Portugal is", "temperature": 0, "max_tokens": 12}
    alone = _post(prefill, body, "/v1/completions")["choices"][0]["text"]
    first = _prefill(prefill, body, "/v1/completions")
    reply = _post(decode, {**body, "kv_transfer_params": {**first["kv_transfer_params"], "do_remote_prefill": True,
                                                          "emit_first_token": True}}, "/v1/completions")
    assert reply["choices"][0]["text"] == alone
    assert reply["kv_transfer_params"]["adopted_blocks"] > 0


def test_unfetched_handoff_expires(workers: tuple[LiveServer, LiveServer]) -> None:
    """A decode worker that never comes (it died before the transfer) strands nothing."""
    prefill, _ = workers
    body = {"model": MODEL, "messages": _messages("Tell me about Rome."), "temperature": 0}
    _prefill(prefill, body)
    assert prefill.load()["kv_transfer"]["held"] == 1 and prefill.load()["kv_blocks_used"] > 0
    time.sleep(3.5)
    load = prefill.wait_idle()
    assert load["kv_transfer"]["held"] == 0 and load["kv_blocks_used"] == 0


def test_unreachable_source_means_local_prefill(workers: tuple[LiveServer, LiveServer]) -> None:
    prefill, decode = workers
    body = {"model": MODEL, "messages": _messages("Tell me about Bern."), "temperature": 0, "max_tokens": 16}
    alone = _post(prefill, body)["choices"][0]["message"]["content"]
    first = _prefill(prefill, body)
    handle = {**first["kv_transfer_params"], "port": 9}  # nobody listens there
    failures = _counters(decode)["pull_failures"]
    reply = _post(decode, {**body, "kv_transfer_params": {**handle, "do_remote_prefill": True,
                                                          "emit_first_token": True}})
    assert reply["choices"][0]["message"]["content"] == alone
    assert reply["kv_transfer_params"]["adopted_blocks"] == 0
    assert _counters(decode)["pull_failures"] == failures + 1
    assert decode.wait_idle()["kv_blocks_used"] == 0
    assert prefill.wait_idle(timeout=10)["kv_blocks_used"] == 0  # expired, never released


def test_corrupted_transfer_and_dead_prefill_worker(workers: tuple[LiveServer, LiveServer],
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """A payload that fails its checksum, then a source that died: both end in local prefill."""
    _, decode = workers
    faulty = start_server(tmp_path_factory.mktemp("faulty") / "prefill.log", "--role", "prefill",
                          *WORKER_ARGS, env={"TANDEM_KV_FAULT": "corrupt"}, secret=TEST_SECRET)
    try:
        body = {"model": MODEL, "messages": _messages("Tell me about Vienna."), "temperature": 0, "max_tokens": 16}
        alone = _post(faulty, body)["choices"][0]["message"]["content"]
        failures = _counters(decode)["pull_failures"]
        handle = _prefill(faulty, body)["kv_transfer_params"]
        reply = _post(decode, {**body, "kv_transfer_params": {**handle, "do_remote_prefill": True,
                                                              "emit_first_token": True}})
        assert reply["choices"][0]["message"]["content"] == alone
        assert _counters(decode)["pull_failures"] == failures + 1
        assert faulty.wait_idle()["kv_blocks_used"] == 0  # released after the failed fetch

        body = {**body, "messages": _messages("Tell me about Prague.")}
        alone = _post(faulty, body)["choices"][0]["message"]["content"]
        handle = _prefill(faulty, body)["kv_transfer_params"]
    finally:
        stop_server(faulty, signal.SIGKILL)
    reply = _post(decode, {**body, "kv_transfer_params": {**handle, "do_remote_prefill": True,
                                                          "emit_first_token": True}})
    assert reply["choices"][0]["message"]["content"] == alone
    assert _counters(decode)["pull_failures"] == failures + 2
    assert decode.wait_idle()["kv_blocks_used"] == 0


@contextmanager
def _pd_pair(tmp_path, prefill_args: tuple[str, ...],  # noqa: ANN001
             decode_args: tuple[str, ...]) -> Iterator[tuple[LiveServer, LiveServer]]:
    """A prefill and a decode worker of their own (tcp handoff), stopped cleanly afterwards."""
    prefill = start_server(tmp_path / "prefill.log", "--role", "prefill", *prefill_args, secret=TEST_SECRET)
    try:
        decode = start_server(tmp_path / "decode.log", "--role", "decode", *decode_args, secret=TEST_SECRET)
    except Exception:
        stop_server(prefill)
        raise
    try:
        yield prefill, decode
    finally:
        for server in (prefill, decode):
            assert not stop_server(server)


def _hand_off(prefill: LiveServer, decode: LiveServer, question: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A greedy 16-token chat prefilled on one worker and decoded on the other: (handle, reply)."""
    body = {"model": MODEL, "messages": _messages(question), "temperature": 0, "max_tokens": 16}
    handle = _prefill(prefill, body)["kv_transfer_params"]
    reply = _post(decode, {**body, "kv_transfer_params": {**handle, "do_remote_prefill": True,
                                                          "emit_first_token": True}})
    return handle, reply


def test_the_prompt_kv_travels_in_8_bits_when_the_decode_worker_asks(tmp_path) -> None:  # noqa: ANN001
    """`--kv-transfer-dtype int8` on the decode worker, over tcp (no shared memory): the prefill
    worker sends 8-bit blocks with their scales, and both count the bytes (/load, /metrics)."""
    import re

    import torch

    from tandem.kvcache.codec import KVCodec

    with _pd_pair(tmp_path, WORKER_ARGS, ("--kv-transfer-dtype", "int8", *WORKER_ARGS)) as (prefill, decode):
        handle, reply = _hand_off(prefill, decode, "Tell me about Porto.")
        handed = len(handle["block_hashes"])
        assert reply["kv_transfer_params"]["adopted_blocks"] == handed
        assert reply["usage"]["completion_tokens"] == 16
        shape = (30, 2, 3, handed, BLOCK, 64)  # SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32
        int8_bytes = KVCodec("int8").payload_bytes(shape, torch.float32)
        received, sent = _counters(decode), _counters(prefill)
        assert received["bytes_received"] == int8_bytes == sent["bytes_sent"]
        assert received["bytes_per_token_received"] == pytest.approx(int8_bytes / (handed * BLOCK))
        # a quarter of the fp32 cache's bytes, and a little more for the scales
        assert int8_bytes / KVCodec("raw").payload_bytes(shape, torch.float32) == pytest.approx((64 + 4) / 256)
        with decode.client(10) as client:
            metrics = client.get("/metrics").text
        found = re.search(r"^tandem:kv_transfer_bytes_received_total\{[^}]*\} (\S+)$", metrics, re.MULTILINE)
        assert found and float(found[1]) == int8_bytes
        assert prefill.wait_idle()["kv_blocks_used"] == 0 and decode.wait_idle()["kv_blocks_used"] == 0


def test_int8_caches_hand_off_their_prompt_in_4_bits(tmp_path) -> None:  # noqa: ANN001
    """`--kv-cache-dtype int8` on both workers and `--kv-transfer-dtype
    int4` on the decode worker: the prefill worker encodes its rows' values (not their scale
    bytes) in 4 bits, 36 bytes a value row of 64 against the cache's 68 (keys: 32 and a minimum
    and step per channel over 64 tokens), and the decode worker rounds them into rows again
    and goes on from them."""
    import torch

    from tandem.kvcache.codec import KVCodec

    int8 = ("--kv-cache-dtype", "int8", *WORKER_ARGS)
    with _pd_pair(tmp_path, int8, ("--kv-transfer-dtype", "int4", *int8)) as (prefill, decode):
        handle, reply = _hand_off(prefill, decode, "Tell me about Lisbon.")
        handed = len(handle["block_hashes"])
        assert handed >= 4 and reply["kv_transfer_params"]["adopted_blocks"] == handed
        assert reply["usage"]["completion_tokens"] == 16
        rows = 30 * 3 * handed * BLOCK  # SmolLM2-135M: 30 layers, 3 KV heads of 64; keys and values each
        received, sent = _counters(decode), _counters(prefill)
        int4_bytes = KVCodec("int4").payload_bytes((30, 2, 3, handed, BLOCK, 68), torch.uint8)  # one pull
        assert received["bytes_received"] == sent["bytes_sent"] == int4_bytes
        groups = -(-handed * BLOCK // 64)
        assert int4_bytes == rows * (32 + 4) + rows * 32 + 30 * 3 * groups * 64 * 6
        assert prefill.wait_idle()["kv_blocks_used"] == 0 and decode.wait_idle()["kv_blocks_used"] == 0


def test_an_fp32_prefill_worker_hands_off_to_an_int8_decode_worker(tmp_path) -> None:  # noqa: ANN001
    """Cache dtypes may differ across the handoff: the prefill worker keeps fp32 rows and sends
    them raw (256 bytes a row of 64), the decode worker keeps int8 rows (68 bytes) and rounds
    what it received into them, adopting every block instead of recomputing the prompt."""
    with _pd_pair(tmp_path, WORKER_ARGS, ("--kv-cache-dtype", "int8", *WORKER_ARGS)) as (prefill, decode):
        handle, reply = _hand_off(prefill, decode, "Tell me about Porto.")
        handed = len(handle["block_hashes"])
        assert handed >= 4 and reply["kv_transfer_params"]["adopted_blocks"] == handed
        assert reply["usage"]["completion_tokens"] == 16
        rows = 30 * 2 * 3 * handed * BLOCK  # SmolLM2-135M: 30 layers, K and V, 3 KV heads of 64
        assert _counters(decode)["bytes_received"] == _counters(prefill)["bytes_sent"] == rows * 64 * 4
        assert prefill.wait_idle()["kv_blocks_used"] == 0 and decode.wait_idle()["kv_blocks_used"] == 0


def test_int8_caches_hand_off_through_shared_memory(tmp_path) -> None:  # noqa: ANN001
    """Both workers keep int8 rows and the prefill worker's cache is a shared-memory file: the
    decode worker copies the rows, scales and all, 68 bytes a row of 64, from the file."""
    int8 = ("--kv-cache-dtype", "int8", *WORKER_ARGS)
    with _pd_pair(tmp_path, ("--kv-transfer-shm", *int8), int8) as (prefill, decode):
        handle, reply = _hand_off(prefill, decode, "Tell me about Braga.")
        handed = len(handle["block_hashes"])
        assert handed >= 4 and reply["kv_transfer_params"]["adopted_blocks"] == handed
        assert reply["usage"]["completion_tokens"] == 16
        rows = 30 * 2 * 3 * handed * BLOCK  # SmolLM2-135M: 30 layers, K and V, 3 KV heads of 64
        assert _counters(decode)["bytes_received"] == rows * 68
        assert _counters(prefill)["bytes_sent"] == 0  # copied from the file, not sent over the port
        assert prefill.wait_idle()["kv_blocks_used"] == 0 and decode.wait_idle()["kv_blocks_used"] == 0


def test_caches_of_two_dtypes_on_one_host_hand_off_over_the_port(tmp_path) -> None:  # noqa: ANN001
    """A shared-memory copy is the source's rows as they are, so an fp32 decode worker does not
    copy an int8 prefill worker's file: it asks for the blocks over the port, which turns them
    into its rows (256 bytes a row of 64), and adopts every one."""
    with _pd_pair(tmp_path, ("--kv-transfer-shm", "--kv-cache-dtype", "int8", *WORKER_ARGS), WORKER_ARGS) as (
            prefill, decode):
        handle, reply = _hand_off(prefill, decode, "Tell me about Faro.")
        handed = len(handle["block_hashes"])
        assert handed >= 4 and reply["kv_transfer_params"]["adopted_blocks"] == handed
        assert reply["usage"]["completion_tokens"] == 16
        rows = 30 * 2 * 3 * handed * BLOCK  # SmolLM2-135M: 30 layers, K and V, 3 KV heads of 64
        assert _counters(decode)["pull_failures"] == 0
        assert _counters(prefill)["bytes_sent"] == rows * 68  # the int8 rows, over the port
        assert prefill.wait_idle()["kv_blocks_used"] == 0 and decode.wait_idle()["kv_blocks_used"] == 0


def test_a_bf16_cache_hands_off_to_an_fp32_decode_worker(tmp_path) -> None:  # noqa: ANN001
    """--kv-cache-dtype bfloat16 under the fp32 model: the prefill worker sends its bf16 rows as
    they are (128 bytes a row of 64, half an fp32 cache's), and the fp32 decode worker widens
    them into its own rows and adopts every block."""
    with _pd_pair(tmp_path, ("--kv-cache-dtype", "bfloat16", *WORKER_ARGS), WORKER_ARGS) as (prefill, decode):
        handle, reply = _hand_off(prefill, decode, "Tell me about Coimbra.")
        handed = len(handle["block_hashes"])
        assert handed >= 4 and reply["kv_transfer_params"]["adopted_blocks"] == handed
        assert reply["usage"]["completion_tokens"] == 16
        rows = 30 * 2 * 3 * handed * BLOCK  # SmolLM2-135M: 30 layers, K and V, 3 KV heads of 64
        assert _counters(decode)["bytes_received"] == _counters(prefill)["bytes_sent"] == rows * 64 * 2
        assert prefill.wait_idle()["kv_blocks_used"] == 0 and decode.wait_idle()["kv_blocks_used"] == 0


def test_fp8_caches_hand_off_their_bytes_and_decode_as_one_worker_would(tmp_path) -> None:  # noqa: ANN001
    """--kv-cache-dtype fp8 on both workers: the prefill worker sends its e4m3 bytes (64 a row of
    64, half a bf16 row) with its layers' scales in the reply's layout; the decode worker's
    scales are the same (the same model measured on the same text), so it keeps the bytes as
    they are, and goes on as the prefill worker alone does. The two split the
    work into other steps, whose sums run in other orders: the question is one whose greedy
    answer has no near-tie (its closest two tokens 0.23 nats apart on the AVX-512 EPYC; for
    "Evora" a 0.03-nat tie at the twelfth token went either way)."""
    fp8 = ("--kv-cache-dtype", "fp8", *WORKER_ARGS)
    with _pd_pair(tmp_path, fp8, fp8) as (prefill, decode):
        body = {"model": MODEL, "messages": _messages("Tell me about Paris."), "temperature": 0, "max_tokens": 16}
        alone = _post(prefill, body)["choices"][0]["message"]["content"]
        handle, reply = _hand_off(prefill, decode, "Tell me about Paris.")
        handed = len(handle["block_hashes"])
        assert handed >= 4 and reply["kv_transfer_params"]["adopted_blocks"] == handed
        assert reply["choices"][0]["message"]["content"] == alone
        rows = 30 * 2 * 3 * handed * BLOCK  # SmolLM2-135M: 30 layers, K and V, 3 KV heads of 64
        assert _counters(decode)["bytes_received"] == _counters(prefill)["bytes_sent"] == rows * 64
        assert prefill.wait_idle()["kv_blocks_used"] == 0 and decode.wait_idle()["kv_blocks_used"] == 0


def test_an_fp8_prefill_worker_hands_off_in_8_bits_to_an_fp32_decode_worker(tmp_path) -> None:  # noqa: ANN001
    """Cache dtypes differ and the decode worker asks for int8 chunks: the fp8 worker's values
    are encoded in 8 bits with a scale a run of 64 (68 bytes a row), and the fp32 decode worker
    widens them into its rows and adopts every block."""
    import torch

    from tandem.kvcache.codec import KVCodec

    fp8 = ("--kv-cache-dtype", "fp8", *WORKER_ARGS)
    with _pd_pair(tmp_path, fp8, ("--kv-transfer-dtype", "int8", *WORKER_ARGS)) as (prefill, decode):
        handle, reply = _hand_off(prefill, decode, "Tell me about Tomar.")
        handed = len(handle["block_hashes"])
        assert handed >= 4 and reply["kv_transfer_params"]["adopted_blocks"] == handed
        assert reply["usage"]["completion_tokens"] == 16
        int8_bytes = KVCodec("int8").payload_bytes((30, 2, 3, handed, BLOCK, 64), torch.bfloat16)
        assert int8_bytes == 30 * 2 * 3 * handed * BLOCK * 68
        assert _counters(decode)["bytes_received"] == _counters(prefill)["bytes_sent"] == int8_bytes
        assert prefill.wait_idle()["kv_blocks_used"] == 0 and decode.wait_idle()["kv_blocks_used"] == 0

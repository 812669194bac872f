"""Tenant isolation of the prefix cache through the router, on the session's real worker.

With API keys each identity's requests carry their own cache_salt: a prompt alice sent is
cached for alice, and bob sending the same prompt gets nothing from it (cached_tokens 0), so
his time to first token cannot tell him what alice asked. --shared-prefix-cache opts out.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import httpx

from tandem.router.accounting.keys_store import KeyLimits, new_key, write_store
from tandem.router.config import AccountingConfig, WorkerSpec
from tests.support.router_helpers import MODEL_TIMEOUTS


def _cached(url: str, key: str, prompt: str) -> int:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 2, "temperature": 0}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {key}"})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_one_tenants_prompt_is_no_cache_hit_for_another(
    tandem_server: str, start_router: Callable[..., str], tmp_path: Path
) -> None:
    (alice, a), (bob, b) = (new_key(n, KeyLimits(), set()) for n in ("alice", "bob"))
    keys = tmp_path / "keys.json"
    write_store(keys, [a, b])
    worker = [WorkerSpec(tandem_server, "both")]
    isolated = start_router(worker, accounting=AccountingConfig(api_keys_file=keys), timeouts=MODEL_TIMEOUTS)
    shared = start_router(worker, accounting=AccountingConfig(api_keys_file=keys), timeouts=MODEL_TIMEOUTS,
                          shared_prefix_cache=True)
    prompt = f"Secret {uuid.uuid4().hex}: " + "the quarterly numbers look very good. " * 6
    assert _cached(isolated, alice, prompt) == 0
    assert _cached(isolated, alice, prompt) > 32  # alice's own second turn hits
    assert _cached(isolated, bob, prompt) == 0  # bob learns nothing from alice's prompt
    assert _cached(isolated, bob, prompt) > 32  # but has his own cache
    other = f"Secret {uuid.uuid4().hex}: " + "the launch date is next Tuesday. " * 6
    first = _cached(shared, alice, other)  # at most the chat template's opening, cached before
    assert first < 32 and _cached(shared, bob, other) > 32  # opted out: tenants share

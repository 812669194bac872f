"""The cluster secret on the KV transfer port: only peers that know it may read held KV.

A KV source hands out raw tensors of other tenants' prompts to whoever asks with a lease id,
so with a secret set (`tandem serve --cluster-secret`, or env TANDEM_CLUSTER_SECRET; `tandem
up` makes one per cluster) every request carries a time stamp in its JSON body and an
HMAC-SHA256 of its kind and body under the secret, and the source refuses a request without
one, with a wrong one, or stamped more than `MAX_SKEW_S` away from its own clock (a captured
request cannot be replayed later). Comparisons are constant-time. Replies are not signed: the
peer proved it is one of the cluster's workers, and the payload's checksum and block hashes
are checked on arrival as before. Same-host shared-memory copies read a file under /dev/shm
that only the worker's user may open; their lease checks and releases go over this port.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time

MAX_SKEW_S = 60.0


def _mac(secret: str, kind: bytes, body: bytes) -> bytes:
    return hmac.new(secret.encode(), kind + b"\n" + body, hashlib.sha256).hexdigest().encode()


def sign(secret: str | None, frames: list[bytes]) -> list[bytes]:
    """[kind, body] → [kind, body with a time stamp, mac] (unchanged without a secret)."""
    if not secret:
        return frames
    kind, body = frames[0], json.loads(frames[1])
    stamped = json.dumps({**body, "ts": time.time()}).encode()
    return [kind, stamped, _mac(secret, kind, stamped), *frames[2:]]


def refusal(secret: str | None, frames: list[bytes], now: float | None = None) -> str | None:
    """Why a request may not be served (None: it may)."""
    if not secret:
        return None
    if len(frames) < 3:
        return "this KV source needs the cluster secret (--cluster-secret)"
    kind, body, mac = frames[0], frames[1], frames[2]
    if not hmac.compare_digest(_mac(secret, kind, body), bytes(mac)):
        return "wrong cluster secret"
    try:
        stamp = float(json.loads(body).get("ts"))
    except (TypeError, ValueError):
        return "unstamped request"
    if abs((time.time() if now is None else now) - stamp) > MAX_SKEW_S:
        return "stale request (clock skew or a replay)"
    return None

"""Request fields only tandem's own processes may set, and tenant salts only the router can make.

`kv_transfer_params` steers the engine's KV connectors: it makes a prefill worker hold a
prompt's KV under a lease, tells a decode worker whose lease to fetch and from where, and
hands over tokens generated elsewhere (a prefill worker's first token, a migrated stream's
output). Coming from a client it would let them pin other requests' memory, read another
tenant's KV or feed the engine tokens it never checked, so the router strips it from every
client body before setting its own, and a worker takes it only on a peer-signed request.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from tandem.trust.keys import TENANT_SALT, derive_key

INTERNAL_FIELDS = ("kv_transfer_params",)


def strip_internal(body: dict[str, Any]) -> dict[str, Any]:
    """The body without any internal field (the same object when it had none)."""
    if not any(name in body for name in INTERNAL_FIELDS):
        return body
    return {k: v for k, v in body.items() if k not in INTERNAL_FIELDS}


class TenantSalts:
    """Per-tenant cache salts: an HMAC of the identity under the cluster secret's salt key.

    Workers salt a request's KV block hashes with its `cache_salt`, so one tenant's requests
    never hit blocks another tenant's prompts left in any cache tier (a shared prefix cache
    answers a prompt someone else sent faster, and that time difference leaks the prompt). A
    salt that could be computed from the tenant's name could be sent by anyone who reaches a
    worker; this one cannot be made without the secret. Routers that share the secret make the
    same salts, so a tenant's cache survives router restarts and spans replicas.
    """

    def __init__(self, secret: str) -> None:
        self._key = derive_key(secret, TENANT_SALT)

    def salt(self, identity: str) -> str:
        digest = hmac.new(self._key, identity.encode(), hashlib.sha256).hexdigest()[:32]
        return f"tenant-{digest}"

    def salted(self, body: dict[str, Any], identity: str) -> dict[str, Any]:
        """The body with the tenant's own `cache_salt` (the client's own salt kept inside it)."""
        tenant = self.salt(identity)
        own = body.get("cache_salt")
        salt = f"{tenant}:{own}" if isinstance(own, str) and own else tenant
        return {**body, "cache_salt": salt}

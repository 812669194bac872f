"""Keys derived from the cluster secret, one per purpose.

The same secret signs router-to-worker HTTP requests, KV-port frames and tenant cache salts;
each use takes its own key (HMAC-SHA256 of a purpose label under the secret), so that a value
made for one purpose (a tenant's salt, which travels in request bodies and logs) can never
stand in for another (a signature).
"""

from __future__ import annotations

import hashlib
import hmac
import os

CLUSTER_SECRET_ENV = "TANDEM_CLUSTER_SECRET"
ADMIN_KEY_ENV = "TANDEM_ADMIN_KEY"

# Purposes: each derives a distinct key from the one secret.
HTTP = "http-request"
KV_PORT = "kv-port"
TENANT_SALT = "tenant-salt"


def derive_key(secret: str, purpose: str) -> bytes:
    """The 32-byte key for `purpose` under the cluster secret."""
    if not secret:
        raise ValueError("the cluster secret is empty")
    return hmac.new(secret.encode(), b"tandem/" + purpose.encode(), hashlib.sha256).digest()


def secret_from_env(given: str | None = None) -> str | None:
    """The cluster secret: the one given (a flag), else env TANDEM_CLUSTER_SECRET, else None."""
    return given or os.environ.get(CLUSTER_SECRET_ENV) or None


def admin_key_from_env(given: str | None = None) -> str | None:
    """The admin key: the one given (a flag), else env TANDEM_ADMIN_KEY, else None."""
    return given or os.environ.get(ADMIN_KEY_ENV) or None


def same_token(given: str, expected: str) -> bool:
    """Constant-time comparison of a presented token with the expected one."""
    return hmac.compare_digest(given.encode(), expected.encode())

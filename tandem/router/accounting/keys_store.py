"""The API key file `tandem keys` writes: salted hashes of keys, never the keys themselves.

A key looks like `sk-tandem-<id>-<secret>`: `id` (8 hex digits) names its entry, so a
request's key is checked against one stored hash, not against all of them; `secret` is 32
random bytes (256 bits, base64url). The file keeps, per key, a random salt and
SHA-256(salt + key): a stolen file gives no key back, and two files never share a hash. A slow
password hash (scrypt, argon2) buys nothing here: it protects guessable passwords, and a
256-bit random secret is not guessable, while a per-request KDF would cost milliseconds on
every call. The comparison is `hmac.compare_digest`, constant-time.

Each entry may carry the key's limits: requests and tokens per minute (token buckets in the
router) and tokens per day (a quota counted from the usage ledger); absent, the router's
`--rate-limit-*` / `--quota-tokens-per-day` defaults apply. Revoking marks the entry (the
router re-reads the file when it changes) and keeps it, so `list` still shows who it was.

File (JSON, mode 0600, replaced atomically on every write):
    {"version": 2, "keys": [{"id", "identity", "salt", "hash", "created", "revoked",
                              "limits": {"rpm", "tpm", "tokens_per_day"}}]}
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import hashlib
import hmac
import json
import os
import re
import secrets
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 2
KEY_PREFIX = "sk-tandem-"
_KEY_RE = re.compile(r"^sk-tandem-([0-9a-f]{8})-[A-Za-z0-9_-]{43}$")


@dataclass(frozen=True)
class KeyLimits:
    """None: the router's default for that limit (itself None: unlimited)."""

    rpm: int | None = None
    tpm: int | None = None
    tokens_per_day: int | None = None

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"the key limit {name} must be a positive integer, got {value!r}")

    def over(self, defaults: KeyLimits) -> KeyLimits:
        """These limits, with `defaults` where none is set."""
        return KeyLimits(
            self.rpm if self.rpm is not None else defaults.rpm,
            self.tpm if self.tpm is not None else defaults.tpm,
            self.tokens_per_day if self.tokens_per_day is not None else defaults.tokens_per_day,
        )


@dataclass(frozen=True)
class StoredKey:
    id: str
    identity: str
    salt: str
    hash: str
    created: str
    revoked: str | None = None  # when, ISO time
    limits: KeyLimits = field(default_factory=KeyLimits)

    def matches(self, key: str) -> bool:
        return hmac.compare_digest(_hash(self.salt, key), self.hash)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["limits"] = {k: v for k, v in asdict(self.limits).items() if v is not None}
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> StoredKey:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: each key must be an object")
        try:
            limits = KeyLimits(**(data.get("limits") or {}))
            key = cls(
                id=str(data["id"]),
                identity=str(data["identity"]),
                salt=str(data["salt"]),
                hash=str(data["hash"]),
                created=str(data.get("created") or ""),
                revoked=data.get("revoked"),
                limits=limits,
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{where}: a key entry lacks or mistypes {exc}") from None
        if not re.fullmatch(r"[0-9a-f]{8}", key.id) or not key.identity.strip():
            raise ValueError(f"{where}: a key entry has a bad id or an empty identity")
        return key


def _hash(salt: str, key: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt) + key.encode()).hexdigest()


def key_id(key: str) -> str | None:
    """The entry id a `sk-tandem-...` key names (None: not such a key)."""
    match = _KEY_RE.match(key)
    return match.group(1) if match else None


def new_key(identity: str, limits: KeyLimits, taken: set[str]) -> tuple[str, StoredKey]:
    """A fresh key (shown once) and the entry that stores only its salted hash."""
    if not identity.strip() or any(c.isspace() for c in identity):
        raise ValueError("the identity must be a non-empty name without spaces")
    while True:
        entry_id = secrets.token_hex(4)
        if entry_id not in taken:
            break
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")
    key = f"{KEY_PREFIX}{entry_id}-{secret}"
    salt = secrets.token_hex(16)
    created = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    return key, StoredKey(entry_id, identity, salt, _hash(salt, key), created, None, limits)


def is_key_store(data: Any) -> bool:
    return isinstance(data, dict) and data.get("version") == FORMAT_VERSION and "keys" in data


def parse_store(data: dict[str, Any], what: str) -> list[StoredKey]:
    entries = data.get("keys")
    if not isinstance(entries, list):
        raise ValueError(f"{what}: `keys` must be a list")
    keys = [StoredKey.from_json(e, f"{what}, key #{n}") for n, e in enumerate(entries, 1)]
    if len({k.id for k in keys}) != len(keys):
        raise ValueError(f"{what}: two entries share an id")
    return keys


def read_store(path: Path) -> list[StoredKey]:
    """The file's entries; an absent file holds none."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    try:
        data = json.loads(text) if text.strip() else {"version": FORMAT_VERSION, "keys": []}
    except json.JSONDecodeError as exc:
        raise ValueError(f"the key file {path} is not valid JSON: {exc}") from None
    if not is_key_store(data):
        raise ValueError(
            f"{path} is not a key file written by `tandem keys` (version {FORMAT_VERSION})"
        )
    return parse_store(data, f"key file {path}")


def write_store(path: Path, keys: list[StoredKey]) -> None:
    """Atomically, readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"version": FORMAT_VERSION, "keys": [k.to_json() for k in keys]}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(payload, out, indent=2)
            out.write("\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise

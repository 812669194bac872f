"""Internal fields and tenant salts (tandem/trust/fields.py)."""

from __future__ import annotations

from tandem.trust.fields import TenantSalts, strip_internal


def test_internal_fields_are_stripped_and_the_rest_kept() -> None:
    body = {"model": "m", "messages": [], "kv_transfer_params": {"transfer_id": "victim"}, "cache_salt": "mine"}
    assert strip_internal(body) == {"model": "m", "messages": [], "cache_salt": "mine"}
    plain = {"model": "m"}
    assert strip_internal(plain) is plain


def test_a_tenant_salt_cannot_be_made_without_the_secret() -> None:
    """Before, the salt was a hash of the tenant's name: anyone could compute it."""
    ours, theirs = TenantSalts("secret-a"), TenantSalts("secret-b")
    assert ours.salt("alice") == TenantSalts("secret-a").salt("alice")  # routers sharing the secret agree
    assert ours.salt("alice") != theirs.salt("alice") != ours.salt("bob")
    import hashlib

    assert hashlib.sha256(b"alice").hexdigest()[:16] not in ours.salt("alice")


def test_a_client_salt_lives_inside_the_tenants() -> None:
    salts = TenantSalts("s")
    assert salts.salted({"cache_salt": "x"}, "alice")["cache_salt"] == salts.salt("alice") + ":x"
    assert salts.salted({}, "alice")["cache_salt"] == salts.salt("alice")

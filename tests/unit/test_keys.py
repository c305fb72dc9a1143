"""The key ring (serve_app/domain/keys.py) and the token signer on it: one key per purpose, kids, rotation
with a grace, and what a deployment from before the ring made still verifying."""

from __future__ import annotations

import hashlib
import hmac
import time

import jwt
import pytest

from serve_app.api.tokens import TokenSigner
from serve_app.domain.errors import AuthenticationFailed, NotFound
from serve_app.domain.keys import (
    ACCESS_TOKENS,
    AUDIT_SUBJECTS,
    CLIENT_SECRETS,
    PROOF_URLS,
    PURPOSES,
    KeyRing,
    subject_hash,
    subject_hashes,
)
from serve_app.settings import AuthSettings

OLD = "old-secret-0123456789abcdef"
NEW = "new-secret-0123456789abcdef"


@pytest.mark.parametrize(
    "spec",
    ["", "k1", "k1:short", "k1:" + NEW + ",k1:" + OLD, "bad kid:" + NEW, "k" * 33 + ":" + NEW, ":" + NEW],
)
def test_a_malformed_ring_is_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        KeyRing.parse(spec)


def test_each_purpose_has_its_own_key_and_the_current_kid_comes_first() -> None:
    ring = KeyRing.parse(f"k2:{NEW}, k1:{OLD}")
    keys = [ring.for_purpose(purpose) for purpose in PURPOSES]
    assert len({purpose_keys.current for purpose_keys in keys}) == len(PURPOSES)
    assert all(purpose_keys.kids() == ["k2", "k1"] for purpose_keys in keys)
    assert ring.for_purpose(ACCESS_TOKENS).get("k1") != ring.for_purpose(ACCESS_TOKENS).current
    assert ring.for_purpose(ACCESS_TOKENS).get("k0") is None
    assert OLD not in repr(ring) and NEW not in repr(keys)


def test_kid_0_keeps_the_keys_of_the_single_secret_before_the_ring() -> None:
    legacy = KeyRing.single(OLD)
    # Before the ring: the pepper and the audit key were the secret itself, the token keys derived from it.
    assert legacy.for_purpose(CLIENT_SECRETS).current == OLD.encode()
    assert legacy.for_purpose(AUDIT_SUBJECTS).current == OLD.encode()
    derived = hmac.new(OLD.encode(), b"access-token", hashlib.sha256).digest()
    assert legacy.for_purpose(ACCESS_TOKENS).current == derived
    before = hmac.new(OLD.encode(), b"reference:customer-1", hashlib.sha256).hexdigest()[:32]
    assert (
        subject_hash(legacy.for_purpose(AUDIT_SUBJECTS), "reference", "customer-1") == f"hmac-sha256:{before}"
    )


def test_audit_subjects_carry_their_kid_and_old_ones_are_found_after_a_rotation() -> None:
    written_before = subject_hash(KeyRing.single(OLD).for_purpose(AUDIT_SUBJECTS), "reference", "c-1")
    rotated = KeyRing.parse(f"k1:{NEW},0:{OLD}").for_purpose(AUDIT_SUBJECTS)
    written_after = subject_hash(rotated, "reference", "c-1")
    assert written_after.startswith("hmac-sha256:k1:") and written_after != written_before
    assert subject_hashes(rotated, "reference", "c-1") == [written_after, written_before]


def _pre_ring_access_token(secret: str, client_id: str) -> str:
    """An access token as the signer made them before the ring: no kid in its header."""
    now = int(time.time())
    claims = {"iss": "facesearch", "sub": client_id, "typ": "access", "iat": now, "exp": now + 60}
    return jwt.encode(claims, hmac.new(secret.encode(), b"access-token", hashlib.sha256).digest(), "HS256")


def test_tokens_and_proofs_verify_through_the_grace_and_not_after() -> None:
    before = TokenSigner(KeyRing.single(OLD), 60, 60)
    grace = TokenSigner(KeyRing.parse(f"k1:{NEW},0:{OLD}"), 60, 60)
    after = TokenSigner(KeyRing.parse(f"k1:{NEW}"), 60, 60)
    old_access, _ = before.issue_access("cl_1")
    old_proof = before.issue_proof("cl_1", "f" + "0" * 32)
    pre_ring = _pre_ring_access_token(OLD, "cl_1")
    for token in (old_access, pre_ring):
        assert grace.verify_access(token).client_id == "cl_1"
    assert grace.verify_proof(old_proof).face_id == "f" + "0" * 32
    new_access, _ = grace.issue_access("cl_1")
    assert jwt.get_unverified_header(new_access)["kid"] == "k1"
    assert after.verify_access(new_access).client_id == "cl_1"
    assert after.verify_proof(grace.issue_proof("cl_1", "f" + "1" * 32)).face_id == "f" + "1" * 32
    for token in (old_access, pre_ring):
        with pytest.raises(AuthenticationFailed):
            after.verify_access(token)
    with pytest.raises(NotFound):
        after.verify_proof(old_proof)


def test_a_token_naming_another_kid_than_its_signature_is_refused() -> None:
    ring = KeyRing.parse(f"k1:{NEW},0:{OLD}")
    signed_with_old = KeyRing.single(OLD).for_purpose(ACCESS_TOKENS).current
    now = int(time.time())
    claims = {"iss": "facesearch", "sub": "cl_1", "typ": "access", "iat": now, "exp": now + 60}
    forged = jwt.encode(claims, signed_with_old, "HS256", headers={"kid": "k1"})
    with pytest.raises(AuthenticationFailed):
        TokenSigner(ring, 60, 60).verify_access(forged)
    proof_key = ring.for_purpose(PROOF_URLS).current  # a proof key never signs an access token
    with pytest.raises(AuthenticationFailed):
        TokenSigner(ring, 60, 60).verify_access(jwt.encode(claims, proof_key, "HS256", headers={"kid": "k1"}))


def test_the_settings_read_the_ring_as_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FACESEARCH_SECRET_KEYS", f"k1:{NEW},0:{OLD}")
    monkeypatch.setenv("FACESEARCH_SECRET_KEY", OLD)
    auth = AuthSettings()
    assert NEW not in repr(auth) and OLD not in repr(auth)
    assert auth.key_ring().current_kid == "k1"
    monkeypatch.delenv("FACESEARCH_SECRET_KEYS")
    assert AuthSettings().key_ring().for_purpose(CLIENT_SECRETS).current == OLD.encode()

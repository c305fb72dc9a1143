"""Proof tokens are minted without PyJWT's encoder (serve_app/api/tokens._hs256_jwt, on every result read):
they must be the very tokens PyJWT would make, and still verify."""

from __future__ import annotations

import jwt
import pytest

from serve_app.api.tokens import TokenSigner
from serve_app.domain.keys import PROOF_URLS, KeyRing

TENANT, FACE = "cl_" + "a" * 24, "f" + "1" * 32


@pytest.mark.parametrize(
    "ring",
    [
        KeyRing.single("a-single-secret-of-enough-length-0123"),
        KeyRing(
            [("k8", "newer-secret-of-enough-length-9876543"), ("k7", "older-secret-of-enough-length-012")]
        ),
    ],
)
def test_a_proof_token_is_byte_for_byte_what_pyjwt_makes(ring: KeyRing) -> None:
    signer = TokenSigner(ring, access_ttl_s=900, proof_ttl_s=900)
    keys = ring.for_purpose(PROOF_URLS)
    claims = {"typ": "proof", "ten": TENANT, "fid": FACE, "iat": 1_800_000_000, "exp": 1_800_000_900}
    expected = jwt.encode(claims, keys.current, algorithm="HS256", headers={"kid": keys.current_kid})
    assert signer.issue_proof(TENANT, FACE, now=1_800_000_000) == expected
    fresh = signer.verify_proof(signer.issue_proof(TENANT, FACE))
    assert (fresh.tenant_id, fresh.face_id) == (TENANT, FACE)

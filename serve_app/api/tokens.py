"""Signed tokens: access tokens for clients and proof tokens inside proof-image URLs.

Both are HS256 JWTs, each signed with its own key of the key ring (serve_app/domain/keys.py), so a proof
token can never pass as an access token or the reverse. A token names its key in the JWT header (`kid`;
none: kid 0, the key before the ring) and is verified with that key while the ring still holds it, so tokens
issued before a rotation stay valid through its grace. The algorithm is pinned on decode: `alg: none` and
tokens signed with any other key are rejected.

A client sends the same access token with every request until it expires, so each replica remembers the
tokens it has verified (bounded, least recently used first out) and skips the signature check and the JSON
decoding while a token is valid. Only the signature is remembered: whether the client is still active is
checked on every request (ClientAuthenticator.admit), so a revocation takes effect at once.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import jwt

from serve_app.domain.errors import AuthenticationFailed, NotFound, ProofExpired
from serve_app.domain.keys import ACCESS_TOKENS, LEGACY_KID, PROOF_URLS, KeyRing, PurposeKeys, as_purpose_keys

_ISSUER = "facesearch"
_ALGORITHM = "HS256"


def _key_of(token: str, keys: PurposeKeys) -> bytes | None:
    """The key that verifies the token: its header's kid's, while the ring holds it."""
    try:
        kid = jwt.get_unverified_header(token).get("kid", LEGACY_KID)
    except jwt.InvalidTokenError:
        return None
    return keys.get(kid) if isinstance(kid, str) else None


@functools.cache
def _jwt_header(kid: str) -> bytes:
    """The encoded JOSE header PyJWT writes for an HS256 token with this kid (sorted keys, no blanks)."""
    header = json.dumps({"alg": _ALGORITHM, "kid": kid, "typ": "JWT"}, separators=(",", ":"), sort_keys=True)
    return _b64url(header.encode())


def _b64url(data: bytes) -> bytes:
    return base64.urlsafe_b64encode(data).rstrip(b"=")


def _hs256_jwt(kid: str, key: bytes, claims: dict[str, object]) -> str:
    """An HS256 JWT as jwt.encode makes it (compact JSON, unpadded base64url, HMAC-SHA256 over the first
    two segments), without its per-call header and options handling."""
    signing_input = _jwt_header(kid) + b"." + _b64url(json.dumps(claims, separators=(",", ":")).encode())
    signature = _b64url(hmac.new(key, signing_input, hashlib.sha256).digest())
    return (signing_input + b"." + signature).decode()


@dataclass(frozen=True)
class AccessClaims:
    client_id: str
    expires_at: int


@dataclass(frozen=True)
class ProofClaims:
    tenant_id: str
    face_id: str
    expires_at: int


class TokenSigner:
    def __init__(
        self,
        keys: KeyRing | str,
        access_ttl_s: int,
        proof_ttl_s: int,
        verified_cache_size: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """keys: the ring (a bare secret is a ring of one, kid 0)."""
        self._access: PurposeKeys
        self._proof: PurposeKeys
        if isinstance(keys, KeyRing):
            self._access, self._proof = keys.for_purpose(ACCESS_TOKENS), keys.for_purpose(PROOF_URLS)
        else:
            self._access, self._proof = (
                as_purpose_keys(ACCESS_TOKENS, keys),
                as_purpose_keys(PROOF_URLS, keys),
            )
        self.access_ttl_s = access_ttl_s
        self.proof_ttl_s = proof_ttl_s
        self._clock = clock
        self._verified: OrderedDict[str, AccessClaims] = OrderedDict()
        self._verified_cache_size = verified_cache_size

    def issue_access(self, client_id: str, now: float | None = None) -> tuple[str, int]:
        issued = int(now if now is not None else self._clock())
        claims = {
            "iss": _ISSUER,
            "sub": client_id,
            "typ": "access",
            "iat": issued,
            "exp": issued + self.access_ttl_s,
            "jti": uuid.uuid4().hex,
        }
        token = jwt.encode(
            claims, self._access.current, algorithm=_ALGORITHM, headers={"kid": self._access.current_kid}
        )
        return token, self.access_ttl_s

    def verify_access(self, token: str) -> AccessClaims:
        """The token's claims; AuthenticationFailed when it is invalid or expired. The signature of a token
        seen before is not checked again; the expiry is, on every call, by this signer's clock."""
        claims = self._verified.get(token)
        if claims is not None:
            self._verified.move_to_end(token)
        else:
            claims = self._decode_access(token)
            if self._verified_cache_size > 0:
                self._verified[token] = claims
                if len(self._verified) > self._verified_cache_size:
                    self._verified.popitem(last=False)  # the least recently used
        if self._clock() >= claims.expires_at:
            self._verified.pop(token, None)
            raise AuthenticationFailed("The access token has expired; request a new one.")
        return claims

    def _decode_access(self, token: str) -> AccessClaims:
        """Signature, algorithm, issuer, type and the claims' presence; the expiry is verify_access's."""
        key = _key_of(token, self._access)
        if key is None:
            raise AuthenticationFailed("The access token is invalid.")
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=[_ALGORITHM],
                issuer=_ISSUER,
                options={"require": ["exp", "iat", "sub", "iss"], "verify_exp": False},
            )
            expires_at = int(claims["exp"])
        except (jwt.InvalidTokenError, TypeError, ValueError):
            raise AuthenticationFailed("The access token is invalid.") from None
        if claims.get("typ") != "access":
            raise AuthenticationFailed("The access token is invalid.")
        return AccessClaims(client_id=str(claims["sub"]), expires_at=expires_at)

    def issue_proof(self, tenant_id: str, face_id: str, now: float | None = None) -> str:
        """A proof token: one per match of every result read, so minted by _hs256_jwt (13 us) rather than
        jwt.encode (42 us); the tokens are the same to the byte (tests/unit/test_tokens_fast.py)."""
        issued = int(now if now is not None else time.time())
        claims = {
            "typ": "proof",
            "ten": tenant_id,
            "fid": face_id,
            "iat": issued,
            "exp": issued + self.proof_ttl_s,
        }
        return _hs256_jwt(self._proof.current_kid, self._proof.current, claims)

    def verify_proof(self, token: str) -> ProofClaims:
        key = _key_of(token, self._proof)
        if key is None:
            raise NotFound("No proof image exists for this URL.")
        try:
            claims = jwt.decode(
                token, key, algorithms=[_ALGORITHM], options={"require": ["exp", "ten", "fid"]}
            )
        except jwt.ExpiredSignatureError:
            raise ProofExpired(
                "This proof URL has expired; request the result again for a fresh URL."
            ) from None
        except jwt.InvalidTokenError:
            raise NotFound("No proof image exists for this URL.") from None
        if claims.get("typ") != "proof":
            raise NotFound("No proof image exists for this URL.")
        return ProofClaims(
            tenant_id=str(claims["ten"]), face_id=str(claims["fid"]), expires_at=int(claims["exp"])
        )

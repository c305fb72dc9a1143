"""The service's key ring: one key per purpose, each with a key id (kid), so a key can rotate.

The ring is a list of (kid, secret) entries, the current one first. Each purpose derives its own key from
every entry (HMAC-SHA256 of the purpose's name under the entry's secret), so a key of one purpose never
works for another. The current entry signs and hashes; every entry verifies, so an entry left in the ring
after a rotation keeps what it made valid (tokens, proof URLs, client-secret hashes, audit subjects) until
the operator drops it (docs/security.md, "Rotating the keys").

Kid "0" is the single key of a deployment that configured FACESEARCH_SECRET_KEY before the ring existed: a
record stored without a kid was made with it, and its client-secret pepper and audit key are that secret
itself, as they were, so such a deployment keeps working and can rotate away from it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping, Sequence

ACCESS_TOKENS = "access-token"
PROOF_URLS = "proof-token"
CLIENT_SECRETS = "client-secret-pepper"
AUDIT_SUBJECTS = "audit-subject"
WEBHOOK_SECRETS = "webhook-secret"  # encrypts the clients' webhook signing secrets at rest
PURPOSES = (ACCESS_TOKENS, PROOF_URLS, CLIENT_SECRETS, AUDIT_SUBJECTS, WEBHOOK_SECRETS)

LEGACY_KID = "0"
MIN_SECRET_LENGTH = 16
_KID = re.compile(r"[A-Za-z0-9._-]{1,32}")
_AS_BEFORE_THE_RING = (CLIENT_SECRETS, AUDIT_SUBJECTS)  # kid 0 used the secret itself for these


class PurposeKeys:
    """The keys of one purpose by kid: `current` signs or hashes, every one verifies."""

    def __init__(self, purpose: str, current_kid: str, keys: Mapping[str, bytes]) -> None:
        self.purpose = purpose
        self.current_kid = current_kid
        self._keys = dict(keys)

    @property
    def current(self) -> bytes:
        return self._keys[self.current_kid]

    def get(self, kid: str) -> bytes | None:
        """The key of kid, None for a kid no longer (or never) in the ring."""
        return self._keys.get(kid)

    def kids(self) -> list[str]:
        """Every kid, the current one first."""
        return [self.current_kid, *(kid for kid in self._keys if kid != self.current_kid)]

    def __repr__(self) -> str:
        return f"PurposeKeys({self.purpose!r}, kids={self.kids()!r})"  # never the keys


class KeyRing:
    def __init__(self, entries: Sequence[tuple[str, str]]) -> None:
        """entries: (kid, secret), the current one first."""
        if not entries:
            raise ValueError("the key ring needs at least one key")
        kids = [kid for kid, _ in entries]
        if len(set(kids)) != len(kids):
            raise ValueError("the key ring names a kid twice")
        for kid, secret in entries:
            if not _KID.fullmatch(kid):
                raise ValueError(f"kid {kid!r}: 1 to 32 of A-Z a-z 0-9 . _ -")
            if len(secret) < MIN_SECRET_LENGTH:
                raise ValueError(f"the key of kid {kid!r} must be at least {MIN_SECRET_LENGTH} characters")
        self._entries = [(kid, secret.encode()) for kid, secret in entries]

    @classmethod
    def single(cls, secret: str) -> KeyRing:
        """FACESEARCH_SECRET_KEY alone: a ring of one key, kid 0."""
        return cls([(LEGACY_KID, secret)])

    @classmethod
    def parse(cls, spec: str) -> KeyRing:
        """FACESEARCH_SECRET_KEYS: comma-separated `<kid>:<secret>` entries, the current one first."""
        entries = []
        for item in spec.split(","):
            kid, separator, secret = item.strip().partition(":")
            if not separator:
                raise ValueError("each key ring entry is <kid>:<secret>")
            entries.append((kid, secret))
        return cls(entries)

    @property
    def current_kid(self) -> str:
        return self._entries[0][0]

    def for_purpose(self, purpose: str) -> PurposeKeys:
        if purpose not in PURPOSES:
            raise ValueError(f"unknown key purpose {purpose!r}")
        keys = {kid: _derive(kid, secret, purpose) for kid, secret in self._entries}
        return PurposeKeys(purpose, self.current_kid, keys)

    def __repr__(self) -> str:
        return f"KeyRing(kids={[kid for kid, _ in self._entries]!r})"


def as_purpose_keys(purpose: str, key: PurposeKeys | str | bytes) -> PurposeKeys:
    """`key` as the keys of one purpose: a bare key is a ring of one, kid 0 (for callers that have one
    secret and no ring: tests, benchmarks)."""
    if isinstance(key, PurposeKeys):
        return key
    raw = key.encode() if isinstance(key, str) else bytes(key)
    return PurposeKeys(purpose, LEGACY_KID, {LEGACY_KID: _derive(LEGACY_KID, raw, purpose)})


def _derive(kid: str, secret: bytes, purpose: str) -> bytes:
    if kid == LEGACY_KID and purpose in _AS_BEFORE_THE_RING:
        return secret
    return hmac.new(secret, purpose.encode(), hashlib.sha256).digest()


def subject_hash(keys: PurposeKeys, kind: str, value: str) -> str:
    """The audit trail's name for a client_reference or face id, under the current audit key, with its
    kid (kid 0 writes the form it wrote before the ring: no kid)."""
    return _subject_hash(keys.current_kid, keys.current, kind, value)


def subject_hashes(keys: PurposeKeys, kind: str, value: str) -> list[str]:
    """The names the subject may have in the trail, one under each key of the ring: what an operator looks
    for to answer 'was this reference erased?' across rotations."""
    return [_subject_hash(kid, key, kind, value) for kid in keys.kids() if (key := keys.get(kid)) is not None]


def _subject_hash(kid: str, key: bytes, kind: str, value: str) -> str:
    digest = hmac.new(key, f"{kind}:{value}".encode(), hashlib.sha256).hexdigest()[:32]
    return f"hmac-sha256:{digest}" if kid == LEGACY_KID else f"hmac-sha256:{kid}:{digest}"

"""Domain errors. The API maps each class to one HTTP status in serve_app/api/errors.py."""

from __future__ import annotations

from typing import ClassVar


class ServiceError(Exception):
    """Base class; `message` is safe to show to clients, `details` lists field-level problems.

    A class with a `public_message` is a failure of something behind the service: its `message` carries
    the backend's own text (hosts, ports, replies) for the log, and clients get `public_message` only.
    """

    public_message: ClassVar[str | None] = None
    # Seconds a client should wait before trying again (the Retry-After header); None: no header.
    retry_after_s: int | None = None

    def __init__(self, message: str, details: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}


class ValidationFailed(ServiceError):
    """A request field is missing or has a value outside its rules (422)."""


class UnsupportedMedia(ServiceError):
    """The body or the uploaded file is of a type we do not accept (415)."""


class PayloadTooLarge(ServiceError):
    """The request or image exceeds a configured size or pixel limit (413)."""


class AuthenticationFailed(ServiceError):
    """No credentials, or credentials that are invalid, expired or revoked (401)."""


class RateLimited(ServiceError):
    """Too many requests for this key in the current window (429)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotFound(ServiceError):
    """The resource does not exist, or belongs to another tenant (404)."""


class ProofExpired(ServiceError):
    """A proof URL whose token has expired (410)."""


class BackendUnavailable(ServiceError):
    """Redis or Milvus cannot be reached, or refuses writes for now (Redis at its maxmemory, or unable to
    write its own files) (503). A worker treats it as an outage, not as the transaction's fault: the
    transaction goes back on the queue with a fresh delivery count (BackendRejected and LockUnavailable
    below count as failed attempts instead)."""

    public_message = "The service is temporarily unavailable; retry after the indicated delay."
    retry_after_s = 5


class BackendRejected(BackendUnavailable):
    """The backend answered but refused the request itself (a bug, or data it cannot take). Still 503 to a
    client, but a worker counts it as a failed attempt, which ends in `failed` after max_deliveries,
    instead of requeueing it as an outage forever: retrying the same request cannot help."""


class LockUnavailable(BackendUnavailable):
    """A face's lock was not taken within its wait, or was lost while held (its holder was paused past
    the lock's expiry and another took it): 503 to a client, and a failed attempt to a worker, so a
    reference that stays locked ends its transactions `failed` after max_deliveries instead of requeueing
    them for ever."""


class NotReplicated(BackendUnavailable):
    """A create was written on the Redis master but not acknowledged by the replicas in time (503): the
    transaction `reference_id` exists and may be processed, and a retry with its Idempotency-Key gets it."""

    def __init__(self, message: str, reference_id: str) -> None:
        super().__init__(message)
        self.reference_id = reference_id


class StorageFull(BackendUnavailable):
    """The blob store has no space (ENOSPC) or quota (EDQUOT) left for a write (507). An upload refused so
    created nothing (the image is written before its transaction exists), so a retry is always safe; the
    operator frees space, or the orphan sweep does. To a worker it is an outage like any other."""

    public_message = (
        "The service has no storage space left for this request; retry after the indicated delay."
    )
    retry_after_s = 30


class ModelUnavailable(ServiceError):
    """A model deployment failed to answer (503)."""

    public_message = "Image analysis is temporarily unavailable; retry after the indicated delay."
    retry_after_s = 5

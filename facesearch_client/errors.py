"""Errors the client raises."""

from __future__ import annotations


class FaceSearchError(Exception):
    """Base class of the client's errors."""


class ApiError(FaceSearchError):
    """The service answered with an error envelope (or a non-JSON error)."""

    def __init__(self, status_code: int, message: str, errors: dict[str, str] | None = None) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.errors = errors or {}


class AuthenticationError(ApiError):
    """401: bad credentials, or a token the service no longer accepts even after a fresh login."""


class RetriesExhausted(ApiError):
    """429 or 503 answers kept coming after the bounded number of retries."""


class TransactionFailed(FaceSearchError):
    """The transaction ended in state `failed` (the service could not process the stored image)."""

    def __init__(self, reference_id: str, message: str) -> None:
        super().__init__(f"transaction {reference_id} failed: {message}")
        self.reference_id = reference_id
        self.message = message


class ResultTimeout(FaceSearchError, TimeoutError):
    """The transaction was not final within the caller's timeout."""

"""Python client of the facesearch service (sync and async, on httpx).

    from facesearch_client import FaceSearchClient
    with FaceSearchClient("http://127.0.0.1:8000", "cl_...", "secret") as client:
        result = client.search("selfie.jpg", client_reference="customer-0001")
        for match in result.matches:
            print(match.face_id, match.score, match.client_reference)

See docs/gallery.md, "Python client".
"""

from facesearch_client._policy import RetryPolicy
from facesearch_client.aio import AsyncFaceSearchClient
from facesearch_client.errors import (
    ApiError,
    AuthenticationError,
    FaceSearchError,
    ResultTimeout,
    RetriesExhausted,
    TransactionFailed,
)
from facesearch_client.models import (
    AgeResult,
    AuditEntry,
    AuditPage,
    Erasure,
    FaceSearchResult,
    GalleryFace,
    GalleryPage,
    GalleryStats,
    Match,
    Pending,
)
from facesearch_client.sync import FaceSearchClient
from facesearch_client.webhooks import WebhookVerificationError, verify_webhook

__all__ = [
    "AgeResult",
    "ApiError",
    "AsyncFaceSearchClient",
    "AuditEntry",
    "AuditPage",
    "AuthenticationError",
    "Erasure",
    "FaceSearchClient",
    "FaceSearchError",
    "FaceSearchResult",
    "GalleryFace",
    "GalleryPage",
    "GalleryStats",
    "Match",
    "Pending",
    "ResultTimeout",
    "RetriesExhausted",
    "RetryPolicy",
    "TransactionFailed",
    "WebhookVerificationError",
    "verify_webhook",
]

"""The ingress' object graph (its stores, built once, and the API services) from Settings. No model library
is imported here (tests/unit/test_ingress_imports.py)."""

from __future__ import annotations

from serve_app.api.app import ApiServices
from serve_app.api.limits import parse_networks
from serve_app.api.tokens import TokenSigner
from serve_app.domain.keys import AUDIT_SUBJECTS
from serve_app.pipelines.auth import ClientAuthenticator
from serve_app.pipelines.gallery import GalleryService
from serve_app.pipelines.proofs import ProofService
from serve_app.pipelines.transactions import TransactionService
from serve_app.settings import Settings
from serve_app.stores.blobs import LocalBlobStore
from serve_app.wiring.models import serving_face_model
from serve_app.wiring.stores import gallery_store, lock_policy, redis_stores, result_archive
from serve_app.wiring.webhooks import webhook_service


def build_api_services(settings: Settings) -> ApiServices:
    stores = redis_stores(settings)
    blobs = LocalBlobStore(settings.blobs)
    return ApiServices(
        transactions=TransactionService(
            stores.transactions,
            blobs,
            settings.limits.max_image_pixels,
            records=stores.records,
            archive=result_archive(settings),
        ),
        proofs=ProofService(stores.records, blobs),
        auth=ClientAuthenticator(
            stores.clients,
            stores.limiter,
            stores.admission,
            login_failures_per_window=settings.auth.login_failures_per_window,
            login_window_s=settings.auth.login_window_s,
            requests_per_minute=settings.limits.requests_per_minute,
            login_backoff_max_s=settings.auth.login_backoff_max_s,
            unauthenticated_per_minute=settings.limits.unauthenticated_per_minute,
        ),
        signer=TokenSigner(
            settings.auth.key_ring(),
            settings.auth.access_token_ttl_s,
            settings.auth.proof_ttl_s,
            verified_cache_size=settings.auth.verified_token_cache,
        ),
        max_upload_bytes=settings.limits.max_upload_bytes,
        wait_for_result_timeout_s=settings.limits.wait_for_result_timeout_s,
        public_base_url=settings.http.public_base_url,
        trusted_proxies=parse_networks(settings.http.trusted_proxies),
        # Gallery management needs Milvus (removals); an API built on Redis alone (the edge tests) has none.
        gallery=GalleryService(
            stores.records,
            gallery_store(settings, stores.redis),  # connects to Milvus lazily, on the first removal
            blobs,
            stores.audit,
            subject_key=settings.auth.key_ring().for_purpose(AUDIT_SUBJECTS),
            model_version=serving_face_model(settings).version,
            lock=lock_policy(settings),
        )
        if settings.milvus.uri
        else None,
        webhooks=webhook_service(settings, stores.redis),
    )

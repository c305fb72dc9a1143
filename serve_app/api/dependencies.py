"""What every route module shares: the replica's services, the caller's source address, and the
authentication dependency that yields the tenant. A new router (e.g. gallery management) declares
`tenant: Tenant` and `services: Services` and gets the same authentication, throttling and counting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from serve_app.api.limits import IPNetwork, client_source
from serve_app.api.tokens import TokenSigner
from serve_app.domain.errors import AuthenticationFailed
from serve_app.pipelines.auth import ClientAuthenticator
from serve_app.pipelines.gallery import GalleryService
from serve_app.pipelines.proofs import ProofService
from serve_app.pipelines.transactions import TransactionService
from serve_app.pipelines.webhooks import WebhookService

CLIENT_SECRET_HEADER = "Client-Secret"


@dataclass(frozen=True)
class ApiServices:
    transactions: TransactionService
    proofs: ProofService
    auth: ClientAuthenticator
    signer: TokenSigner
    max_upload_bytes: int
    wait_for_result_timeout_s: float
    public_base_url: str | None
    trusted_proxies: tuple[IPNetwork, ...] = ()  # whose X-Forwarded-For is believed
    gallery: GalleryService | None = None  # the gallery management extension (api/routes/gallery.py)
    webhooks: WebhookService | None = None  # completion webhooks (api/routes/webhooks.py)


async def api_services(request: Request) -> ApiServices:
    """The services create_app() put on this app (one app per replica). async although it never waits:
    FastAPI runs a plain `def` dependency in its thread pool, a thread hop on every request (about 5% of
    the ingress' CPU under load; docs/performance.md)."""
    services = request.app.state.services
    assert isinstance(services, ApiServices)
    return services


Services = Annotated[ApiServices, Depends(api_services)]


def source_of(request: Request, services: ApiServices) -> str:
    peer = request.client.host if request.client else None
    return client_source(peer, request.headers.getlist("x-forwarded-for"), services.trusted_proxies)


def base_url(request: Request, services: ApiServices) -> str:
    return services.public_base_url or str(request.base_url).rstrip("/")


async def authenticated_tenant(request: Request, services: Services) -> str:
    """Bearer access token, or the Client-Secret header; either way the client is the tenant. A failed
    check counts against the source's allowance of unauthenticated requests (429 once it is spent)."""
    try:
        return await _admitted_client(request, services)
    except AuthenticationFailed:
        await services.auth.count_unauthenticated(source_of(request, services))
        raise


async def _admitted_client(request: Request, services: ApiServices) -> str:
    """The client's id once its credentials are checked and the request is counted against its allowance."""
    authorization = request.headers.get("authorization", "")
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationFailed("Authorization must be 'Bearer <access token>'.")
        claims = services.signer.verify_access(token.strip())
        # Still active? and counted: one round trip (the token alone cannot tell a revocation).
        await services.auth.admit(claims.client_id)
        return claims.client_id
    if secret := request.headers.get(CLIENT_SECRET_HEADER):
        client = await services.auth.client_by_secret(secret)
        await services.auth.count_request(client.client_id)
        return client.client_id
    raise AuthenticationFailed(
        f"Authentication required: send 'Authorization: Bearer <token>' or '{CLIENT_SECRET_HEADER}'."
    )


# The tenant id of an authenticated caller; declare it before the body so credentials are checked first.
Tenant = Annotated[str, Depends(authenticated_tenant)]

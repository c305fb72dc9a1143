"""Authentication: access tokens, the Client-Secret header, login throttling, request limits, proof URLs."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import warnings
from typing import Any

import httpx
import jwt
import pytest
from jwt.warnings import InsecureKeyLengthWarning

from serve_app.api.tokens import TokenSigner
from serve_app.domain.errors import AuthenticationFailed
from serve_app.domain.identifiers import new_client_id
from serve_app.domain.keys import as_purpose_keys
from tests.unit.fakes import (
    SERVICE_SECRET,
    Api,
    ManualClock,
    assert_error_envelope,
    build_api,
    embedding,
    solid_png,
)

RED = (200, 30, 30)


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def b64url_json(value: dict[str, Any]) -> str:
    return b64url(json.dumps(value).encode())


def access_claims(client_id: str, **overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    claims: dict[str, Any] = {
        "iss": "facesearch",
        "sub": client_id,
        "typ": "access",
        "iat": now,
        "exp": now + 600,
        "jti": "x",
    }
    claims.update(overrides)
    return {key: value for key, value in claims.items() if value is not None}


def with_payload(token: str, payload: dict[str, Any]) -> str:
    """The token's header and signature around another payload."""
    header, _, signature = token.split(".")
    return f"{header}.{b64url_json(payload)}.{signature}"


def flip_signature(token: str) -> str:
    header, payload, signature = token.split(".")
    middle = len(signature) // 2
    replacement = "A" if signature[middle] != "A" else "B"
    return f"{header}.{payload}.{signature[:middle]}{replacement}{signature[middle + 1 :]}"


def unsigned(payload: dict[str, Any]) -> str:
    return f"{b64url_json({'alg': 'none', 'typ': 'JWT'})}.{b64url_json(payload)}."


async def search(http: httpx.AsyncClient, headers: dict[str, str]) -> httpx.Response:
    return await http.post(
        "/face-search",
        data={"type": "face_search"},
        files={"file": ("a.png", solid_png(RED), "image/png")},
        headers=headers,
    )


async def login(http: httpx.AsyncClient, client_id: str, secret: str, form: bool = False) -> httpx.Response:
    body = {"client_id": client_id, "client_secret": secret}
    if form:
        return await http.post("/request-access-token", data=body)
    return await http.post("/request-access-token", json=body)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_login_issues_a_working_bearer_token_from_json_or_form() -> None:
    async def scenario() -> None:
        api = await build_api()
        async with api.http() as http:
            for form in (False, True):
                response = await login(http, api.client_id, api.client_secret, form=form)
                assert response.status_code == 200, response.text
                body = response.json()
                assert body["status"] is True
                data = body["result"]["data"]
                assert set(data) == {"token", "token_type", "expires_in"}
                assert data["token_type"] == "Bearer"
                assert data["expires_in"] == 900
                assert api.signer.verify_access(data["token"]).client_id == api.client_id
                created = await search(http, bearer(data["token"]))
                assert created.status_code == 200

    asyncio.run(scenario())


def forged_tokens(api: Api) -> dict[str, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureKeyLengthWarning)  # forgeries may use short keys
        return _forged_tokens(api)


def _forged_tokens(api: Api) -> dict[str, str]:
    good = api.token()
    access_key = as_purpose_keys("access-token", SERVICE_SECRET).current
    return {
        "expired": api.signer.issue_access(api.client_id, now=time.time() - 3600)[0],
        "tampered signature": flip_signature(good),
        "tampered payload": with_payload(good, access_claims("cl_someone_else")),
        "alg none": unsigned(access_claims(api.client_id)),
        "alg none, signature kept": unsigned(access_claims(api.client_id)) + good.split(".")[2],
        "another service's key": TokenSigner("another-secret", 900, 900).issue_access(api.client_id)[0],
        "signed with the raw secret": jwt.encode(access_claims(api.client_id), SERVICE_SECRET, "HS256"),
        "HS512 with the access key": jwt.encode(access_claims(api.client_id), access_key, "HS512"),
        "proof token": api.signer.issue_proof(api.client_id, "f123"),
        "access key, typ proof": jwt.encode(access_claims(api.client_id, typ="proof"), access_key, "HS256"),
        "access key, no typ": jwt.encode(access_claims(api.client_id, typ=None), access_key, "HS256"),
        "access key, wrong issuer": jwt.encode(access_claims(api.client_id, iss="evil"), access_key, "HS256"),
        "access key, no exp": jwt.encode(access_claims(api.client_id, exp=None), access_key, "HS256"),
        "garbage": "not-a-jwt",
        "three dots of nothing": "..",
    }


def test_forged_expired_and_misused_access_tokens_are_401() -> None:
    async def scenario() -> None:
        api = await build_api()
        tokens = forged_tokens(api)
        async with api.http() as http:
            # The same claims, correctly signed, are accepted: the refusals below are about the defect alone.
            valid = jwt.encode(
                access_claims(api.client_id), as_purpose_keys("access-token", SERVICE_SECRET).current, "HS256"
            )
            assert (await search(http, bearer(valid))).status_code == 200
            for name, token in tokens.items():
                response = await search(http, bearer(token))
                assert response.status_code == 401, name
                assert_error_envelope(response.json())
                assert response.headers["WWW-Authenticate"].startswith("Bearer")
            expired = await search(http, bearer(tokens["expired"]))
            assert "expired" in expired.json()["message"]
        assert api.world.queue.undelivered == 1

    asyncio.run(scenario())


def test_a_verified_token_is_remembered_until_it_expires_and_the_memory_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decoded: list[str] = []
    real_decode = jwt.decode

    def counting_decode(token: str, *args: Any, **kwargs: Any) -> Any:
        decoded.append(token)
        return real_decode(token, *args, **kwargs)

    monkeypatch.setattr("serve_app.api.tokens.jwt.decode", counting_decode)
    clock = ManualClock(start=time.time())
    signer = TokenSigner(SERVICE_SECRET, access_ttl_s=60, proof_ttl_s=60, verified_cache_size=2, clock=clock)
    first, _ = signer.issue_access(new_client_id())
    claims = signer.verify_access(first)
    assert [signer.verify_access(first) for _ in range(3)] == [claims] * 3
    assert decoded == [first]  # the signature was checked once

    # Refused tokens are never remembered: each attempt is checked in full.
    tampered = first[:-2] + ("AA" if not first.endswith("AA") else "BB")
    for _ in range(2):
        with pytest.raises(AuthenticationFailed, match="invalid"):
            signer.verify_access(tampered)
    assert decoded == [first, tampered, tampered]

    # Bounded: a third token pushes out the least recently used one.
    second, _ = signer.issue_access(new_client_id())
    third, _ = signer.issue_access(new_client_id())
    signer.verify_access(second)
    signer.verify_access(first)  # now the most recently used
    signer.verify_access(third)  # evicts second
    decoded.clear()
    signer.verify_access(first)
    signer.verify_access(second)
    assert decoded == [second]

    # Expiry is checked on every call, remembered or not, to the second of the token's exp.
    clock.advance(59)
    assert signer.verify_access(first) == claims
    clock.advance(1)
    for _ in range(2):
        with pytest.raises(AuthenticationFailed, match="expired"):
            signer.verify_access(first)


@pytest.mark.parametrize(
    "authorization",
    ["", "Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "Token abc", "bearer"],
)
def test_malformed_authorization_headers_are_401(authorization: str) -> None:
    async def scenario() -> None:
        api = await build_api()
        async with api.http() as http:
            headers = {"Authorization": authorization} if authorization else {}
            response = await search(http, headers)
        assert response.status_code == 401
        assert_error_envelope(response.json())

    asyncio.run(scenario())


def test_a_revoked_client_is_refused_everywhere_at_once() -> None:
    async def scenario() -> None:
        api = await build_api()
        token = api.token()
        async with api.http() as http:
            assert (await search(http, bearer(token))).status_code == 200
            assert await api.clients.revoke(api.client_id)
            assert (await search(http, bearer(token))).status_code == 401
            assert (await search(http, {"Client-Secret": api.client_secret})).status_code == 401
            assert (await login(http, api.client_id, api.client_secret)).status_code == 401

    asyncio.run(scenario())


def test_client_secret_header_authenticates_and_a_wrong_one_is_401() -> None:
    async def scenario() -> None:
        api = await build_api()
        other_id, other_secret = await api.new_client("tenant-b")
        async with api.http() as http:
            ok = await search(http, {"Client-Secret": api.client_secret})
            wrong = await search(http, {"Client-Secret": api.client_secret[:-1] + "x"})
            empty = await search(http, {"Client-Secret": ""})
            theirs = await search(http, {"Client-Secret": other_secret})
        assert ok.status_code == 200
        assert wrong.status_code == 401 and empty.status_code == 401
        assert_error_envelope(wrong.json())
        assert theirs.status_code == 200
        tenants = {
            api.world.transactions.peek(r.json()["result"]["data"]["reference_id"]).tenant_id
            for r in (ok, theirs)
        }
        assert tenants == {api.client_id, other_id}

    asyncio.run(scenario())


def test_failed_logins_back_off_with_doubling_waits_and_a_success_forgets_them() -> None:
    async def scenario() -> None:
        clock = ManualClock(time.time())
        api = await build_api(
            login_failures_per_window=3, login_window_s=300, login_backoff_max_s=8, limiter_clock=clock
        )
        async with api.http() as http:
            for _ in range(3):  # the free attempts, back to back
                failed = await login(http, api.client_id, "wrong-secret")
                assert failed.status_code == 401
                assert_error_envelope(failed.json())
            waits = []
            for _ in range(5):
                blocked = await login(http, api.client_id, api.client_secret)  # even the right secret
                assert blocked.status_code == 429
                assert_error_envelope(blocked.json())
                waits.append(int(blocked.headers["Retry-After"]))
                clock.advance(waits[-1])
                assert (await login(http, api.client_id, "wrong-secret")).status_code == 401
            assert waits == [1, 2, 4, 8, 8]  # doubling, capped at login_backoff_max_s

            clock.advance(8)
            allowed = await login(http, api.client_id, api.client_secret)
            assert allowed.status_code == 200
            assert (await search(http, bearer(allowed.json()["result"]["data"]["token"]))).status_code == 200
            # The success forgot the failures: three free attempts again.
            for _ in range(3):
                assert (await login(http, api.client_id, "wrong-secret")).status_code == 401
            assert (await login(http, api.client_id, api.client_secret)).status_code == 429

            clock.advance(301 + 8)  # failures are forgotten login_window_s after the last one
            assert (await login(http, api.client_id, api.client_secret)).status_code == 200

    asyncio.run(scenario())


def test_an_attackers_failed_logins_never_lock_the_client_out_from_its_own_address() -> None:
    async def scenario() -> None:
        clock = ManualClock(time.time())
        api = await build_api(login_failures_per_window=3, login_window_s=300, limiter_clock=clock)
        async with api.http(client=("203.0.113.7", 1000)) as attacker:
            statuses = [(await login(attacker, api.client_id, f"guess-{n}")).status_code for n in range(20)]
            assert statuses[:3] == [401, 401, 401] and set(statuses[3:]) == {429}
            # Spoofed X-Forwarded-For does not move the attacker into another bucket (no trusted proxies).
            spoofed = await attacker.post(
                "/request-access-token",
                json={"client_id": api.client_id, "client_secret": api.client_secret},
                headers={"X-Forwarded-For": "198.51.100.20"},
            )
            assert spoofed.status_code == 429
        async with api.http(client=("198.51.100.20", 1000)) as client:
            assert (await login(client, api.client_id, api.client_secret)).status_code == 200

    asyncio.run(scenario())


def test_unauthenticated_requests_are_limited_per_source() -> None:
    async def scenario() -> None:
        api = await build_api(unauthenticated_per_minute=5)
        async with api.http(client=("203.0.113.7", 1000)) as attacker:
            spray = [new_client_id() for _ in range(3)]
            for guess in spray:  # a spray over client ids: each a different (client_id, source) pair
                assert (await login(attacker, guess, "guess")).status_code == 401
            assert (await attacker.post("/result", json={"reference_id": "0" * 32})).status_code == 401
            assert (await attacker.get("/get-proof/not-a-token")).status_code == 404
            # The allowance of 5 is spent: logins, bad credentials and bad proof URLs are all refused.
            refused = [
                await login(attacker, new_client_id(), "guess"),
                await login(attacker, api.client_id, api.client_secret),
                await attacker.post(
                    "/result", json={"reference_id": "0" * 32}, headers={"Client-Secret": "x"}
                ),
                await attacker.get("/get-proof/not-a-token"),
            ]
            for response in refused:
                assert response.status_code == 429, response.text
                assert_error_envelope(response.json())
                assert 1 <= int(response.headers["Retry-After"]) <= 60
            # A client with valid credentials behind the same address is not an unauthenticated request.
            assert (await search(attacker, api.headers())).status_code == 200
        async with api.http(client=("198.51.100.20", 1000)) as other:
            assert (await login(other, api.client_id, api.client_secret)).status_code == 200

    asyncio.run(scenario())


def test_forwarded_for_is_believed_only_from_trusted_proxies() -> None:
    async def scenario() -> None:
        api = await build_api(login_failures_per_window=2, trusted_proxies=("10.0.0.0/8",))
        async with api.http(client=("10.1.2.3", 1000)) as proxy:

            async def attempt(forwarded_for: str, secret: str = "wrong") -> int:
                response = await proxy.post(
                    "/request-access-token",
                    json={"client_id": api.client_id, "client_secret": secret},
                    headers={"X-Forwarded-For": forwarded_for},
                )
                return response.status_code

            # Behind the proxy each caller has its own bucket: the right-most untrusted address counts,
            # whatever the caller put in front of it.
            assert [await attempt("203.0.113.7") for _ in range(3)] == [401, 401, 429]
            assert await attempt("1.1.1.1, 203.0.113.7") == 429
            assert await attempt("203.0.113.7, 10.9.9.9") == 429  # through a second trusted proxy
            assert await attempt("203.0.113.7, 198.51.100.20", api.client_secret) == 200
        async with api.http(client=("192.0.2.1", 1000)) as untrusted:
            # An untrusted peer's header is ignored: its own address is the source.
            for _ in range(2):
                response = await untrusted.post(
                    "/request-access-token",
                    json={"client_id": api.client_id, "client_secret": "wrong"},
                    headers={"X-Forwarded-For": f"198.51.100.{_}"},
                )
                assert response.status_code == 401
            response = await untrusted.post(
                "/request-access-token",
                json={"client_id": api.client_id, "client_secret": api.client_secret},
                headers={"X-Forwarded-For": "198.51.100.99"},
            )
            assert response.status_code == 429

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"client_id": "cl_x"},
        {"client_secret": "s"},
        {"client_id": "", "client_secret": "s"},
        {"client_id": 1, "client_secret": 2},
    ],
)
def test_login_requires_both_credentials(body: dict[str, Any]) -> None:
    async def scenario() -> None:
        api = await build_api()
        async with api.http() as http:
            response = await http.post("/request-access-token", json=body)
        assert response.status_code == 422
        assert_error_envelope(response.json())

    asyncio.run(scenario())


def test_requests_over_the_per_client_rate_are_429_with_retry_after() -> None:
    async def scenario() -> None:
        api = await build_api(requests_per_minute=3)
        other_id, _ = await api.new_client("tenant-b")
        async with api.http() as http:
            statuses = [(await search(http, api.headers())).status_code for _ in range(4)]
            limited = await search(http, api.headers())
            other = await search(http, api.headers(other_id))
        assert statuses == [200, 200, 200, 429]
        assert limited.status_code == 429
        assert 0 < int(limited.headers["Retry-After"]) <= 60
        assert_error_envelope(limited.json())
        assert other.status_code == 200  # limits are per client

    asyncio.run(scenario())


# -------------------------------------------------------------------------------------- proof URLs


def test_proof_tokens_expire_refuse_tampering_and_never_cross_faces() -> None:
    async def scenario() -> None:
        api = await build_api()
        other_id, _ = await api.new_client("tenant-b")
        world = api.world
        await world.enrol(api.client_id, "face-a", embedding(1), proof=b"image of A")
        await world.enrol(api.client_id, "face-b", embedding(2), proof=b"image of B")
        await world.enrol(other_id, "face-c", embedding(3), proof=b"image of C")
        token_a = api.signer.issue_proof(api.client_id, "face-a")
        proof_key = as_purpose_keys("proof-token", SERVICE_SECRET).current
        now = int(time.time())

        async with api.http() as http:

            async def get(token: str) -> httpx.Response:
                return await http.get(f"/get-proof/{token}")

            assert (await get(token_a)).content == b"image of A"
            assert (await get(api.signer.issue_proof(api.client_id, "face-b"))).content == b"image of B"

            expired = await get(api.signer.issue_proof(api.client_id, "face-a", now=time.time() - 901))
            assert expired.status_code == 410
            assert_error_envelope(expired.json())

            a_claims = jwt.decode(token_a, options={"verify_signature": False})
            refused = {
                "tampered signature": flip_signature(token_a),
                "A's signature on B's id": with_payload(token_a, {**a_claims, "fid": "face-b"}),
                "A's signature on another tenant": with_payload(token_a, {**a_claims, "ten": other_id}),
                "alg none": unsigned({**a_claims, "fid": "face-b"}),
                "signed with the access key": jwt.encode(
                    {**a_claims}, as_purpose_keys("access-token", SERVICE_SECRET).current
                ),
                "an access token": api.token(),
                "another service's key": TokenSigner("another-secret", 900, 900).issue_proof(
                    api.client_id, "face-a"
                ),
                "proof key, typ access": jwt.encode({**a_claims, "typ": "access"}, proof_key, "HS256"),
                "tenant and face mismatched": api.signer.issue_proof(api.client_id, "face-c"),
                "unknown face": api.signer.issue_proof(api.client_id, "face-z"),
                "garbage": "abc.def.ghi",
            }
            for name, token in refused.items():
                response = await get(token)
                assert response.status_code == 404, name
                assert_error_envelope(response.json())
                assert b"image of" not in response.content, name

            # Once A is removed (replaced by an override), its still-valid URL stops working.
            await world.gallery.delete(api.client_id, ["face-a"])
            await world.record_store.delete(api.client_id, "face-a")
            assert (await get(token_a)).status_code == 404
            assert (await get(api.signer.issue_proof(api.client_id, "face-b"))).content == b"image of B"
        assert now <= a_claims["exp"] - 900 <= now + 1

    asyncio.run(scenario())


# -------------------------------------------------------------------------------------------- logs


def test_no_secret_or_token_appears_in_the_logs(caplog: pytest.LogCaptureFixture) -> None:
    seen: dict[str, str] = {}

    async def scenario() -> None:
        clock = ManualClock(time.time())
        api = await build_api(login_failures_per_window=2, limiter_clock=clock)
        seen["secret"] = api.client_secret
        wrong_secret = "wrong-" + api.client_secret[:20]
        seen["wrong"] = wrong_secret
        async with api.http() as http:
            token = (await login(http, api.client_id, api.client_secret)).json()["result"]["data"]["token"]
            seen["token"] = token
            await search(http, bearer(token))
            await search(http, {"Client-Secret": api.client_secret})
            await search(http, {"Client-Secret": wrong_secret})
            await search(http, bearer(flip_signature(token)))
            for _ in range(3):
                await login(http, api.client_id, wrong_secret)
            await login(http, api.client_id, api.client_secret)  # throttled now
            await http.post("/result", json={"reference_id": api.client_secret}, headers=bearer(token))

    with caplog.at_level(logging.DEBUG):
        asyncio.run(scenario())
    text = caplog.text + "".join(str(record.args) for record in caplog.records)
    assert seen["secret"] not in text
    assert seen["wrong"] not in text
    assert seen["token"] not in text
    assert seen["token"].split(".")[2] not in text

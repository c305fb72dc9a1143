"""What the sync and async clients share: credentials and token state, the retry policy, and turning
answers into typed results. No I/O here."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from facesearch_client import calls
from facesearch_client.calls import Call
from facesearch_client.errors import TransactionFailed
from facesearch_client.models import Pending, Result, parse_result

RETRY_STATUSES = (429, 503, 507)  # 507: the service's storage is full, nothing was created


@dataclass(frozen=True)
class RetryPolicy:
    """Back-off on 429, 503 and 507: wait what Retry-After says (capped at max_wait_s), else an exponential
    delay from base_s; give up (RetriesExhausted) after max_retries retries. A connection that broke
    before any answer is retried the same way when sending the call again is safe (resend_delay)."""

    max_retries: int = 5
    base_s: float = 0.5
    max_wait_s: float = 30.0

    def delay(self, response: httpx.Response, retries_done: int) -> float | None:
        """Seconds to wait before retrying, or None when the answer is final: not one to retry, or the
        retries are spent (the caller then sees that last answer: RetriesExhausted from a typed call)."""
        if response.status_code not in RETRY_STATUSES or retries_done >= self.max_retries:
            return None
        header = response.headers.get("retry-after", "").strip()
        if header.isdigit():
            return min(float(header), self.max_wait_s)
        return self._backoff(retries_done)

    def resend_delay(self, call: Call, error: httpx.TransportError, retries_done: int) -> float | None:
        """Seconds to wait before sending `call` again after its exchange failed without an answer, or None
        to let the error through. A refused connection reached nothing, so any call goes again; a
        connection that broke later (reset, closed mid-answer) may have reached the service, so only a
        repeatable call does. A timeout is the caller's own budget, never retried here."""
        if retries_done >= self.max_retries:
            return None
        if isinstance(error, httpx.ConnectError) or (
            call.repeatable and isinstance(error, httpx.NetworkError | httpx.RemoteProtocolError)
        ):
            return self._backoff(retries_done)
        return None

    def _backoff(self, retries_done: int) -> float:
        return min(self.base_s * 2.0**retries_done, self.max_wait_s)


class Session:
    """Credentials and the current access token.

    mode "token": log in with client_id and client_secret, send the Bearer token, log in again shortly
    before it expires (refresh_margin_s) and once more when the service answers 401 (it was revoked or the
    service's key changed). mode "secret": send the Client-Secret header on every request, no login.
    A preset `token` without credentials is used as it is (no refresh possible).
    """

    def __init__(
        self,
        client_id: str | None,
        client_secret: str | None,
        mode: str = "token",
        token: str | None = None,
        refresh_margin_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in ("token", "secret"):
            raise ValueError("mode must be 'token' or 'secret'")
        if mode == "secret" and not client_secret:
            raise ValueError("the Client-Secret mode needs client_secret")
        if mode == "token" and token is None and not (client_id and client_secret):
            raise ValueError("the token mode needs client_id and client_secret (or a token)")
        self.client_id = client_id
        self.client_secret = client_secret
        self.mode = mode
        self._token = token
        self._expires_at = float("inf") if token is not None else 0.0
        self._refresh_margin_s = refresh_margin_s
        self._clock = clock

    @property
    def can_login(self) -> bool:
        return self.mode == "token" and bool(self.client_id and self.client_secret)

    def needs_login(self) -> bool:
        if self.mode != "token":
            return False
        if self._token is None:
            return True
        return self.can_login and self._clock() >= self._expires_at - self._refresh_margin_s

    def login_call(self) -> Call:
        assert self.client_id and self.client_secret
        return calls.login(self.client_id, self.client_secret)

    def accept_login(self, response: httpx.Response) -> None:
        data = calls.data_of(response)
        self._token = str(data["token"])
        self._expires_at = self._clock() + float(data.get("expires_in", 0))

    def forget_token(self) -> None:
        self._token = None

    def headers(self) -> dict[str, str]:
        if self.mode == "secret":
            assert self.client_secret
            return {"Client-Secret": self.client_secret}
        return {"Authorization": f"Bearer {self._token}"}


def created_outcome(response: httpx.Response) -> Result | str:
    """A create's answer: the result when the service answered it in the same request (Prefer: wait and
    final in time), else the reference_id to wait for (the create's own envelope, data: reference_id
    alone). TransactionFailed for a failed one."""
    data = calls.data_of(response)
    if response.status_code == 200 and set(data) == {"reference_id"}:
        return str(data["reference_id"])
    answer = outcome(response)
    return answer.reference_id if isinstance(answer, Pending) else answer


def outcome(response: httpx.Response) -> Result | Pending:
    """A /result (or wait_for_result) answer as a typed result; TransactionFailed for a failed one."""
    data = calls.data_of(response)
    if response.status_code == 202:
        return Pending(str(data["reference_id"]), str(data.get("state", "queued")))
    if data.get("state") == "failed":
        raise TransactionFailed(str(data.get("reference_id", "")), calls.error_of(response).message)
    return parse_result(data)

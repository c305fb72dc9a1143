"""Which backend errors are outages (requeued without counting) and which are rejections (counted)."""

from __future__ import annotations

import pytest
from pymilvus.exceptions import MilvusException
from redis import exceptions as redis_exceptions

from serve_app.domain.errors import BackendRejected, BackendUnavailable
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from serve_app.stores.redis_support import to_backend_unavailable


@pytest.mark.parametrize(
    "error",
    [
        redis_exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6379"),
        redis_exceptions.TimeoutError("Timeout reading from socket"),
        redis_exceptions.BusyLoadingError("Redis is loading the dataset in memory"),
        redis_exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'"),
        redis_exceptions.ReadOnlyError("You can't write against a read only replica."),
        redis_exceptions.ResponseError("MISCONF Redis is configured to save RDB snapshots, but ..."),
        # A script writing to a master demoted by a failover: the server's reply wrapped in a script error.
        redis_exceptions.ResponseError(
            "Error running script (call to f_99dff4): @user_script:2: @user_script: 2: "
            "-READONLY You can't write against a read only replica."
        ),
        ConnectionResetError(104, "Connection reset by peer"),
    ],
    ids=lambda error: f"{type(error).__name__}-{str(error)[:24]}",
)
def test_redis_outages_are_not_rejections(error: BaseException) -> None:
    translated = to_backend_unavailable(error)
    assert isinstance(translated, BackendUnavailable) and not isinstance(translated, BackendRejected)


@pytest.mark.parametrize(
    "error",
    [
        redis_exceptions.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        redis_exceptions.ResponseError("string exceeds maximum allowed size (proto-max-bulk-len)"),
        redis_exceptions.ResponseError("Error running script (call to f_...): @user_script:3: bad argument"),
        redis_exceptions.ExecAbortError("Transaction discarded because of previous errors."),
    ],
    ids=["wrongtype", "too-large", "script", "execabort"],
)
def test_redis_refusing_the_command_is_a_rejection(error: BaseException) -> None:
    assert isinstance(to_backend_unavailable(error), BackendRejected)


def test_milvus_refusing_a_request_is_a_rejection_and_a_lost_connection_is_not() -> None:
    refused = MilvusException(code=1100, message="the length of varchar field exceeds max length (256)")
    assert isinstance(MilvusGalleryStore._unavailable(refused), BackendRejected)
    lost = MilvusException(code=2, message="Fail connecting to server on 127.0.0.1:19530, illegal connection")
    translated = MilvusGalleryStore._unavailable(lost)
    assert isinstance(translated, BackendUnavailable) and not isinstance(translated, BackendRejected)

"""`facesearch start` keeps the embedded servers it started alive: a server that died and cannot be started
again at once (its port taken meanwhile, say) is tried again, with a growing pause, and the supervisor goes
on; it never ends the service."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
import redis

from serve_app.launch.embedded import EmbeddedServerError, EmbeddedServices, Revival, _pid_alive


class FlakyServices:
    """Stands in for EmbeddedServices: its revive() fails `failures` times, then starts the server."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[float] = []

    def revive(self) -> list[str]:
        self.calls.append(clock.now)
        if self.failures:
            self.failures -= 1
            raise EmbeddedServerError("could not bind 127.0.0.1:6390: address in use")
        return ["redis"]


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


clock = Clock()


def test_a_revive_that_fails_is_logged_and_tried_again_later_with_a_growing_pause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock.now = 0.0
    services = FlakyServices(failures=3)
    revival = Revival(services, first_delay_s=1.0, max_delay_s=3.0, clock=clock)  # type: ignore[arg-type]
    revived: list[list[str]] = []
    while clock.now < 20:  # the supervisor's loop, one check a quarter second
        revived.append(revival.check())  # never raises
        clock.now += 0.25
    # Tried at once, then after 1, 2 and (capped) 3 s: the fourth attempt starts it.
    assert services.calls == [0.0, 1.0, 3.0, 6.0, *services.calls[4:]]
    assert ["redis"] in revived and revival.failures == 0
    failures = [record for record in caplog.records if "failed" in record.getMessage()]
    assert len(failures) == 3 and all("address in use" in record.getMessage() for record in failures)
    # After a success the pause starts again from the first delay.
    services.failures = 1
    start = clock.now
    revival.check()
    clock.now += 1.0
    revival.check()
    assert services.calls[-2:] == [start, start + 1.0]


def test_a_dead_redis_whose_port_is_taken_is_started_once_the_port_is_free(tmp_path: Path) -> None:
    """The real redis-server: killed, its port taken by another program before it could come back (the
    restart fails), then freed: the next revive starts it, on the same port and password."""
    with EmbeddedServices(tmp_path, milvus=False) as services:
        assert services.redis is not None and services.redis.pid is not None
        url, port, pid = services.redis.url, services.redis.port, services.redis.pid
        os.kill(pid, signal.SIGKILL)
        squatter = socket.socket()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 30
        while True:  # the dead server's last threads let go of the port a moment after the kill
            try:
                squatter.bind(("127.0.0.1", port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        squatter.listen()
        assert not _pid_alive(pid)
        try:
            with pytest.raises(EmbeddedServerError):
                services.revive()
        finally:
            squatter.close()
        # Still this launcher's server to start: the next check starts it.
        assert services.revive() == ["redis"]
        assert services.redis.url == url and services.redis.owned
        client = redis.Redis.from_url(url)
        try:
            assert client.ping()
        finally:
            client.close()

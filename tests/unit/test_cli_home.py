"""The admin commands (`facesearch clients`, `reconcile`, `reindex`) work on the running service's stores,
found through one per-user default whatever the working directory, and never start a store of their own:
without a running service they stop with exit 2 and say where they looked. Real embedded redis-server."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_app.launch.cli import main
from serve_app.launch.embedded import EmbeddedServices
from serve_app.settings import Settings, default_data_dir, development_secret_path


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A per-user data home under tmp_path, nothing else configured, and a working directory elsewhere."""
    for name in list(os.environ):
        if name.startswith("FACESEARCH_") or name in ("REDIS_URL", "MILVUS_URI"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    yield tmp_path / "xdg" / "facesearch"
    assert not any(elsewhere.iterdir()), "a command wrote into its working directory"


def test_the_default_data_dir_does_not_depend_on_the_working_directory(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert Settings().data_dir == default_data_dir() == home
    monkeypatch.chdir(tmp_path)
    assert Settings().data_dir == home
    monkeypatch.delenv("XDG_DATA_HOME")
    assert Settings().data_dir == Path.home() / ".local" / "share" / "facesearch"


@pytest.mark.parametrize(
    "command",
    [["clients", "create", "x"], ["clients", "list"], ["reconcile"], ["reindex", "--tenant", "cl_x"]],
)
def test_without_a_running_service_a_command_stops_and_says_where_it_looked(
    home: Path, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(command) == 2
    error = capsys.readouterr().err
    assert "no running facesearch service" in error and str(home) in error
    assert "facesearch start" in error and "FACESEARCH_DATA_DIR" in error and "REDIS_URL" in error
    assert not home.exists(), "the command made a store or a key of its own"


def test_a_command_uses_the_running_services_redis_and_key(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with EmbeddedServices(home, milvus=False) as service:
        # The service's development key is made by the service, never by a command.
        assert main(["clients", "create", "x"]) == 2
        assert "keys are not in the environment" in capsys.readouterr().err
        assert not development_secret_path(home).exists()

        Settings.from_env()  # as the service's start does: makes the development key
        assert main(["clients", "create", "from-elsewhere"]) == 0
        made = json.loads(capsys.readouterr().out)
        assert main(["clients", "list"]) == 0
        listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [client["client_id"] for client in listed] == [made["client_id"]]
        assert service.redis is not None and service.redis.is_running()  # attached to, left running


def test_a_dead_embedded_server_is_started_again_in_place(tmp_path: Path) -> None:
    """What `facesearch start` does every second for the servers it started: one that died (here
    SIGKILLed) comes back on the same port with the same password, so every client's URL still works."""
    import signal

    import redis

    with EmbeddedServices(tmp_path, milvus=False) as services:
        assert services.redis is not None
        url, pid = services.redis.url, services.redis.pid
        assert services.revive() == []  # alive: nothing to do
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        # As the launcher's loop: checked until the kernel has ended the process, then started again.
        deadline = time.monotonic() + 30
        while not (revived := services.revive()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert revived == ["redis"]
        assert services.redis.url == url and services.redis.pid != pid
        client = redis.Redis.from_url(url)
        try:
            assert client.ping()
        finally:
            client.close()


def test_a_server_whose_lock_outlives_it_a_moment_is_started_again(tmp_path: Path) -> None:
    """A killed redis-server lets go of its data directory's lock only once its last thread, or a child it
    forked to save, has ended: a restart that finds the lock still held by nobody alive takes it once it is
    free, instead of waiting for a server that will never answer. Here another process keeps the lock a
    moment after the kill, as such a child would."""
    import signal
    import subprocess
    import sys

    with EmbeddedServices(tmp_path, milvus=False) as services:
        assert services.redis is not None and services.redis.pid is not None
        url, pid = services.redis.url, services.redis.pid
        lock_path = services.redis.lock_path
        os.kill(pid, signal.SIGKILL)
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import fcntl, os, sys, time\n"
                f"fd = os.open({str(lock_path)!r}, os.O_RDWR)\n"
                "fcntl.flock(fd, fcntl.LOCK_SH)\n"  # blocks until the killed server has let go
                "print('held', flush=True)\n"
                "time.sleep(1.5)\n",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            deadline = time.monotonic() + 30
            while not (revived := services.revive()) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert revived == ["redis"]
            assert services.redis.url == url and services.redis.owned
        finally:
            holder.wait(30)

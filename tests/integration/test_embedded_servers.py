"""The embedded redis-server and milvus-lite that `facesearch start` runs (serve_app.launch.embedded): they
listen on 127.0.0.1 only, a second start attaches to the live ones, and a missing binary is named."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_app.launch.embedded import EmbeddedRedis, EmbeddedServerError, EmbeddedServices


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServices]:
    with EmbeddedServices(tmp_path_factory.mktemp("embedded")) as services:
        yield services


def test_servers_listen_on_loopback_only(servers: EmbeddedServices) -> None:
    if shutil.which("ss") is None:
        pytest.skip("ss is not installed")
    assert servers.redis is not None and servers.milvus is not None
    listing = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    for pid in (servers.redis.pid, servers.milvus.pid):
        sockets = [line.split()[3] for line in listing.splitlines() if f"pid={pid}," in line]
        assert sockets, f"pid {pid} listens nowhere?\n{listing}"
        for address in sockets:
            assert address.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")), address


def test_second_start_reuses_the_live_servers(servers: EmbeddedServices) -> None:
    second = EmbeddedServices(servers.data_dir)
    second.start()
    assert second.redis is not None and second.milvus is not None
    assert (second.redis_url, second.milvus_uri) == (servers.redis_url, servers.milvus_uri)
    assert not second.redis.owned and not second.milvus.owned
    second.stop()  # not its servers: they keep running
    assert servers.redis is not None and servers.redis.is_running()
    assert servers.milvus is not None and servers.milvus.is_running()


def test_missing_redis_binary_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(EmbeddedRedis, "binary", staticmethod(lambda: "/nonexistent/redis-server"))
    with pytest.raises(EmbeddedServerError, match="cannot run"):
        EmbeddedRedis(tmp_path).start()

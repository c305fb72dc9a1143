from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from serve_app.launch.embedded import EmbeddedMilvus
from tests import netns
from tests.milvus_server import MilvusServerProcess
from tests.service_harness import RunningService, running_service


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    """The whole application (Ray Serve on 127.0.0.1, embedded Redis and milvus-lite, real models)."""
    data_dir: Path = tmp_path_factory.mktemp("service-data")
    # A hot window of seconds: results move to the result archive while the session runs, so every test
    # that reads a result later reads it from there (test_result_storage_service checks it directly).
    archiving = {"FACESEARCH_RESULT_HOT_WINDOW_S": "3", "FACESEARCH_RESULT_ARCHIVE_EVERY_S": "1"}
    # The webhook test's receiver listens on 127.0.0.1, which only an operator's explicit allowance admits.
    webhooks = {"FACESEARCH_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1"}
    with running_service(data_dir, env=archiving | webhooks) as running:
        yield running


@dataclass(frozen=True)
class GalleryBackend:
    """A Milvus the gallery store is tested against: `milvus-lite` or `milvus-server`."""

    name: str
    uri: str

    @property
    def server(self) -> bool:
        return self.name == "milvus-server"


@pytest.fixture(scope="session")
def milvus_lite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedMilvus(tmp_path_factory.mktemp("milvus-lite"))
    server.start()
    try:
        yield server.uri
    finally:
        server.stop()


@pytest.fixture(scope="session")
def milvus_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The Milvus server of the `milvus` wheel, in a network namespace of its own joined to this one by a
    veth pair: its gRPC roles listen on every interface, which there means only that veth (and lo)."""
    why = netns.available()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"the Milvus server tests must run in CI: {why}")
        pytest.skip(why)
    tag = os.getpid() % 250
    link = netns.Link(None, f"fsmv{os.getpid() % 100000}", f"10.251.{tag}.1", f"10.251.{tag}.2", prefix=30)
    link.create()
    server = MilvusServerProcess(
        tmp_path_factory.mktemp("milvus-server"), 19530, host=link.address_b, netns=link.b
    )
    try:
        server.start()
        yield server.uri
    finally:
        server.discard()  # its data goes with the session's temporary directory
        link.teardown()


@pytest.fixture(scope="session", params=["milvus-lite", "milvus-server"])
def gallery_backend(request: pytest.FixtureRequest) -> GalleryBackend:
    """Every gallery store test runs on milvus-lite (the default install) and on a Milvus server (where the
    partition key, HNSW and nprobe are real)."""
    name = str(request.param)
    fixture = "milvus_lite" if name == "milvus-lite" else "milvus_server"
    return GalleryBackend(name, str(request.getfixturevalue(fixture)))

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service_harness import RunningService, running_service


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    """The whole application (Ray Serve on 127.0.0.1, embedded Redis and milvus-lite, real models)."""
    data_dir: Path = tmp_path_factory.mktemp("service-data")
    with running_service(data_dir) as running:
        yield running

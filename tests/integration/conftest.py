from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service_harness import RunningService, running_service


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    """The whole application (Ray Serve on 127.0.0.1, embedded Redis and milvus-lite, real models)."""
    data_dir: Path = tmp_path_factory.mktemp("service-data")
    # A hot window of seconds: results move to the result archive while the session runs, so every test
    # that reads a result later reads it from there (test_result_storage_service checks it directly).
    archiving = {"FACESEARCH_RESULT_HOT_WINDOW_S": "3", "FACESEARCH_RESULT_ARCHIVE_EVERY_S": "1"}
    with running_service(data_dir, env=archiving) as running:
        yield running

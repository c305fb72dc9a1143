from __future__ import annotations

import os

# Before any test module imports ray (it reads this at import): keep every local Ray on 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest

from tests.faces_dev import FacesDev, load_faces_dev


@pytest.fixture(scope="session")
def faces_dev() -> FacesDev:
    """Real labelled photos from ../shared/testdata/faces-dev (and, through FacesDev.sibling, the sets next
    to it such as faces-calib); the only way tests get real faces."""
    return load_faces_dev()

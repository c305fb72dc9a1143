from __future__ import annotations

import pytest

from tests.faces_dev import FacesDev, load_faces_dev


@pytest.fixture(scope="session")
def faces_dev() -> FacesDev:
    """Real labelled photos from ../shared/testdata/faces-dev; the only way tests get real faces."""
    return load_faces_dev()

"""The fault tests start, kill, stop and restart their own application. Ray can be initialised only once
per process at a time, so they must not overlap the session-scoped `service` fixture of the other
integration tests: collection moves them in front of the first test that uses that fixture."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def _is_fault_test(item: pytest.Item) -> bool:
    return _HERE in Path(item.path).resolve().parents


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if _is_fault_test(item)]
    if not ours:
        return
    others = [item for item in items if not _is_fault_test(item)]
    first_shared = next(
        (index for index, item in enumerate(others) if "service" in getattr(item, "fixturenames", ())),
        len(others),
    )
    items[:] = others[:first_shared] + ours + others[first_shared:]

"""`facesearch clients update` over a fake client store (the Redis store is covered in integration)."""

from __future__ import annotations

import asyncio
import json

import pytest

from serve_app.launch.cli import _update_client, _update_service_default
from tests.unit.fakes import FakeClientStore


def test_update_sets_keeps_and_clears_the_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    async def scenario() -> None:
        clients = FakeClientStore()
        info, _ = await clients.create("tenant")
        assert await _update_client(clients, info.client_id, "0.62", "3") == 0
        shown = json.loads(capsys.readouterr().out)
        assert (shown["min_score"], shown["max_matches"]) == (0.62, 3)
        assert await _update_client(clients, info.client_id, None, "5") == 0  # min score kept
        stored = await clients.get(info.client_id)
        assert stored is not None and (stored.min_score, stored.max_matches) == (0.62, 5)
        assert await _update_client(clients, info.client_id, "default", None) == 0
        stored = await clients.get(info.client_id)
        assert stored is not None and (stored.min_score, stored.max_matches) == (None, 5)
        assert await _update_client(clients, info.client_id, None, "default") == 0
        stored = await clients.get(info.client_id)
        assert stored is not None and (stored.min_score, stored.max_matches) == (None, None)

        for bad in (("1.5", None), ("x", None), (None, "0"), (None, "1000")):
            assert await _update_client(clients, info.client_id, *bad) == 2
        assert await _update_client(clients, "cl_unknown", "0.5", None) == 1
        stored = await clients.get(info.client_id)
        assert stored is not None and (stored.min_score, stored.max_matches) == (None, None)

    asyncio.run(scenario())


def test_update_default_sets_and_clears_the_service_wide_minimum_score(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def scenario() -> None:
        clients = FakeClientStore()
        info, _ = await clients.create("tenant")
        assert await _update_service_default(clients, "0.45", None, None) == 0
        assert json.loads(capsys.readouterr().out) == {"service_default": {"min_score": 0.45}}
        assert await clients.default_min_score() == 0.45
        assert await clients.get(info.client_id) == info  # no client changed
        for bad in (("1.5", None, None), ("x", None, None), (None, None, None), ("0.5", "3", None)):
            assert await _update_service_default(clients, *bad) == 2
        assert await clients.default_min_score() == 0.45
        assert await _update_service_default(clients, "default", None, None) == 0
        assert await clients.default_min_score() is None

    asyncio.run(scenario())

"""serve_app/api/console.py: the console's files and headers, without the service."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from serve_app.api import console


def test_console_is_served_with_its_policy() -> None:
    app = FastAPI()
    console.mount_console(app, public_base_url="https://faces.example.org/api")

    async def fetch() -> tuple[httpx.Response, httpx.Response]:
        # httpx over ASGI (Starlette's TestClient on httpx is deprecated, and warnings are errors here).
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.get("/console/"), await client.get("/console/app.js")

    page, script = asyncio.run(fetch())
    assert page.status_code == 200 and '<script src="app.js"' in page.text
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    for response in (page, script):
        policy = response.headers["content-security-policy"]
        assert "img-src 'self' blob: https://faces.example.org;" in policy
        assert "script-src 'self';" in policy and "connect-src 'self';" in policy
        assert response.headers["x-content-type-options"] == "nosniff"


def test_policy_without_a_public_base_url_allows_only_the_service() -> None:
    policy = console.content_security_policy(None)
    assert "img-src 'self' blob:;" in policy
    assert "http" not in policy


def test_missing_files_stop_the_mount_with_a_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(console, "CONSOLE_DIR", tmp_path)
    with pytest.raises(RuntimeError, match="console files missing"):
        console.mount_console(FastAPI())

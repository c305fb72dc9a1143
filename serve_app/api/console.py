"""The operator console: plain static files (HTML, JS, CSS) shipped in the package and served by the ingress
at /console. It is a client of the public API like any other (it signs in with client credentials and calls
the same endpoints), so it needs no server code of its own beyond serving these files with strict headers."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from fastapi import FastAPI
from starlette.datastructures import MutableHeaders
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONSOLE_PATH = "/console"
CONSOLE_DIR = Path(__file__).with_name("console_static")


def content_security_policy(public_base_url: str | None = None) -> str:
    """Same origin only, no inline script or style: whatever a stored client_reference contains, it can
    never run as code. Proof images may come from the public base URL when one is configured (a proxy's
    origin), and the preview of a chosen photo is a blob: URL made in the page."""
    images = ["'self'", "blob:"]
    if public_base_url:
        parts = urlsplit(public_base_url)
        if parts.scheme and parts.netloc:
            images.append(f"{parts.scheme}://{parts.netloc}")
    return "; ".join(
        (
            "default-src 'none'",
            "script-src 'self'",
            "style-src 'self'",
            f"img-src {' '.join(images)}",
            "connect-src 'self'",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        )
    )


class _SecurityHeaders:
    """Adds the console's security headers to every response of the wrapped app."""

    def __init__(self, app: ASGIApp, policy: str) -> None:
        self._app = app
        self._headers = {
            "Content-Security-Policy": policy,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            # The files change with the package; revalidating is cheap (StaticFiles answers 304).
            "Cache-Control": "no-cache",
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in self._headers.items():
                    headers[name] = value
            await send(message)

        await self._app(scope, receive, send_with_headers)


def mount_console(app: FastAPI, public_base_url: str | None = None) -> None:
    """Serve the console at /console/ (index.html for the directory)."""
    if not (CONSOLE_DIR / "index.html").is_file():
        raise RuntimeError(f"console files missing from {CONSOLE_DIR}: reinstall the package")
    files = StaticFiles(directory=CONSOLE_DIR, html=True)
    app.mount(CONSOLE_PATH, _SecurityHeaders(files, content_security_policy(public_base_url)), name="console")

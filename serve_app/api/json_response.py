"""The API's one JSON response class: Starlette's JSONResponse, rendered by orjson.

orjson writes the same compact UTF-8 JSON as Starlette's json.dumps settings, several times faster, which
counts on a path every request takes. Content orjson refuses (an integer beyond 64 bits, a non-string key)
falls back to Starlette's own rendering, so the wire format never depends on which encoder ran.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import JSONResponse as StarletteJSONResponse


class JSONResponse(StarletteJSONResponse):
    def render(self, content: Any) -> bytes:
        try:
            return orjson.dumps(content)
        except TypeError:
            return super().render(content)

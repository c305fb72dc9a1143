"""What a response must never carry: the words of the backends behind the service (issue 10, item 3)."""

from __future__ import annotations

import re
from collections.abc import Iterable

# Redis replies and redis-py/socket/pymilvus/grpc exception text, and the way they name hosts.
BACKEND_TEXT = re.compile(
    r"WRONGTYPE|NOAUTH|MISCONF|OOM command|LOADING|NOGROUP|BUSYGROUP|Connection refused|ConnectionError"
    r"|TimeoutError|ResponseError|RedisError|Error \d+ connecting|redis\.|Redis is|Milvus is|MilvusException"
    r"|pymilvus|grpc|StatusCode\.|Traceback|127\.0\.0\.1|localhost",
    re.IGNORECASE,
)


def assert_no_backend_text(text: str, ports: Iterable[int] = ()) -> None:
    found = BACKEND_TEXT.search(text)
    assert found is None, f"backend text {found.group(0)!r} in a response: {text}"
    for port in ports:
        assert not re.search(rf"(?<!\d){port}(?!\d)", text), f"backend port {port} in a response: {text}"

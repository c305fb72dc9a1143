"""Private network namespaces for tests that need a second host (needs root, as CI runs).

A namespace has `lo` and one end of a veth pair, nothing else: servers in it that listen on every interface
(Ray, the Milvus server's gRPC roles) are reachable only through that veth. `teardown()` ends every process
still in the namespace (by `ip netns pids`, never by name) and deletes it, which also removes the veth.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def available() -> str:
    """Why namespaces cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if subprocess.run(["ip", "-V"], capture_output=True).returncode != 0:
        return "iproute2 (`ip`) is missing"
    return ""


def pids(namespace: str) -> list[int]:
    result = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(pid) for pid in result.stdout.split()] if result.returncode == 0 else []


def kill_all(namespace: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in `namespace` until none is left (a dying parent may fork once more)."""
    deadline = time.monotonic() + timeout_s
    while (left := pids(namespace)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


@dataclass
class Link:
    """Namespace `a` (or the root namespace when `a` is None) joined to namespace `b` by one veth pair."""

    a: str | None
    b: str
    address_a: str
    address_b: str
    prefix: int = 24

    def create(self) -> None:
        names = [name for name in (self.a, self.b) if name]
        for name in names:
            self.teardown_namespace(name)  # a leftover of a crashed run
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        end_a, end_b = f"v{self.b}a"[:15], f"v{self.b}b"[:15]
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", end_a)  # a root-side leftover
        if self.a:
            _ip("link", "add", end_a, "netns", self.a, "type", "veth", "peer", "name", end_b, "netns", self.b)
            _ip("-n", self.a, "addr", "add", f"{self.address_a}/{self.prefix}", "dev", end_a)
            _ip("-n", self.a, "link", "set", end_a, "up")
        else:
            _ip("link", "add", end_a, "type", "veth", "peer", "name", end_b, "netns", self.b)
            _ip("addr", "add", f"{self.address_a}/{self.prefix}", "dev", end_a)
            _ip("link", "set", end_a, "up")
        _ip("-n", self.b, "addr", "add", f"{self.address_b}/{self.prefix}", "dev", end_b)
        _ip("-n", self.b, "link", "set", end_b, "up")

    @staticmethod
    def teardown_namespace(name: str) -> None:
        kill_all(name)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "del", name)

    def teardown(self) -> None:
        for name in (self.b, self.a):
            if name:
                self.teardown_namespace(name)
        if not self.a:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("link", "del", f"v{self.b}a"[:15])

"""A real Milvus server for tests: the standalone binary that the `milvus` wheel (2.3.5, a dev extra) ships,
started by the wheel's own launcher with every role pinned to one address.

- `MilvusServerProcess` runs this module as a child (`python -m tests.milvus_server`), optionally inside a
  network namespace (`ip netns exec NAME`), and stops it cleanly: the child releases the loaded collections
  before SIGTERM (a loaded collection can hang the server's shutdown), then stops the binary.
- The binary (~250 MB unpacked from the wheel's .lzma) is unpacked once into a shared cache directory and
  linked into each data directory.
- Roles advertise `host` (they default to the first non-loopback address), and the launcher probes its ports
  on 127.0.0.1; the gRPC ports listen on every interface of the namespace, so run a server that must not be
  reachable from elsewhere in the root namespace only on a machine without other interfaces, or in a
  namespace of its own.
- One server per network namespace: its embedded etcd's peer port is fixed.
- `settings` overrides keys of milvus.yaml that the wheel's template does not expose (e.g.
  `dataCoord.gc.dropTolerance`), through the environment: Milvus reads a variable named like the key
  (case, dots and underscores ignored) over its config file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

ROLES = ("rootCoord", "proxy", "queryCoord", "queryNode", "indexNode", "dataCoord", "dataNode")
START_TIMEOUT_S = 120.0
BIN_CACHE = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "facesearch" / "milvus-server-bin"
)


class MilvusServerProcess:
    """A Milvus server for the duration of a test (a context manager)."""

    def __init__(
        self,
        data_dir: Path,
        port: int,
        *,
        host: str = "127.0.0.1",
        netns: str | None = None,
        settings: Mapping[str, str | int | float] | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.port = port
        self.host = host
        self.netns = netns
        self.settings = dict(settings or {})
        self._process: subprocess.Popen[str] | None = None
        self.binary_pid: int | None = None

    @property
    def uri(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "tests.milvus_server", "--data", str(self.data_dir),
                   "--port", str(self.port), "--host", self.host]  # fmt: skip
        if self.netns:
            command = ["ip", "netns", "exec", self.netns, *command]
        log = (self.data_dir / "launcher.log").open("w")
        env = {**os.environ, **{key.replace(".", "_").upper(): str(v) for key, v in self.settings.items()}}
        self._process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
            cwd=Path(__file__).resolve().parent.parent,
        )  # fmt: skip
        assert self._process.stdout is not None
        line = self._process.stdout.readline()  # "ready <binary pid>" or EOF on failure
        if not line.startswith("ready "):
            self.stop()
            log_text = (self.data_dir / "launcher.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the Milvus server did not start:\n{log_text}")
        self.binary_pid = int(line.split()[1])

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.binary_pid is not None:  # the launcher died without stopping the binary
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.binary_pid, signal.SIGKILL)
            self.binary_pid = None

    def discard(self) -> None:
        """Kill the server at once, for one whose data directory is thrown away with it: a clean stop
        (releasing every collection, then Milvus' own graceful shutdown) takes up to half a minute."""
        process, self._process = self._process, None
        for pid in (self.binary_pid, process.pid if process is not None else None):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.binary_pid = None
        if process is not None:
            process.wait()

    def __enter__(self) -> MilvusServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _release_all(uri: str) -> None:
    from pymilvus import MilvusClient

    client = MilvusClient(uri=uri, timeout=10)
    try:
        for name in client.list_collections():
            with contextlib.suppress(Exception):
                client.release_collection(name, timeout=10)
    finally:
        client.close()


def _serve(data_dir: Path, port: int, host: str) -> int:
    from milvus import MilvusServer, MilvusServerConfig

    BIN_CACHE.mkdir(parents=True, exist_ok=True)
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    if not (data_dir / "bin").exists():
        (data_dir / "bin").symlink_to(BIN_CACHE, target_is_directory=True)
    config = MilvusServerConfig(data_dir=str(data_dir), proxy_port=port)
    for role in ROLES:
        config.set(f"{role}.ip", host)
    server = MilvusServer(config, wait_for_started=False)
    stopping = threading.Event()

    def on_term(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    server.start()
    try:
        server.wait_started(timeout=START_TIMEOUT_S * 1000)
        print(f"ready {server.server_proc.pid}", flush=True)
        while not stopping.wait(0.5):
            if server.server_proc.poll() is not None:
                print("the Milvus binary exited", file=sys.stderr)
                return 1
        with contextlib.suppress(Exception):
            _release_all(f"http://127.0.0.1:{port}")
    finally:
        proc = server.server_proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            deadline = time.monotonic() + 15
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for handle in server.proc_fds.values():
            handle.close()
        server.server_proc = None  # the wheel's __del__ would stop it again
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    return _serve(args.data, args.port, args.host)


if __name__ == "__main__":
    sys.exit(main())

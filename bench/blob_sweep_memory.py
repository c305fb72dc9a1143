"""Peak memory of one orphaned-blob sweep against the number of proofs in the gallery.

    python -m bench.blob_sweep_memory [--sizes 10000 100000 1000000] [--orphans 0.01]
                                      [--before-tree DIR] [--work-dir DIR]

For each size N: N enrolled faces, each a FaceRecord in an embedded redis-server (127.0.0.1; written with
RedisFaceRecordStore.put, spread over 10 tenants) and its proof in a file blob store (a dummy 1-byte image
in the store's own layout), plus N x --orphans uploads that nothing owns. Then one sweep runs in a fresh
Python process (pipelines/blob_sweep.py, pages of 1,000 blobs, grace 0 so every blob is a candidate) and
reports its resident memory once its modules are loaded and its clients connected ("RSS before") and its
peak (VmHWM) at the end, and how many blobs it removed (the orphans).

--before-tree: a checkout of an earlier tree (e.g. `git archive <commit> | tar -x -C DIR`) whose sweep
gathered every proof key first (reconcile._proof_keys, then LocalBlobStore.sweep with that set); its
sweep runs on the same data in a fresh process too, so both rows of a size come from the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import format_table, scratch_redis
from serve_app.domain.faces import FaceRecord
from serve_app.domain.transactions import new_reference_id, upload_key
from serve_app.pipelines.processing import enrolled_face_id
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis

TENANTS = [f"cl_{n:024d}" for n in range(10)]
PUT_CONCURRENCY = 500

# The sweep of the earlier tree, run with that tree first on sys.path: every proof key in a set, then the
# directory walk that keeps the keys of that set.
_BEFORE = """
import asyncio, json, sys, time
from serve_app.pipelines.reconcile import _proof_keys
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_transactions import RedisTransactionStore

def status_kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))

async def main(url, prefix, directory):
    redis = connect_redis(url)
    records = RedisFaceRecordStore(redis, prefix=prefix)
    transactions = RedisTransactionStore(redis, prefix=prefix)
    blobs = LocalBlobStore(directory)
    await redis.ping()
    before = status_kib("VmRSS")
    started = time.perf_counter()
    keep = await transactions.image_keys_in_flight()
    keep |= await _proof_keys(records)
    removed = await blobs.sweep(keep, 0.0)
    seconds = time.perf_counter() - started
    await redis.aclose()
    print(json.dumps({"before_kib": before, "peak_kib": status_kib("VmHWM"), "removed": removed,
                      "seconds": seconds}))

asyncio.run(main(*sys.argv[1:4]))
"""


def status_kib(field: str) -> int:
    """VmRSS (resident now) or VmHWM (the peak of this process image: unlike ru_maxrss, not inherited from
    the parent that forked it) in KiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


async def sweep_child(url: str, prefix: str, directory: str) -> None:
    """One sweep of this tree in this (fresh) process; prints its measurements as JSON."""
    from serve_app.pipelines.blob_sweep import BlobSweep, SweepReport
    from serve_app.stores.redis_transactions import RedisTransactionStore

    redis = connect_redis(url)
    records = RedisFaceRecordStore(redis, prefix=prefix)
    sweep = BlobSweep(LocalBlobStore(directory), records, RedisTransactionStore(redis, prefix=prefix), 0.0)
    await redis.ping()
    before = status_kib("VmRSS")
    started = time.perf_counter()
    report = SweepReport()

    async def checkpoint(cursor: str) -> None:
        return None  # no lease here: the sweep alone is measured

    await sweep.run(None, checkpoint, report)
    seconds = time.perf_counter() - started
    await redis.aclose()
    peak = status_kib("VmHWM")
    print(json.dumps({"before_kib": before, "peak_kib": peak, "removed": report.removed, "seconds": seconds}))


async def populate(url: str, prefix: str, store: LocalBlobStore, size: int, orphans: int) -> None:
    redis = connect_redis(url, max_connections=PUT_CONCURRENCY)
    records = RedisFaceRecordStore(redis, prefix=prefix)
    limit = asyncio.Semaphore(PUT_CONCURRENCY)

    def write_blob(key: str) -> None:
        # The store's own layout, without its per-file fsync (a million files on a shared disk).
        path = store._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
        path.with_suffix(".type").write_text(f"image/jpeg\n{key}")

    async def enrol(index: int) -> None:
        reference_id = new_reference_id()
        tenant = TENANTS[index % len(TENANTS)]
        key = upload_key(tenant, reference_id)
        write_blob(key)
        if index >= size:
            return  # an orphan: no record, no transaction
        record = FaceRecord(
            enrolled_face_id(reference_id), tenant, None, key, "bench", time.time(), reference_id
        )
        async with limit:
            await records.put(record)

    for start in range(0, size + orphans, 10_000):
        await asyncio.gather(*(enrol(index) for index in range(start, min(size + orphans, start + 10_000))))
    await redis.aclose()


def run_child(command: list[str], env: dict[str, str], cwd: str) -> dict[str, float]:
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"sweep failed: {done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--orphans", type=float, default=0.01, help="orphaned uploads, as a share of N")
    parser.add_argument("--before-tree", type=Path, help="an earlier checkout whose sweep to run as well")
    parser.add_argument("--work-dir", type=Path, help="where the blob directories go (default: a temp dir)")
    parser.add_argument("--child", nargs=3, metavar=("URL", "PREFIX", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        asyncio.run(sweep_child(*args.child))
        return

    here = str(Path(__file__).resolve().parent.parent)
    rows: list[list[str]] = []
    with scratch_redis() as url, tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        for size in args.sizes:
            prefix = f"b{uuid.uuid4().hex[:8]}:"
            directory = Path(work) / f"blobs-{size}"
            store = LocalBlobStore(directory)
            orphans = int(size * args.orphans)
            started = time.perf_counter()
            asyncio.run(populate(url, prefix, store, size, orphans))
            print(
                f"{size:,} proofs + {orphans:,} orphans written in {time.perf_counter() - started:.0f} s",
                flush=True,
            )
            command = [
                sys.executable,
                "-m",
                "bench.blob_sweep_memory",
                "--child",
                url,
                prefix,
                str(directory),
            ]
            runs = [("this tree", command, {**os.environ, "PYTHONPATH": here}, here)]
            if args.before_tree is not None:
                tree = str(args.before_tree.resolve())
                command = [sys.executable, "-c", _BEFORE, url, prefix, str(directory)]
                runs.append(("before", command, {**os.environ, "PYTHONPATH": tree}, tree))
            for number, (name, command, env, cwd) in enumerate(runs):
                if number:
                    # The sweep before removed the orphans: new ones, so each run has the same work.
                    asyncio.run(populate(url, prefix, store, 0, orphans))
                measured = run_child(command, env, cwd)
                rows.append(
                    [
                        f"{size:,}",
                        name,
                        f"{measured['before_kib'] / 1024:.0f}",
                        f"{measured['peak_kib'] / 1024:.0f}",
                        f"{(measured['peak_kib'] - measured['before_kib']) / 1024:.0f}",
                        f"{int(measured['removed']):,}",
                        f"{measured['seconds']:.0f}",
                    ]
                )
                print(format_table(HEADER, rows[-1:]), flush=True)
            shutil.rmtree(directory)
    print()
    print(format_table(HEADER, rows))


HEADER = ["proofs", "sweep", "RSS before (MiB)", "peak RSS (MiB)", "growth (MiB)", "removed", "seconds"]

if __name__ == "__main__":
    main()

"""bench.service_stages: its probe, loaded as sitecustomize by a fresh Python process as the service's
processes load it, counts what asyncio.to_thread runs and writes the process's snapshot; the table's
arithmetic turns two snapshots into CPU per transaction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.service_stages import PROBE_DIR, Snapshot, rows_for

_PROGRAM = """
import asyncio

def burn(rounds):
    total = 0
    for value in range(rounds):
        total += value * value
    return total

async def main():
    await asyncio.to_thread(burn, 200_000)
    await asyncio.to_thread(burn, 200_000)
    await asyncio.sleep(1.5)  # the probe writes twice a second; the executor's threads are still there

asyncio.run(main())
"""


def _run_probed(out_dir: Path, probe_dir: str | None) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(PROBE_DIR), os.environ.get("PYTHONPATH")) if p),
    }
    if probe_dir is None:
        env.pop("FACESEARCH_STAGE_PROBE_DIR", None)
    else:
        env["FACESEARCH_STAGE_PROBE_DIR"] = probe_dir
    return subprocess.run(
        [sys.executable, "-c", _PROGRAM], env=env, cwd=out_dir, capture_output=True, text=True, check=True
    )


def test_the_probe_counts_each_to_thread_call_and_the_threads_cpu(tmp_path: Path) -> None:
    _run_probed(tmp_path, str(tmp_path))
    snapshots = list(tmp_path.glob("*.json"))
    assert len(snapshots) == 1
    data = json.loads(snapshots[0].read_text())
    calls, cpu = data["steps"]["__main__:burn"]
    assert calls == 2
    assert cpu > 0
    assert "MainThread" in data["threads_cpu_s"]
    assert any(
        name.startswith("asyncio") or name.startswith("ThreadPoolExecutor") for name in data["threads_cpu_s"]
    )
    assert data["process_cpu_s"] >= cpu


def test_without_its_directory_the_probe_does_nothing(tmp_path: Path) -> None:
    result = _run_probed(tmp_path, None)
    assert result.returncode == 0
    assert list(tmp_path.iterdir()) == []


def test_rows_are_per_transaction_differences_and_the_rest_is_outside_python_threads() -> None:
    before = Snapshot(
        10.0, {"AsyncIO Thread: default": 1.0, "ThreadPoolExecutor-0": 2.0}, {"m:decode": (5, 0.5)}
    )
    after = Snapshot(
        14.0,
        {"AsyncIO Thread: default": 2.0, "ThreadPoolExecutor-0": 4.5},
        {"m:decode": (105, 2.5), "m:search": (50, 0.2)},
    )
    rows = rows_for("TransactionWorker", before, after, transactions=100)
    by_where = {row[1]: row[2:] for row in rows}
    assert by_where["step m:decode"] == ["1.00", "20.00"]
    assert by_where["step m:search"] == ["0.50", "2.00"]
    assert by_where["thread AsyncIO Thread: default"] == ["", "10.00"]
    assert by_where["thread ThreadPoolExecutor-0"] == ["", "25.00"]
    # 4 s of process CPU, 3.5 s of it in Python threads.
    assert by_where["outside Python threads (Ray core, gRPC, ...)"] == ["", "5.00"]
    assert by_where["process total"] == ["", "40.00"]

"""The CPU probe of bench.service_stages, loaded by Python at start-up in every process of the service that
benchmark starts (it puts this directory first on PYTHONPATH, and Ray's workers inherit the variable).

When FACESEARCH_STAGE_PROBE_DIR is set, every call handed to asyncio.to_thread (decoding, the model runs,
Milvus, file I/O: the blocking steps of the ingress and the worker) has its thread CPU added up under the
callable's name, and twice a second the process writes `<pid>.json` there: those sums with their call
counts, the CPU of each Python thread by thread name (the event loop's, the executor's), and the whole
process's CPU, so what runs outside Python threads (Ray's core worker, gRPC) is the rest. Self-contained
(no import of the project), so it loads in Ray's own Python daemons too, where it only writes its file.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

_Result = TypeVar("_Result")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_DUMP_INTERVAL_S = 0.5


def _callable_name(function: Callable[..., Any]) -> str:
    while isinstance(function, functools.partial):
        function = function.func
    return f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', repr(function))}"


def _cpu_seconds(stat_path: str) -> float:
    """utime + stime from a /proc stat file (fields 14 and 15, counted after the command name)."""
    with open(stat_path) as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


class _Probe:
    def __init__(self, out_dir: Path) -> None:
        self._out = out_dir / f"{os.getpid()}.json"
        self._lock = threading.Lock()
        self._steps: dict[str, list[float]] = {}  # name -> [calls, thread CPU seconds]

    def install(self) -> None:
        plain_to_thread = asyncio.to_thread

        async def to_thread(function: Callable[..., _Result], /, *args: Any, **kwargs: Any) -> _Result:
            name = _callable_name(function)

            def timed() -> _Result:
                started = time.thread_time()
                try:
                    return function(*args, **kwargs)
                finally:
                    spent = time.thread_time() - started
                    with self._lock:
                        step = self._steps.setdefault(name, [0.0, 0.0])
                        step[0] += 1
                        step[1] += spent

            return await plain_to_thread(timed)

        asyncio.to_thread = to_thread
        threading.Thread(target=self._dump_forever, name="stage-probe", daemon=True).start()

    def _threads(self) -> dict[str, float]:
        by_name: dict[str, float] = {}
        for thread in threading.enumerate():
            if thread.native_id is None:
                continue
            # Executor threads are numbered; one row for each pool is enough.
            name = (
                thread.name.rsplit("_", 1)[0] if thread.name.startswith("ThreadPoolExecutor") else thread.name
            )
            try:
                spent = _cpu_seconds(f"/proc/self/task/{thread.native_id}/stat")
            except OSError:
                continue  # ended meanwhile
            by_name[name] = by_name.get(name, 0.0) + spent
        return by_name

    def _dump_forever(self) -> None:
        while True:
            time.sleep(_DUMP_INTERVAL_S)
            with self._lock:
                steps = {name: list(step) for name, step in self._steps.items()}
            snapshot = {
                "written_at": time.time(),
                "process_cpu_s": _cpu_seconds("/proc/self/stat"),
                "threads_cpu_s": self._threads(),
                "steps": steps,
            }
            partial = self._out.with_suffix(".tmp")
            partial.write_text(json.dumps(snapshot))
            partial.replace(self._out)


if _probe_dir := os.environ.get("FACESEARCH_STAGE_PROBE_DIR"):
    _Probe(Path(_probe_dir)).install()

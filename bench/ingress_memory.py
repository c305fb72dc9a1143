"""Memory of each replica of the running service, the ingress' above all (issue 13: the ingress must not load
model libraries).

    python -m bench.ingress_memory [--topology split]

Starts the service as the tests do (127.0.0.1, embedded Redis and milvus-lite, a temporary data dir), makes
a few calls so the ingress has served requests, then prints the resident (RSS) and unique (USS) memory of
every Serve replica among this process' descendants (other Ray clusters on the machine are not counted).
Linux only.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read by ray at import: stay on 127.0.0.1

import argparse
import re
import tempfile
from pathlib import Path

import psutil

from bench.common import format_table
from tests.service_harness import running_service

_REPLICA = re.compile(r"ServeReplica:[^:]+:(\w+)")
_MIB = 1024 * 1024


def replica_memory() -> list[list[str]]:
    rows: list[list[str]] = []
    for process in psutil.Process().children(recursive=True):
        try:
            match = _REPLICA.search(" ".join(process.cmdline()))
            if match is None:
                continue
            info = process.memory_full_info()
        except psutil.Error:
            continue  # ended between the listing and the read
        modules = "cv2/onnxruntime/dlib mapped" if _maps_model_libraries(process) else "no model library"
        rows.append([match.group(1), f"{info.rss / _MIB:.0f}", f"{info.uss / _MIB:.0f}", modules])
    return sorted(rows)


def _maps_model_libraries(process: psutil.Process) -> bool:
    try:
        paths = {region.path for region in process.memory_maps()}
    except psutil.Error:
        return False
    return any(re.search(r"/(cv2|onnxruntime|_dlib_pybind11)", path) for path in paths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--topology", choices=("in_process", "split"), default="in_process")
    args = parser.parse_args()
    # in_process: the default config (config/serve.yaml), as `facesearch start` runs it.
    app_args = None if args.topology == "in_process" else {"topology": args.topology}
    with (
        tempfile.TemporaryDirectory() as data_dir,
        running_service(Path(data_dir), app_args) as service,
    ):
        token = service.token_for(service.new_client("bench"))
        with service.http() as http:
            for _ in range(20):  # unknown ids: each call still authenticates, parses and reads Redis
                http.post(
                    "/result", headers={"Authorization": f"Bearer {token}"}, json={"reference_id": "x" * 32}
                )
        print(format_table(["replica", "RSS MiB", "USS MiB", "maps"], replica_memory()))


if __name__ == "__main__":
    main()

"""ONNX Runtime session settings against the in-process pipeline: one row per setting, one run.

    python -m bench.ort_settings [--rounds 3] [--variants default threads-1 ...]

Each row is bench.service's fair in-process rate (decode the uploaded bytes as the worker does, then the
models the transaction needs, in batches of 16) on the dev identity photos (face search: detect + both
descriptors) and age crops (age estimation: detect + age), with every model session built with that
setting: images/s (best of --rounds) and the models' own CPU per image (decoding excluded). The default
row is what ModelConfig() gives with 2 intra-op threads, as the benchmarks and shipped configs run.
On a shared box the CPU column is the steadier one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from bench.common import format_table
from bench.service import in_process_rate
from models.analyzer import ModelConfig
from models.sessions import SessionOptions
from tests.faces_dev import load_faces_dev

VARIANTS: dict[str, dict[str, Any]] = {
    "default (2 threads)": {},
    "threads-1": {"intra_op_threads": 1},
    "spinning": {"allow_spinning": True},
    "extended-optimisation": {"graph_optimization": "extended"},
    "basic-optimisation": {"graph_optimization": "basic"},
    "parallel-executor": {"execution_mode": "parallel", "inter_op_threads": 2},
}


@dataclasses.dataclass(frozen=True)
class VariantConfig(ModelConfig):
    """ModelConfig whose sessions carry the variant's settings."""

    overrides: tuple[tuple[str, Any], ...] = ()

    def session_options(self, gpu_run_size: int = 0) -> SessionOptions:
        return dataclasses.replace(super().session_options(gpu_run_size), **dict(self.overrides))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    dev = load_faces_dev()
    workloads = {
        "faces": [image.path for image in dev.of_kind("identity")],
        "ages": [image.path for image in dev.of_kind("age")],
    }
    rows = []
    for name in args.variants:
        config = VariantConfig(intra_op_threads=2, overrides=tuple(VARIANTS[name].items()))
        cells = []
        for workload, paths in workloads.items():
            rate = in_process_rate(paths, workload, 2, args.rounds, config)
            cells += [f"{rate.images_per_s:.1f}", f"{rate.model_cpu_ms:.1f}"]
        rows.append([name, *cells, f"{os.getloadavg()[0]:.1f}"])
    header = ["setting", "faces img/s", "faces CPU ms/img", "ages img/s", "ages CPU ms/img", "load (1 min)"]
    print(format_table(header, rows))


if __name__ == "__main__":
    main()

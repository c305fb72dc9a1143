"""The one reader of the shared labelled dev photos (../shared/testdata/faces-dev).

The photos are for internal testing only and are never copied into this repository; set FACES_DEV_DIR to
point elsewhere. Benchmarks import this module too, so every consumer reads labels the same way.
"""

from __future__ import annotations

import csv
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO_ROOT.parent / "shared" / "testdata" / "faces-dev"


@dataclass(frozen=True)
class LabelledImage:
    path: Path
    kind: str  # identity | age | negative | group
    identity: str | None
    age: int | None
    n_faces: int | None


@dataclass(frozen=True)
class FacesDev:
    root: Path
    images: tuple[LabelledImage, ...]

    def of_kind(self, kind: str) -> list[LabelledImage]:
        return [image for image in self.images if image.kind == kind]

    def sibling(self, name: str) -> FacesDev:
        """Another shared photo set next to this one with the same labels.csv columns (faces-calib: the
        calibration set, read where it is, never copied into the repository)."""
        return load_faces_dev(self.root.parent / name)

    def by_identity(self) -> dict[str, list[LabelledImage]]:
        groups: dict[str, list[LabelledImage]] = defaultdict(list)
        for image in self.of_kind("identity"):
            assert image.identity is not None
            groups[image.identity].append(image)
        return dict(sorted(groups.items()))


def faces_dev_dir() -> Path:
    return Path(os.environ.get("FACES_DEV_DIR", str(DEFAULT_DIR)))


def load_faces_dev(root: Path | None = None) -> FacesDev:
    root = root or faces_dev_dir()
    labels = root / "labels.csv"
    if not labels.is_file():
        raise FileNotFoundError(f"labelled dev photos not found at {root} (set FACES_DEV_DIR)")
    images = []
    with labels.open(newline="") as handle:
        for row in csv.DictReader(handle):
            images.append(
                LabelledImage(
                    path=root / row["file"],
                    kind=row["kind"],
                    identity=row["identity"] or None,
                    age=int(row["age"]) if row["age"] else None,
                    n_faces=int(row["n_faces"]) if row["n_faces"] else None,
                )
            )
    return FacesDev(root=root, images=tuple(images))

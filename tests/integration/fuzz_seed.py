"""The seed of every hypothesis-driven test against the running service.

CI runs one fixed seed: a run is reproducible, and a green run means the same examples passed as last
time. `make fuzz-random` sets FACESEARCH_FUZZ_SEED=random to explore new examples; each test prints the
seed it used, and FACESEARCH_FUZZ_SEED=<that seed> replays it.
"""

from __future__ import annotations

import os
import random

FIXED_SEED = 20261123


def fuzz_seed() -> int:
    raw = os.environ.get("FACESEARCH_FUZZ_SEED", "").strip()
    if raw == "random":
        return random.SystemRandom().randrange(2**32)
    return int(raw) if raw else FIXED_SEED

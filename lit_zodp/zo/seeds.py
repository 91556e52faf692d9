"""Per-step perturbation seeds derived from (run seed, step, direction index).

The directions are public randomness: every DDP rank derives the same seed without communication,
and a resumed run regenerates the same directions. They never share a stream with the DP noise.
"""

from __future__ import annotations

import numpy as np


def derive_seed(run_seed: int, step: int, direction: int = 0) -> int:
    """A well-mixed 63-bit seed for direction ``direction`` of step ``step`` (SeedSequence hashing)."""
    state = np.random.SeedSequence([int(run_seed), int(step), int(direction)]).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1]))

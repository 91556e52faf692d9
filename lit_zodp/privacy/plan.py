"""A step plan: what one training step of an algorithm releases about its batch.

Each algorithm declares its plan once; calibration, the ledger and the logged epsilon all derive
from it. A plan is a list of Gaussian releases on the same batch, each with an L2 sensitivity in
units of the clip ``C`` (add/remove one example) and a noise std in units of ``sigma * C``.
Releases on one batch compose into one Gaussian mechanism (Dong, Roth & Su's mu-GDP:
``mu = sqrt(sum_i mu_i^2)`` with ``mu_i = sensitivity_i / (sigma * noise_i)``), which is then
subsampled by the sampling description.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lit_zodp.errors import check_positive, raise_if_any


@dataclass(frozen=True)
class GaussianRelease:
    """One Gaussian release per step.

    Args:
        name: what is released (``release(..., name)`` must use it).
        sensitivity: L2 sensitivity of the clipped sum, in units of ``C`` (``sqrt(k)`` for ``k``
            coordinates each clipped to ``C``).
        noise: noise std in units of ``sigma * C``.
    """

    name: str
    sensitivity: float = 1.0
    noise: float = 1.0

    def __post_init__(self) -> None:
        raise_if_any([check_positive(f"sensitivity of release {self.name!r}", self.sensitivity),
                      check_positive(f"noise of release {self.name!r}", self.noise)])


StepPlan = tuple[GaussianRelease, ...]


def composed_multiplier(plan: StepPlan, sigma: float) -> float:
    """Noise multiplier of the one Gaussian that all of a step's releases compose into."""
    if not plan:
        raise ValueError("A private step plan needs at least one release")
    if sigma == 0:
        return 0.0
    mu_squared = sum((release.sensitivity / (sigma * release.noise)) ** 2 for release in plan)
    return 1.0 / math.sqrt(mu_squared)


__all__ = ["GaussianRelease", "StepPlan", "composed_multiplier"]

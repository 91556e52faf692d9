"""Two-point (central difference) estimates of directional derivatives, per example.

``(f(x + lam u; xi_i) - f(x - lam u; xi_i)) / (2 lam)`` for every example ``i`` of a batch
(DPZero Eq. 2, Alg. 1-2 line 3), computed with two in-place perturbations of the parameters.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from lit_zodp.zo.perturbation import PerturbationEngine


def central_differences(engine: PerturbationEngine, seed: int, lam: float,
                        losses: Callable[[], Tensor]) -> Tensor:
    """Per-example central differences along ``u(seed)``.

    Leaves the parameters at ``x - lam u`` (pending in ``engine``): the caller restores them, or fuses
    the restore into the update (``ZOSGD.step``).
    """
    if lam <= 0:
        raise ValueError(f"Expected the smoothing `lam` > 0, but got {lam}")
    engine.perturb_(seed, +lam)
    plus = losses()
    engine.perturb_(seed, -2.0 * lam)
    minus = losses()
    return (plus - minus) / (2.0 * lam)

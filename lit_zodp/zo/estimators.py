"""Two-point (central difference) estimates of directional derivatives, per example.

``(f(x + lam u; xi_i) - f(x - lam u; xi_i)) / (2 lam)`` for every example ``i`` of a batch
(DPZero Eq. 2, Alg. 1-2 line 3), computed with two in-place perturbations of the parameters; and
the three-point second difference along ``u``, whose mean over Gaussian ``u`` is ``tr(H)`` (ours:
MeZO-BCD's ``block_lr="curvature"``).
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
    plus, minus = two_point_losses(engine, seed, lam, losses)
    return (plus - minus) / (2.0 * lam)


def second_differences(engine: PerturbationEngine, seed: int, lam: float, losses: Callable[[], Tensor],
                       center: Tensor) -> Tensor:
    """Per-example ``(f(x + lam u) + f(x - lam u) - 2 f(x)) / lam^2`` along ``u(seed)``, ``center = f(x)``.

    On a quadratic ``f = x'Ax / 2 + b'x`` it is ``u'Au`` exactly, so over ``u ~ N(0, I)`` its mean is
    ``tr(A)`` (Hutchinson's estimator with Gaussian probes, variance ``2 ||A||_F^2``); for a smooth
    ``f`` the error is ``O(lam^2)``. Leaves ``x - lam u`` pending, like :func:`central_differences`.
    """
    plus, minus = two_point_losses(engine, seed, lam, losses)
    return (plus + minus - 2.0 * center) / (lam * lam)


def two_point_losses(engine: PerturbationEngine, seed: int, lam: float,
                     losses: Callable[[], Tensor]) -> tuple[Tensor, Tensor]:
    """``(f(x + lam u), f(x - lam u))`` by two in-place perturbations; leaves ``x - lam u`` pending.
    A forward that raises (a refused configuration, out of memory) leaves no perturbation behind."""
    if lam <= 0:
        raise ValueError(f"Expected the smoothing `lam` > 0, but got {lam}")
    try:
        engine.perturb_(seed, +lam)
        plus = losses()
        engine.perturb_(seed, -2.0 * lam)
        return plus, losses()
    except BaseException:
        engine.restore_()
        raise

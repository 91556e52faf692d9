"""Calibrating the noise multiplier to a target (epsilon, delta), and DPZero's closed form.

``calibrate_noise_multiplier`` bisects sigma on the ledger's UPPER bound of epsilon, so the
calibrated run provably spends at most ``target_epsilon`` under the PRV accountant.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

from lit_zodp.errors import (
    AccountingError,
    check_delta,
    check_positive,
    check_positive_int,
    check_probability,
    raise_if_any,
)
from lit_zodp.privacy.ledger import PrivacyLedger
from lit_zodp.privacy.mechanisms import Mechanism, SubsampledGaussian


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    releases_per_step: int = 1,
    eps_error: float = 0.05,
    sigma_tolerance: float = 1e-3,
    sigma_max: float = 1e4,
) -> float:
    """Smallest sigma (to ``sigma_tolerance``, relative) whose epsilon upper bound is <= target.

    ``releases_per_step`` counts Poisson-subsampled Gaussian releases per step sharing one batch
    (for example q directions of one DPZero step released separately).
    """
    raise_if_any([
        check_positive("target_epsilon", target_epsilon),
        check_delta(delta),
        check_probability("sample_rate", sample_rate),
        check_positive_int("steps", steps),
        check_positive_int("releases_per_step", releases_per_step),
    ])
    count = steps * releases_per_step
    return bisect_sigma(lambda sigma: [(SubsampledGaussian(sigma, sample_rate), count)],
                        target_epsilon=target_epsilon, delta=delta, eps_error=eps_error,
                        sigma_tolerance=sigma_tolerance, sigma_max=sigma_max)


def bisect_sigma(
    plan: Callable[[float], Iterable[tuple[Mechanism, int]]],
    *,
    target_epsilon: float,
    delta: float,
    eps_error: float = 0.05,
    sigma_tolerance: float = 1e-3,
    sigma_max: float = 1e4,
) -> float:
    """Bisect sigma for any plan ``sigma -> [(mechanism, count)]`` whose epsilon decreases in sigma."""
    if eps_error >= target_epsilon:
        raise AccountingError(f"`eps_error`={eps_error} must be below target_epsilon={target_epsilon}")

    def upper_epsilon(sigma: float) -> float:
        try:
            return PrivacyLedger(eps_error=eps_error).epsilon(delta, extra=plan(sigma)).upper
        except AccountingError:
            return math.inf

    high = 1.0
    while upper_epsilon(high) > target_epsilon:
        high *= 2.0
        if high > sigma_max:
            raise AccountingError(
                f"No noise multiplier up to {sigma_max} reaches epsilon={target_epsilon} at "
                f"delta={delta}; the target is impossible for this sample rate and step count "
                "(raise epsilon, or lower the steps or the sample rate).")
    low = high / 2.0
    while low > 1e-3 and upper_epsilon(low) <= target_epsilon:
        high, low = low, low / 2.0
    while (high - low) / high > sigma_tolerance:
        mid = 0.5 * (low + high)
        if upper_epsilon(mid) <= target_epsilon:
            high = mid
        else:
            low = mid
    return high


def dpzero_theory_sigma(*, clip: float, steps: int, n: int, epsilon: float, delta: float) -> float:
    """Noise std of DPZero Alg. 2 / Thm. 3 by advanced composition: ``4C sqrt(2T log(e+eps/delta)) / (n eps)``.

    This is the standard deviation added to the *mean* over ``n`` examples (replace-one neighbours,
    sensitivity ``2C/n``, no subsampling), as the paper states it; the PRV calibration above is
    much tighter and is what the modules use.
    """
    raise_if_any([check_positive("clip", clip), check_positive_int("steps", steps),
                  check_positive_int("n", n), check_positive("epsilon", epsilon), check_delta(delta)])
    return 4 * clip * math.sqrt(2 * steps * math.log(math.e + epsilon / delta)) / (n * epsilon)


def steps_within_budget(ledger: PrivacyLedger, per_step: list, *, max_epsilon: float, delta: float,
                        limit: int) -> int:
    """Largest ``k <= limit`` such that ``k`` more steps keep epsilon's upper bound <= ``max_epsilon``.

    Epsilon grows with ``k``, so bisection over ``k`` is exact (``O(log limit)`` accountant calls).
    """
    def fits(k: int) -> bool:
        extra = [(mechanism, count * k) for mechanism, count in per_step]
        return ledger.epsilon(delta, extra=extra).upper <= max_epsilon

    if fits(limit):
        return limit
    if not fits(0):
        return 0
    low, high = 0, limit  # fits(low), not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low

"""Calibrating the noise multiplier to a target (epsilon, delta), and DPZero's closed form.

``calibrate_noise_multiplier`` bisects sigma on the ledger's UPPER bound of epsilon, so the
calibrated run provably spends at most ``target_epsilon`` under the PRV accountant.
"""

from __future__ import annotations

import functools
import math
import warnings
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
from lit_zodp.privacy.plan import StepPlan, composed_multiplier


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


def steps_cost(sampling, plan: StepPlan, steps: int, sigma: float) -> list:
    """``[(mechanism, count)]`` of ``steps`` steps of ``plan``'s releases on ``sampling``'s batches (a sampling
    description: ``noise multiplier -> mechanism``) at noise multiplier ``sigma``."""
    return [(sampling.mechanism(composed_multiplier(plan, sigma)), steps)]


@functools.lru_cache(maxsize=64)
def calibrated_multiplier(sampling, plan: StepPlan, steps: int, *, target_epsilon: float, delta: float,
                          eps_error: float) -> float:
    """:func:`bisect_sigma` for ``steps`` steps of ``plan``'s releases on ``sampling``'s batches (a sampling
    description: ``sigma -> mechanism``), memoised. The answer is a function of these public, hashable settings
    alone, so a second fit of one configuration in a process (a sweep over seeds, a test suite) reuses it: with the
    PRV accountant a calibration costs seconds. A refusal (no sigma reaches the target) is raised, not stored."""
    return bisect_sigma(lambda sigma: steps_cost(sampling, plan, steps, sigma),
                        target_epsilon=target_epsilon, delta=delta, eps_error=eps_error)


def bisect_sigma(
    plan: Callable[[float], Iterable[tuple[Mechanism, int]]],
    *,
    target_epsilon: float,
    delta: float,
    eps_error: float = 0.05,
    sigma_tolerance: float = 1e-3,
    sigma_max: float = 1e4,
) -> float:
    """The smallest sigma (to ``sigma_tolerance``, relative) whose epsilon upper bound is <= target, for
    any plan ``sigma -> [(mechanism, count)]`` whose epsilon decreases in sigma.

    A start from the (cheap) RDP accountant's sigma, a bracket ``[low, high]`` by doubling/halving
    from it, then the Illinois variant of regula falsi on ``log eps(sigma) - log target`` against
    ``log sigma`` (nearly linear there): 4-6 calls of the (expensive) PRV accountant in all, where
    bisection from 1 took 13-15. ``high`` always satisfies the target, and it is what is returned.
    """
    if eps_error >= target_epsilon:
        raise AccountingError(f"`eps_error`={eps_error} must be below target_epsilon={target_epsilon}")

    def excess(sigma: float, accountant: str = "prv") -> float:  # log(eps_upper / target): <= 0 meets it
        try:
            ledger = PrivacyLedger(eps_error=eps_error, accountant=accountant)
            eps = ledger.epsilon(delta, extra=plan(sigma)).upper
        except AccountingError:
            return math.inf
        return math.log(eps / target_epsilon) if eps > 0 else -math.inf

    start = _rdp_start(lambda sigma: excess(sigma, "rdp"), sigma_max)
    high, f_high = start, excess(start)
    while f_high > 0:
        high *= 2.0
        if high > sigma_max:
            raise AccountingError(
                f"No noise multiplier up to {sigma_max} reaches epsilon={target_epsilon} at "
                f"delta={delta}; the target is impossible for this sample rate and step count "
                "(raise epsilon, or lower the steps or the sample rate).")
        f_high = excess(high)
    shrink = 0.8 if start != 1.0 else 0.5  # the RDP start is within ~20% (RDP is the looser bound)
    low, f_low = high * shrink, excess(high * shrink)
    while low > 1e-3 and f_low <= 0:
        high, f_high, low = low, f_low, low * shrink
        f_low = excess(low)
    return _regula_falsi(excess, low, f_low, high, f_high, sigma_tolerance)


def _rdp_start(rdp_excess: Callable[[float], float], sigma_max: float) -> float:
    """The sigma meeting the target under RDP (to 1%), a close upper guess for PRV's; 1 if RDP
    cannot account the plan. Each RDP evaluation takes about a millisecond. Opacus's warnings about its orders
    are silenced: this guess is ours, not the user's accountant (they printed Opacus's source line under PRV)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _rdp_guess(rdp_excess, sigma_max)


def _rdp_guess(rdp_excess: Callable[[float], float], sigma_max: float) -> float:
    try:
        high = 1.0
        while rdp_excess(high) > 0 and high <= sigma_max:
            high *= 2.0
        low = high / 2.0
        while low > 1e-3 and rdp_excess(low) <= 0:
            high, low = low, low / 2.0
        while (high - low) / high > 0.01:
            mid = 0.5 * (low + high)
            high, low = (mid, low) if rdp_excess(mid) <= 0 else (high, mid)
        return min(high, sigma_max)
    except Exception:  # noqa: BLE001 - any mechanism RDP does not cover: fall back to the plain start
        return 1.0


def _regula_falsi(excess: Callable[[float], float], low: float, f_low: float, high: float, f_high: float,
                  tolerance: float) -> float:
    """Shrink ``[low, high]`` (``excess(low) > 0 >= excess(high)``) to ``tolerance`` relative width."""
    last = 0
    while (high - low) / high > tolerance:
        if math.isfinite(f_low) and math.isfinite(f_high) and f_low != f_high:
            t = f_low / (f_low - f_high)
            x = math.exp(math.log(low) + t * (math.log(high) - math.log(low)))
        else:
            x = 0.5 * (low + high)
        margin = 0.25 * tolerance * high  # keep strictly inside, so the bracket shrinks
        x = min(max(x, low + margin), high - margin)
        f_x = excess(x)
        if f_x <= 0:
            high, f_high = x, f_x
            if last == 1:
                f_low /= 2.0  # Illinois: a side kept twice has its value halved
            last = 1
        else:
            low, f_low = x, f_x
            if last == -1:
                f_high /= 2.0
            last = -1
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

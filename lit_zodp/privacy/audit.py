"""Empirical privacy auditing: what a membership test on the released values shows.

An auditor runs a private module on neighbouring datasets, with and without a *canary* row, and scores each
observation an attacker gets (here: a step's release, read back from the weights). Two readings of the scores:

* :func:`epsilon_lower_bound`, assumption-free (Jagielski et al. 2020, "Auditing differentially private machine
  learning", Sec. 3; Nasr et al. 2021): a threshold test's true- and false-positive rates, bounded with
  Clopper-Pearson intervals, give ``epsilon >= log((TPR - delta) / FPR)`` at the stated confidence. It must
  never exceed the accounted epsilon; it is loose for one Gaussian observation.
* :func:`gaussian_mu`, for a Gaussian mechanism (Dong, Roth and Su 2019, "Gaussian differential privacy"):
  a step whose release is ``sum + N(0, (sigma C)^2)`` with one row moving the sum by ``C`` is ``mu``-GDP with
  ``mu = 1 / sigma``; the scores' mean shift over their standard deviation estimates ``mu``, and
  :func:`gaussian_epsilon` turns a ``mu`` into an ``(epsilon, delta)`` (their Corollary 2.13). A measured ``mu``
  above ``1 / sigma`` means less noise or more sensitivity than accounted; below it, noise paid for nothing.

Pure functions of the scores: how to observe a module is the auditor's (``benchmarks/audit_privacy.py``, the
contract tests).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
from scipy import stats

from lit_zodp.errors import ConfigError
from lit_zodp.privacy.mechanisms import Gaussian, SubsampledGaussian


class Interval(NamedTuple):
    """An estimate with a two-sided confidence interval."""

    estimate: float
    low: float
    high: float


def _scores(name: str, values: Sequence[float], minimum: int = 2) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if array.size < minimum or not np.all(np.isfinite(array)):
        raise ConfigError(f"Expected at least {minimum} finite `{name}`, but got {array.size} values"
                          f"{'' if np.all(np.isfinite(array)) else ' with a non-finite one'}")
    return array


def _check_level(name: str, value: float) -> None:
    if not 0.0 < value < 1.0:
        raise ConfigError(f"Expected `{name}` in (0, 1), but got {value}")


def clopper_pearson(successes: int, trials: int, confidence: float = 0.95) -> Interval:
    """The exact two-sided binomial interval for ``successes / trials`` (Clopper and Pearson 1934)."""
    _check_level("confidence", confidence)
    if not 0 <= successes <= trials or trials < 1:
        raise ConfigError(f"Expected 0 <= successes <= trials and trials >= 1, but got {successes} of {trials}")
    tail = (1.0 - confidence) / 2
    low = 0.0 if successes == 0 else float(stats.beta.ppf(tail, successes, trials - successes + 1))
    high = 1.0 if successes == trials else float(stats.beta.ppf(1 - tail, successes + 1, trials - successes))
    return Interval(successes / trials, low, high)


def _rates_bound(positives: int, n_in: int, false_positives: int, n_out: int, delta: float,
                 confidence: float) -> float:
    """``log((TPR_low - delta) / FPR_high)``: each rate's one-sided bound fails with probability at most
    ``(1 - confidence) / 2`` (a tail of the two-sided interval), so both hold together with probability at least
    ``confidence`` (Bonferroni); 0 where the test shows nothing."""
    tpr_low = clopper_pearson(positives, n_in, confidence).low
    fpr_high = clopper_pearson(false_positives, n_out, confidence).high
    if tpr_low - delta <= 0 or fpr_high <= 0:
        return 0.0
    return max(0.0, math.log((tpr_low - delta) / fpr_high))


def _best_threshold(in_scores: np.ndarray, out_scores: np.ndarray, delta: float) -> tuple[float, int]:
    """The threshold and side (``+1``: guess "in" above it; ``-1``: below) whose plain rates give the largest
    ``log((TPR - delta) / FPR)`` on these scores (a false-positive count floored at one)."""
    best, choice = -math.inf, (math.inf, 1)
    for side in (1, -1):
        inside, outside = np.sort(side * in_scores), np.sort(side * out_scores)
        for threshold in np.unique(inside):
            tpr = (inside.size - np.searchsorted(inside, threshold, side="left")) / inside.size
            fpr = max(outside.size - np.searchsorted(outside, threshold, side="left"), 1) / outside.size
            if tpr > delta and math.log((tpr - delta) / fpr) > best:
                best, choice = math.log((tpr - delta) / fpr), (float(side * threshold), side)
    return choice


def epsilon_lower_bound(in_scores: Sequence[float], out_scores: Sequence[float], *, delta: float,
                        confidence: float = 0.95) -> float:
    """A lower bound on the epsilon of the mechanism that produced the scores, valid with probability
    ``confidence``: the threshold is chosen on the first half of each set of scores and its rates are bounded
    on the second (Jagielski et al. 2020, Algorithm 2; choosing and bounding on the same scores would overstate
    it). ``in_scores``: one score per observation with the canary, ``out_scores`` without; larger or smaller
    scores may mean "in", both sides are tried."""
    _check_level("delta", delta)
    inside, outside = _scores("in_scores", in_scores, 4), _scores("out_scores", out_scores, 4)
    threshold, side = _best_threshold(inside[: inside.size // 2], outside[: outside.size // 2], delta)
    held_in, held_out = side * inside[inside.size // 2:], side * outside[outside.size // 2:]
    positives, false_positives = int((held_in >= side * threshold).sum()), int((held_out >= side * threshold).sum())
    return _rates_bound(positives, held_in.size, false_positives, held_out.size, delta, confidence)


def gaussian_mu(in_scores: Sequence[float], out_scores: Sequence[float], confidence: float = 0.95) -> Interval:
    """``mu = (mean_in - mean_out) / s``, ``s`` the pooled standard deviation, with a normal-approximation
    interval: the standard error of a standardised mean difference, ``sqrt(1/n_in + 1/n_out + mu^2 / (2 (n_in +
    n_out)))`` (Hedges and Olkin 1985, Sec. 5.B). Assumes Gaussian scores of one variance in both sets."""
    _check_level("confidence", confidence)
    inside, outside = _scores("in_scores", in_scores), _scores("out_scores", out_scores)
    pooled = math.sqrt(((inside.size - 1) * inside.var(ddof=1) + (outside.size - 1) * outside.var(ddof=1))
                       / (inside.size + outside.size - 2))
    if pooled == 0.0:
        raise ConfigError("Expected scores with some spread (a noised release), but every score in each set is "
                          "the same: nothing to estimate mu from")
    mu = float((inside.mean() - outside.mean()) / pooled)
    error = math.sqrt(1 / inside.size + 1 / outside.size + mu * mu / (2 * (inside.size + outside.size)))
    half = float(stats.norm.ppf((1 + confidence) / 2)) * error
    return Interval(mu, mu - half, mu + half)


def gaussian_spread(scores: Sequence[float], confidence: float = 0.95) -> Interval:
    """The standard deviation ``s`` of Gaussian ``scores`` (``ddof=1``) with its exact interval: ``(n - 1) s^2 /
    std^2`` is chi-square with ``n - 1`` degrees of freedom. In units of the clip, a release's noise std over the
    sensitivity the ledger charges is ``1 / mu``: measured on one set of scores, it is tighter than :func:`gaussian_mu`
    (whose mean difference carries both sets' noise) and needs no second set of independent noise."""
    _check_level("confidence", confidence)
    values = _scores("scores", scores)
    degrees, spread = values.size - 1, float(values.std(ddof=1))
    if spread == 0.0:
        raise ConfigError("Expected scores with some spread (a noised release), but every score is the same")
    tail = (1.0 - confidence) / 2
    return Interval(spread, spread * math.sqrt(degrees / stats.chi2.ppf(1 - tail, degrees)),
                    spread * math.sqrt(degrees / stats.chi2.ppf(tail, degrees)))


def gaussian_delta(mu: float, epsilon: float) -> float:
    """``delta(epsilon)`` of a ``mu``-GDP mechanism: ``Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)`` (Dong,
    Roth and Su 2019, Corollary 2.13), in log space for large ``epsilon``."""
    if mu <= 0:
        return 0.0
    first = stats.norm.cdf(-epsilon / mu + mu / 2)
    second = math.exp(epsilon + stats.norm.logcdf(-epsilon / mu - mu / 2))
    return float(max(first - second, 0.0))


def gaussian_epsilon(mu: float, delta: float, *, tolerance: float = 1e-9) -> float:
    """The smallest ``epsilon >= 0`` at which a ``mu``-GDP mechanism is ``(epsilon, delta)``-DP (bisection of
    :func:`gaussian_delta`, decreasing in ``epsilon``). ``T`` composed ``mu``-GDP steps are ``sqrt(T) mu``-GDP
    (their Corollary 3.3)."""
    _check_level("delta", delta)
    if mu < 0 or not math.isfinite(mu):
        raise ConfigError(f"Expected a finite `mu` >= 0, but got {mu}")
    if gaussian_delta(mu, 0.0) <= delta:
        return 0.0
    low, high = 0.0, 1.0
    while gaussian_delta(mu, high) > delta:
        low, high = high, 2 * high
    while high - low > tolerance * max(1.0, high):
        middle = (low + high) / 2
        low, high = (middle, high) if gaussian_delta(mu, middle) > delta else (low, middle)
    return high


def accounted_mu(counts: Mapping[Any, int]) -> float:
    """The ``mu`` of a ledger's composition (``PrivacyLedger.counts``) of full-batch Gaussian mechanisms: ``T``
    steps of noise multiplier ``sigma`` (the multiplier of the sensitivity, as accounted) are ``sqrt(T) / sigma``-GDP,
    and a composition the root of the sum of squares (Dong, Roth and Su 2019, Corollary 3.3). Subsampled steps have
    no exact ``mu``: refused."""
    total = 0.0
    for mechanism, count in counts.items():
        if not isinstance(mechanism, (Gaussian, SubsampledGaussian)) or getattr(mechanism, "sample_rate", 1.0) != 1.0:
            raise ConfigError(f"Expected full-batch Gaussian mechanisms (an exact mu), but the ledger holds {mechanism}")
        total += count / mechanism.noise_multiplier ** 2
    return math.sqrt(total)


__all__ = ["Interval", "accounted_mu", "clopper_pearson", "epsilon_lower_bound", "gaussian_delta", "gaussian_epsilon", "gaussian_mu",
           "gaussian_spread"]

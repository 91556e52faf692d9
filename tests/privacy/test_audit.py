"""The audit's statistics against closed forms and the accountant (``lit_zodp/privacy/audit.py``)."""

import math

import numpy as np
import pytest

from lit_zodp.errors import ConfigError
from lit_zodp.privacy import Gaussian, PrivacyLedger, SubsampledGaussian
from lit_zodp.privacy.audit import (
    accounted_mu,
    clopper_pearson,
    epsilon_lower_bound,
    gaussian_delta,
    gaussian_epsilon,
    gaussian_mu,
    gaussian_spread,
)


@pytest.mark.parametrize("sigma, steps", [(1.0, 1), (2.0, 100), (4.0, 1000), (0.8, 3)])
def test_the_gdp_epsilon_of_t_gaussian_steps_is_the_prv_accountants(sigma, steps):
    """Full-batch Gaussian steps compose exactly as mu-GDP: the PRV accountant's estimate agrees to 1e-4."""
    ledger = PrivacyLedger()
    ledger.record(Gaussian(noise_multiplier=sigma), steps)
    mu = accounted_mu(ledger.counts)
    assert mu == pytest.approx(math.sqrt(steps) / sigma)
    bounds = ledger.epsilon(1e-5)
    assert gaussian_epsilon(mu, 1e-5) == pytest.approx(bounds.estimate, rel=1e-4)
    assert bounds.lower <= gaussian_epsilon(mu, 1e-5) <= bounds.upper


def test_gaussian_delta_at_its_epsilon_is_delta_and_zero_mu_costs_nothing():
    assert gaussian_delta(1.0, gaussian_epsilon(1.0, 1e-5)) == pytest.approx(1e-5, rel=1e-6)
    assert gaussian_epsilon(0.0, 1e-5) == 0.0 and gaussian_delta(0.0, 0.0) == 0.0
    assert gaussian_epsilon(1e-6, 1e-5) == 0.0  # delta(0) = 2 Phi(mu / 2) - 1 < 1e-5


def test_accounted_mu_adds_compositions_in_squares_and_refuses_subsampled_steps():
    counts = {Gaussian(noise_multiplier=1.0): 4, SubsampledGaussian(noise_multiplier=2.0, sample_rate=1.0): 12}
    assert accounted_mu(counts) == pytest.approx(math.sqrt(4 + 12 / 4))
    with pytest.raises(ConfigError, match="full-batch Gaussian"):
        accounted_mu({SubsampledGaussian(noise_multiplier=1.0, sample_rate=0.1): 10})


def test_clopper_pearson_matches_its_closed_forms():
    """At 0 or n successes the interval has closed forms: ``1 - (alpha/2)^(1/n)`` and ``(alpha/2)^(1/n)``."""
    assert clopper_pearson(0, 10, 0.95) == pytest.approx((0.0, 0.0, 1 - 0.025 ** 0.1))
    assert clopper_pearson(10, 10, 0.95) == pytest.approx((1.0, 0.025 ** 0.1, 1.0))
    estimate, low, high = clopper_pearson(37, 100, 0.99)
    assert low < 0.37 < high and high - low == pytest.approx(0.245, abs=0.01)
    with pytest.raises(ConfigError, match="successes <= trials"):
        clopper_pearson(11, 10)


def test_the_lower_bound_stays_below_the_true_epsilon_and_finds_a_strong_signal():
    """Scores of ``mu``-GDP mechanisms: the bound stays below the mechanism's epsilon (at mu 1, 4.38: 100 draws of
    2000 scores per set gave at most 2.41, mean 1.09; here 20), is near 0 without a signal, and is large where in
    and out barely overlap (mu 8). Loose by nature: at mu 6 (epsilon 42.8) 2000 scores cannot show more than about
    log(1000) = 6.9; they showed 5.27 on average."""
    rng = np.random.default_rng(0)
    truth = gaussian_epsilon(1.0, 1e-5)
    for _ in range(20):
        assert epsilon_lower_bound(rng.normal(1.0, 1, 2000), rng.normal(0, 1, 2000), delta=1e-5) <= truth
    assert epsilon_lower_bound(rng.normal(0, 1, 2000), rng.normal(0, 1, 2000), delta=1e-5) < 0.5
    assert epsilon_lower_bound(rng.normal(8.0, 1, 2000), rng.normal(0, 1, 2000), delta=1e-5) > 5.0
    assert epsilon_lower_bound(-rng.normal(8.0, 1, 2000), rng.normal(0, 1, 2000), delta=1e-5) > 5.0  # either side


@pytest.mark.parametrize("mu", [0.0, 0.5, 2.0])
def test_the_mu_interval_covers_the_truth_at_its_confidence(mu):
    """Coverage over 400 draws of 300 scores per set (std 2, shift 2 mu): within 3 binomial standard errors of 95%."""
    rng = np.random.default_rng(1)
    covered = sum(low <= mu <= high for _, low, high in
                  (gaussian_mu(rng.normal(2 * mu, 2.0, 300), rng.normal(0, 2.0, 300), 0.95) for _ in range(400)))
    assert abs(covered / 400 - 0.95) < 3 * math.sqrt(0.95 * 0.05 / 400)


@pytest.mark.parametrize("std", [0.5, 2.0])
def test_the_spread_interval_covers_the_truth_at_its_confidence(std):
    """Coverage over 400 draws of 150 scores: within 3 binomial standard errors of 95%."""
    rng = np.random.default_rng(2)
    covered = sum(low <= std <= high for _, low, high in
                  (gaussian_spread(rng.normal(1.0, std, 150), 0.95) for _ in range(400)))
    assert abs(covered / 400 - 0.95) < 3 * math.sqrt(0.95 * 0.05 / 400)
    with pytest.raises(ConfigError, match="some spread"):
        gaussian_spread([1.0, 1.0])


def test_bad_scores_and_levels_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="at least 2 finite `in_scores`.*non-finite"):
        gaussian_mu([1.0, float("nan")], [0.0, 1.0])
    with pytest.raises(ConfigError, match="some spread"):
        gaussian_mu([1.0, 1.0], [0.0, 0.0])
    with pytest.raises(ConfigError, match="`delta` in \\(0, 1\\)"):
        epsilon_lower_bound([0.0] * 4, [0.0] * 4, delta=0.0)
    with pytest.raises(ConfigError, match="`confidence` in \\(0, 1\\)"):
        gaussian_mu([0.0, 1.0], [0.0, 1.0], confidence=1.0)

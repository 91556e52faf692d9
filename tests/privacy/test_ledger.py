import math

import pytest
from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant
from scipy.stats import norm

from lit_zodp.privacy import (
    AccountingError,
    Gaussian,
    Laplace,
    PrivacyConfigError,
    PrivacyLedger,
    SubsampledGaussian,
    calibrate_noise_multiplier,
)


def test_ledger_agrees_with_prv_accountant_called_directly():
    ledger = PrivacyLedger(eps_error=0.05)
    ledger.record(SubsampledGaussian(1.1, 0.02), 300)
    ledger.record(SubsampledGaussian(1.1, 0.02), 200)
    direct = PRVAccountant(prvs=[PoissonSubsampledGaussianMechanism(0.02, 1.1)], max_self_compositions=[512],
                           eps_error=0.05, delta_error=1e-8).compute_epsilon(1e-5, [500])
    bounds = ledger.epsilon(1e-5)
    assert bounds.upper == pytest.approx(direct[2], rel=1e-9)
    assert bounds.lower <= bounds.estimate <= bounds.upper


def test_ledger_agrees_with_opacus_prv_within_one_percent():
    opacus = pytest.importorskip("opacus.accountants")
    acc = opacus.PRVAccountant()
    ledger = PrivacyLedger(eps_error=0.01)
    for sigma, q, steps in [(1.0, 0.01, 400), (2.0, 0.05, 100)]:
        acc.history.append((sigma, q, steps))
        ledger.record(SubsampledGaussian(sigma, q), steps)
    theirs = acc.get_epsilon(delta=1e-5, eps_error=0.01)
    ours = ledger.epsilon(1e-5).upper
    assert ours == pytest.approx(theirs, rel=0.01)


def test_planned_composition_answers_the_spent_epsilon_exactly_and_once():
    """The fit-start check (``extra`` = the planned steps) and the ledger after those steps are the same
    composition with the same accountant: one evaluation, bitwise the value a fresh ledger computes."""
    mechanism = SubsampledGaussian(1.1, 0.02)
    ledger = PrivacyLedger()
    planned = ledger.epsilon(1e-5, extra=[(mechanism, 700)])
    ledger.record(mechanism, 300)
    after_300 = ledger.epsilon(1e-5)
    ledger.record(mechanism, 400)
    assert ledger.epsilon(1e-5) == planned and ledger.computations == 2
    fresh = PrivacyLedger()
    fresh.record(mechanism, 700)
    assert fresh.epsilon(1e-5) == planned
    assert after_300.upper < planned.upper


def test_ledgers_share_a_built_accountant_only_for_the_same_public_settings(monkeypatch):
    """Stop 63: every ledger of a process reuses the discretised accountant built for the same mechanisms,
    capacities and errors; any other setting builds its own, answers do not depend on what other ledgers asked
    before, and the process keeps at most ``ACCOUNTANTS_KEPT`` of them."""
    from lit_zodp.privacy import ledger as ledger_module

    builds = []
    monkeypatch.setattr(ledger_module, "PRVAccountant", lambda **kw: builds.append(kw) or PRVAccountant(**kw))
    ledger_module._build_accountant.cache_clear()

    def epsilon(steps, delta=1e-5, eps_error=0.05, sigma=1.1):
        ledger = PrivacyLedger(eps_error=eps_error)
        ledger.record(SubsampledGaussian(sigma, 0.02), steps)
        return ledger.epsilon(delta).upper

    first = epsilon(300)
    assert len(builds) == 1 and epsilon(300) == first and epsilon(500) > first and len(builds) == 1
    for other in (dict(sigma=1.2), dict(delta=1e-6), dict(eps_error=0.1)):
        epsilon(300, **other)
    epsilon(600)  # beyond the first accountant's capacity of 512
    assert len(builds) == 5 and ledger_module._build_accountant.cache_info().currsize == ledger_module.ACCOUNTANTS_KEPT
    direct = PRVAccountant(prvs=[PoissonSubsampledGaussianMechanism(0.02, 1.1)], max_self_compositions=[512],
                           eps_error=0.05, delta_error=1e-8).compute_epsilon(1e-5, [300])
    assert first == pytest.approx(direct[2], rel=1e-12)
    assert epsilon(300) == first  # rebuilt after its eviction: the same answer


def test_a_changed_accountant_error_recomputes():
    """A restored ledger with another ``eps_error`` must not reuse the accountant (or bounds) built for the old one."""
    mechanism = SubsampledGaussian(1.1, 0.02)
    ledger = PrivacyLedger(eps_error=0.5)
    ledger.record(mechanism, 500)
    loose = ledger.epsilon(1e-5)
    ledger.load_state_dict({**ledger.state_dict(), "eps_error": 0.01})
    tight = PrivacyLedger(eps_error=0.01)
    tight.record(mechanism, 500)
    assert ledger.epsilon(1e-5) == tight.epsilon(1e-5) != loose


def test_gaussian_mechanism_brackets_the_exact_closed_form():
    """For the full-batch Gaussian mechanism, the exact delta(eps) (Balle & Wang) is known."""
    sigma, steps, delta = 3.0, 16, 1e-5
    ledger = PrivacyLedger(eps_error=0.01)
    ledger.record(Gaussian(sigma), steps)
    bounds = ledger.epsilon(delta)
    mu = math.sqrt(steps) / sigma  # composition of Gaussians is a Gaussian with mu = sqrt(T)/sigma

    def exact_delta(eps):
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)

    assert exact_delta(bounds.upper) <= delta <= exact_delta(bounds.lower)


def test_heterogeneous_composition_is_monotone_and_laplace_works():
    ledger = PrivacyLedger()
    ledger.record(SubsampledGaussian(1.0, 0.01), 100)
    first = ledger.epsilon(1e-5).upper
    ledger.record(Gaussian(20.0), 10)
    ledger.record(Laplace(0.01), 5)
    assert ledger.epsilon(1e-5).upper > first
    assert len(ledger.counts) == 3


def test_state_dict_round_trip():
    ledger = PrivacyLedger()
    ledger.record(SubsampledGaussian(1.0, 0.01), 100)
    ledger.record(Laplace(0.5), 2)
    clone = PrivacyLedger()
    clone.load_state_dict(ledger.state_dict())
    assert clone.counts == ledger.counts
    assert clone.epsilon(1e-5) == ledger.epsilon(1e-5)


def test_empty_ledger_spends_nothing():
    assert PrivacyLedger().epsilon(1e-5).upper == 0.0


@pytest.mark.parametrize("target", [0.5, 2.0, 8.0])
def test_calibrated_sigma_achieves_epsilon_at_most_target_and_is_tight(target):
    sigma = calibrate_noise_multiplier(target_epsilon=target, delta=1e-5, sample_rate=0.02, steps=500)
    ledger = PrivacyLedger()
    ledger.record(SubsampledGaussian(sigma, 0.02), 500)
    assert ledger.epsilon(1e-5).upper <= target
    looser = PrivacyLedger()
    looser.record(SubsampledGaussian(sigma * 0.98, 0.02), 500)
    assert looser.epsilon(1e-5).upper > target


@pytest.mark.parametrize("kwargs,match", [
    (dict(target_epsilon=0.0), "target_epsilon"),
    (dict(target_epsilon=-1.0), "target_epsilon"),
    (dict(delta=1.0), "delta"),
    (dict(delta=0.0), "delta"),
    (dict(sample_rate=1.5), "sample_rate"),
    (dict(sample_rate=0.0), "sample_rate"),
    (dict(steps=0), "steps"),
])
def test_bad_calibration_input_raises(kwargs, match):
    args = dict(target_epsilon=1.0, delta=1e-5, sample_rate=0.01, steps=100) | kwargs
    with pytest.raises(PrivacyConfigError, match=match):
        calibrate_noise_multiplier(**args)


def test_impossible_target_raises_clearly():
    with pytest.raises(AccountingError, match="target is impossible|must be below"):
        calibrate_noise_multiplier(target_epsilon=0.01, delta=1e-10, sample_rate=1.0, steps=100_000,
                                   sigma_max=100.0)


def test_mechanism_parameters_validated():
    with pytest.raises(PrivacyConfigError, match="sample_rate"):
        SubsampledGaussian(1.0, 1.2)
    with pytest.raises(PrivacyConfigError, match="noise_multiplier"):
        Gaussian(0.0)


def test_the_memoised_calibration_is_the_plans_own_and_keyed_by_every_public_setting():
    """``calibrated_multiplier`` (what a fit's privacy component calibrates with) equals a fresh bisection of the same
    plan, and a change of the rate, the plan's sensitivity, the steps or the target is a new calibration."""
    from lit_zodp.privacy.calibration import bisect_sigma, calibrated_multiplier
    from lit_zodp.privacy.plan import GaussianRelease, composed_multiplier
    from lit_zodp.privacy.sampling import PoissonSampling

    sampling, plan = PoissonSampling(n=1000, sample_rate=0.02), (GaussianRelease("g", sensitivity=math.sqrt(2)),)
    settings = dict(target_epsilon=2.0, delta=1e-5, eps_error=0.05)
    sigma = calibrated_multiplier(sampling, plan, 300, **settings)
    fresh = bisect_sigma(lambda s: [(SubsampledGaussian(composed_multiplier(plan, s), 0.02), 300)], **settings)
    assert sigma == fresh
    hits = calibrated_multiplier.cache_info().hits
    assert calibrated_multiplier(sampling, plan, 300, **settings) == sigma
    assert calibrated_multiplier.cache_info().hits == hits + 1
    one = (GaussianRelease("g"),)
    others = [calibrated_multiplier(PoissonSampling(n=1000, sample_rate=0.04), plan, 300, **settings),
              calibrated_multiplier(sampling, one, 300, **settings),
              calibrated_multiplier(sampling, plan, 600, **settings),
              calibrated_multiplier(sampling, plan, 300, **settings | dict(target_epsilon=4.0))]
    assert others[0] > sigma and others[2] > sigma and others[3] < sigma
    assert others[1] == pytest.approx(sigma / math.sqrt(2), rel=2e-3)  # sensitivity sqrt(2): sqrt(2) times the noise

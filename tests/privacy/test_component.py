"""The privacy component alone: plan, release, commit, budget and its checkpointed state."""

import math

import pytest
import torch

from lit_zodp.errors import AccountingError, PrivacyConfigError
from lit_zodp.privacy import (
    FullBatchSampling,
    GaussianRelease,
    NoiseSource,
    NonPrivate,
    PoissonSampling,
    PrivacyComponent,
    PrivacyLedger,
    SinglePassSampling,
    SubsampledGaussian,
    composed_multiplier,
)

PLAN = (GaussianRelease("g"),)
POISSON = PoissonSampling(n=1000, sample_rate=0.05)


def planned(steps=100, sampling=POISSON, plan=PLAN, **kwargs):
    component = PrivacyComponent(**({"clip": 1.0, "delta": 1e-5} | kwargs))
    component.plan(step_plan=plan, sampling=sampling, planned_steps=steps)
    return component


def test_releases_on_one_batch_compose_into_one_gaussian():
    assert composed_multiplier((GaussianRelease("a", sensitivity=2.0),), 3.0) == pytest.approx(1.5)
    two = (GaussianRelease("a"), GaussianRelease("b"))
    assert composed_multiplier(two, 1.0) == pytest.approx(1 / math.sqrt(2))
    assert composed_multiplier(two, 1.0) == composed_multiplier((GaussianRelease("ab", sensitivity=math.sqrt(2)),), 1.0)


def test_a_step_commits_the_declared_mechanism_at_the_composed_multiplier():
    component = planned(noise_multiplier=2.0, plan=(GaussianRelease("g", sensitivity=2.0),))
    component.release(torch.zeros(4), "g")
    component.commit_step()
    assert component.ledger.counts == {SubsampledGaussian(1.0, 0.05): 1}


def test_calibration_spends_at_most_the_target_and_sets_it_as_budget():
    component = planned(steps=300, target_epsilon=2.0)
    assert component.budget == 2.0 and component.steps_allowed == 300
    for _ in range(300):
        component.release(torch.zeros(()), "g")
        component.commit_step()
    assert 1.8 < component.epsilon() <= 2.0 and component.budget_exhausted


def test_release_divides_by_the_expected_batch_size_and_adds_noise_of_sigma_clip():
    component = planned(noise_multiplier=1.5, clip=2.0, noise_seed=7)
    reference = NoiseSource(7)
    out = component.release(torch.tensor([10.0, 20.0]), "g", batch_size=3)
    expected = (torch.tensor([10.0, 20.0]) + reference.gaussian((2,), 3.0)) / 50.0
    torch.testing.assert_close(out, expected)


def test_release_all_reduces_then_adds_one_draw():
    component = PrivacyComponent(clip=1.0, noise_multiplier=1.0, delta=1e-5, noise_seed=1)
    component.plan(step_plan=PLAN, sampling=FullBatchSampling(10), planned_steps=5, reduce_sum=lambda t: t * 2)
    out = component.release(torch.tensor([1.0]), "g")
    torch.testing.assert_close(out * 10, torch.tensor([2.0]) + NoiseSource(1).gaussian((1,), 1.0))


def test_the_noise_secret_is_rank_zeros_broadcast_and_fresh_at_every_plan():
    component = PrivacyComponent(clip=1.0, noise_multiplier=1.0, delta=1e-5)
    rank_zeros = lambda value: 42 if isinstance(value, int) else value  # noqa: E731 (the secret is the int)
    component.plan(step_plan=PLAN, sampling=POISSON, planned_steps=5, broadcast=rank_zeros)
    torch.testing.assert_close(component.noise.gaussian((3,), 1.0), NoiseSource.from_secret(42).gaussian((3,), 1.0))
    first = PrivacyComponent(clip=1.0, noise_multiplier=1.0, delta=1e-5)
    first.plan(step_plan=PLAN, sampling=POISSON, planned_steps=5)
    draw = first.noise.gaussian((3,), 1.0)
    first.plan(step_plan=PLAN, sampling=POISSON, planned_steps=5)
    assert not torch.equal(first.noise.gaussian((3,), 1.0), draw)


def test_a_step_must_release_exactly_its_plan():
    component = planned(noise_multiplier=1.0)
    with pytest.raises(AccountingError, match="not in the step plan"):
        component.release(torch.zeros(()), "other")
    component._released.clear()
    with pytest.raises(AccountingError, match="declares"):
        component.commit_step()  # nothing was released
    component.release(torch.zeros(()), "g")
    component.release(torch.zeros(()), "g")
    with pytest.raises(AccountingError, match="declares"):
        component.commit_step()  # released twice


def test_the_audit_resume_cannot_overspend_whatever_the_configuration_says():
    """Planned for epsilon 4 over 300 steps, resumed to 600: the budget of the first plan binds."""
    first = planned(steps=300, target_epsilon=4.0)
    for _ in range(300):
        first.release(torch.zeros(()), "g")
        first.commit_step()
    state = first.state_dict()
    resumed = PrivacyComponent(clip=1.0, noise_multiplier=first.noise_multiplier, delta=1e-5)  # no budget given
    resumed.load_state_dict(state)
    resumed.plan(step_plan=PLAN, sampling=POISSON, planned_steps=300)
    assert resumed.budget == 4.0 and resumed.budget_exhausted
    looser = PrivacyComponent(clip=1.0, target_epsilon=8.0, delta=1e-5)
    looser.load_state_dict(state)
    looser.plan(step_plan=PLAN, sampling=POISSON, planned_steps=300)
    assert looser.budget == 4.0 and looser.noise_multiplier == first.noise_multiplier


def test_state_dict_holds_the_ledger_and_the_plan_and_nothing_secret():
    component = planned(noise_multiplier=1.0, noise_seed=3)
    component.release(torch.zeros(()), "g")
    component.commit_step()
    state = component.state_dict()
    assert set(state) == {"ledger", "plan"}
    assert set(state["plan"]) == {"noise_multiplier", "delta", "budget", "clip", "neighbours", "planned_steps",
                                  "sampling", "sample_rate", "n", "lineage", "other_branch_steps"}
    assert len(state["plan"]["lineage"]) == 32  # a random 128-bit id: public, it names the run's spend records
    restored = PrivacyComponent(clip=1.0, noise_multiplier=1.0)
    restored.load_state_dict(state)
    assert restored.epsilon() == pytest.approx(component.epsilon(), rel=1e-3) and restored.delta == 1e-5
    assert restored.lineage == component.lineage


def test_a_changed_delta_on_resume_is_refused():
    state = planned(noise_multiplier=1.0).state_dict()
    other = PrivacyComponent(clip=1.0, noise_multiplier=1.0, delta=1e-3)
    other.load_state_dict(state)
    with pytest.raises(PrivacyConfigError, match="delta"):
        other.plan(step_plan=PLAN, sampling=POISSON, planned_steps=10)


def test_single_pass_steps_compose_in_parallel():
    component = planned(noise_multiplier=1.0, sampling=SinglePassSampling(n=1000, steps=50), neighbours="replace_one")
    for _ in range(50):
        component.release(torch.zeros(()), "g")
        component.commit_step()
    one_gaussian = PrivacyLedger()
    one_gaussian.record(SubsampledGaussian(1.0, 1.0), 1)
    assert component.epsilon() == pytest.approx(one_gaussian.epsilon(1e-5).upper)


def test_unaccountable_sigma_is_refused_at_plan_time():
    with pytest.raises(AccountingError, match="cannot be accounted"):
        planned(noise_multiplier=1e-4, steps=1000)


def test_the_non_private_twin_has_the_same_api_and_divides_by_the_realized_size():
    twin = NonPrivate(clip=math.inf)
    twin.plan(step_plan=PLAN)
    out = twin.release(torch.tensor([6.0, 3.0]), "g", batch_size=3)
    torch.testing.assert_close(out, torch.tensor([2.0, 1.0]))
    assert twin.release(torch.tensor(5.0), "g", batch_size=0) == 5.0  # empty batch: no division by 0
    assert twin.epsilon() == math.inf and twin.state_dict() == {} and not twin.budget_exhausted


def test_replace_one_neighbours_double_the_noise_and_account_the_same_sigma():
    add_remove = planned(noise_multiplier=1.5, clip=2.0, noise_seed=7)
    replace_one = planned(noise_multiplier=1.5, clip=2.0, noise_seed=7, neighbours="replace_one")
    zero = torch.zeros(3)
    torch.testing.assert_close(replace_one.release(zero, "g") * 50, 2 * add_remove.release(zero, "g") * 50)
    for component in (add_remove, replace_one):
        component.commit_step()
    assert replace_one.ledger.counts == add_remove.ledger.counts == {SubsampledGaussian(1.5, 0.05): 1}


def test_the_rdp_accountant_reproduces_opacus_calibration_and_epsilon():
    opacus = pytest.importorskip("opacus")
    from opacus.accountants.utils import get_noise_multiplier

    component = planned(steps=1000, target_epsilon=2.0, accountant="rdp", neighbours="replace_one")
    expected = get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.05, steps=1000)
    assert component.noise_multiplier == expected
    for _ in range(10):
        component.release(torch.zeros(()), "g")
        component.commit_step()
    accountant = opacus.accountants.RDPAccountant()
    accountant.history = [(expected, 0.05, 10)]
    assert component.epsilon() == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)


def test_a_checkpoint_resumes_only_under_its_own_accounting_convention():
    state = planned(noise_multiplier=1.0, accountant="rdp").state_dict()
    with pytest.raises(PrivacyConfigError, match="accountant='rdp'"):
        PrivacyComponent(clip=1.0, noise_multiplier=1.0).load_state_dict(state)


def test_single_pass_is_refused_under_add_remove_neighbours():
    """Examples go to steps by position: removing one moves the others (parallel composition needs replace-one)."""
    with pytest.raises(PrivacyConfigError, match="replace-one neighbours only"):
        planned(noise_multiplier=1.0, sampling=SinglePassSampling(n=1000, steps=50))


def test_a_single_pass_must_continue_the_ledgers_pass():
    """A restarted pass (second fit, reloaded loader, fresh DataModule) would reuse examples counted once."""
    first = planned(noise_multiplier=1.0, sampling=SinglePassSampling(n=1000, steps=50), neighbours="replace_one")
    for _ in range(20):
        first.release(torch.zeros(()), "g")
        first.commit_step()
    state = first.state_dict()
    for start, refused in [(0, True), (19, True), (20, False)]:
        resumed = PrivacyComponent(clip=1.0, noise_multiplier=1.0, delta=1e-5, neighbours="replace_one")
        resumed.load_state_dict(state)
        plan = dict(step_plan=PLAN, sampling=SinglePassSampling(n=1000, steps=50, start=start), planned_steps=30)
        if refused:
            with pytest.raises(PrivacyConfigError, match="restarted pass would reuse examples"):
                resumed.plan(**plan)
        else:
            resumed.plan(**plan)


@pytest.mark.parametrize("n, expected", [(1000, 1e-5), (10**6, 1e-7)])
def test_the_default_delta_is_well_below_one_over_n(n, expected):
    component = planned(noise_multiplier=1.0, delta=None, sampling=PoissonSampling(n=n, sample_rate=0.05))
    assert component.delta == pytest.approx(expected)


def test_a_delta_of_one_over_n_or_more_warns():
    with pytest.warns(UserWarning, match="publishes one whole random record"):
        planned(noise_multiplier=1.0, delta=1e-3, sampling=POISSON)


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_a_calibrated_single_pass_spends_its_target_in_one_pass_under_either_accountant(accountant):
    """One pass composes in parallel (one unsubsampled Gaussian in the ledger): rdp calibrated at
    q = 1/steps gave sigma 0.72 instead of ~2, so the budget allowed 0 steps (audit 3 F3)."""
    if accountant == "rdp":
        pytest.importorskip("opacus")
    component = planned(target_epsilon=2.0, sampling=SinglePassSampling(n=1000, steps=100),
                        neighbours="replace_one", accountant=accountant)
    assert component.steps_allowed >= 100
    for _ in range(100):
        component.release(torch.zeros(()), "g")
        component.commit_step()
    assert 1.9 <= component.epsilon() <= 2.0


@pytest.mark.parametrize("value", [1.97135837, 2.2541, 1.9996, 9.99951, 0.000123456, 2.0, 3.0000000001])
@pytest.mark.parametrize("spec", [".3f", ".4g"])
def test_a_shown_epsilon_is_never_below_the_bound(value, spec):
    from lit_zodp.privacy.component import epsilon_text

    text = epsilon_text(value, spec)
    assert float(text) >= value and float(text) - value <= (1e-3 if spec == ".3f" else 1e-3 * value)

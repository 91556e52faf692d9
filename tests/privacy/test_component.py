"""The privacy component alone: plan, release, commit, budget and its checkpointed state."""

import math
import pickle
import warnings
from copy import deepcopy

import pytest
import torch

from lit_zodp.errors import AccountingError, LitZodpWarning, PrivacyConfigError
from lit_zodp.privacy import (
    FullBatchSampling,
    GaussianRelease,
    NoiseSource,
    NonPrivate,
    PoissonSampling,
    PrivacyComponent,
    PrivacyLedger,
    ShuffledSampling,
    SinglePassSampling,
    SubsampledGaussian,
    composed_multiplier,
)
from lit_zodp.privacy.spend_log import SpendLog

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


def test_a_float64_clipped_sum_is_released_in_the_asked_dtype_after_the_noise():
    """Zeroth-order modules sum their clipped scalars in float64 and ask for a float32 release: the noise is added
    to the float64 sum, and the one rounding comes last. Without noise (the non-private twin) nothing is rounded."""
    sums = torch.tensor([10.0, 20.0], dtype=torch.float64) + 1e-9
    out = planned(noise_multiplier=1.5, clip=2.0, noise_seed=7).release(sums, "g", batch_size=3, dtype=torch.float32)
    expected = ((sums + NoiseSource(7).gaussian((2,), 3.0, dtype=torch.float64)) / 50.0).float()
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    twin = NonPrivate(clip=math.inf)
    twin.plan(step_plan=PLAN)
    mean = twin.release(sums, "g", batch_size=3, dtype=torch.float32)
    assert mean.dtype == torch.float64 and torch.equal(mean, sums / 3)


def test_each_fit_releases_and_commits_the_clip_sigma_and_neighbours_of_its_plan():
    """Each release's std is made once per plan (``StepConstants``). An independent review found the cache keyed
    on sigma but not on the clip: a clip raised between fits clipped at the new C and added noise for the old
    one (an effective sigma of sigma C_old / C_new, accounted at sigma)."""
    component = PrivacyComponent(clip=1.0, noise_multiplier=2.0, delta=1e-5, noise_seed=3)
    settings = [(1.0, 2.0, "add_remove"), (10.0, 2.0, "add_remove"), (10.0, 3.0, "add_remove"),
                (10.0, 3.0, "replace_one")]
    for steps, (clip, sigma, neighbours) in enumerate(settings):
        # each plan keys the test-seeded source anew, on the stream of the run's steps so far
        z = NoiseSource(3, stream=steps).gaussian((1,), 1.0, dtype=torch.float64).item()
        component.clip, component.configured_noise_multiplier = clip, sigma
        component.neighbours, component.sensitivity_factor = neighbours, 2.0 if neighbours == "replace_one" else 1.0
        component.plan(step_plan=PLAN, sampling=PoissonSampling(n=100, sample_rate=0.1), planned_steps=10)
        released = float(component.release(torch.zeros(1, dtype=torch.float64), "g"))
        assert released == component.sensitivity_factor * sigma * clip * z / 10  # (0 + std z) / B, B = 10
        component.commit_step()
        component.end_fit()
    assert component.ledger.counts == {SubsampledGaussian(2.0, 0.1): 2, SubsampledGaussian(3.0, 0.1): 2}


@pytest.mark.parametrize("setting, value", [("noise_multiplier", 1.0), ("clip", 10.0), ("sensitivity_factor", 2.0),
                                            ("neighbours", "replace_one")])
def test_sigma_clip_and_neighbours_cannot_change_within_a_fit(setting, value):
    """Audit 12 F1: a sigma lowered mid-fit (a callback's schedule) was released and recorded at its new value, but
    ``max_epsilon``'s step count and the spend log's per-step cost kept the planned sigma: a sigma = 3 fit with
    ``max_epsilon = 1`` lowered to 1 at step 5 ran 47 steps and spent epsilon 4.8, and a rollback counted the
    other branch's steps at the old cost. Within a fit these settings are refused; the same value is accepted."""
    component = planned(clip=1.0, noise_multiplier=3.0, max_epsilon=1.0, sampling=PoissonSampling(n=1000, sample_rate=0.1))
    allowed = component.steps_allowed
    setattr(component, setting, getattr(component, setting))
    with pytest.raises(PrivacyConfigError, match=f"`{setting}` cannot change within a fit"):
        setattr(component, setting, value)
    assert getattr(component, setting) != value
    component.release(torch.zeros(1), "g")
    component.commit_step()
    assert component.ledger.counts == {SubsampledGaussian(3.0, 0.1): 1} and component.steps_allowed == allowed - 1
    component.end_fit()
    setattr(component, setting, value)  # between fits: the next plan makes its constants for it
    assert getattr(component, setting) == value


def test_a_commit_outside_a_fit_is_refused():
    with pytest.raises(AccountingError, match="outside a fit"):
        PrivacyComponent(clip=1.0, noise_multiplier=1.0).commit_step()


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
                                  "sampling", "sample_rate", "n", "lineage", "other_branch_steps", "branches",
                                  "noiseless_steps", "poisson_assumed", "test_seeded", "split", "single_pass"}
    assert len(state["plan"]["lineage"]) == 32  # a random 128-bit id: public, it names the run's spend records
    assert list(state["plan"]["branches"].values()) == [1]  # this fit's branch: its one step is in the ledger
    restored = PrivacyComponent(clip=1.0, noise_multiplier=1.0)
    restored.load_state_dict(state)
    assert restored.epsilon() == pytest.approx(component.epsilon(), rel=1e-3) and restored.delta == 1e-5
    assert restored.lineage == component.lineage


def test_an_old_checkpoints_digest_of_the_private_rows_is_neither_read_nor_written_again():
    """Red-team review 17: plans before it kept ``private_split``, a digest of the private rows' ids (texts)."""
    state = planned(noise_multiplier=1.0).state_dict()
    state["plan"]["private_split"] = "a" * 64
    restored = PrivacyComponent(clip=1.0, noise_multiplier=1.0)
    restored.load_state_dict(state)
    assert "private_split" not in restored.state_dict()["plan"] and restored.split is None
    restored.plan(step_plan=PLAN, sampling=POISSON, planned_steps=10, split="b" * 64)  # (no old digest to compare)
    assert "private_split" not in restored.state_dict()["plan"]


def test_a_changed_delta_on_resume_is_refused():
    state = planned(noise_multiplier=1.0).state_dict()
    other = PrivacyComponent(clip=1.0, noise_multiplier=1.0, delta=1e-3)
    other.load_state_dict(state)
    with pytest.raises(PrivacyConfigError, match="delta"):
        other.plan(step_plan=PLAN, sampling=POISSON, planned_steps=10)


def test_single_pass_steps_compose_in_parallel():
    component = planned(steps=50, noise_multiplier=1.0, sampling=SinglePassSampling(n=1000, steps=50),
                        neighbours="replace_one")
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


def test_a_budget_rdp_cannot_certify_is_refused_in_one_line_naming_the_accountant():
    """Opacus's RDP orders stop at 63, so below about log(1/delta)/62 no noise certifies the budget: one line saying
    which accountant can (before, Opacus's bare ValueError "The privacy budget is too low.")."""
    pytest.importorskip("opacus")
    with pytest.raises(PrivacyConfigError, match="accountant='prv'") as caught:
        planned(steps=1000, target_epsilon=0.1, delta=4e-7, accountant="rdp")
    assert "\n" not in str(caught.value)
    assert planned(steps=1000, target_epsilon=0.1, delta=4e-7).noise_multiplier > 0  # PRV accounts it


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
    first = planned(steps=50, noise_multiplier=1.0, sampling=SinglePassSampling(n=1000, steps=50),
                    neighbours="replace_one")
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


@pytest.mark.parametrize("old_checkpoint", [False, "before review 17", "before anchors"])
def test_a_single_pass_continues_only_with_its_own_assignment(old_checkpoint):
    """Red-team review 17: resumed with another batch size (other steps), data (other n) or seed, the pass was drawn
    anew and continued from the old position, reusing examples the ledger counts once. A checkpoint from before it
    keeps n and the rate (steps), not the seed; one from before anchored passes keeps (n, steps, seed), and its pass
    was unanchored: an anchored continuation (another assignment, with the same steps) is refused too."""
    first = planned(steps=50, noise_multiplier=1.0, sampling=SinglePassSampling(n=1000, steps=50, seed=7),
                    neighbours="replace_one")
    for _ in range(20):
        first.release(torch.zeros(()), "g")
        first.commit_step()
    state = first.state_dict()
    assert state["plan"]["single_pass"] == [1000, 50, 7, 1, 1.0]
    if old_checkpoint == "before review 17":
        del state["plan"]["single_pass"]
    elif old_checkpoint == "before anchors":
        state["plan"]["single_pass"] = [1000, 50, 7]
    for n, steps, seed, anchors, refused in [
            (1000, 100, 7, {}, True), (990, 50, 7, {}, True), (1000, 50, 8, {}, old_checkpoint != "before review 17"),
            (1000, 50, 7, dict(anchor_period=5, anchor_weight=5.0), True), (1000, 50, 7, {}, False)]:
        resumed = PrivacyComponent(clip=1.0, noise_multiplier=1.0, delta=1e-5, neighbours="replace_one")
        resumed.load_state_dict(state)
        plan = dict(step_plan=PLAN, sampling=SinglePassSampling(n=n, steps=steps, start=20, seed=seed, **anchors),
                    planned_steps=30)
        if refused:
            with pytest.raises(PrivacyConfigError, match="would be used again, accounted once") as info:
                resumed.plan(**plan)
            assert "\n" not in str(info.value)
        else:
            resumed.plan(**plan)


def test_a_single_pass_fit_planning_more_steps_than_the_pass_is_refused():
    """Audit 7: max_steps beyond the pass made the sampler's length 0 at its end, and the fit waited forever."""
    single = dict(noise_multiplier=1.0, neighbours="replace_one")
    with pytest.raises(PrivacyConfigError, match="plans 51 steps, but the single pass has 50"):
        planned(steps=51, sampling=SinglePassSampling(n=1000, steps=50), **single)
    assert planned(steps=50, sampling=SinglePassSampling(n=1000, steps=50), **single).planned_steps == 50


@pytest.mark.parametrize("n, expected", [(1000, 1e-5), (10**6, 1e-7)])
def test_the_default_delta_is_well_below_one_over_n(n, expected):
    component = planned(noise_multiplier=1.0, delta=None, sampling=PoissonSampling(n=n, sample_rate=0.05))
    assert component.delta == pytest.approx(expected)


@pytest.mark.parametrize("privacy", [dict(noise_multiplier=1.0), dict(target_epsilon=2.0)])
def test_a_delta_of_one_over_n_or_more_is_refused(privacy):
    """A calibrated run used to skip the warning (sigma is resolved after delta): delta 0.01 at n = 1300
    calibrated sigma 0.028 and reported epsilon 0.036; delta 0.5 a negative epsilon (audit 5)."""
    with pytest.raises(PrivacyConfigError, match="publishes one whole random record") as info:
        planned(**privacy, delta=1e-3, sampling=POISSON)
    assert "\n" not in str(info.value)


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


# ------------------------------------------------------------------ forks, copies, rollbacks (audit 4)
def _fit_steps(component: PrivacyComponent, steps: int, spend_dir, state=None) -> dict:
    """One fit of ``steps`` steps with the spend log in ``spend_dir``, continuing ``state``; its state after."""
    if state is not None:
        component.load_state_dict(state)
    component.plan(step_plan=PLAN, sampling=POISSON, planned_steps=100, spend_log=SpendLog(spend_dir))
    for _ in range(steps):
        component.release(torch.zeros(()), "g")
        component.commit_step()
    component.end_fit()
    return component.state_dict()


def test_steps_made_on_another_machine_do_not_hide_a_fork_made_here(tmp_path):
    """4 steps logged elsewhere, then two continuations here of 2 steps each: the second counts the first
    (4 + 2 + 2 = 8). Compared per mechanism, the 4 foreign steps hid the local fork (6)."""
    elsewhere = _fit_steps(PrivacyComponent(clip=1.0, noise_multiplier=1.0), 4, tmp_path / "elsewhere")
    first = PrivacyComponent(clip=1.0, noise_multiplier=1.0)
    _fit_steps(first, 2, tmp_path / "here", elsewhere)
    second = PrivacyComponent(clip=1.0, noise_multiplier=1.0)
    with pytest.warns(UserWarning, match="counts 4 steps, but its run .* released 6"):
        state = _fit_steps(second, 2, tmp_path / "here", elsewhere)
    assert second.ledger.total_count == 8 and second.other_branch_steps == 2
    assert sorted(state["plan"]["branches"].values()) == [2, 2, 4]  # every branch's steps in this ledger


def test_a_checkpoint_of_the_same_run_never_shrinks_a_ledger_that_went_further(tmp_path):
    """Testing the best (earlier) checkpoint after a fit: the model chosen by validation over every
    iterate carries the whole run's epsilon, not the epsilon of the step it was saved at."""
    component = PrivacyComponent(clip=1.0, noise_multiplier=1.0)
    early = _fit_steps(component, 3, tmp_path)
    _fit_steps(component, 5, tmp_path)
    epsilon = component.epsilon()
    component.load_state_dict(early)
    assert component.ledger.total_count == 8 and component.epsilon() == epsilon
    fresh = PrivacyComponent(clip=1.0, noise_multiplier=1.0)
    fresh.load_state_dict(early)  # another module (load_from_checkpoint): the checkpoint's own ledger
    assert fresh.ledger.total_count == 3


def test_a_step_that_released_twice_is_counted_twice_before_it_raises():
    component = planned(noise_multiplier=1.0)
    component.release(torch.zeros(()), "g")
    component.release(torch.zeros(()), "g")
    with pytest.raises(AccountingError, match="released"):
        component.commit_step()
    assert component.ledger.total_count == 2 and component.steps_allowed is None


def test_the_secret_noise_source_is_gone_after_the_fit_and_from_every_copy(tmp_path):
    component = PrivacyComponent(clip=1.0, noise_multiplier=1.0)
    component.plan(step_plan=PLAN, sampling=POISSON, planned_steps=10)
    assert isinstance(component.noise, NoiseSource)
    for copy in (pickle.loads(pickle.dumps(component)), deepcopy(component)):
        assert copy.noise is None and b"NoiseSource" not in pickle.dumps(copy)
        with pytest.raises(AccountingError, match="outside a fit"):
            copy.release(torch.zeros(()), "g")
    component.end_fit()
    assert component.noise is None and b"NoiseSource" not in pickle.dumps(component)


def test_an_optimizer_not_attached_to_the_ledger_is_refused():
    component = planned(noise_multiplier=1.0)
    attached, other = (torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1) for _ in range(2))
    component.attach(attached)
    component.require_attached([attached])
    with pytest.raises(PrivacyConfigError, match="SGD was not built by the private module's configure_optimizers"):
        component.require_attached([attached, other])


def steps(component, count):
    for _ in range(count):
        component.release(torch.zeros(()), "g")
        component.commit_step()
    return component


def test_a_budget_below_the_calibration_target_is_refused_for_a_new_run_only():
    """Before: calibrated to spend 2 over the plan, stopped by max_epsilon 1 (or before its first step), exit 0."""
    with pytest.raises(PrivacyConfigError, match=r"`max_epsilon` >= `target_epsilon`.* max_epsilon=1 < target_eps"):
        planned(target_epsilon=2.0, max_epsilon=1.0)
    state = steps(planned(steps=20, target_epsilon=2.0), 10).state_dict()
    stricter = PrivacyComponent(clip=1.0, delta=1e-5, target_epsilon=2.0, max_epsilon=1.0)  # a resume: sigma is kept
    stricter.load_state_dict(state)
    stricter.plan(step_plan=PLAN, sampling=POISSON, planned_steps=20)
    assert stricter.budget == 1.0


def test_a_noiseless_ablation_counts_its_steps_outside_the_ledger():
    """Before: sigma = 0 reported "after 0 steps" (the ledger records nothing at sigma 0, rightly)."""
    component = steps(planned(noise_multiplier=0.0), 5)
    assert component.steps == 5 and component.ledger.counts == {} and component.epsilon() == math.inf
    assert component.summary().startswith("not private: epsilon = inf after 5 steps (sigma = 0")
    resumed = PrivacyComponent(clip=1.0, noise_multiplier=0.0)
    resumed.load_state_dict(component.state_dict())
    resumed.plan(step_plan=PLAN, sampling=POISSON, planned_steps=10)
    assert steps(resumed, 3).steps == 8 and resumed.ledger.counts == {}
    noised = steps(planned(noise_multiplier=1.0), 5)
    assert noised.steps == noised.ledger.total_count == 5 and noised.noiseless_steps == 0


def test_a_budget_never_binds_a_noiseless_run_configured_or_restored():
    """Audit 6: resuming a noiseless ablation's checkpoint with ``target_epsilon`` took its sigma (0) and trained
    on without noise and without a budget (epsilon inf, steps_allowed None); ``noise_multiplier=0`` with
    ``max_epsilon`` was accepted the same way."""
    with pytest.raises(PrivacyConfigError, match=r"`max_epsilon`=3.0 cannot bind a noiseless run"):
        PrivacyComponent(clip=1.0, noise_multiplier=0.0, max_epsilon=3.0)
    ablation = steps(planned(noise_multiplier=0.0), 5).state_dict()
    for budget in (dict(target_epsilon=3.0), dict(target_epsilon=3.0, max_epsilon=3.0)):
        resumed = PrivacyComponent(clip=1.0, delta=1e-5, **budget)
        resumed.load_state_dict(ablation)
        with pytest.raises(PrivacyConfigError, match=r"budget \(epsilon 3\b.*`noise_multiplier`=0 \(the checkpoint's"):
            resumed.plan(step_plan=PLAN, sampling=POISSON, planned_steps=100)
        assert resumed.noise is None
    unbudgeted = PrivacyComponent(clip=1.0, noise_multiplier=0.0)  # continuing the ablation as one stays allowed
    unbudgeted.load_state_dict(ablation)
    unbudgeted.plan(step_plan=PLAN, sampling=POISSON, planned_steps=100)
    assert steps(unbudgeted, 2).steps == 7


def test_a_shuffled_runs_epsilon_says_it_assumes_poisson_sampling():
    """Before: the summary printed the Poisson epsilon of shuffled batches like a guarantee."""
    shuffled = steps(planned(noise_multiplier=1.0, sampling=ShuffledSampling(n=1000, sample_rate=0.05)), 3)
    assert shuffled.poisson_assumed
    assert "upper bound ASSUMING POISSON SAMPLING, which shuffled batches do not satisfy" in shuffled.summary()
    loaded = PrivacyComponent(clip=1.0, noise_multiplier=1.0)
    loaded.load_state_dict(shuffled.state_dict())  # e.g. load_from_checkpoint, then `lightning test`
    assert loaded.poisson_assumed
    poisson = steps(planned(noise_multiplier=1.0), 3)
    assert not poisson.poisson_assumed and "POISSON" not in poisson.summary()


def test_a_checkpoint_loaded_after_a_fit_is_the_run_the_next_fit_continues():
    """Review 31: a second fit takes its run's plan (sigma, delta, budget); a checkpoint of another run loaded between
    the fits is that run, whose budget is stated at its own delta (1e-6 here, not the first fit's 1e-5)."""
    other = steps(planned(steps=50, target_epsilon=2.0, delta=1e-6), 5)
    other.end_fit()
    component = steps(planned(steps=200, target_epsilon=3.0, delta=None), 5)
    component.end_fit()
    component.load_state_dict(other.state_dict())
    with pytest.raises(PrivacyConfigError, match="`delta`=1e-05 differs from the checkpoint's delta=1e-06"):
        component.plan(step_plan=PLAN, sampling=POISSON, planned_steps=300)
    component.delta = 1e-6  # (as configured for the resume)
    component.load_state_dict(other.state_dict())
    component.plan(step_plan=PLAN, sampling=POISSON, planned_steps=300)
    assert component.noise_multiplier == other.noise_multiplier and component.budget == 2.0


def test_a_refused_resume_saves_the_checkpoints_plan_not_its_own_partial_one():
    """Review 31: a resume refused at its plan (another delta) had set its sampling, so its state (an
    ``OnExceptionCheckpoint``) took the partial plan: budget None, delta 1e-6. Resumed from it with sigma 1 and no
    budget, 10 steps at epsilon 2 went on for 30 more, to epsilon 5.23; the run's budget of 2 was gone."""
    run = steps(planned(steps=10, target_epsilon=2.0), 10)
    run.end_fit()
    resumed = PrivacyComponent(clip=1.0, target_epsilon=2.0, delta=1e-6)
    resumed.load_state_dict(run.state_dict())
    with pytest.raises(PrivacyConfigError, match="differs from the checkpoint's delta"):
        resumed.plan(step_plan=PLAN, sampling=POISSON, planned_steps=40)
    plan = resumed.state_dict()["plan"]
    assert (plan["budget"], plan["delta"], plan["noise_multiplier"]) == (2.0, 1e-5, run.noise_multiplier)
    after = PrivacyComponent(clip=1.0, noise_multiplier=1.0)
    after.load_state_dict(resumed.state_dict())
    after.plan(step_plan=PLAN, sampling=POISSON, planned_steps=40)
    assert after.budget == 2.0 and after.steps_allowed == 0


def test_a_resume_refused_after_counting_other_branches_saves_their_steps_with_the_ledger(tmp_path):
    """Review 35: a resume refused after its plan counted the run's other branches (3 steps beyond the checkpoint, 2 of
    a shuffled fork: ledger 8) saved the checkpoint's branch map (3) and no mark with that ledger, so a resume of the
    file counted them again (13 steps where 8 ran) and, elsewhere, showed the shuffled steps as a guarantee."""
    def fitted(component, sampling=POISSON, planned_steps=100):
        component.plan(step_plan=PLAN, sampling=sampling, planned_steps=planned_steps, spend_log=SpendLog(tmp_path))
        return component

    run = fitted(PrivacyComponent(clip=1.0, noise_multiplier=1.0, delta=1e-5))
    checkpoint = steps(run, 3).state_dict()
    steps(run, 3).end_fit()
    fork = PrivacyComponent(clip=1.0, noise_multiplier=1.0, delta=1e-5)
    fork.load_state_dict(checkpoint)
    steps(fitted(fork, ShuffledSampling(n=1000, sample_rate=0.05)), 2).end_fit()
    refused = PrivacyComponent(clip=1.0, noise_multiplier=0.1, delta=1e-5)
    refused.load_state_dict(checkpoint)
    with pytest.warns(UserWarning, match="released 8 in all branches"), pytest.raises(AccountingError):
        fitted(refused, planned_steps=100_000)
    saved = refused.state_dict()
    elsewhere = PrivacyComponent(clip=1.0, noise_multiplier=1.0, delta=1e-5)
    elsewhere.load_state_dict(saved)
    assert elsewhere.ledger.total_count == 8 and elsewhere.poisson_assumed
    resumed = PrivacyComponent(clip=1.0, noise_multiplier=1.0, delta=1e-5)
    resumed.load_state_dict(saved)
    assert fitted(resumed).ledger.total_count == 8 and resumed.poisson_assumed


def test_a_release_pending_in_a_pickled_component_is_in_the_spend_log_for_a_rollback(tmp_path):
    """Review 35: a module pickled between a release and its commit (its fit's end never ran) carries the release in
    its weights; the copy's next fit commits it (4 steps), but its spend log writes nothing, so after the original's
    process ended a rollback to step 2 counted 2 + 1 + 2 = 5 of the 4 + 2 released."""
    run = PrivacyComponent(clip=1.0, noise_multiplier=1.0, delta=1e-5)
    run.plan(step_plan=PLAN, sampling=POISSON, planned_steps=100, spend_log=SpendLog(tmp_path))
    checkpoint = steps(run, 2).state_dict()
    steps(run, 1).release(torch.zeros(()), "g")
    copy = pickle.loads(pickle.dumps(run))  # (the original's process ends here)
    copy.plan(step_plan=PLAN, sampling=POISSON, planned_steps=100, spend_log=SpendLog(tmp_path))
    assert copy.ledger.total_count == 4
    steps(copy, 2).end_fit()
    rollback = PrivacyComponent(clip=1.0, noise_multiplier=1.0, delta=1e-5)
    rollback.load_state_dict(checkpoint)
    with pytest.warns(UserWarning, match="released 6 in all branches"):
        rollback.plan(step_plan=PLAN, sampling=POISSON, planned_steps=100, spend_log=SpendLog(tmp_path))
    assert rollback.ledger.total_count == 6


def test_a_next_fit_without_the_noise_seed_keeps_the_runs_test_seeded_mark():
    """Review 35: 4 steps with a test ``noise_seed``, then a fit of the same component without it, showed epsilon 1.526
    after 6 steps as a guarantee, and saved ``test_seeded`` False (a resume kept the mark since review 31)."""
    component = steps(planned(noise_multiplier=1.0, noise_seed=7), 4)
    component.end_fit()
    component.noise_seed = None
    component.plan(step_plan=PLAN, sampling=POISSON, planned_steps=100)
    steps(component, 2).end_fit()
    assert component.test_seeded and component.state_dict()["plan"]["test_seeded"]
    assert "after 6 steps" in component.summary() and "REPRODUCIBLE" in component.summary()


def test_the_summary_shows_the_sigma_and_rate_the_ledgers_steps_ran_at():
    """Review 31: 10 steps at sigma 1, q 0.05, then a fit of 15 at sigma 0.8, q 0.1 read ``after 25 steps (...;
    sigma = 0.8, poisson, q = 0.1)``; a later fit that took no step showed its own plan, which never ran."""
    component = steps(planned(noise_multiplier=1.0), 10)
    component.end_fit()
    assert component.summary().endswith("after 10 steps (PRV accountant, upper bound; sigma = 1, poisson, q = 0.05)")
    component.configured_noise_multiplier = 0.8  # (as a resume configured with another sigma)
    component.plan(step_plan=PLAN, sampling=PoissonSampling(n=1000, sample_rate=0.1), planned_steps=100)
    steps(component, 15).end_fit()
    assert component.summary().endswith("after 25 steps (PRV accountant, upper bound; steps by noise multiplier per "
                                        "step: 10 at 1 (q = 0.05), 15 at 0.8 (q = 0.1))")
    component.plan(step_plan=(GaussianRelease("a"), GaussianRelease("b")), sampling=POISSON, planned_steps=100)
    assert "25 steps (PRV accountant, upper bound; steps by noise multiplier per step: 10 at 1 (q = 0.05), 15 at " \
           "0.8 (q = 0.1))" in component.summary()  # (a fit of two releases per step, 0.5657 each: none ran)


def test_the_summary_names_the_accountant_used():
    """Before: "PRV accountant" under accountant="rdp" too."""
    assert "(PRV accountant, upper bound;" in steps(planned(noise_multiplier=1.0), 2).summary()
    assert "(RDP accountant, upper bound;" in steps(planned(noise_multiplier=1.0, accountant="rdp"), 2).summary()


def test_a_new_run_whose_budget_allows_no_step_is_refused_and_a_spent_resume_is_not():
    """Acceptance test (2026-11-28): sigma 0.3 with max_epsilon 3 planned 0 steps, trained none and ended with rc 0
    and 'epsilon=0.000', as if it had run. A new run is refused at its plan; a resumed run whose ledger spent the
    budget plans 0 steps (its fit ends at once, saying so)."""
    with pytest.raises(PrivacyConfigError, match=r"allows no step at `noise_multiplier`=0.3: one step spends epsilon "):
        planned(noise_multiplier=0.3, max_epsilon=3.0)
    spent = PrivacyComponent(clip=1.0, delta=1e-5, noise_multiplier=0.3, max_epsilon=3.0)
    spent.ledger.record(SubsampledGaussian(1.0, 0.5), 50)  # epsilon 25.8 (100k steps at q 0.05: 65 s of FFTs)
    spent.plan(step_plan=PLAN, sampling=POISSON, planned_steps=10)
    assert spent.steps_allowed == 0 and spent.budget_exhausted


def test_a_fit_sampling_otherwise_than_the_runs_last_is_named_in_one_line():
    """Acceptance test (2026-11-28): a resume with another batch size (q 0.0495 -> 0.0989) or another validation
    share (another n) said nothing; only the final summary's q showed it. Accounting it is right; now it is said."""
    first = planned(noise_multiplier=1.0)
    first.end_fit()
    assert first.sampling_change(POISSON) is None  # the same again (a second fit in this process)
    doubled = PoissonSampling(n=1000, sample_rate=0.1)
    assert first.sampling_change(doubled) == ("This fit samples poisson with q = 0.1 of n = 1000 private examples; "
                                              "the run's steps so far sampled poisson with q = 0.05 of n = 1000: "
                                              "each step is accounted at its own rate")
    resumed = PrivacyComponent(clip=1.0, delta=1e-5, noise_multiplier=1.0)
    assert resumed.sampling_change(doubled) is None  # a new run: nothing before it
    resumed.load_state_dict(first.state_dict())
    assert resumed.sampling_change(POISSON) is None and "n = 900 private" in resumed.sampling_change(
        PoissonSampling(n=900, sample_rate=0.05))


def test_a_configured_budget_above_the_runs_is_named_in_one_line_and_the_runs_binds():
    """Review 31: a Python resume with `target_epsilon` 5 of a run budgeted at 2 kept 2, saying only that it allowed
    no more step. The configured budget is now named as dropped; one at or below the run's says nothing."""
    first = PrivacyComponent(clip=1.0, delta=1e-5, target_epsilon=2.0)
    first.plan(step_plan=PLAN, sampling=POISSON, planned_steps=10)
    first.end_fit()
    larger = PrivacyComponent(clip=1.0, delta=1e-5, target_epsilon=5.0)
    larger.load_state_dict(first.state_dict())
    with pytest.warns(LitZodpWarning, match=r"^The configured budget epsilon=5 .* above this run's budget 2 "):
        larger.plan(step_plan=PLAN, sampling=POISSON, planned_steps=10)
    assert larger.budget == 2.0
    stricter = PrivacyComponent(clip=1.0, delta=1e-5, target_epsilon=2.0, max_epsilon=1.5)
    stricter.load_state_dict(first.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error", LitZodpWarning)
        stricter.plan(step_plan=PLAN, sampling=POISSON, planned_steps=10)
    assert stricter.budget == 1.5

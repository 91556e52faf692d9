"""The privacy contract: every registered algorithm, today's and every later one, must pass these.

Parametrized over ``lit_zodp.algorithms.ALGORITHMS`` (filled as algorithm classes are defined), so a
new private module is checked the moment it exists. Each check fails if the noise, the clipping,
the sampling or the accounting were wrong. DDP (2 gloo processes == 1 process) is in test_ddp.py,
parametrized over the same registry.
"""

import math
import pickle
import traceback
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from lit_zodp.algorithms import ALGORITHMS, ZerothOrderModule
from lit_zodp.algorithms.base import AlgorithmModule
from lit_zodp.algorithms.first_order import FirstOrderModule
from lit_zodp.algorithms.dpzero import DERIVATIVES, DPZero
from lit_zodp.callbacks.audit import CanaryAudit
from lit_zodp.errors import AccountingError, ConfigError, PrivacyConfigError
from lit_zodp.privacy import (FullBatchSampler, GaussianRelease, NoiseSource, PoissonBatchSampler, PrivacyComponent,
                              PrivacyLedger)
from lit_zodp.privacy.plan import composed_multiplier
from lit_zodp.privacy.audit import accounted_mu, epsilon_lower_bound, gaussian_epsilon, gaussian_mu, gaussian_spread
from tests.conftest import (ALGORITHM_KWARGS, TokenBag, blobs, collate_tensors, fixed_batches_loader, mlp,
                            poisson_loader, quiet_trainer, token_loader, with_public_data)

PRIVATE = sorted(name for name, cls in ALGORITHMS.items() if cls.private)
EVERY = sorted(ALGORITHMS)
#: Variants of a registered algorithm, ``"Class[variant]"``, checked as its class is: the class from
#: :func:`algorithm_class`, the options from ``ALGORITHM_KWARGS[variant]`` (tests/conftest.py). DPO2NC's first-order
#: oracle (Alg. 5) is another estimator behind the same class.
VARIANTS = ("DPO2NC[first_order]",)


def algorithm_class(name):
    """The registered class of ``name``: an algorithm's name or a variant's (``"Class[variant]"``)."""
    return ALGORITHMS[name.split("[", 1)[0]]


def class_name(name):
    """The registered class's name of an algorithm or a variant (the key of the class-wide sets below)."""
    return algorithm_class(name).__name__


def twin_of(name):
    """The non-private twin of an algorithm or a variant (``"DPO2NC[first_order]"``: ``"O2NC[first_order]"``)."""
    twin = algorithm_class(name).non_private_twin
    return twin if twin is None or "[" not in name else twin + name[name.index("["):]


#: The private algorithms and the private variants: the cases of every check a private module must pass.
PRIVATE_CASES = PRIVATE + [name for name in VARIANTS if algorithm_class(name).private]
#: Every algorithm, the variants and their non-private twins: the cases of the checks every module must pass.
EVERY_CASES = EVERY + list(VARIANTS) + [twin_of(name) for name in VARIANTS if twin_of(name)]
#: The modules that run every variant of a check that is a product of variants and modules in the default suite: the
#: two bases' steps (zeroth and first order).
EVERY_VARIANT = ("DPZero", "DPSGD")


#: DPGD-0th and DP-Adam share DPZero's and DP-SGD's steps but for the release: in the five longest checks of one
#: case a module (:func:`sharing`) they run with ``-m slow``, as in the DDP tests.
SHARED_PATHS = ("DPGD0th", "DPAdam")


def sharing(names=PRIVATE_CASES) -> list:
    """``names``, those of :data:`SHARED_PATHS` marked ``slow`` (the default suite's budget, stop 59)."""
    return [pytest.param(name, marks=pytest.mark.slow) if name in SHARED_PATHS else name for name in names]


def spread(variants, names=PRIVATE_CASES) -> list:
    """The cases ``(*variant, name)`` of the product ``variants x names``: in the default suite every variant on
    :data:`EVERY_VARIANT`'s modules and one variant on each other module (rotating, so each variant meets several
    modules); the rest with ``-m slow``. The full products took about a tenth of the default suite (stop 59: 942 s on
    two cores, over its 15-minute budget)."""
    cases = []
    for i, name in enumerate(names):
        for j, variant in enumerate(variants):
            default = name in EVERY_VARIANT or j == i % len(variants)
            values = variant if isinstance(variant, tuple) else (variant,)
            cases.append(pytest.param(*values, name, marks=() if default else pytest.mark.slow))
    return cases


def backprops_private_rows(name):
    """Whether a private step runs a backward through private examples: the first-order classes, and a zeroth-order
    class's first-order estimator (DPO2NC's Alg. 5)."""
    return (not issubclass(algorithm_class(name), ZerothOrderModule)
            or ALGORITHM_KWARGS.get(name, {}).get("estimator") == "first_order")


pytestmark = pytest.mark.filterwarnings("ignore:`(noise|sampling)_seed` is set", "ignore:.*ckpt_path.*",
                                        "ignore:.*dataloader is not resumable.*", "ignore:.*pre-optimization.*")


def test_the_registry_holds_todays_algorithms():
    assert {"DPZero", "DPGD0th"} <= set(PRIVATE) and "MeZO" in EVERY and "MeZO" not in PRIVATE


def build(name, backbone=None, cls=None, **overrides):
    cls = cls or algorithm_class(name)
    kwargs = dict(lr=0.05, seed=3) | ALGORITHM_KWARGS.get(name, ALGORITHM_KWARGS.get(class_name(name), {}))
    if cls.private:
        kwargs |= dict(clip=1.0, noise_multiplier=1.0, delta=1e-5)
    return with_public_data(cls(backbone if backbone is not None else mlp(seed=1), **(kwargs | overrides)))


def flat(module):
    return torch.cat([p.detach().flatten().double() for p in module.backbone.parameters()]).clone()


def recorded_releases(monkeypatch) -> list:
    """The values every :meth:`PrivacyComponent.release` returns from now on, in order (clear it between runs)."""
    released, release = [], PrivacyComponent.release
    monkeypatch.setattr(PrivacyComponent, "release",
                        lambda self, *args, **kwargs: released.append(release(self, *args, **kwargs)) or released[-1])
    return released


def releases_of(released: list) -> torch.Tensor:
    assert released, "a module in AUDITED_ELSEWHERE releases through PrivacyComponent.release"
    return torch.cat([value.detach().double().reshape(-1) for value in released])


class Trace(Callback):
    def __init__(self):
        self.before, self.after, self.sizes = [], [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before.append(flat(module))
        self.sizes.append(len(batch[1]))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after.append(flat(module))


def fit(module, loader, steps, callbacks=(), **trainer_kwargs):
    trainer = quiet_trainer(max_steps=steps, callbacks=list(callbacks), **trainer_kwargs)
    trainer.fit(module, loader)
    return trainer


def full_batch_loader(dataset, steps):
    return DataLoader(dataset, batch_sampler=FullBatchSampler(len(dataset), steps_per_epoch=steps),
                      collate_fn=collate_tensors)


# --------------------------------------------------------------------------------- graph
@pytest.mark.parametrize("name", EVERY_CASES)
def test_a_private_batch_never_enters_an_autograd_graph(name):
    if backprops_private_rows(name):
        pytest.skip("first-order algorithms (and O2NC's first-order oracle) backprop through clipped per-example "
                    "gradients")
    seen = []
    backbone = mlp(seed=1)
    module = build(name, backbone)
    for layer in backbone.modules():
        layer.register_forward_hook(lambda m, i, out: seen.append((module.public_forward, torch.is_grad_enabled(),
                                                                    out.requires_grad)))
    fit(module, poisson_loader(blobs(), 0.25), 3)
    private = [state[1:] for state in seen if not state[0]]
    assert private and all(state == (False, False) for state in private)
    assert all(p.grad is None for p in backbone.parameters())
    # PAZO backprops through its public batches only, every step
    assert any(state == (True, True, True) for state in seen) == bool(getattr(module, "needs_public_batches", False))


# ------------------------------------------------------------------------------ release
@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_the_released_sum_is_divided_by_the_expected_batch_size(name, monkeypatch):
    """released * B == all-reduced clipped sum + the one noise draw, with B = q n, whatever the realized size."""
    calls, draws = [], []
    original_release, original_along = PrivacyComponent.release, PrivacyComponent.release_along
    original_noised = NoiseSource.noised  # every scalar or vector release's noise is added here

    def noised(self, x, std, *, divisor=1.0, dtype=None):
        draws.append((x.detach().clone(), divisor, original_noised(self, x, std, divisor=divisor, dtype=dtype)))
        return draws[-1][2]

    def release(self, clipped_sum, *args, **kwargs):
        out = original_release(self, clipped_sum, *args, **kwargs)
        calls.append(("scalar", clipped_sum.detach().clone(), out, draws[-1]))
        return out

    def along(self, clipped_sum, *args, **kwargs):
        out = original_along(self, clipped_sum, *args, **kwargs)
        calls.append(("vector", clipped_sum.detach().clone(), out, None))
        return out

    monkeypatch.setattr(NoiseSource, "noised", noised)
    monkeypatch.setattr(PrivacyComponent, "release", release)
    monkeypatch.setattr(PrivacyComponent, "release_along", along)
    dataset, q = blobs(n=256), 0.25
    sigma, clip, B = 1.3, 0.7, 0.25 * 256
    trace = Trace()
    module = build(name, noise_multiplier=sigma, clip=clip)
    fit(module, poisson_loader(dataset, q, seed=2), 6, [trace])
    assert len(calls) == 6 * len(module.privacy.step_plan) and any(size != B for size in trace.sizes)
    for kind, clipped_sum, out, noise in calls:
        if kind == "scalar":
            given, divisor, noised_out = noise
            torch.testing.assert_close(given, clipped_sum, rtol=0, atol=0)  # the all-reduced sum is noised
            assert divisor == B and out is noised_out  # ... and divided by B (in float64, before the rounding)
            assert (out.double() * B - given.double()).abs().sum() > 0  # a real draw was added
            if issubclass(algorithm_class(name), ZerothOrderModule):  # scalars: summed in float64, rounded after noise
                assert given.dtype == torch.float64 and out.dtype == torch.float32
        else:
            torch.testing.assert_close(out.coefficient * B, clipped_sum, rtol=1e-6, atol=1e-6)
            assert out.noise_coefficient == pytest.approx(sigma * clip / B)


class FailingUpdate(Callback):
    """The 5th optimizer step writes its update into the weights, then fails before its post-hooks run (an update
    failing part-way: out of memory for a chunk's scratch, an interrupt)."""

    def __init__(self, step=4):
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step:
            optimizer, self.before = trainer.optimizers[0], flat(module)

            def step(closure=None):
                type(optimizer).step.__wrapped__(optimizer, closure)  # the update, without the post-hooks
                raise RuntimeError("the update failed part-way")

            optimizer.step = step


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_release_whose_optimizer_step_failed_part_way_is_counted(name, tmp_path):
    """Review 25: the 5th release reached the weights, but no post-hook committed it, so the ledger, the "Privacy spent
    before the fit failed" line and `OnExceptionCheckpoint`'s file counted 4 steps for 5 releases."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    module, failing = build(name), FailingUpdate()
    with pytest.raises(RuntimeError, match="failed part-way"):
        fit(module, poisson_loader(blobs(), 0.25), 10, [failing, OnExceptionCheckpoint(dirpath=tmp_path)],
            enable_checkpointing=True)
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)
    weights = torch.cat([saved["state_dict"][f"backbone.{n}"].flatten().double()
                         for n, _ in module.backbone.named_parameters()])
    assert not torch.equal(weights, failing.before)  # the 5th release is in the saved weights
    assert module.privacy.ledger.total_count == 5
    assert [entry["count"] for entry in saved["privacy"]["ledger"]["entries"]] == [5]


class RaisingOnException(Callback):
    """A user's callback whose own ``on_exception`` raises: Lightning runs no later callback's ``on_exception`` (the
    privacy callback's commit of the pending release), no teardown and no fit end."""

    def on_exception(self, trainer, module, exception):
        raise RuntimeError("the user's on_exception failed too")


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_release_pending_when_the_fit_end_never_ran_is_counted_in_checkpoints_and_the_next_fit(name, tmp_path):
    """The 5th release reached the weights; a callback's raising ``on_exception`` skipped every commit of it. A
    checkpoint the user saves then, and the module's next fit, still count 5 steps (before: 4, and the next fit's
    plan dropped the pending release)."""
    module, failing = build(name), FailingUpdate()
    trainer = quiet_trainer(max_steps=10, callbacks=[RaisingOnException(), failing])
    with pytest.raises(RuntimeError, match="on_exception failed too"):
        trainer.fit(module, poisson_loader(blobs(), 0.25))
    assert module.privacy.in_fit and module.privacy.ledger.total_count == 4  # the fit's end never ran
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    saved = torch.load(tmp_path / "after.ckpt", weights_only=False)
    assert [entry["count"] for entry in saved["privacy"]["ledger"]["entries"]] == [5]
    fit(module, poisson_loader(blobs(), 0.25), 2)
    assert module.privacy.ledger.total_count == 7 and module.privacy.fit_steps == 2


@pytest.mark.parametrize("name", sharing())
def test_a_checkpoint_loaded_into_a_module_whose_fit_end_never_ran_takes_no_pending_release(name, tmp_path):
    """Review 35: the module's next plan committed the failed fit's pending release into the ledger loaded since, so
    resuming the checkpoint saved after the failure (5 steps) to step 7 counted 5 + 1 + 3 = 9 where 8 ran, and another
    run's checkpoint (3 steps) failed the plan with a KeyError (the failed fit's branch is not in its branch map)."""
    module = build(name)
    trainer = quiet_trainer(max_steps=10, callbacks=[RaisingOnException(), FailingUpdate()])
    with pytest.raises(RuntimeError, match="on_exception failed too"):
        trainer.fit(module, poisson_loader(blobs(), 0.25))
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    quiet_trainer(max_steps=7).fit(module, poisson_loader(blobs(), 0.25), ckpt_path=tmp_path / "after.ckpt")
    assert module.privacy.ledger.total_count == 8 and sorted(module.privacy.branches.values()) == [3, 5]
    other = fit(build(name), poisson_loader(blobs(), 0.25), 3)
    other.save_checkpoint(tmp_path / "other.ckpt")
    module = build(name)
    with pytest.raises(RuntimeError, match="on_exception failed too"):
        quiet_trainer(max_steps=10, callbacks=[RaisingOnException(), FailingUpdate()]).fit(
            module, poisson_loader(blobs(), 0.25))
    quiet_trainer(max_steps=5).fit(module, poisson_loader(blobs(), 0.25), ckpt_path=tmp_path / "other.ckpt")
    assert module.privacy.ledger.total_count == 5 and module.privacy.fit_steps == 2


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_noiseless_release_pending_when_the_fit_end_never_ran_is_in_the_checkpoints_noiseless_steps(name, tmp_path):
    """Review 33: a sigma = 0 ablation whose 1st update reached the weights and whose fit's end never ran saved
    ``noiseless_steps`` 0, so a resume with noise took it for a private run (epsilon finite, the clipped sum itself in
    the weights); the pending step is now one noiseless step, and the resume is refused."""
    module = build(name, noise_multiplier=0.0)
    trainer = quiet_trainer(max_steps=10, callbacks=[RaisingOnException(), FailingUpdate(step=0)])
    with pytest.raises(RuntimeError, match="on_exception failed too"):
        trainer.fit(module, poisson_loader(blobs(), 0.25))
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert torch.load(tmp_path / "after.ckpt", weights_only=False)["privacy"]["plan"]["noiseless_steps"] == 1
    with pytest.raises(PrivacyConfigError, match="already took 1 steps with `noise_multiplier`=0"):
        quiet_trainer(max_steps=3).fit(build(name), poisson_loader(blobs(), 0.25), ckpt_path=tmp_path / "after.ckpt")


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_checkpoint_holding_a_pending_release_puts_it_in_the_spend_log_for_a_rollback(name, tmp_path):
    """Review 33: the checkpoint saved after the fit's end never ran counts the 5th release, but the spend log logs a
    step at its commit and the process ended before one: a rollback to step 2 counted 2 + 2 logged + 2 new = 6 steps
    where the run released 5 + 2 = 7 (both checkpoints published). Saving a pending release logs it; its commit does
    not log it again."""
    every_step = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=1, filename="{step}")
    trainer = quiet_trainer(max_steps=10, callbacks=[RaisingOnException(), FailingUpdate(), every_step],
                            enable_checkpointing=True)
    with pytest.raises(RuntimeError, match="on_exception failed too"):
        trainer.fit(build(name), poisson_loader(blobs(), 0.25))
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    trainer.save_checkpoint(tmp_path / "again.ckpt")  # (logged once)
    resumed = build(name)  # (the failed fit's process ended: its module is never fitted again)
    with pytest.warns(UserWarning, match="counts 2 steps, but its run .* released 5 in all branches"):
        quiet_trainer(max_steps=4).fit(resumed, poisson_loader(blobs(), 0.25), ckpt_path=tmp_path / "step=2.ckpt")
    assert resumed.privacy.ledger.total_count == 7


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_pending_release_logged_by_a_checkpoint_is_not_logged_again_by_its_commit(name, tmp_path):
    """The mid-step checkpoint logs the 3rd step; the step then commits, and the fit runs to 6: the branch logs 6, and
    a resume there (ledger 3) to step 3 counts 6 + 1 new."""
    fit(build(name), poisson_loader(blobs(), 0.25), 6, [SaveBeforeTheThirdStepCommits(tmp_path / "mid.ckpt")])
    resumed = build(name)
    with pytest.warns(UserWarning, match="released 6 in all branches"):
        quiet_trainer(max_steps=3).fit(resumed, poisson_loader(blobs(), 0.25), ckpt_path=tmp_path / "mid.ckpt")
    assert resumed.privacy.ledger.total_count == 7


class SaveBeforeTheThirdStepCommits(Callback):
    """A user's callback that saves a checkpoint inside the 3rd optimizer step, after its release, before its commit
    (``on_before_optimizer_step``: the ledger counts 2 steps, and the 3rd is pending)."""

    def __init__(self, path):
        self.path = path

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.global_step == 2:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_checkpoint_written_between_a_release_and_its_commit_is_resumed_without_counting_the_step_twice(
        name, tmp_path):
    """Review 33: such a checkpoint's ledger counts the pending 3rd step (3), but its branch map said 2, so a resume
    added 4 of the branch's 6 logged steps ("released 7 in all branches"): 7 + 3 new = 10 where the run released
    6 + 3 = 9."""
    path = tmp_path / "mid_step.ckpt"
    fit(build(name), poisson_loader(blobs(), 0.25), 6, [SaveBeforeTheThirdStepCommits(path)])
    saved = torch.load(path, weights_only=False)["privacy"]
    assert saved["ledger"]["entries"][0]["count"] == 3 and list(saved["plan"]["branches"].values()) == [3]
    resumed = build(name)
    with pytest.warns(UserWarning, match="counts 3 steps, but its run .* released 6 in all branches"):
        quiet_trainer(max_steps=5).fit(resumed, poisson_loader(blobs(), 0.25), ckpt_path=path)
    assert resumed.privacy.ledger.total_count == 9 and resumed.privacy.other_branch_steps == 3


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_collate_making_inference_tensors_for_its_rows_trains_whatever_batches_are_empty(name):
    """Review 27: a collate computing its rows' features under ``torch.inference_mode()`` (a frozen encoder) and
    returning plain zero rows for an empty batch failed a first-order fit at the first batch holding an example
    ("Inference tensors cannot be saved for backward"), after one step per empty batch before it: 0, 1 or 2 steps as
    the first batches were empty or not. Every private module now trains every step."""
    data = blobs(n=20)
    x0, y0 = data[0]

    def collate(items):
        if not items:
            return x0.unsqueeze(0)[:0].clone(), y0.unsqueeze(0)[:0].clone()
        with torch.inference_mode():
            x, y = collate_tensors(items)
            return x * 1.0, y.clone()

    for seed in range(3):
        module = build(name)
        loader = DataLoader(data, batch_sampler=PoissonBatchSampler(20, 0.05, seed=seed, steps_per_epoch=10),
                            collate_fn=collate)
        assert fit(module, loader, 10).global_step == 10 == module.privacy.ledger.total_count


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_an_empty_poisson_batch_still_adds_noise_and_counts_a_step(name):
    trace = Trace()
    module = build(name)
    fit(module, poisson_loader(blobs(n=20), 0.02, seed=1), 10, [trace])
    empty = [t for t, size in enumerate(trace.sizes) if size == 0]
    assert empty, "expected empty Poisson batches at q = 0.02, n = 20"
    assert all(not torch.equal(trace.before[t], trace.after[t]) for t in empty)
    assert module.privacy.ledger.total_count == 10


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_collate_that_fails_or_skips_an_empty_poisson_batch_is_refused_before_the_first_step(name):
    """Review 22: ``default_collate([])`` raised at the first empty Poisson batch (q = 0.15 of 8 rows, 20 batches: the
    fit stopped after 6 steps), and a collate returning ``None`` made Lightning skip the step (15 steps for 20 batches,
    no release for the empty ones): when the fit stopped, or how many steps it took, told which batches held no
    example, the target included."""
    def skipping(items):
        return collate_tensors(items) if items else None

    for collate, problem in ((None, "raises IndexError"), (skipping, "returns None")):
        module = build(name)
        sampler = PoissonBatchSampler(8, 0.15, seed=1, steps_per_epoch=20)
        with pytest.raises(PrivacyConfigError, match=f"collate_fn {problem} for an empty batch"):
            fit(module, DataLoader(blobs(n=8), batch_sampler=sampler, collate_fn=collate), 20)
        assert module.privacy.ledger.total_count == 0


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_the_noise_cannot_be_reproduced_from_the_run_seed(name, monkeypatch):
    """Same run seed, same data, same (test) sampling seed: only the secret noise differs. Where the weights show
    less than the releases (:data:`AUDITED_ELSEWHERE`: PAZO-S's show which candidate won, the same in two runs with
    chance about 1/81 at k = 3 over 4 steps; CI met it once), the releases themselves are compared."""
    released = recorded_releases(monkeypatch)

    def run(**overrides):
        released.clear()
        pl.seed_everything(0)
        module = build(name, **overrides)
        fit(module, poisson_loader(blobs(), 0.25, seed=5), 4)
        return flat(module) if class_name(name) not in AUDITED_ELSEWHERE else releases_of(released)

    assert not torch.equal(run(), run())
    assert torch.equal(run(noise_multiplier=0.0), run(noise_multiplier=0.0))  # control: no noise, no difference


#: A module's clips besides ``clip``, unbounded too in the noiseless ablation that equals the non-private twin.
OTHER_CLIPS_UNBOUNDED = {"GEP": dict(embedding_clip=math.inf)}


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_sigma_zero_and_infinite_clip_equal_the_non_private_method(name):
    """Full batch: the realized batch is the expected one, so dividing by either gives the same update."""
    twin_name = twin_of(name)
    assert twin_name is not None, f"{name} must name its non-private twin"
    private = build(name, noise_multiplier=0.0, clip=math.inf, **OTHER_CLIPS_UNBOUNDED.get(class_name(name), {}))
    twin = build(twin_name)
    fit(private, full_batch_loader(blobs(), 5), 5)
    fit(twin, full_batch_loader(blobs(), 5), 5)
    assert not torch.equal(flat(private), flat(build(name)))  # it trained
    torch.testing.assert_close(flat(private), flat(twin), rtol=0, atol=1e-10)
    assert not private.privacy.is_private and private.privacy.epsilon() == math.inf


class NaNLogitsAbove(nn.Module):
    """An MLP whose logits are NaN for the rows whose first feature exceeds ``threshold`` (crafted records)."""

    num_classes = 3

    def __init__(self, threshold: float):
        super().__init__()
        self.body, self.threshold = mlp(seed=1), threshold

    def forward(self, x):
        logits = self.body(x)
        return torch.where(x[:, :1] > self.threshold, torch.full_like(logits, float("nan")), logits)


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_non_finite_per_example_values_contribute_zero(name):
    """A crafted record with a NaN loss must not make the released parameters NaN (unbounded influence)."""
    dataset = blobs(n=64)
    dataset.tensors[0][:8, 0] = 5.0  # eight crafted records
    module = build(name, NaNLogitsAbove(2.0))
    fit(module, poisson_loader(dataset, 0.5, seed=0), 5)
    assert torch.isfinite(flat(module)).all()


def as_on_an_accelerator(monkeypatch):
    """The accelerator's handling of class targets (vetted on the host, else checked on the device), on the CPU."""
    monkeypatch.setattr(AlgorithmModule, "_device_checks_labels", lambda self: True)


@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu", "accelerator_path"])
@pytest.mark.parametrize("declared", [None, 3], ids=["classes_from_logits", "classes_declared"])
@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_row_whose_label_the_classifier_cannot_take_counts_as_zero_and_fails_no_step(name, declared, accelerator,
                                                                                      monkeypatch):
    """Review 21: a private row labelled outside ``0..C-1`` (7 or -3 for 3 classes) failed the fit at the first
    Poisson batch that sampled it, ``IndexError: Target 7 is out of bounds.`` (DPZero and DPSGD at q = 0.5: after 1
    of 20 steps; at q = 0.05 all 20 ran): whether, when and with what message a fit failed told of one private
    label. Its loss is now NaN, counted as zero like a row whose input is NaN: on the CPU after the plain losses
    raised (zeroth order) or checked in every forward (first order); on an accelerator checked on the device where
    ``C`` is the logits' width, and where it is declared (the host vets each batch first and finds these out of
    range)."""
    if accelerator:
        as_on_an_accelerator(monkeypatch)

    def trained(mutate):
        dataset = blobs(n=64)
        mutate(dataset)
        module = build(name, noise_multiplier=0.0, num_classes=declared)
        assert fit(module, full_batch_loader(dataset, 3), 3).global_step == 3
        return flat(module)

    def bad_labels(dataset):
        dataset.tensors[1][[5, 9]] = torch.tensor([7, -3])

    def nan_inputs(dataset):
        dataset.tensors[0][[5, 9], 0] = float("nan")

    torch.testing.assert_close(trained(bad_labels), trained(nan_inputs), rtol=0, atol=0)


class LabelSpy(Callback):
    """Records whether each step's losses checked the class targets on the device; ``rewrite`` sets row 0's target
    after the transfer (a callback's own relabelling), which the host never saw."""

    def __init__(self, rewrite=None):
        self.rewrite, self.checked = rewrite, []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.rewrite is not None:
            batch[1][0] = self.rewrite

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.checked.append(module._check_labels)


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_on_an_accelerator_targets_the_host_vetted_skip_the_device_check_and_a_rewrite_does_not(name, monkeypatch):
    """The device check of the class targets (review 21) costs about six tensor ops per forward (56 us per forward
    on the quickstart's CPU, launches on a GPU), so a zeroth-order step whose targets the host saw all in range before
    the transfer skips it; a target rewritten after the transfer (here to 7, out of range) is checked on the device
    and counts as zero. First-order steps check in every forward."""
    as_on_an_accelerator(monkeypatch)
    first_order = issubclass(algorithm_class(name), FirstOrderModule)
    spy = LabelSpy()
    fit(build(name, num_classes=3), full_batch_loader(blobs(n=64), 3), 3, [spy])
    assert spy.checked == [first_order] * 3
    rewritten = LabelSpy(rewrite=7)
    assert fit(build(name, num_classes=3), full_batch_loader(blobs(n=64), 3), 3, [rewritten]).global_step == 3
    assert rewritten.checked == [True] * 3


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_autograd_anomaly_mode_is_refused_where_a_private_backward_runs(name):
    """Review 20: under ``Trainer(detect_anomaly=True)`` a DP-SGD fit stopped (RuntimeError from LogSoftmaxBackward0)
    at the first Poisson batch holding one crafted row with a NaN loss, after 3 of its 20 steps, and ran all 20
    without the row: whether and when it failed told of one private example. First-order modules refuse the mode
    before a step; zeroth-order ones run no private backward."""
    dataset = blobs(n=64)
    dataset.tensors[0][:1, 0] = 5.0  # one crafted record
    module = build(name, NaNLogitsAbove(4.5))
    if not backprops_private_rows(name):
        assert fit(module, poisson_loader(dataset, 0.5, seed=0), 3, detect_anomaly=True).global_step == 3
        return
    with pytest.raises(PrivacyConfigError, match=r"`Trainer\(detect_anomaly=True\)` .* stops a private fit") as info:
        fit(module, poisson_loader(dataset, 0.5, seed=0), 3, detect_anomaly=True)
    assert "\n" not in str(info.value) and module.privacy.ledger.total_count == 0


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_fit_inside_inference_mode_fails_or_trains_whatever_batches_are_empty(name):
    """Review 24: ``with torch.inference_mode(): trainer.fit(...)`` failed a first-order fit at the first batch holding an
    example, after the empty batches' steps: 1 step with the target in the second batch, 2 without, so when it failed
    told of the target. First-order modules refuse it at their first step; zeroth-order ones train (no graph)."""
    for second in ([0], []):  # row 0 is the target
        loader = fixed_batches_loader(blobs(n=64), [[], second, [5, 6], [7, 8]])
        module = build(name)
        with torch.inference_mode():
            zeroth_order = issubclass(algorithm_class(name), ZerothOrderModule)
            if zeroth_order and not getattr(module, "needs_public_batches", False):
                assert fit(module, loader, 4).global_step == 4
                continue
            with pytest.raises(PrivacyConfigError, match=r"inside `torch.inference_mode\(\)`") as info:
                fit(module, loader, 4)
        assert "\n" not in str(info.value) and module.privacy.ledger.total_count == 0


# ---------------------------------------------------------------------------- accounting
@pytest.mark.parametrize("name", EVERY_CASES)
def test_ledger_steps_equal_optimizer_steps(name):
    module = build(name)
    trainer = fit(module, poisson_loader(blobs(), 0.1), 7)
    assert trainer.global_step == module.privacy.steps == 7


class _BFloat16Casts(TorchDispatchMode):
    """Records where an op turns float32 into bfloat16 outside the backbone's forward and outside autograd's backward
    (the module's own arithmetic: autocast casts a matmul's float32 operands this way), by its ``lit_zodp`` frames."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.depth, self.found = 0, set()
        backbone.register_forward_pre_hook(lambda *_: setattr(self, "depth", self.depth + 1))
        backbone.register_forward_hook(lambda *_: setattr(self, "depth", self.depth - 1))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.depth == 0 and torch._C._current_graph_task_id() == -1:
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if (any(t.dtype == torch.float32 for t in tensors)
                    and any(t.dtype == torch.bfloat16 for t in torch.utils._pytree.tree_leaves(out)
                            if isinstance(t, torch.Tensor))):
                frames = [f for f in traceback.extract_stack() if "/lit_zodp/" in f.filename]
                self.found.add(" <- ".join(f"{f.filename.split('/lit_zodp/')[1]}:{f.name}" for f in frames[-2:][::-1]))
        return out


#: DOPE-SGD's recentring subtracts its public centre in the per-example gradients' dtype (bfloat16 rows under autocast:
#: the engine's rounding model covers them); its centre is added back in float32 (public either way).
_BFLOAT16_BY_DESIGN = {"per_example/transforms.py:apply <- per_example/engine.py:_transformed"}


@pytest.mark.parametrize("name", EVERY_CASES)
def test_bf16_mixed_precision_steps_and_counts_and_loss_scaling_is_refused_in_one_line(name):
    """``bf16-mixed`` (autocast; the engine's sums stay float32: tests/per_example/test_pe_rounding.py)
    takes its steps, and no module's own arithmetic outside the forward and the backward runs in bfloat16 (the
    autocast audit of 2026-11-30 found GEP's power method, DP-GaLore's projections and PAZO-P's directions there).
    ``16-mixed`` on CUDA steps through a GradScaler, which failed every module with
    an AssertionError ("Attempted unscale_ but _scale is None"); refused before the first step."""
    from lightning.pytorch.plugins import MixedPrecision

    module = build(name)
    casts = _BFloat16Casts(module.backbone)
    with casts:
        trainer = fit(module, poisson_loader(blobs(), 0.1), 3, precision="bf16-mixed")
    assert trainer.global_step == module.privacy.steps == 3
    assert casts.found <= _BFLOAT16_BY_DESIGN
    scaled = build(name)
    with pytest.raises(ConfigError, match="precision 'bf16-mixed'") as info:
        fit(scaled, poisson_loader(blobs(), 0.1), 1, plugins=[MixedPrecision("16-mixed", device="cpu")])
    assert "\n" not in str(info.value) and scaled.privacy.steps == 0


class _SumInRowCountOrder(nn.Module):
    """A frozen sum of the first three inputs in an order set by the batch's row count, as a batched kernel picks
    its reduction order by the call's shape (this CPU's float32 GEMM rounds a row of two cancelling 1e10 terms to
    losses 1.299 in a batch of 2 and 1.171 in one of 4); the other inputs pass through. Per-example."""

    def forward(self, x):
        terms = x[:, :3] if len(x) > 2 else x[:, :3].flip(1)
        total = terms[:, 0] + terms[:, 1] + terms[:, 2]  # float32, left to right
        return torch.cat([total.unsqueeze(1), x[:, 3:]], 1)


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_one_row_that_rounds_with_the_batch_shape_does_not_stop_a_per_example_fit(name):
    """Red-team review 20: the halves check compared each row computed in a batch of 4 with the same row in a batch
    of 2; a row of huge cancelling terms moved with that shape alone, so DPSGD, DPAdam and DPMeZOBCD refused a
    per-example MLP exactly when that row was in the checked batch. A mismatch is now measured again in the batch's
    own shape, each row in its place."""
    torch.manual_seed(0)
    backbone = nn.Sequential(_SumInRowCountOrder(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y = blobs(n=4).tensors
    crafted = x.clone()
    crafted[2, :3] = torch.tensor([1e10, -1e10, 0.5])  # 0.5 in a batch of 4, 0 in a half of 2
    module = build(name, backbone)
    fit(module, full_batch_loader(torch.utils.data.TensorDataset(crafted, y), 2), 2)
    assert module.privacy.steps == 2


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_epsilon_continues_after_a_trainer_resume_and_after_load_from_checkpoint(name, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = build(name)
    fit(first, poisson_loader(blobs(), 0.1), 4, [checkpoint], enable_checkpointing=True)
    spent_at_4 = first.privacy.epsilon()
    loaded = algorithm_class(name).load_from_checkpoint(tmp_path / "last.ckpt", backbone=mlp(seed=1))
    assert loaded.privacy.ledger.total_count == 4 and loaded.privacy.epsilon() == pytest.approx(spent_at_4)

    resumed = build(name)
    quiet_trainer(max_steps=9).fit(resumed, poisson_loader(blobs(), 0.1), ckpt_path=tmp_path / "last.ckpt")
    assert resumed.privacy.ledger.total_count == 9
    reference = PrivacyLedger()
    (mechanism, _), = first.privacy.ledger.counts.items()
    reference.record(mechanism, 9)
    assert resumed.privacy.epsilon() == pytest.approx(reference.epsilon(1e-5).upper, rel=1e-9)
    assert resumed.privacy.epsilon() > spent_at_4


def _synthetic(data_seed=0, public_fraction=0.25, batch_size=20, **extra):
    from datamodules.synthetic import SyntheticClassificationDataModule

    return SyntheticClassificationDataModule(n_samples=200, n_features=10, num_classes=3, batch_size=batch_size,
                                             public_fraction=public_fraction, val_fraction=0.25,
                                             data_seed=data_seed, **extra)


@pytest.mark.parametrize("changed", [dict(data_seed=1), dict(public_fraction=0.35)])
@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_resume_on_another_private_split_is_refused_before_a_step(name, changed, tmp_path):
    """Audit, 2026-11-28: another ``data_seed`` (same n and q) made 50 rows accounted as private public and 40 of them
    validation rows, logged without noise, and nothing was said; a larger public fraction only said "each step is
    accounted at its own rate". The same split resumes."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(build(name), _synthetic(), 2, [checkpoint], enable_checkpointing=True, limit_val_batches=0)
    resumed = build(name)
    with pytest.raises(PrivacyConfigError, match="private split is not the one this run.s earlier steps") as info:
        quiet_trainer(max_steps=4, limit_val_batches=0).fit(resumed, datamodule=_synthetic(**changed),
                                                            ckpt_path=tmp_path / "last.ckpt")
    assert "\n" not in str(info.value) and resumed.privacy.ledger.total_count == 2
    quiet_trainer(max_steps=4, limit_val_batches=0).fit(resumed, datamodule=_synthetic(),
                                                        ckpt_path=tmp_path / "last.ckpt")
    assert resumed.privacy.ledger.total_count == 4


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork", "ddp_notebook"])
def test_strategies_that_return_only_the_weights_are_refused_for_a_private_fit(strategy):
    """Red-team review 18: their children trained, and the module came back with the weights and an empty ledger
    (epsilon 0); a checkpoint of it resumed as a new run at epsilon 0. One fit runs (fork: quick); the other two
    strategies' launchers are the same class."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    trainer = quiet_trainer(max_steps=2, strategy=strategy, use_distributed_sampler=False)
    assert isinstance(trainer.strategy.launcher, _MultiProcessingLauncher)
    if strategy != "ddp_fork":
        return
    module = build("DPZero")
    before = flat(module)
    with pytest.raises(Exception, match="returns only the weights, so the module would come back with an empty"):
        trainer.fit(module, poisson_loader(blobs(), 0.25))
    assert module.privacy.ledger.total_count == 0 and torch.equal(flat(module), before)


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_evaluation_on_the_private_training_data_is_refused_before_a_metric_is_logged(name):
    """Red-team review 18: validation, test or predict loaders over the private rows logged exact means of them
    (val_acc moved by 1/n with one row). Refused: the training loader itself, a loader over its dataset or a
    Subset of it, the DataModule's private split; the DataModule's own held-out splits still validate."""
    data = blobs(n=128)
    private_loader = poisson_loader(data, 0.1)
    over_the_rows = DataLoader(torch.utils.data.Subset(data, range(40)), batch_size=16)
    for val_loader in (private_loader, over_the_rows):
        trainer = quiet_trainer(max_steps=4, val_check_interval=2, num_sanity_val_steps=2)
        with pytest.raises(PrivacyConfigError, match="The validation loader reads the private training data") as info:
            trainer.fit(build(name), train_dataloaders=private_loader, val_dataloaders=val_loader)
        assert "\n" not in str(info.value) and not any(k.startswith("val_") for k in trainer.callback_metrics)
    module, datamodule = build(name), _synthetic()
    trainer = quiet_trainer(max_steps=2, val_check_interval=1, limit_val_batches=1)
    trainer.fit(module, datamodule=datamodule)  # (its held-out validation split)
    assert "val_acc" in trainer.callback_metrics
    for run in (lambda: trainer.test(module, datamodule.train_dataloader(), verbose=False),
                lambda: trainer.validate(module, DataLoader(datamodule.private_dataset, batch_size=8), verbose=False),
                lambda: trainer.predict(module, DataLoader(torch.utils.data.Subset(datamodule.private_dataset,
                                                                                    range(8)), batch_size=8))):
        with pytest.raises(PrivacyConfigError, match="loader reads the private training data"):
            run()


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_evaluation_after_a_fit_on_loaders_or_in_a_new_trainer_is_refused_on_the_private_data(stage):
    """Review 19: evaluating other loaders resets the Trainer's record of its training loader, and a new Trainer
    never had it, so "train accuracy" over the private rows was logged after a fit with loaders, or in a new Trainer
    over a DataModule's private split. A private fit's data (and a DataModule's private split) is remembered."""
    private = blobs(n=128)
    module, trainer = build("DPZero"), quiet_trainer(max_steps=2)
    trainer.fit(module, train_dataloaders=poisson_loader(private, 0.1))
    with pytest.raises(PrivacyConfigError, match="reads the private training data"):
        getattr(trainer, stage)(module, DataLoader(private, batch_size=32), verbose=False)
    getattr(trainer, stage)(module, DataLoader(blobs(n=32, seed=5), batch_size=32), verbose=False)  # held out
    datamodule = _synthetic()
    datamodule.setup("fit")
    with pytest.raises(PrivacyConfigError, match="reads the private training data"):
        getattr(quiet_trainer(), stage)(build("DPZero"), DataLoader(torch.utils.data.Subset(
            datamodule.private_dataset, range(16)), batch_size=8), verbose=False)


class _RowsUsed(Callback):
    """The private rows (by their features) the fit's steps used."""

    def __init__(self):
        self.rows = set()

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.rows |= {tuple(row.tolist()) for row in batch[0]}


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_single_pass_resumed_with_another_batch_size_is_refused_before_reusing_an_example(name, tmp_path):
    """Red-team review 17: 5 steps of a 15-step pass (batch size 10), resumed at batch size 5 (a 30-step pass drawn
    anew, continued from step 5), used 19 of the first steps' 43 rows again, while the ledger counted one Gaussian
    for the whole pass. The same batch size continues the pass on new rows."""
    def data(batch_size):
        return _synthetic(public_fraction=0.0, sampling="single_pass", batch_size=batch_size)

    first, single = _RowsUsed(), dict(neighbours="replace_one", noise_multiplier=2.0)
    fit(build(name, **single), data(10), 5, [first, ModelCheckpoint(dirpath=tmp_path, save_last=True)],
        enable_checkpointing=True, limit_val_batches=0)
    resumed, later = build(name, **single), _RowsUsed()
    with pytest.raises(PrivacyConfigError, match="would be used again, accounted once") as info:
        quiet_trainer(max_steps=15, limit_val_batches=0, callbacks=[later]).fit(
            resumed, datamodule=data(5), ckpt_path=tmp_path / "last.ckpt")
    assert "\n" not in str(info.value) and not later.rows and resumed.privacy.ledger.total_count == 5
    quiet_trainer(max_steps=15, limit_val_batches=0, callbacks=[later]).fit(
        resumed, datamodule=data(10), ckpt_path=tmp_path / "last.ckpt")
    assert resumed.privacy.ledger.total_count == 15 and later.rows and not later.rows & first.rows


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_noiseless_runs_checkpoint_cannot_resume_with_noise_or_show_a_finite_epsilon(name, tmp_path):
    """Audit, 2026-11-28: a sigma = 0 ablation resumed with noise reported epsilon 2.9 over the noised steps only,
    within a `max_epsilon` of 3, although its first 50 steps released the clipped sums themselves."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(build(name, noise_multiplier=0.0), poisson_loader(blobs(), 0.25), 3, [checkpoint], enable_checkpointing=True)
    loaded = algorithm_class(name).load_from_checkpoint(tmp_path / "last.ckpt", backbone=mlp(seed=1),
                                                        noise_multiplier=1.0)
    assert loaded.privacy.epsilon() == math.inf
    resumed = build(name)
    with pytest.raises(PrivacyConfigError, match="already took 3 steps with `noise_multiplier`=0") as info:
        quiet_trainer(max_steps=5).fit(resumed, poisson_loader(blobs(), 0.25), ckpt_path=tmp_path / "last.ckpt")
    assert "\n" not in str(info.value) and resumed.privacy.ledger.total_count == 0


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_non_private_twins_checkpoint_is_refused_in_one_line(name, tmp_path):
    """Its privacy state is empty: the resume failed with a raw ``KeyError: 'ledger'``."""
    twin_cls = ALGORITHMS["MeZO" if issubclass(algorithm_class(name), ZerothOrderModule) else "SGD"]
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(twin_cls(mlp(seed=1), lr=0.05, seed=3), poisson_loader(blobs(), 0.25), 2, [checkpoint],
        enable_checkpointing=True)
    with pytest.raises(PrivacyConfigError, match="no privacy state") as info:
        quiet_trainer(max_steps=4).fit(build(name), poisson_loader(blobs(), 0.25), ckpt_path=tmp_path / "last.ckpt")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_private_checkpoint_is_not_continued_by_the_non_private_twin(name, tmp_path):
    """Red-team review 18: the CLI refused it, a Trainer of one's own continued a private run's checkpoint without
    noise or accounting and said nothing."""
    twin_cls = ALGORITHMS["MeZO" if issubclass(algorithm_class(name), ZerothOrderModule) else "SGD"]
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(build(name), poisson_loader(blobs(), 0.25), 2, [checkpoint], enable_checkpointing=True)
    twin = twin_cls(mlp(seed=1), lr=0.05, seed=3)
    before = flat(twin)
    with pytest.raises(PrivacyConfigError, match="private run's \\(2 accounted steps\\)") as info:
        quiet_trainer(max_steps=4).fit(twin, poisson_loader(blobs(), 0.25), ckpt_path=tmp_path / "last.ckpt")
    assert "\n" not in str(info.value) and torch.equal(flat(twin), before)


def test_a_runs_epsilon_stays_marked_poisson_assumed_after_its_shuffled_steps(tmp_path):
    """Audit, 2026-11-28: 40 shuffled steps resumed with Poisson sampling printed a plain ``epsilon=5.199``."""
    from lit_zodp.callbacks.privacy import epsilon_metric

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    with pytest.warns(Warning):
        fit(build("DPZero"), _synthetic(sampling="shuffle"), 2, [checkpoint], enable_checkpointing=True,
            limit_val_batches=0)
    resumed = build("DPZero")
    quiet_trainer(max_steps=4, limit_val_batches=0).fit(resumed, datamodule=_synthetic(),
                                                        ckpt_path=tmp_path / "last.ckpt")
    assert resumed.privacy.sampling.name == "poisson" and resumed.privacy.poisson_assumed
    assert "ASSUMING POISSON SAMPLING" in resumed.privacy.summary()
    assert epsilon_metric(resumed.privacy) == "epsilon_poisson_assumed"
    assert resumed.privacy.state_dict()["plan"]["poisson_assumed"]


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_runs_epsilon_stays_marked_test_seeded_after_a_resume_without_the_seed(name, tmp_path):
    """Review 31: 4 steps with ``noise_seed: 5`` (noise anyone with that config reproduces), resumed to 8 without the
    seed, printed ``epsilon = 2.723`` as a guarantee, and so did the checkpoint loaded with ``load_from_checkpoint``."""
    from lit_zodp.cli import _epsilon_field

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(build(name, noise_seed=5), poisson_loader(blobs(), 0.1), 4, [checkpoint], enable_checkpointing=True)
    loaded = algorithm_class(name).load_from_checkpoint(tmp_path / "last.ckpt", backbone=mlp(seed=1))
    assert loaded.privacy.noise_seed is None and loaded.privacy.test_seeded
    resumed = build(name)
    quiet_trainer(max_steps=8).fit(resumed, poisson_loader(blobs(), 0.1), ckpt_path=tmp_path / "last.ckpt")
    assert resumed.privacy.ledger.total_count == 8 and resumed.privacy.test_seeded
    assert "REPRODUCIBLE" in resumed.privacy.summary() and _epsilon_field(resumed.privacy).endswith("(test-seeded)")
    assert resumed.privacy.state_dict()["plan"]["test_seeded"]


def test_a_second_fit_in_the_process_keeps_the_runs_split_and_its_poisson_assumed_mark():
    """Review, 2026-11-28: the split and the mark were read only from a loaded checkpoint, while a second
    ``trainer.fit`` of the same module continues its ledger in memory: another split was accepted, and after shuffled
    steps a Poisson fit printed a plain epsilon (and its checkpoint stored the mark as False)."""
    module = build("DPZero")
    with pytest.warns(Warning):
        quiet_trainer(max_steps=2, limit_val_batches=0).fit(module, datamodule=_synthetic(sampling="shuffle"))
    quiet_trainer(max_steps=2, limit_val_batches=0).fit(module, datamodule=_synthetic())
    assert module.privacy.ledger.total_count == 4 and module.privacy.poisson_assumed
    assert module.privacy.state_dict()["plan"]["poisson_assumed"]
    with pytest.raises(PrivacyConfigError, match="private split is not the one"):
        quiet_trainer(max_steps=2, limit_val_batches=0).fit(module, datamodule=_synthetic(data_seed=1))
    assert module.privacy.ledger.total_count == 4


# --------------------------------------------------------------------------------- empirical audit
class _BiasFreeLinear(nn.Module):
    """All-zero rows give every loss difference and gradient exactly 0: only the canary moves a release."""

    num_classes = 3

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Linear(10, 3, bias=False)

    def forward(self, x):
        return self.w(x)


def audit_scores(name, with_canary, steps, trainer_kwargs=None, **overrides):
    """:class:`CanaryAudit`'s scores of a full-batch fit on 8 zero rows, with or without a canary of norm 1e4 labelled
    with its least likely class (its central differences and gradient are far beyond the clip, never saturated:
    every term of it is clipped to C); and the ledger's mu per step. ``trainer_kwargs``: the Trainer's own options
    (``precision``)."""
    backbone = _BiasFreeLinear()
    canary = torch.randn(1, 10, generator=torch.Generator().manual_seed(1))
    canary = canary * (1e4 / canary.norm())
    label = backbone(canary).argmin(1).detach()
    rows = [(torch.zeros(10), torch.tensor(0))] * 8 + ([(canary[0], label[0])] if with_canary else [])
    module = build(name, backbone, noise_seed=0, **overrides)
    audit = CanaryAudit(canary, label)
    fit(module, full_batch_loader(rows, steps), steps, [audit], **(trainer_kwargs or {}))
    return audit.scores, accounted_mu(module.privacy.ledger.counts) / math.sqrt(steps)


#: What the audit reads differently: DPZero's sqrt(k) of k directions; naive DP-GaLore's projection is post-processing
#: of DP-Adam's full release, which the weights show only in part, so it is audited projecting nothing.
AUDIT_KWARGS = {"DPZero": dict(num_directions=2), "DPGaLore": dict(rank=16), "PAZOM": dict(alpha=0.0, num_directions=2),
                "PAZOP": dict(num_directions=2), "DPMD": dict(total_steps=10**12)}
#: Whose weights show less than the release, by class (its variants too): PAZO-S's show which candidate won (its
#: release is audited in test_pazo); O2NC's move along a running estimate (its releases are audited in test_o2nc);
#: GEP's show the sum of its two releases (they are audited in test_gep).
AUDITED_ELSEWHERE = {"PAZOS", "DPO2NC", "GEP"}


def audit_agrees(name, trainer_kwargs=None, **overrides):
    """The measured ``mu`` (mean shift over spread) and the measured spread of the scores (the noise std over the
    canary's shift of 1, i.e. ``1 / mu``; chi-square interval) against the ledger's ``mu`` per step, 99.9%
    intervals; and the assumption-free lower bound under the accounted epsilon of one step."""
    inside, claimed = audit_scores(name, True, 150, trainer_kwargs, **overrides)
    outside, _ = audit_scores(name, False, 150, trainer_kwargs, **overrides)
    measured, spread = gaussian_mu(inside, outside, confidence=0.999), gaussian_spread(outside, confidence=0.999)
    return (measured.low <= claimed <= measured.high and spread.low <= 1 / claimed <= spread.high
            and epsilon_lower_bound(inside, outside, delta=1e-5) <= gaussian_epsilon(claimed, 1e-5)), (measured, spread,
                                                                                                      claimed)


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_the_weights_show_one_row_exactly_as_much_as_accounted(name):
    """An attacker reading the weights around each step, knowing every row but the canary: the release along the
    canary's clipped term is ``N(1, sigma^2)`` in units of C with it, ``N(0, sigma^2)`` without, so the measured
    ``mu`` (mean shift over spread) must be the ledger's ``mu = 1 / sigma`` per step (sqrt(k) / sigma for k
    directions), and the spread ``1 / mu``. Fails if the noise, the clipping, or the division by B were wrong, or if
    the ledger's sigma were not the one applied (half the noise measured mu 1.97, 99.9% interval [1.50, 2.43],
    against 1)."""
    if class_name(name) in AUDITED_ELSEWHERE:
        with pytest.raises(ConfigError, match="CanaryAudit cannot read"):
            audit_scores(name, True, 1)
        return
    agrees, numbers = audit_agrees(name, **AUDIT_KWARGS.get(name, AUDIT_KWARGS.get(class_name(name), {})))
    assert agrees, numbers


def test_the_audit_sees_a_ledger_that_drops_the_sqrt_k_of_k_directions(monkeypatch):
    """Review 27: a DPZero ledger charging 2 directions the sensitivity of one (C, not sqrt(2) C: its mu 1 where the
    weights show 1.41) passed the check above: with 150 scores per world the mu interval was [0.87, 1.71] at 99.9%.
    The scores' spread (0.78 [0.65, 0.94] against the 1 / mu = 1 such a ledger implies) shows it."""
    monkeypatch.setattr(DPZero, "step_plan", lambda self: (GaussianRelease(DERIVATIVES, sensitivity=1.0),))
    agrees, numbers = audit_agrees("DPZero", num_directions=2)
    assert not agrees, numbers


@pytest.mark.parametrize("name, precision", [("DPSGD", "bf16-true"), ("DPZero", "16-true")])
def test_the_audit_reads_a_fit_in_the_trainers_precision(name, precision):
    """Review 26: under ``Trainer(precision="bf16-true")`` (or "16-true") the module's forwards see the batch cast to
    the parameters' dtype, and the audit's own forward of the float32 canary failed after the first step (``expected
    m1 and m2 to have the same dtype``). It casts the canary as the Trainer casts a batch; the weights then show one
    row as accounted (2000 steps per world, 95%: DPSGD bf16 1.02 [0.96, 1.09]; DPZero fp16 0.94 [0.87, 1.00])."""
    inside, claimed = audit_scores(name, True, 150, trainer_kwargs=dict(precision=precision))
    outside, _ = audit_scores(name, False, 150, trainer_kwargs=dict(precision=precision))
    measured = gaussian_mu(inside, outside, confidence=0.999)
    assert len(inside) == len(outside) == 150 and measured.low <= claimed <= measured.high, (measured, claimed)


def test_the_audit_sees_half_the_accounted_noise(monkeypatch):
    """The check above can fail: with the noise std halved behind the ledger's back, the measured mu is 2."""
    halved = PrivacyComponent._noise_std
    monkeypatch.setattr(PrivacyComponent, "_noise_std", lambda self, release: halved(self, release) / 2)
    inside, claimed = audit_scores("DPZero", True, 150)
    outside, _ = audit_scores("DPZero", False, 150)
    measured = gaussian_mu(inside, outside, confidence=0.999)
    assert claimed == pytest.approx(1.0) and measured.low > 1.5


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_the_budget_stop_never_overspends(name):
    module = build(name, noise_multiplier=2.0, max_epsilon=0.5)
    trainer = fit(module, poisson_loader(blobs(), 0.1), 500)
    steps = trainer.global_step
    assert 0 < steps < 500 and module.privacy.ledger.total_count == steps
    assert module.privacy.epsilon() <= 0.5
    (mechanism, _), = module.privacy.ledger.counts.items()
    assert module.privacy.ledger.epsilon(1e-5, extra=[(mechanism, 1)]).upper > 0.5


class LowerSigmaAt(Callback):
    """A sigma schedule: sets the privacy component's sigma at one step (audit 12 F1)."""

    def __init__(self, step, sigma):
        self.step, self.sigma = step, sigma

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step:
            module.privacy.noise_multiplier = self.sigma


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_sigma_changed_within_a_fit_is_refused_before_it_releases(name):
    """Audit 12 F1: lowering sigma from 3 to 1 at step 5 of a fit with ``max_epsilon = 1`` ran 47 steps and spent
    epsilon 4.8 (the budget's step count was made for sigma 3). Now the fit stops at that step in one line,
    having released and counted only steps at sigma 3, within the budget."""
    module = build(name, noise_multiplier=3.0, max_epsilon=1.0)
    with pytest.raises(PrivacyConfigError, match="`noise_multiplier` cannot change within a fit"):
        fit(module, poisson_loader(blobs(), 0.1), 400, callbacks=[LowerSigmaAt(5, 1.0)])
    (mechanism, count), = module.privacy.ledger.counts.items()
    assert (mechanism, count) == (module.privacy._steps_cost(1, 3.0)[0][0], 5) and module.privacy.epsilon() <= 1.0


@pytest.mark.parametrize("name", PRIVATE_CASES)
@pytest.mark.parametrize("minimum", [dict(min_steps=100), dict(min_epochs=20)])
def test_a_budget_that_stops_before_the_trainers_minimum_is_refused_before_a_step(name, minimum):
    """Audit 7: Lightning ignores should_stop before min_steps/min_epochs, and the budget let no step run:
    the fit looped over empty epochs forever (ledger still at the budget)."""
    module = build(name, noise_multiplier=2.0, max_epsilon=0.5)
    with pytest.raises(PrivacyConfigError, match=f"allows \\d+ more steps.*`{next(iter(minimum))}` asks for"):
        fit(module, poisson_loader(blobs(), 0.1, steps_per_epoch=10), 500, **minimum)
    assert module.privacy.ledger.total_count == 0


@pytest.mark.parametrize("name", sharing())
def test_a_second_fit_of_one_module_keeps_the_runs_calibrated_sigma(name):
    """Review 31: calibrated to epsilon 2 over 30 steps (sigma 1.528), a second ``trainer.fit`` of the same module with
    40 steps at q = 0.05 recalibrated sigma for those steps alone (1.114): the budget let none run, and the summary
    showed sigma 1.114. A second fit now takes the run's sigma, as a resume does; the budget still binds."""
    module = build(name, noise_multiplier=None, target_epsilon=2.0)
    fit(module, poisson_loader(blobs(), 0.1), 30)
    sigma = module.privacy.noise_multiplier
    fit(module, poisson_loader(blobs(), 0.05), 40)
    assert module.privacy.noise_multiplier == sigma and f"30 at {sigma:.4g} (q = 0.1))" in module.privacy.summary()
    per_step = composed_multiplier(module.privacy.step_plan, sigma)  # (sigma but for rounding: GEP's two releases)
    assert all(m.noise_multiplier == per_step for m in module.privacy.ledger.counts) and module.privacy.epsilon() <= 2.0


@pytest.mark.parametrize("name", sharing())
def test_the_budget_binds_across_a_resume_with_more_steps(name, tmp_path):
    """The audit's case: planned for epsilon 1 over 20 steps, resumed to 40 steps: it must stop at the budget."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = build(name, noise_multiplier=None, target_epsilon=1.0)
    fit(first, poisson_loader(blobs(), 0.1), 20, [checkpoint], enable_checkpointing=True)
    resumed = build(name, noise_multiplier=None, target_epsilon=1.0)
    trainer = quiet_trainer(max_steps=40)
    trainer.fit(resumed, poisson_loader(blobs(), 0.1), ckpt_path=tmp_path / "last.ckpt")
    assert resumed.privacy.noise_multiplier == first.privacy.noise_multiplier
    assert resumed.privacy.epsilon() <= 1.0 and trainer.global_step < 40
    stricter = build(name, noise_multiplier=None, target_epsilon=1.0, max_epsilon=0.5)
    quiet_trainer(max_steps=40).fit(stricter, poisson_loader(blobs(), 0.1), ckpt_path=tmp_path / "last.ckpt")
    assert stricter.privacy.ledger.total_count == 20  # already past 0.5: not one more step


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_second_continuation_of_one_checkpoint_counts_the_first(name, tmp_path):
    """A fork: 4 steps, then two continuations of the step-4 checkpoint to 8. The second one's ledger
    holds all 12 releases of the run (spend log), not the 8 of its own path."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = build(name)
    fit(first, poisson_loader(blobs(), 0.1), 4, [checkpoint], enable_checkpointing=True)
    branch = build(name)
    quiet_trainer(max_steps=8).fit(branch, poisson_loader(blobs(), 0.1), ckpt_path=tmp_path / "last.ckpt")
    assert branch.privacy.ledger.total_count == 8 and branch.privacy.other_branch_steps == 0
    second = build(name)
    with pytest.warns(UserWarning, match="counts 4 steps, but its run .* released 8 in all branches"):
        quiet_trainer(max_steps=8).fit(second, poisson_loader(blobs(), 0.1), ckpt_path=tmp_path / "last.ckpt")
    assert second.privacy.ledger.total_count == 12 and second.privacy.other_branch_steps == 4
    (mechanism, _), = first.privacy.ledger.counts.items()
    reference = PrivacyLedger()
    reference.record(mechanism, 12)
    assert second.privacy.epsilon() == pytest.approx(reference.epsilon(1e-5).upper, rel=1e-9)
    assert "12 steps, 4 of them in other branches" in second.privacy.summary()


def _shuffled_loader(dataset, batch_size):
    from lit_zodp.privacy import ShuffleBatchSampler

    with pytest.warns(Warning, match="sampling='shuffle'"):
        sampler = ShuffleBatchSampler(len(dataset), batch_size)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_tensors)


@pytest.mark.parametrize("branch,name", spread(["noiseless", "test_seeded", "shuffled"]))
def test_a_continuation_counts_what_made_another_branchs_steps_no_guarantee(name, branch, tmp_path):
    """Review 31: 4 steps, then one continuation of the step-4 checkpoint to 8 at sigma 0, with a test `noise_seed` or
    with shuffled batches, then a second, plain continuation of it. The second printed ``epsilon = 2.723`` after 8 steps
    (the noiseless branch wrote no spend record) or a plain 3.072 / 3.085 after 12: the other branch's releases, which
    its own fit marked as no guarantee, counted as Poisson steps with secret noise."""
    from lit_zodp.callbacks.privacy import epsilon_metric
    from lit_zodp.cli import _epsilon_field

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(build(name), poisson_loader(blobs(), 0.1), 4, [checkpoint], enable_checkpointing=True)
    other = {"noiseless": dict(noise_multiplier=0.0), "test_seeded": dict(noise_seed=7), "shuffled": {}}[branch]
    loader = _shuffled_loader(blobs(), 26) if branch == "shuffled" else poisson_loader(blobs(), 0.1)
    quiet_trainer(max_steps=8).fit(build(name, **other), loader, ckpt_path=tmp_path / "last.ckpt")
    second = build(name)
    with pytest.warns(UserWarning, match="counts 4 steps, but its run .* released 8 in all branches"):
        if branch == "noiseless":
            with pytest.raises(PrivacyConfigError, match="already took 4 steps with `noise_multiplier`=0") as info:
                quiet_trainer(max_steps=8).fit(second, poisson_loader(blobs(), 0.1), ckpt_path=tmp_path / "last.ckpt")
            assert "\n" not in str(info.value)
            assert second.privacy.ledger.total_count == 4 and second.privacy.epsilon() == math.inf
            return
        quiet_trainer(max_steps=8).fit(second, poisson_loader(blobs(), 0.1), ckpt_path=tmp_path / "last.ckpt")
    assert second.privacy.ledger.total_count == 12 and second.privacy.other_branch_steps == 4
    mark = {"test_seeded": "(test-seeded)", "shuffled": "(poisson-assumed)"}[branch]
    assert _epsilon_field(second.privacy).endswith(mark) and "not a guarantee" in second.privacy.summary()
    assert epsilon_metric(second.privacy) == ("epsilon_poisson_assumed" if branch == "shuffled" else "epsilon")
    assert second.privacy.state_dict()["plan"]["poisson_assumed" if branch == "shuffled" else "test_seeded"]


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_the_budget_binds_across_a_rollback(name, tmp_path):
    """Planned for epsilon 1 over 12 steps with a checkpoint at 6: the run spends the budget; resuming
    the step-6 checkpoint must not spend the last 6 steps' share again."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=6, save_top_k=-1)
    first = build(name, noise_multiplier=None, target_epsilon=1.0)
    fit(first, poisson_loader(blobs(), 0.1), 12, [checkpoint], enable_checkpointing=True)
    assert first.privacy.budget_exhausted
    older, = (path for path in tmp_path.glob("*.ckpt") if "step=6" in path.name)
    rolled_back = build(name, noise_multiplier=None, target_epsilon=1.0)
    with pytest.warns(UserWarning, match="a rollback or a second continuation"):
        trainer = quiet_trainer(max_steps=12)
        trainer.fit(rolled_back, poisson_loader(blobs(), 0.1), ckpt_path=older)
    assert trainer.global_step == 6 and rolled_back.privacy.ledger.total_count == 12
    assert rolled_back.privacy.epsilon() <= 1.0


# ----------------------------------------------------------------------------- secrets
def _secrets_in(obj, path="checkpoint"):
    """Paths of anything in a checkpoint that looks like generator state or a large secret."""
    found = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "state_dict":
                continue  # the model's weights
            if any(word in str(key).lower() for word in ("generator", "rng", "bit_generator", "secret")):
                found.append(f"{path}.{key}")
            found += _secrets_in(value, f"{path}.{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            found += _secrets_in(value, f"{path}[{i}]")
    elif isinstance(obj, torch.Tensor) and obj.dtype == torch.uint8:
        found.append(path)
    elif isinstance(obj, int) and not isinstance(obj, bool) and abs(obj) >= 2**63:
        found.append(path)
    return found


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_checkpoints_hold_no_secret_and_two_continuations_draw_fresh_noise(name, tmp_path, monkeypatch):
    """The audit's attack: continuing one checkpoint twice must not reuse the noise (or the masks). Where the weights
    show less than the releases (:data:`AUDITED_ELSEWHERE`: PAZO-S's show which candidate won, and two continuations
    often pick the same ones), the releases themselves are compared."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(build(name), poisson_loader(blobs(), 0.25), 3, [checkpoint], enable_checkpointing=True)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert _secrets_in(saved) == []
    assert set(saved["privacy"]) == {"ledger", "plan"}
    released, continuations = recorded_releases(monkeypatch), []
    for _ in range(2):
        module = build(name)
        released.clear()
        quiet_trainer(max_steps=5).fit(module, poisson_loader(blobs(), 0.25, seed=9), ckpt_path=tmp_path / "last.ckpt")
        continuations.append(flat(module) if class_name(name) not in AUDITED_ELSEWHERE else releases_of(released))
    assert not torch.equal(*continuations)


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_test_seed_is_kept_out_of_checkpoints_and_its_continuation_draws_other_noise(name, tmp_path, monkeypatch):
    """Audit, 2026-11-28: ``noise_seed`` sat in the checkpoint's hparams, a CLI resume configured with ``noise_seed:
    null`` kept it, and the resumed fit repeated the first fit's noise draw for draw (a continuation's release minus
    the first fit's at the same step: a noise-free difference of private sums)."""
    keys = []
    original = NoiseSource._fresh_secret

    def recorded(self, bits):
        keys[-1].append(original(self, bits))
        return keys[-1][-1]

    monkeypatch.setattr(NoiseSource, "_fresh_secret", recorded)  # every noise draw is keyed here
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    keys.append([])
    fit(build(name, noise_seed=5), poisson_loader(blobs(), 0.25, seed=1), 3, [checkpoint], enable_checkpointing=True)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert "noise_seed" not in saved["hyper_parameters"]
    assert type(build(name)).load_from_checkpoint(tmp_path / "last.ckpt", backbone=mlp(seed=1)).privacy.noise_seed is None
    keys.append([])
    quiet_trainer(max_steps=6).fit(build(name, noise_seed=5), poisson_loader(blobs(), 0.25, seed=1),
                                   ckpt_path=tmp_path / "last.ckpt")
    first, continued = keys
    assert first and continued and not set(first) & set(continued)


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_module_pickled_after_its_fit_holds_no_noise_key(name):
    """Audit 4: the noise source outlived the fit, so ``torch.save(module)`` gave away every draw."""
    module = build(name, noise_seed=None)
    fit(module, poisson_loader(blobs(), 0.25), 2)
    assert module.privacy.noise is None and b"NoiseSource" not in pickle.dumps(module)


@pytest.mark.parametrize("name", EVERY_CASES)
def test_a_module_copied_or_pickled_during_its_fit_holds_no_secret_and_the_copy_trains(name):
    """Review 24: an EMA or teacher callback's ``deepcopy(pl_module)`` raised in every zeroth-order module (the
    engine's chunk views of a written split), ``torch.save(pl_module)`` during a fit raised in every private module
    (the registration watch's local hook), and a first-order copy's own fit failed with ``KeyError`` (the engine's maps
    keyed by the original's ids). The copies hold no noise source or sampling stream, and the copy's fit draws its own."""
    import copy
    import io

    copies = []

    class Copier(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 1:
                saved = io.BytesIO()
                torch.save(module, saved)
                copies.append((copy.deepcopy(module), saved.getvalue()))

    module = build(name)
    fit(module, poisson_loader(blobs(), 0.25), 3, [Copier()])
    (twin, saved), = copies
    assert b"NoiseSource" not in saved and b"PCG64" not in saved and twin.privacy.__dict__.get("noise") is None
    before, original = flat(twin), flat(module)
    fit(twin, poisson_loader(blobs(), 0.25), 2)
    assert not torch.equal(flat(twin), before) and torch.equal(flat(module), original)


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_testing_an_earlier_checkpoint_after_the_fit_keeps_the_whole_runs_epsilon(name, tmp_path):
    """``test_ckpt: best``: the model picked among all iterates depends on all releases (audit 4)."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    module = build(name)
    trainer = fit(module, poisson_loader(blobs(), 0.1), 4, [checkpoint], enable_checkpointing=True)
    spent = module.privacy.epsilon()
    earlier, = (path for path in tmp_path.glob("*.ckpt") if "step=2" in path.name)
    trainer.test(module, DataLoader(blobs(n=32, seed=5), batch_size=16), ckpt_path=earlier, verbose=False)
    assert module.privacy.ledger.total_count == 4 and module.privacy.epsilon() == spent


@pytest.mark.parametrize("name", sharing())
def test_an_optimizer_the_module_did_not_build_is_refused_before_the_first_step(name):
    """LightningCLI's ``optimizer:`` replaces configure_optimizers: its steps were never counted (audit 4)."""
    module = build(name)
    module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(PrivacyConfigError, match="SGD was not built by the private module"):
        fit(module, poisson_loader(blobs(), 0.25), 2)
    assert module.privacy.ledger.total_count == 0


class _RateSchedule(pl.LightningDataModule):
    """A private loader rebuilt every epoch at a growing rate (a batch-size warm-up)."""

    def __init__(self):
        super().__init__()
        self.rate = 0.05

    def train_dataloader(self):
        loader = poisson_loader(blobs(), self.rate, steps_per_epoch=2)
        self.rate *= 4
        return loader


def test_a_private_loader_rebuilt_at_another_rate_is_refused():
    """The ledger accounts every step of a fit at its start's rate (audit 4: 0.02 -> 0.32 reported 1.29, spent 4.91)."""
    module = build("DPZero")
    trainer = quiet_trainer(max_epochs=3, reload_dataloaders_every_n_epochs=1)
    with pytest.raises(PrivacyConfigError, match="rebuilt with sampling PoissonSampling.*sample_rate=0.2"):
        trainer.fit(module, datamodule=_RateSchedule())
    assert module.privacy.ledger.total_count == 2


def test_lightnings_tuner_is_refused_on_a_private_module():
    """The learning-rate finder trains on private batches, then restores a ledger without those steps."""
    from lightning.pytorch.tuner import Tuner

    with pytest.raises(PrivacyConfigError, match="LearningRateFinder") as info:
        Tuner(quiet_trainer(max_steps=20)).lr_find(build("DPZero"), poisson_loader(blobs(), 0.25), num_training=5)
    # (review 20: it advised the non-private twin as an alternative, on the private data a rate from exact losses)
    assert "on public data only" in str(info.value) and "or with the non-private twin" not in str(info.value)


@pytest.mark.parametrize("monitor", ["ThroughputMonitor", "DeviceStatsMonitor"])
def test_monitors_logging_the_private_batch_sizes_are_refused_before_a_step(monitor, tmp_path):
    """Review 20: Lightning's ThroughputMonitor logged ``train/samples`` 75, 137, 202 for Poisson batches of 75, 62
    and 65 rows (the secret sampling's realized sizes); DeviceStatsMonitor logs the device memory each private step
    takes. The non-private twin keeps them."""
    from lightning.pytorch import callbacks
    from lightning.pytorch.loggers import CSVLogger

    def made():
        return (callbacks.ThroughputMonitor(batch_size_fn=lambda batch: len(batch[1])) if monitor == "ThroughputMonitor"
                else callbacks.DeviceStatsMonitor(cpu_stats=False))

    module = build("DPZero")
    with pytest.raises(PrivacyConfigError, match=f"{monitor} logs the realized size of each private") as info:
        fit(module, poisson_loader(blobs(), 0.25), 2, [made()], logger=CSVLogger(tmp_path))
    assert "\n" not in str(info.value) and module.privacy.ledger.total_count == 0
    twin = build("MeZO")
    fit(twin, poisson_loader(blobs(), 0.25), 2, [made()], logger=CSVLogger(tmp_path))
    assert twin.privacy.steps == 2


# -------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_loader_without_a_private_sampler_is_refused_even_with_a_sample_rate_attribute(name):
    loader = DataLoader(blobs(), batch_size=32, shuffle=True)
    loader.sample_rate, loader.n_private = 0.125, 256  # duck typing must not be trusted
    with pytest.raises(PrivacyConfigError, match="PrivateBatchSampler"):
        fit(build(name), loader, 2)


@pytest.mark.parametrize("name", PRIVATE_CASES)
@pytest.mark.parametrize("sigma", [1e-3, 1e-4])
def test_an_unaccountable_sigma_is_refused_before_the_first_step(name, sigma):
    module = build(name, noise_multiplier=sigma)
    before = flat(module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(AccountingError, match="noise_multiplier"):
            fit(module, poisson_loader(blobs(), 0.1), 100)
    assert torch.equal(flat(module), before)


@pytest.mark.parametrize("name", PRIVATE_CASES)
@pytest.mark.parametrize("kwargs,match", [
    (dict(noise_multiplier=None, target_epsilon=1e9), "target_epsilon"),
    (dict(noise_multiplier=None, target_epsilon=0.05), r"`target_epsilon` above `eps_error`=0.05"),
    (dict(max_epsilon=1e9), "max_epsilon"),
    (dict(lr=0.0), "lr"),
    (dict(clip=0.0), "clip"),
    (dict(delta=1.5), "delta"),
])
def test_impossible_settings_are_refused_at_construction_in_one_line(name, kwargs, match):
    with pytest.raises(PrivacyConfigError, match=match) as info:
        build(name, **kwargs)
    assert "\n" not in str(info.value)


def _batchnorm_mlp(track_running_stats):
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16, track_running_stats=track_running_stats),
                         nn.Tanh(), nn.Linear(16, 3))


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_batchnorm_using_batch_statistics_in_eval_mode_is_refused_in_one_line(name):
    """Such a layer makes each loss depend on the batch-mates (audit 3: 2.67 C released on one removal)."""
    with pytest.raises(PrivacyConfigError, match="BatchNorm layer `1`") as info:
        build(name, _batchnorm_mlp(track_running_stats=False))
    assert "\n" not in str(info.value)


def refused_before_a_step(name, first_layer, match):
    """``first_layer`` in front of the MLP: the fit is refused in one line matching ``match``, no step released."""
    torch.manual_seed(1)
    module = build(name, nn.Sequential(first_layer, nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3)))
    with pytest.raises(PrivacyConfigError, match=match) as info:
        fit(module, poisson_loader(blobs(), 0.25), 2)
    assert "\n" not in str(info.value) and module.privacy.ledger.total_count == 0


class _InputAverage(nn.Module):
    """Keeps a running average of its inputs in a buffer in every mode (a custom normalisation layer)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("average", torch.zeros(10))

    def forward(self, x):
        self.average.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return x


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_layer_writing_a_buffer_in_the_private_forward_is_refused_in_one_line(name):
    """The buffer would keep an un-noised average of private examples in every checkpoint (audit 4)."""
    refused_before_a_step(name, _InputAverage(), "`0` \\(_InputAverage\\) wrote `average` in the private forward")


class _ParameterAverage(nn.Module):
    """Keeps a running average of its inputs in a frozen parameter, written in place in every mode."""

    def __init__(self):
        super().__init__()
        self.average = nn.Parameter(torch.zeros(10), requires_grad=False)

    def forward(self, x):
        with torch.no_grad():
            self.average.mul_(0.9).add_(0.1 * x.mean(0))
        return x


class _RenormalisingScale(nn.Module):
    """A trainable scale renormalised in place by each forward, as ``F.embedding(max_norm=...)`` does to its rows."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((10,), 3.0))

    def forward(self, x):
        with torch.no_grad():
            self.scale.div_(self.scale.norm().clamp_min(1.0))
        return x * self.scale


@pytest.mark.parametrize("layer", [_ParameterAverage, _RenormalisingScale])
@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_layer_writing_a_parameter_in_the_private_forward_is_refused_in_one_line(name, layer):
    """The parameter would keep an un-noised function of private examples in every checkpoint (audit, 2026-11-28:
    an embedding's max_norm left a row's norm at 1.00 with the one example using it, 2.54 without)."""
    refused_before_a_step(name, layer(), f"`0` \\({layer.__name__}\\) wrote its parameter `")


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_an_embedding_with_max_norm_is_refused_at_construction_in_one_line(name):
    backbone = nn.Sequential(nn.Embedding(20, 8, max_norm=1.0), nn.Flatten(), nn.Linear(8, 3))
    with pytest.raises(PrivacyConfigError, match="embedding `0` sets max_norm") as info:
        build(name, backbone)
    assert "\n" not in str(info.value)


class _BatchCentring(nn.Module):
    """Subtracts the batch mean of its (detached) inputs: no gradient crosses rows, the values do."""

    def forward(self, x):
        return x - x.detach().mean(0)


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_forward_mixing_the_batch_in_its_values_is_refused_before_a_step_is_released(name):
    """Every example's value then moved with each batch-mate: up to 1.37 C on one removal (audit 5)."""
    refused_before_a_step(name, _BatchCentring(), "depend on their batch-mates")


class _RowCountForSomeRows(nn.Module):
    """Scales the rows whose first input is above 0.5 (about a third of them) by ``1 + len(x) / 10``, a function of
    the batch's row count: fewer than most rows move between the halves and the whole batch, and each half agrees in
    the whole batch's shape (the checks' rule until stop 58 passed it)."""

    def forward(self, x):
        return torch.where(x[:, :1] > 0.5, x * (1 + len(x) / 10), x)


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_forward_reading_the_row_count_in_some_rows_is_refused_before_a_step_is_released(name):
    """Removing one example would move every such batch-mate's value (7.8 C released through a loss of this kind,
    stop 58: ``test_pe_losses_halves_attacks.py``)."""
    refused_before_a_step(name, _RowCountForSomeRows(), "depend on (their batch-mates|the batch's row count)")


class _LateCentring(nn.Module):
    """Centres on the batch mean only from its owner's step ``after`` on (``owner`` set after it is built): mixing
    that the first batch does not trigger. ``mixed``: the private forwards that centred. (Counted in forwards until
    2026-11-30, when a checked first-order step began to run its module three more times.)"""

    def __init__(self, after: int):
        super().__init__()
        self.after, self.mixed = after, 0

    def forward(self, x):
        if _in_public_forward(self):  # (a public batch may mix as it likes: GEP's anchor gradients)
            return x
        if self.owner.global_step < self.after:
            return x
        self.mixed += 1
        return x - x.detach().mean(0)


def _in_public_forward(layer):
    """Whether the module that ``layer.owner`` names (set after it is built) runs a public forward."""
    return bool(getattr(getattr(layer, "owner", None), "public_forward", False))


@pytest.mark.parametrize("recheck_probability,name", spread([1.0, 0.0]))
def test_mixing_that_starts_after_the_first_batch_is_refused_at_a_rechecked_step(name, recheck_probability):
    """After the first batch, the halves check runs again at steps drawn with ``recheck_probability``
    (OS randomness). At 1 the first mixing step is refused before it is released; at 0 mixing that begins
    after the first batch goes unseen, which is what the re-check is for (zeroth-order modules ran it
    only on the first batch before 2026-11-25)."""
    torch.manual_seed(1)
    centring = _LateCentring(after=3)
    module = build(name, nn.Sequential(centring, nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3)),
                   recheck_probability=recheck_probability)
    centring.__dict__["owner"] = module  # (not a submodule)
    steps = 8
    if recheck_probability == 0.0:
        fit(module, poisson_loader(blobs(), 0.25), steps)
        assert module.privacy.ledger.total_count == steps and centring.mixed >= 5  # mixed steps released
        return
    with pytest.raises(PrivacyConfigError, match="depend on their batch-mates") as info:
        fit(module, poisson_loader(blobs(), 0.25), steps)
    assert "\n" not in str(info.value) and 0 < module.privacy.ledger.total_count < steps


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_model_reading_its_batchs_padding_is_refused_before_a_step_is_released(name):
    """A row's loss moved with its batch's longest row (FNet reads padding: 4.6e-3, times 1/lam in a ZO
    step; audit 5). First-order fits did not check it before 2026-11-25."""
    module = build(name, TokenBag(masked=False), num_classes=2)
    with pytest.raises(PrivacyConfigError, match="change with the padding of their batch") as info:
        fit(module, token_loader(), 2)
    assert "\n" not in str(info.value) and module.privacy.ledger.total_count == 0


class _ForwardsPerStep(Callback):
    """The backbone's forward calls in each training step, and whether its batch had a row shorter than its longest."""

    def __init__(self):
        self.calls, self.padded, self._start = [], [], 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        mask = batch[0]["attention_mask"]
        self.padded.append(bool((mask.sum(1) < mask.shape[1]).any()))
        self._start = module.backbone.calls

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.calls.append(module.backbone.calls - self._start)


#: Options under which every step takes as many forwards, by class (its variants too): O2NC's anchors take 2m, its
#: other steps 4m (first order: one vmapped forward and 2m), so a period of 1, every step an anchor.
STEADY = {"DPO2NC": dict(period=1)}


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_the_padding_check_waits_for_a_padded_batch_and_costs_no_forward_before_it(name):
    """Batches of full-length rows cannot show a model reading padding: the check waits for the first batch
    with a shorter row and refuses there, and the steps before it take no forward for it (until 2026-11-28
    first-order steps recomputed the losses on every such step: two forwards, 1.0 s of MiniLM's 3.7 s)."""
    full = 4
    trace = _ForwardsPerStep()
    module = build(name, TokenBag(masked=True), num_classes=2, recheck_probability=0.0,
                   **STEADY.get(class_name(name), {}))
    fit(module, token_loader(full_length_batches=full), full + 3, callbacks=[trace])
    assert trace.padded[:full + 1] == [False] * full + [True]
    steady = trace.calls[-1]  # the padding check passed at step `full`: nothing is pending after it
    assert trace.calls[1:full] == [steady] * (full - 1) and trace.calls[full] > steady
    leaky = build(name, TokenBag(masked=False), num_classes=2, recheck_probability=0.0)
    with pytest.raises(PrivacyConfigError, match="change with the padding of their batch"):
        fit(leaky, token_loader(full_length_batches=full), full + 3)
    assert leaky.privacy.ledger.total_count == full


@pytest.mark.parametrize("name", [n for n in PRIVATE_CASES if issubclass(algorithm_class(n), ZerothOrderModule)])
def test_a_waiting_padding_check_reads_each_batch_once_on_the_host_and_checks_no_forward(name, monkeypatch):
    """While the padding check waits (full-length rows), a zeroth-order step reads its batch's row ends once, on
    the host before the transfer, and its forwards run no check: no second read of the rows, no search for a
    reassigned parameter (until 2026-11-28 both forwards of every such step did both: about 0.3 ms of an 8 ms text
    step on CPU, issue 8). The first padded batch is read and checked; after it nothing is."""
    from lit_zodp.algorithms import base
    from lit_zodp.per_example.checks import ParameterWrites
    from lit_zodp.privacy.fixed_shape import rows_ending_early

    full, reads, searches = 4, [], []
    module = build(name, TokenBag(masked=True), num_classes=2, recheck_probability=0.0)
    for function, read in (("rows_ending_early", rows_ending_early),  # on the device batch, in a step
                           ("any_row_ends_early", base.any_row_ends_early)):  # on the host batch
        monkeypatch.setattr(base, function, lambda mask, read=read: reads.append(module.global_step) or read(mask))
    refuse_since = ParameterWrites.refuse_since

    def counted(self, versions, *, reassigned=True):
        if reassigned:
            searches.append(module.global_step)
        return refuse_since(self, versions, reassigned=reassigned)

    monkeypatch.setattr(ParameterWrites, "refuse_since", counted)
    fit(module, token_loader(full_length_batches=full), full + 3)
    assert "padding" not in module._pending_checks and "halves" not in module._pending_checks
    # (O2NC's first-order oracle asks whether the padded batch lets the check compare before its checking forward:
    # one more read of that batch's rows, once in the fit)
    padded_reads = 4 if backprops_private_rows(name) else 3
    assert [reads.count(step) for step in range(full + 3)] == [1] * full + [padded_reads, 0, 0]
    assert searches == [0, full]  # the halves check (first batch), the padding check (first padded batch)


def _on_a_device_with_padding_pending(module):
    """``module`` as in a fit's training stage on an accelerator, its padding check waiting: a meta device
    stands for the accelerator (reading a meta tensor's values raises, as a step asking the device would)."""
    module._device = torch.device("meta")
    module._trainer = SimpleNamespace(training=True, datamodule=None)
    module._pending_checks = {"padding"}
    return module


def _on_device(inputs):
    return {key: value.to("meta") for key, value in inputs.items()}


def _transferred(module, batch):
    """``batch`` as Lightning hands it to a step on the accelerator: noted on the host, then moved by the module's
    own transfer hooks (the meta device stands for the accelerator)."""
    module._note_host_batch(batch)
    trainer, module._trainer = module._trainer, None  # (no trainer: the transfer calls the module's own hooks)
    try:
        return module._apply_batch_transfer_handler(batch, device=torch.device("meta"))
    finally:
        module._trainer = trainer


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_on_an_accelerator_a_waiting_padding_check_takes_the_hosts_answer_for_the_batch(name):
    """Whether a batch has a row shorter than its longest is read on the host before the transfer (asked on the
    device, every step would wait for it, issue 8). The answer holds only for the very mask the transfer produced,
    unwritten: a batch the host saw with a shorter row, another mask (replaced after the transfer, or of another
    shape), a mask written in place after the transfer, and every batch of a module that changes batches after
    their transfer (its device batch need not be its host batch moved) are asked on the device."""
    module = _on_a_device_with_padding_pending(build(name, TokenBag(masked=True), num_classes=2))
    ids, targets = torch.ones(3, 5, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    full = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    padded = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    padded["attention_mask"][1:, 4] = 0  # rows 1 and 2 are shorter than row 0

    inputs, _ = _transferred(module, (full, targets))
    assert len(module._rows_shorter_than_the_batch(inputs)) == 0
    for other in (_on_device(full), _on_device({k: v[:2] for k, v in full.items()})):
        with pytest.raises(NotImplementedError):  # not the transfer's mask: asked on the device
            module._rows_shorter_than_the_batch(other)
    inputs["attention_mask"][1:, 4] = 0  # written after the transfer (a callback masking the padding ids)
    with pytest.raises(NotImplementedError):
        module._rows_shorter_than_the_batch(inputs)
    inputs, _ = _transferred(module, (padded, targets))
    with pytest.raises(NotImplementedError):
        module._rows_shorter_than_the_batch(inputs)
    assert module._rows_shorter_than_the_batch(padded).tolist() == [1, 2]  # on the CPU, as it is

    class ChangesBatchesOnTheDevice(algorithm_class(name)):
        abstract = True

        def on_after_batch_transfer(self, batch, dataloader_idx):
            return batch

    changing = _on_a_device_with_padding_pending(build(name, TokenBag(masked=True), num_classes=2,
                                                       cls=ChangesBatchesOnTheDevice))
    inputs, _ = _transferred(changing, (full, targets))
    with pytest.raises(NotImplementedError):
        changing._rows_shorter_than_the_batch(inputs)


class _MaskFromTheIds(Callback):
    """Sets each training batch's attention mask from its token ids (0 pads) after the transfer."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        batch[0]["attention_mask"] = (batch[0]["input_ids"] != 0).long()


@pytest.mark.parametrize("name", sharing())
def test_a_mask_set_after_the_transfer_is_checked_as_the_forward_sees_it(name):
    """Red-team review, 2026-11-28: the collate marks every column attended and a callback sets the mask from the
    ids in ``on_train_batch_start``. The host's note of the collated mask (no shorter row) must not stand for the
    mask the forward gets: a model that reads padding is refused at the first batch (it was never refused)."""
    loader = token_loader()
    collate = loader.collate_fn

    def every_column_attended(indices):
        inputs, labels = collate(indices)
        return {"input_ids": inputs["input_ids"], "attention_mask": torch.ones_like(inputs["input_ids"])}, labels

    loader.collate_fn = every_column_attended
    leaky = build(name, TokenBag(masked=False), num_classes=2)
    with pytest.raises(PrivacyConfigError, match="change with the padding of their batch"):
        quiet_trainer(max_steps=6, callbacks=[_MaskFromTheIds()]).fit(leaky, loader)
    assert leaky.privacy.ledger.total_count == 0


class _BlobsData(pl.LightningDataModule):
    def train_dataloader(self):
        return poisson_loader(blobs(), 0.25)


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_each_host_batch_is_seen_before_its_transfer_without_a_warning_beside_a_datamodule(name):
    """The host's answer is read in Lightning's step before each transfer, after the ``on_before_batch_transfer``
    hooks: overriding that public hook makes Lightning warn on every fit given a DataModule."""
    module, seen = build(name), []
    module._note_host_batch = seen.append
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(max_steps=3).fit(module, datamodule=_BlobsData())
    assert len(seen) == 3 and all(len(batch[1]) == len(batch[0]) for batch in seen)
    assert not [w for w in caught if "overridden" in str(w.message)]


@pytest.mark.parametrize("name", [n for n in PRIVATE_CASES if issubclass(algorithm_class(n), ZerothOrderModule)])
def test_a_batchnorm_with_running_statistics_keeps_zeroth_order_losses_per_example(name):
    """Zeroth-order steps forward in eval mode, where running statistics treat each example alone."""
    module = build(name, _batchnorm_mlp(track_running_stats=True))
    x, y = blobs(8)[:]
    alone = torch.stack([module.private_losses(x[i:i + 1], y[i:i + 1])[0] for i in range(8)])
    changed = x.clone()
    changed[0] += 5.0
    together = module.private_losses(changed, y)
    torch.testing.assert_close(together[1:], alone[1:], rtol=1e-6, atol=1e-7)


class _MLPWithOwnLoss(nn.Module):
    """The contract MLP as a backbone whose subclasses define ``per_example_loss``."""

    def __init__(self):
        super().__init__()
        self.net = mlp(seed=1)

    def forward(self, x):
        return self.net(x)


class _PerTokenLosses(_MLPWithOwnLoss):
    """A backbone whose ``per_example_loss`` returns ``[B, L]``: L values, each clipped on its own."""

    def per_example_loss(self, x, y):
        return nn.functional.cross_entropy(self.net(x), y, reduction="none").unsqueeze(1).expand(-1, 4)


class _BatchNormalisedLoss(_MLPWithOwnLoss):
    """A ``per_example_loss`` dividing each loss by the batch's total loss, detached (a "normalised" loss):
    no gradient crosses rows, but every example's clipped contribution moves with each batch-mate. (By the
    total, not the mean: at initialisation the losses are nearly equal, and a half's mean moved a loss by
    less than the rounding tolerance in 1 of 12 runs.)"""

    def per_example_loss(self, x, y):
        losses = nn.functional.cross_entropy(self.net(x), y, reduction="none")
        return losses / losses.detach().sum()


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_loss_mixing_the_batch_after_the_model_is_refused_before_a_step_is_released(name):
    """The loss's own arithmetic, outside every module the engine records, is checked like a forward:
    the losses of two random halves of the first batch must equal the whole batch's."""
    module = build(name, _BatchNormalisedLoss(), num_classes=3)
    with pytest.raises(PrivacyConfigError, match="depend on their batch-mates") as info:
        fit(module, poisson_loader(blobs(), 0.25), 2)
    assert "\n" not in str(info.value) and module.privacy.ledger.total_count == 0


class _TrainOnlyNormalisedLoss(_MLPWithOwnLoss):
    """``_BatchNormalisedLoss`` in training only, behind dropout: the shape of a train-only loss normalisation."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(*mlp(seed=1), nn.Dropout(0.1))

    def per_example_loss(self, x, y):
        losses = nn.functional.cross_entropy(self.net(x), y, reduction="none")
        return losses / losses.detach().sum() if self.training else losses


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_loss_mixing_the_batch_only_in_training_is_refused_where_training_mode_is_released(name):
    """Audit 8: first-order checks recomputed the losses in eval mode without grad, so a loss that mixed the
    batch only in training passed every re-check (62 C released on one removal). Zeroth-order steps run
    their forwards in eval mode: what they release does not mix, and they train."""
    module = build(name, _TrainOnlyNormalisedLoss(), num_classes=3)
    if issubclass(algorithm_class(name), ZerothOrderModule):
        fit(module, poisson_loader(blobs(), 0.25), 2)
        assert module.privacy.ledger.total_count == 2
        return
    with pytest.raises(PrivacyConfigError, match="depend on their batch-mates") as info:
        fit(module, poisson_loader(blobs(), 0.25), 2)
    assert "\n" not in str(info.value) and module.privacy.ledger.total_count == 0


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_per_token_losses_are_refused_in_one_line(name):
    """L clipped values per example would release L C (audit 3: 10 C with L = 10, C = 1)."""
    module = build(name, _PerTokenLosses(), num_classes=3)
    before = flat(module)
    with pytest.raises(PrivacyConfigError, match="one loss per example") as info:
        fit(module, poisson_loader(blobs(), 0.25), 2)
    assert "\n" not in str(info.value)
    # nothing left behind: a zeroth-order perturbation left pending would move them by lam |u| ~ 1e-3
    torch.testing.assert_close(flat(module), before, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(n for n in EVERY if issubclass(algorithm_class(n), ZerothOrderModule)))
def test_private_forwards_run_in_eval_mode_whatever_a_subclass_hook_does(name):
    """A subclass whose ``on_train_batch_start`` leaves the backbone in train mode (dropout, batch
    statistics) still gets its private losses in eval mode."""
    hook = {"on_train_batch_start": lambda self, batch, batch_idx: self.backbone.train()}
    leaky = type("Leaky" + name, (algorithm_class(name),), hook)
    modes = []
    module = build(name, cls=leaky)
    module.backbone.register_forward_pre_hook(lambda m, args: None if module.public_forward else modes.append(m.training))
    fit(module, poisson_loader(blobs(), 0.25), 2)
    assert modes and not any(modes)


class _RecordedDropout(nn.Module):
    """Dropout with p = 1/2 that keeps the masks it draws (a check's recomputation draws at the mean: not kept; a
    check's replay draws the step's masks again, kept again)."""

    def __init__(self):
        super().__init__()
        self.masks = []
        self.public = lambda: False  # (whether the forward is a public one: its masks are not kept)

    def forward(self, x):
        if not self.training:
            return x
        keep = torch.bernoulli(torch.full_like(x, 0.5))
        if not bool((keep == 0.5).all()) and not self.public():
            self.masks.append(keep.detach().clone())
        return x * keep * 2


class _SeededStreams(Callback):
    """Whether each training step left torch's CPU stream (which ``seed_everything`` sets) where it found it."""

    def __init__(self):
        self.unchanged = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before = torch.get_rng_state()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.unchanged.append(torch.equal(self.before, torch.get_rng_state()))


@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_a_private_step_draws_nothing_from_the_seeded_streams_and_its_dropout_masks_are_secret(name):
    """The attacker knows the run seed, so torch's default streams are public: dropout drawn from them in a private
    forward gives row ``p`` the ``p``-th mask whoever sits there, and one added example moves every later row's term
    (audit, 2026-11-28: 31 C with full-batch sampling). Each private step leaves the streams where they were, and two
    fits from one seed on the same batches draw different masks in their private forwards (a public forward's may be
    public: GEP's anchor pass keys them by the run seed and the step, so every DDP rank finds the same subspace)."""
    def run():
        pl.seed_everything(0)
        dropout = _RecordedDropout()
        backbone = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), dropout, nn.Linear(16, 3))
        streams = _SeededStreams()
        module = build(name, backbone)
        dropout.public = lambda: module.public_forward
        fit(module, full_batch_loader(blobs(n=32), 3), 3, [streams])
        return dropout.masks, streams.unchanged

    masks, unchanged = run()
    again, _ = run()
    assert unchanged == [True] * 3
    # (the checks' replays draw a step's masks again, so each fit may keep a different number: any two compared)
    assert not any(a.shape == b.shape and torch.equal(a, b) for a in masks for b in again)
    assert bool(masks) == (not issubclass(algorithm_class(name), ZerothOrderModule))  # zeroth order: eval, no masks


@pytest.mark.parametrize("name", sorted(set(EVERY) - set(PRIVATE)))
def test_a_non_private_module_refuses_privacy_settings_it_would_ignore(name):
    with pytest.raises(PrivacyConfigError, match="not private"):
        build(name, target_epsilon=2.0)


@pytest.mark.parametrize("name", EVERY_CASES)
def test_the_public_gradient_backprops_through_the_public_batch_only(name):
    module = build(name)
    public_x, public_y = blobs(n=16, seed=1).tensors
    private_x = blobs(n=16, seed=2).tensors[0]
    seen = []
    first = next(m for m in module.backbone.modules() if isinstance(m, nn.Linear))
    first.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        grads = module.public_gradient((public_x, public_y))
    assert len(seen) == 1 and seen[0] is public_x
    assert not any(t.data_ptr() == private_x.data_ptr() for t in saved)
    params = [p for p in module.backbone.parameters() if p.requires_grad]
    reference = torch.autograd.grad(nn.functional.cross_entropy(module.backbone(public_x), public_y), params)
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------- fixed-shape forwards
@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_fixed_forward_rows_give_every_private_forward_one_shape_and_the_same_step(name):
    """Poisson batches of varying size, forwarded as chunks of exactly 5 rows (tests/privacy/
    test_fixed_shape.py: why): every forward the backbone sees is [5, 10], and the steps equal the
    unchunked ones (the padding rows are dropped, the noise is the same draw)."""
    shapes = []
    backbone = mlp(seed=1)
    if ALGORITHM_KWARGS.get(name, {}).get("estimator") == "first_order" and issubclass(algorithm_class(name),
                                                                                      ZerothOrderModule):
        with pytest.raises(PrivacyConfigError, match="`fixed_forward_rows` does not reach estimator='first_order'"):
            build(name, backbone, fixed_forward_rows=5)
        pytest.skip("refused at construction: O2NC's first-order oracle vmaps each example's gradient over the "
                    "realized batch, so no forward has a fixed shape")
    module = build(name, backbone, fixed_forward_rows=5, noise_seed=0)
    backbone.register_forward_pre_hook(lambda _, args: None if module.public_forward
                                       else shapes.append(tuple(args[0].shape)))
    fixed, plain = Trace(), Trace()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(module, poisson_loader(blobs(), 0.1, seed=2), 4, [fixed])
        fit(build(name, mlp(seed=1), noise_seed=0), poisson_loader(blobs(), 0.1, seed=2), 4, [plain])
    assert set(shapes) == {(5, 10)} and len(set(fixed.sizes)) > 1 and fixed.sizes == plain.sizes
    for with_rows, without in zip(fixed.after, plain.after):
        # float32 losses of a [5, 10] chunk and of the whole batch differ in the last bit (that is the point
        # of fixed rows), times 1/(2 lam) in a ZO step: 1.5e-6 after 4 steps on some CPUs. A padding row's
        # value kept or another noise draw moves the parameters by ~1e-2.
        torch.testing.assert_close(with_rows, without, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------- logs
@pytest.mark.parametrize("name", PRIVATE_CASES)
def test_by_default_the_logs_hold_no_unaccounted_statistic_of_a_private_batch(name):
    """``clip_fraction`` (which examples were clipped) and ``step_time`` (tracks the realized batch size)
    are exact functions of the private batch: off unless asked for, and asking warns."""
    from tests.algorithms.test_step_logging import Recorder

    recorder = Recorder()
    fit(build(name), poisson_loader(blobs(), 0.25, seed=1), 3, logger=recorder, log_every_n_steps=1)
    logged = set().union(*recorder.steps.values())
    assert "sigma" in logged and not logged & {"clip_fraction", "step_time"}
    with pytest.warns(UserWarning, match="outside the privacy guarantee"):
        build(name, log_private_stats=True)


class _RegistersInItsForward(nn.Module):
    """An MLP whose forward, from its ``at``-th call, registers a parameter made from the batch (``new``), replaces a
    parameter with one (``replaced``), keeps it in a buffer (``buffer``) or builds a layer (``layer``)."""

    def __init__(self, how: str, at: int = 3):
        super().__init__()
        self.net, self.how, self.at, self.calls = mlp(seed=1), how, at, 0

    def forward(self, x):
        if _in_public_forward(self):
            return self.net(x)
        self.calls += 1
        if self.calls >= self.at:
            if self.calls == self.at:  # the owner's steps completed when it first registers (owner: set after build)
                self.first_at_step = self.owner.global_step
            batch_mean = x.detach().mean(0)
            if self.how == "new":
                self.kept = nn.Parameter(batch_mean.clone())
            elif self.how == "replaced":
                self.net[0].bias = nn.Parameter(self.net[0].bias.detach() + 1e-3 * batch_mean.sum())
            elif self.how == "buffer":
                self.register_buffer("kept_mean", batch_mean.clone())
            else:
                self.made = nn.Linear(1, 1)
        return self.net(x)


def _registration_hooks() -> int:
    """torch's global registration hooks, with eval mode's counting hook (``lit_zodp.zo.eval_mode``: installed once
    per process by the first zeroth-order fit, then kept) in place first: the first zeroth-order test of a process
    counted it as a hook its fit left behind."""
    from torch.nn.modules import module as torch_module

    from lit_zodp.zo.eval_mode import _count_registrations
    _count_registrations()
    return sum(len(hooks) for hooks in (torch_module._global_parameter_registration_hooks,
                                        torch_module._global_buffer_registration_hooks,
                                        torch_module._global_module_registration_hooks))


@pytest.mark.parametrize("how,at,name", spread([("new", 3), ("replaced", 3), ("layer", 3), ("buffer", 9), ("new", 9),
                                                ("replaced", 9)]))
def test_a_parameter_or_layer_registered_in_the_private_forward_is_refused_before_its_release(name, how, at):
    """Red-team review, 2026-11-28: a parameter registered in the forward (an un-noised batch mean kept in the model
    and every checkpoint) passed every check, a replaced one passed the forwards that run no independence check
    (all of a fit's steps, at recheck_probability 0), and a zeroth-order forward's new buffer was not looked for.
    Refused in the step that made it, before its release (a first-order engine refuses a new trainable parameter at
    its next forward too); the fit leaves no registration hook behind, refused or not."""
    hooks = _registration_hooks()
    module = build(name, _RegistersInItsForward(how, at), recheck_probability=0.0)  # (3: in the first checks)
    module.backbone.__dict__["owner"] = module  # (its public forwards, GEP's anchor gradients, neither count nor register)
    # (DOPE-SGD, DPMD: the public gradient's forward may be the one that registers it, refused at the private step's)
    # (a parameter replaced at each call from its batch mixes the batch: the gradient halves, whose recomputations
    # replace it too, may refuse the step first, as may the forward halves or, replaced within a step, the coverage
    # check: since stop 58 a checked step runs more calls, and the 9th falls in the first)
    refused = ("registered .* on the model|unfrozen after the per-example engine|wrote its parameter|wrote `kept_mean`"
               "|changed between private steps|depend on their batch-mates|do not add up to the batch gradient")
    with pytest.raises(PrivacyConfigError, match=refused):
        fit(module, poisson_loader(blobs(), 0.25), 6)
    # (counted in forwards until 2026-11-30, when a checked first-order step began to run its module three more times)
    assert module.privacy.ledger.total_count <= module.backbone.first_at_step < 6
    assert _registration_hooks() == hooks
    quiet = build(name, mlp(seed=1))
    fit(quiet, poisson_loader(blobs(), 0.25), 3)
    assert _registration_hooks() == hooks


@pytest.mark.parametrize("name", EVERY_CASES)
def test_a_backbone_with_every_parameter_frozen_is_refused_in_one_line(name):
    """It failed inside the optimizer or the engine ("optimizer got an empty parameter list", an IndexError)."""
    module = build(name)
    for p in module.backbone.parameters():
        p.requires_grad_(False)
    with pytest.raises(ConfigError, match="nothing to train: every parameter of the backbone is frozen") as info:
        fit(module, poisson_loader(blobs(), 0.25), 2)
    assert "\n" not in str(info.value)

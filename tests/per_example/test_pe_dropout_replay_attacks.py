"""Red-team review 72 (2026-12-01): attacks on stop 59 (1ef1847, 814fdfb, c0f0699): the engine's forward check compares
recomputations only with each other once one replaced a random draw, and at a step that drew, the set-apart row's
check (``gradient_halves._refuse_row_apart``) replays the step's own draws from the generators' states the tape kept
at the module's call (``ModuleCall.random_state``). Measured as refusal rates over re-checked steps with and without
review 20's crafted record (``tests/backbones/test_nfresnet_crafted.py``: a refusal only with it tells whether it was
in the batch), or as ``||S(D + record) - S(D)|| / C`` through ``DPSGD.private_gradient`` with the training
randomness made equal across the two runs (``first_order.secret_training_randomness`` patched to a fixed seed: each
step otherwise draws fresh secret masks, whose difference is no removal's).

Fixed here:

* A loss that draws before it calls the module (Gaussian input noise, ``0.01``), with ``losses_of`` (the package's
  modules always pass it): the losses path replayed from the module's call, so ``losses_of``'s noise took the draws
  the step's module had made (its dropout masks, or whatever followed), and every other row's recomputed norm
  differed from the step's. The honest NF-ResNet record was refused at 6 of 6 re-checked steps (dropout 0.1, and 6 of
  6 without dropout), none of 6 without the record, at c0f0699 and at 814fdfb. The tape now keeps the generators'
  states as ``loss_fn`` began (``Tape.loss_state``) and the losses path replays from there: 0 of 6.
* The same noise drawn by a forward pre-hook on the engine's module (no ``losses_of``): the tape kept the states
  and the inputs after the pre-hooks, so the replay drew the noise again on the noised inputs. Passed at 814fdfb
  without dropout (the noise at its mean: 0 of 6), refused at 6 of 6 since c0f0699 (6 of 6 with dropout 0.1 at
  both), none without the record. The tape now takes the states and the inputs in a first pre-hook
  (``Tape._root_begins``) and records the call with those inputs (every recomputation calls the module, so its
  pre-hooks run again, once): 0 of 6. A pre-hook rescaling the inputs (``x * 0.5 + 1``, no draw) was applied twice
  too: the record refused at 6 of 6 re-checked steps without dropout (0 now), and in eval mode any model at its first
  batch, as batch mixing (every mode; passes now).
* One record with an infinite feature (factor 0) and any model with dropout in training: the whole batch's
  recomputation is not finite, and the retry (``gradient_halves._retry_without_non_finite_rows``) compared the
  step's own sum (masks drawn) with the rows in it recomputed alone (masks at their mean): an honest MLP with
  dropout 0.1 under DPSGD was refused at 4 of 4 re-checked steps with the record, none without it (every mode; the
  same at 814fdfb). At a step that drew, the retry now replays the step's draws in the batch's shape, the rows not
  in the sum replaced by copies of rows in it at weight 0, and (each draw at its mean) the rows in the sum alone must
  give what they give in that shape: 0 of 4. Review 67's backward scaled by the batch statistic that the record sets
  to ``inf`` stays refused with dropout (released above 2 C with the retry off), and so does a backward negated above
  16 rows that the record's row reaches (9.01 C through the replayed comparison alone).
* The step's calls pending the gradient halves (``engine._gradient_check``: their inputs and, since c0f0699, the
  generators' states of a private step) outlived a step that failed after the forward check (a backward raising) or
  that never reached the halves (``per_example_gradients``): held on the engine until the next step, in a pickled or
  deep-copied engine's bytes. Now dropped with the tape; the states are out of a call's ``repr`` too (a test's
  assertion printed their first bytes).

Open (strict ``xfail``):

* Review 20's record in a structure's first batch (a fresh engine, or DPSGD's first step): the numeric coverage check
  finds the standardised convolution's rule wrong on it (its rounding apart) and falls back to torch.func, which
  cannot draw dropout: refused in 4 of 4 fresh engines in every mode with dropout 0.1, and in "hooks" without
  dropout too ("do not add up to the batch gradient"), none without the record (at 814fdfb too: not the replay's
  doing). The same through DPSGD's first step (dropout 0.1, "hooks"; with ``micro_batch_size=8`` and with
  ``fixed_forward_rows=16`` too).
* (Not a test: two crafted records.) Review 20's record beside a record with an infinite feature: the retry
  compares the step's sum with the finite rows recomputed, where the cancelling record rounds apart, before any
  row is set apart: refused at 6 of 6 re-checked steps, none with an honest row in its place
  (with and without dropout; at 814fdfb too).

* A float32 model under a CPU bfloat16 autocast with review 20's record: the set-apart row's check compares the
  step's own norms and sum (rounded by the autocast) with float32 recomputations (``without_autocast``) at float32's
  tolerance, and refuses the honest record at 6 of 6 re-checked steps without dropout, 5 or 6 of 6 with dropout 0.1,
  none without the record ("hooks"; not the replay's doing: without dropout nothing is replayed). Loosening to the
  autocast's tolerance let 2.90 C through (review 68), so it is left open.
* Mixup inside the module's forward (``x = lam x + (1 - lam) x[randperm(B)]`` before the first layer): the checks'
  recomputations take ``randperm`` as the identity and ``Beta``'s draws at their stand-ins, so no recomputation
  mixes, and the per-example gradients (of mixed rows) are exact for the alignment check. 4.68 C released on one
  removal (``B = 16``, ``C = 0.1``, every mode; the same at 814fdfb). The same mix after a layer is refused (the layer
  rules are wrong there and the vmap fallback cannot draw). Replaying the step's draws in the batch's shape with the
  other half's rows replaced by copies would see it; not done here. (Closed at stop 60: the engine's forward check
  and the gradient halves each do so at a step that drew, ``engine._refuse_mixing_through_draws`` and
  ``gradient_halves._refuse_mixing_through_draws``; each alone refuses it. The same mix after the module, in the loss,
  through a detached share, passed the forward check by construction and the gradient halves at the draws' stand-ins:
  1.80 C released (``B = 16``, ``C = 0.1``, every mode), refused now.)
"""

from __future__ import annotations

import contextlib
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lit_zodp.backbones.base import Backbone
from lit_zodp.errors import LitZodpWarning, PrivacyConfigError
from lit_zodp.per_example import PerExampleGradientEngine, gradient_halves
from lit_zodp.per_example.tape import LayerCall, ModuleCall
from lit_zodp.privacy.training_randomness import random_state
from tests.per_example.test_pe_gradient_halves_attacks import removal_difference

MODES = ["hooks", "ghost", "bookkeeping"]
MARGIN = 1 + 1e-3


def _nfresnet_with_dropout(p: float):
    """Review 20's standardised-convolution net with dropout ``p`` before the head, in training mode."""
    from tests.backbones.test_nfresnet_crafted import StdConvNet

    class WithDropout(StdConvNet):
        def __init__(self):
            super().__init__(constant_channels=True)
            self.drop = nn.Dropout(p)

        def forward(self, x):
            return self.head(self.drop(self.conv(x).mean((2, 3)))).float()

    return WithDropout().train()


def _refusals(model, losses, with_record: bool, steps: int = 6, *, autocast: bool = False,
              losses_of: bool = True) -> tuple:
    """Refusals of ``steps`` re-checked steps of ``losses(model, x, y)`` (after an honest first batch), with review
    20's record first in the batch or an honest row there; and how many set a row apart."""
    from tests.backbones.test_nfresnet_crafted import honest, null_space_record

    apart = []
    check = gradient_halves._refuse_row_apart

    def spied(*args, **kwargs):
        apart.append(1)
        return check(*args, **kwargs)

    x, y = honest(32)
    engine = PerExampleGradientEngine(model, mode="hooks", recheck_probability=0.0)
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext

    def step(xs, ys):
        with context():
            engine.clipped_sum(lambda: losses(model, xs, ys), 1e-3,
                               losses_of=(lambda rows: losses(model, xs[rows], ys[rows])) if losses_of else None)

    step(torch.cat([x, x[:1]]), torch.cat([y, y[:1]]))
    first = null_space_record(1e10, 100.0) if with_record else 0.5 * x[:1]
    x, y = torch.cat([first, x]), torch.cat([y[:1], y])
    refused = 0
    gradient_halves._refuse_row_apart = spied
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(steps):
                engine.recheck_next = True
                try:
                    step(x, y)
                except PrivacyConfigError:
                    refused += 1
    finally:
        gradient_halves._refuse_row_apart = check
    return refused, len(apart)


def _noisy_inputs(model, x, y):
    """Per-example losses of inputs with Gaussian noise (``0.01``) drawn before the module's call."""
    return F.cross_entropy(model(x + 0.01 * torch.randn_like(x)), y, reduction="none")


def _noisy_model(p: float, where: str):
    """:func:`_nfresnet_with_dropout`, and its per-example losses on inputs with Gaussian noise (``0.01``) drawn
    before the module's forward: by the loss (``where`` "loss") or by a forward pre-hook on the module ("pre-hook")."""
    model = _nfresnet_with_dropout(p)
    if where == "affine-pre-hook":  # (no draw: the inputs rescaled)
        model.register_forward_pre_hook(lambda module, args: (args[0] * 0.5 + 1.0,))
        return model, lambda m, x, y: F.cross_entropy(m(x), y, reduction="none")
    if where == "pre-hook":
        model.register_forward_pre_hook(lambda module, args: (args[0] + 0.01 * torch.randn_like(args[0]),))
        return model, lambda m, x, y: F.cross_entropy(m(x), y, reduction="none")
    return model, _noisy_inputs


@pytest.mark.parametrize("where, losses_of", [("loss", True), ("pre-hook", False), ("pre-hook", True),
                                              ("affine-pre-hook", False)],
                         ids=["loss-losses_of", "pre_hook", "pre_hook-losses_of", "affine_pre_hook"])
@pytest.mark.parametrize("p", [0.1, 0.0], ids=["dropout", "no-dropout"])
def test_noise_drawn_before_the_module_is_not_refused_beside_the_record(p, where, losses_of):
    """Module doc, fixed: 6 of 6 refused with the record before (none without), 0 of 6 now; the record was set apart
    at every step, so the replayed comparison ran."""
    refused, apart = _refusals(*_noisy_model(p, where), with_record=True, losses_of=losses_of)
    assert (refused, apart) == (0, 6)
    assert _refusals(*_noisy_model(p, where), with_record=False, losses_of=losses_of) == (0, 0)


@pytest.mark.parametrize("mode", MODES)
def test_a_forward_pre_hook_on_the_module_is_not_applied_twice(mode):
    """Module doc, fixed: the recomputations ran the module on the inputs its pre-hooks had returned, applying them
    twice; in eval mode the forward check compares the step's outputs with them, and a plain MLP whose pre-hook
    rescales its inputs was refused at its first batch as batch mixing (every mode; training mode passed)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).eval()
    model.register_forward_pre_hook(lambda module, args: (args[0] * 0.5 + 1.0,))
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    clipped = PerExampleGradientEngine(model, mode=mode).clipped_sum(
        lambda: F.cross_entropy(model(x), y, reduction="none"), 1.0)
    assert all(torch.isfinite(g).all() for g in clipped.grads)


def test_the_pending_calls_and_their_generator_states_do_not_outlive_the_step():
    """Module doc, fixed: a step that failed after the forward check, and ``per_example_gradients`` (which never runs
    the halves), left the step's calls (inputs, generators' states) on the engine, in its pickled bytes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Linear(8, 2)).train()
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    engine = PerExampleGradientEngine(model, mode="hooks")

    class Raising(torch.autograd.Function):
        @staticmethod
        def forward(ctx, z):
            return z.view_as(z)

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("a failing backward")

    with pytest.raises(RuntimeError, match="a failing backward"):
        engine.clipped_sum(lambda: F.cross_entropy(Raising.apply(model(x)), y, reduction="none"), 1.0)
    assert engine._gradient_check is None
    engine.recheck_next = True
    grads = engine.per_example_gradients(lambda: F.cross_entropy(model(x), y, reduction="none"))
    assert len(grads[0]) == len(x)
    assert engine._gradient_check is None
    assert b"RandomState" not in pickle.dumps(engine) and b"ModuleCall" not in pickle.dumps(engine)
    call = ModuleCall(model, [], None, [], random_state=random_state())  # (nor in a print of a call)
    assert "RandomState" not in repr(call)
    private = torch.tensor([123456.0])  # (nor the private values a call holds, stop 59)
    call = ModuleCall(model, [private], None, [None], grads={0: private}, outputs={0: private})
    assert "123456" not in repr(call) and "123456" not in repr(LayerCall(model, private, grad=private))


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="open: under a CPU bfloat16 autocast (float32 model) the set-apart row's check refuses "
                          "review 20's honest record at 6 of 6 re-checked steps (none without it), 5 or 6 of 6 with "
                          "dropout 0.1: a refusal that leaks membership")
@pytest.mark.parametrize("p", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_the_record_is_not_refused_under_a_bfloat16_autocast(p):
    def losses(model, x, y):
        return F.cross_entropy(model(x), y, reduction="none")

    assert _refusals(_nfresnet_with_dropout(p), losses, with_record=False, autocast=True, losses_of=False)[0] == 0
    refused, apart = _refusals(_nfresnet_with_dropout(p), losses, with_record=True, autocast=True, losses_of=False)
    assert refused == 0, f"refused at {refused} of 6 re-checked steps with the record (apart at {apart})"


class _InputMixup(Backbone):
    """Mixup inside the forward, before the first layer: ``lam x + (1 - lam) x[randperm(B)]``, ``lam ~ Beta(2, 2)``."""

    num_classes = 2

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            lam = torch.distributions.Beta(2.0, 2.0).sample()
            x = lam * x + (1 - lam) * x[torch.randperm(len(x))]
        return self.fc2(torch.tanh(self.fc1(x)))


@contextlib.contextmanager
def _fixed_training_randomness(device):
    """The step's training randomness from a fixed seed (the removal's two runs draw alike), torch's restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        yield


def _rechecked_release(make, clip: float, mode: str):
    """``(xs, ys) ->`` the flat released clipped sum of a fresh ``DPSGD`` over ``make()`` (float32, train mode), with
    the halves check and its re-check pending (a checked step)."""
    from lit_zodp.algorithms import DPSGD

    def released(xs, ys):
        torch.manual_seed(0)
        module = DPSGD(make().float(), clip=clip, noise_multiplier=1.0, delta=1e-5, lr=1e-3, grad_mode=mode).train()
        module._pending_checks, module._recheck_pending = {"halves"}, True
        return torch.cat([g.flatten() for g in module.private_gradient(xs, ys).grads])

    return released


def _mixup_removal(make, mode: str) -> float:
    """``||S(D + record) - S(D)|| / C`` (0: refused) through a re-checked ``DPSGD`` step over ``make()``, ``B = 16``,
    ``C = 0.1``, the training randomness equal across the two runs; a warning fails it (a check that warns its way
    past is not a pass)."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(16, 8, generator=generator, dtype=torch.float32) * 3
    y = torch.randint(0, 2, (16,), generator=generator)
    record = torch.randn(1, 8, generator=generator, dtype=torch.float32) * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return removal_difference(_rechecked_release(make, 0.1, mode), 0.1, x, y, record, 1)


@pytest.mark.parametrize("mode", MODES)
def test_mixup_inside_the_forward_is_refused(mode, monkeypatch):
    """4.68 C released before stop 60 (a strict ``xfail``). The forward check and the gradient halves, each replaying
    the step's draws, refuse it alone; with neither it passes again."""
    from lit_zodp.algorithms import first_order

    monkeypatch.setattr(first_order, "secret_training_randomness", _fixed_training_randomness)
    assert _mixup_removal(_InputMixup, mode) <= MARGIN
    with monkeypatch.context() as patched:
        patched.setattr(PerExampleGradientEngine, "_refuse_mixing_through_draws", lambda *args, **kwargs: None)
        assert _mixup_removal(_InputMixup, mode) <= MARGIN
    with monkeypatch.context() as patched:
        patched.setattr(gradient_halves, "_refuse_mixing_through_draws", lambda *args, **kwargs: None)
        assert _mixup_removal(_InputMixup, mode) <= MARGIN
    monkeypatch.setattr(PerExampleGradientEngine, "_refuse_mixing_through_draws", lambda *args, **kwargs: None)
    monkeypatch.setattr(gradient_halves, "_refuse_mixing_through_draws", lambda *args, **kwargs: None)
    assert _mixup_removal(_InputMixup, mode) > 4


class _LossMixup(Backbone):
    """Mixup after the module, in ``per_example_loss``: each row's logits plus a detached share of the row
    ``randperm`` picks, ``lam ~ U(0, 1)`` (the alignment check sees no gradient across rows; the forward check sees
    only the module's outputs)."""

    num_classes = 2

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))

    def per_example_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(x)
        if self.training:
            lam = torch.rand(())
            logits = logits + 30 * (1 - lam) * logits[torch.randperm(len(x))].detach()
        return F.cross_entropy(logits, targets, reduction="none")


@pytest.mark.parametrize("mode", MODES)
def test_mixup_in_the_loss_through_a_detached_share_is_refused(mode, monkeypatch):
    """1.80 C released before stop 60, silently (``randperm`` at the identity and ``rand`` at its mean in every
    recomputation); the gradient halves replaying the step's draws refuse it."""
    from lit_zodp.algorithms import first_order

    monkeypatch.setattr(first_order, "secret_training_randomness", _fixed_training_randomness)
    assert _mixup_removal(_LossMixup, mode) <= MARGIN
    monkeypatch.setattr(gradient_halves, "_refuse_mixing_through_draws", lambda *args, **kwargs: None)
    assert _mixup_removal(_LossMixup, mode) > 1.5


class _MixupBehindRReLU(_InputMixup):
    """Mixup inside the forward behind an RReLU in training: on CPU RReLU draws a slope only for each negative input,
    so the number of draws follows the batch's content and no two replays of different content draw alike."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.rrelu(x, training=self.training))


def test_mixup_whose_draws_cannot_be_replayed_alike_is_not_passed_silently():
    """Runs that did not draw alike give no verdict: the engine says so (beside the eval-mode fallback's warning
    that RReLU's draws already give). Where the three runs' inputs happen to hold as many negative values, they draw
    alike and the mixup is refused (by chance, on some secret halves): either is not a silent pass."""
    from lit_zodp.algorithms import DPSGD

    torch.manual_seed(0)
    module = DPSGD(_MixupBehindRReLU().float(), clip=0.1, noise_multiplier=1.0, delta=1e-5, lr=1e-3).train()
    module._pending_checks, module._recheck_pending = {"halves"}, True
    x, y = torch.randn(16, 8, dtype=torch.float32) * 3, torch.randint(0, 2, (16,))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            module.private_gradient(x, y)
        except PrivacyConfigError as refusal:
            assert "random draws" in str(refusal)
            return
    assert any(issubclass(w.category, LitZodpWarning) and "could not replay alike" in str(w.message) for w in seen)


class _DropoutMLP(Backbone):
    """An honest MLP with dropout (``p``) in training; with ``scaled``, review 67's backward scaled by the batch's
    mean squared input (an infinite feature scales every batch-mate's backward to 0)."""

    num_classes = 2

    def __init__(self, p: float = 0.1, scaled: bool = False):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 16), nn.Dropout(p), nn.Linear(16, 2)
        self.scaled = scaled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tests.per_example.test_pe_layer_inputs_attacks import _BatchScaledBackward

        logits = self.fc2(self.drop(torch.relu(self.fc1(x))))
        return _BatchScaledBackward.apply(logits, x.detach().pow(2).sum(1).mean()) if self.scaled else logits


def _batch_and_infinite_record():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(15, 8, generator=generator, dtype=torch.float32) * 3
    y = torch.randint(0, 2, (15,), generator=generator)
    record = torch.randn(1, 8, generator=generator, dtype=torch.float32)
    record[0, 3] = float("inf")
    return x, y, record


@pytest.mark.parametrize("mode", MODES)
def test_a_record_with_an_infinite_feature_is_not_refused_with_dropout(mode):
    """Module doc, fixed: an honest MLP with dropout 0.1, DPSGD, one record with an infinite feature (factor 0): the
    retry compared the step's own sum (masks drawn) with the rows recomputed alone (masks at their mean), and refused
    at 4 of 4 re-checked steps with the record, none without it. It now replays the step's draws in the batch's shape
    (the non-finite row's position holding a copy of another row, at weight 0): 0 of 4."""
    from lit_zodp.algorithms import DPSGD

    x, y, record = _batch_and_infinite_record()
    for xs, ys in ((torch.cat([x, record]), torch.cat([y, y[:1]])), (x, y)):
        torch.manual_seed(0)
        module = DPSGD(_DropoutMLP().float(), clip=1.0, noise_multiplier=1.0, delta=1e-5, lr=1e-3,
                       grad_mode=mode).train()
        for _ in range(4):
            module._pending_checks, module._recheck_pending = {"halves"}, True
            clipped = module.private_gradient(xs, ys)
            assert clipped.batch_size == len(ys) and all(torch.isfinite(g).all() for g in clipped.grads)


@pytest.mark.parametrize("mode", MODES)
def test_review_67s_infinite_record_is_refused_with_dropout(mode, monkeypatch):
    """The replayed retry above still refuses review 67's backward scaled by a batch statistic that the infinite
    record sets to 0 (the copy in its place has a finite one), with dropout 0.1 and the masks equal across the
    removal's two runs; the retry switched off, the same record releases more than C (the attack is real)."""
    from lit_zodp.algorithms import DPSGD, first_order

    monkeypatch.setattr(first_order, "secret_training_randomness", _fixed_training_randomness)
    x, y, record = _batch_and_infinite_record()

    def released(xs, ys):
        torch.manual_seed(0)
        module = DPSGD(_DropoutMLP(scaled=True).float(), clip=0.1, noise_multiplier=1.0, delta=1e-5, lr=1e-3,
                       grad_mode=mode).train()
        module._pending_checks, module._recheck_pending = {"halves"}, True
        return torch.cat([g.flatten() for g in module.private_gradient(xs, ys).grads])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert removal_difference(released, 0.1, x, y, record, 0) <= MARGIN
        monkeypatch.setattr(gradient_halves, "_retry_without_non_finite_rows", lambda *args, **kwargs: None)
        assert removal_difference(released, 0.1, x, y, record, 0) > 2


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="open: in a structure's first batch the numeric coverage check refuses review 20's honest "
                          "record (4 of 4 fresh engines: 'hooks' with or without dropout, 'ghost'/'bookkeeping' with "
                          "dropout 0.1, whose torch.func fallback cannot draw), none without it")
@pytest.mark.parametrize("mode, p", [("hooks", 0.0), ("ghost", 0.1)])
def test_the_record_in_a_structures_first_batch_is_not_refused(mode, p):
    from tests.backbones.test_nfresnet_crafted import honest, null_space_record

    x, y = honest(32)
    refused = []
    for first in (0.5 * x[:1], null_space_record(1e10, 100.0)):  # (an honest row there, then the record)
        model = _nfresnet_with_dropout(p)
        xs, ys = torch.cat([first, x]), torch.cat([y[:1], y])
        try:
            PerExampleGradientEngine(model, mode=mode).clipped_sum(
                lambda: F.cross_entropy(model(xs), ys, reduction="none"), 1e-3)
            refused.append(False)
        except PrivacyConfigError:
            refused.append(True)
    assert refused == [False, False], "refused with the record only" if refused == [False, True] else refused


class _FlippedAbove16(torch.autograd.Function):
    """Identity forward; the backward negated where the batch has more than 16 rows."""

    @staticmethod
    def forward(ctx, z: torch.Tensor) -> torch.Tensor:
        ctx.rows = len(z)
        return z.view_as(z)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return -grad if ctx.rows > 16 else grad


class _RowCountDropoutMLP(_DropoutMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FlippedAbove16.apply(super().forward(x))


@pytest.mark.parametrize("mode", MODES)
def test_an_infinite_record_switching_a_backward_by_the_row_count_is_refused_with_dropout(mode, monkeypatch):
    """The replayed retry runs the batch's shape, so it cannot see the row count: an infinite record (factor 0, in no
    comparison of the finite rows) taking the batch to 17 rows, where a backward negates every batch-mate's gradient.
    Compared only replaying the step's draws in the batch's shape (this review's first fix), 9.01 C released on one
    removal (16 batch-mates, ``C = 1``, every mode). The retry now also compares, each draw at its mean, the rows
    in the sum alone with them in the batch's shape (copies at weight 0): refused."""
    from lit_zodp.algorithms import first_order

    monkeypatch.setattr(first_order, "secret_training_randomness", _fixed_training_randomness)
    x, y, record = _batch_and_infinite_record()
    x, y = torch.cat([x, x[:1] + 0.1]), torch.cat([y, y[:1]])

    released = _rechecked_release(_RowCountDropoutMLP, 1.0, mode)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        moved = removal_difference(released, 1.0, x, y, record, 0)
    assert moved <= MARGIN, f"one removal changed the released sum by {moved:.3f} C"

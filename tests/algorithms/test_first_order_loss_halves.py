"""The engine's gradient halves on the losses a first-order module computes (``FirstOrderModule._micro_batches``
gives the engine each micro-batch's ``losses_of``): what a backbone's ``per_example_loss`` does around its forward is
checked, not only the backbone's recorded call. Red-team review 67 left both attacks below open on the bare engine:
a loss that calls only the model's children (no call of the engine's module: no halves check ran, 6.54 C) and a
backward scaled by a batch statistic after the model (the step's output gradients hold it: 3.73 C)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lit_zodp.algorithms import DPSGD
from lit_zodp.backbones.base import Backbone
from lit_zodp.errors import PrivacyConfigError
from tests.per_example.test_pe_layer_inputs_attacks import _BatchScaledBackward

MODES = ["hooks", "ghost", "bookkeeping"]
CLIP = 0.1


class _ScaledAfterForward(Backbone):
    """Review 65's two-layer net whose ``per_example_loss`` calls its layers itself (``forward`` is never called in
    a step) and, if ``scaled``, divides the backward by ``1 + 1e-6 * mean_b ||x_b||^2`` (a batch statistic)."""

    num_classes = 2

    def __init__(self, scaled: bool = True):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 2)
        self.scaled = scaled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))

    def per_example_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.fc2(torch.relu(self.fc1(x)))
        if self.scaled:
            logits = _BatchScaledBackward.apply(logits, x.detach().pow(2).sum(1).mean())
        return F.cross_entropy(logits, targets, reduction="none")


def _module(mode: str, scaled: bool, micro_batch_size=None) -> DPSGD:
    torch.manual_seed(0)
    return DPSGD(_ScaledAfterForward(scaled), clip=CLIP, noise_multiplier=1.0, delta=1e-5, lr=1e-3, grad_mode=mode,
                 micro_batch_size=micro_batch_size).train()


def _batch():
    torch.manual_seed(0)
    return torch.randn(15, 8) * 3, torch.randint(0, 2, (15,))


def _record():
    return torch.randn(1, 8, generator=torch.Generator().manual_seed(1)) * 1e5


@pytest.mark.parametrize("mode", MODES)
def test_a_backward_scaled_in_the_backbones_loss_is_refused(mode):
    """Review 65's record (1e5 times an input's size) shrinks every batch-mate's clipped gradient: with it the step
    is refused; on the bare engine without ``losses_of`` the same loss is refused only as uncompared."""
    x, y = _batch()
    module = _module(mode, scaled=True)
    with pytest.raises(PrivacyConfigError, match="depend on their batch-mates"):
        module.private_gradient(torch.cat([x, _record()]), torch.cat([y, torch.zeros(1, dtype=torch.long)]))


@pytest.mark.parametrize("mode", MODES)
def test_the_honest_twin_passes_and_the_check_ran(mode, monkeypatch):
    """Without the scale the same step passes, micro-batched too; the engine's gradient halves did run on the
    module's losses (counted), so the refusal above is theirs and not a refusal of every such loss."""
    import lit_zodp.per_example.gradient_halves as halves

    runs = []
    original = halves._loss_weighted_gradient
    monkeypatch.setattr(halves, "_loss_weighted_gradient", lambda *a, **k: runs.append(1) or original(*a, **k))
    x, y = _batch()
    for micro_batch_size in (None, 8):
        runs.clear()
        clipped = _module(mode, scaled=False, micro_batch_size=micro_batch_size).private_gradient(
            torch.cat([x, _record()]), torch.cat([y, torch.zeros(1, dtype=torch.long)]))
        assert clipped.batch_size == 16 and all(torch.isfinite(g).all() for g in clipped.grads)
        assert len(runs) >= 3  # the whole and two halves (of the first micro-batch: the second's structure is known)


@pytest.mark.parametrize("mode", MODES)
def test_the_scale_sets_one_removal_apart_without_the_check(mode, monkeypatch):
    """The attack is real: with the check's refusal ignored, one removal moves the released sum by more than C."""
    import lit_zodp.per_example.engine as engine

    monkeypatch.setattr(engine.PerExampleGradientEngine, "_refuse_gradient_mixing", lambda *a, **k: None)
    x, y = _batch()

    def released(xs, ys):
        return torch.cat([g.flatten() for g in _module(mode, scaled=True).private_gradient(xs, ys).grads])

    with_record = released(torch.cat([x, _record()]), torch.cat([y, torch.zeros(1, dtype=torch.long)]))
    assert float((with_record - released(x, y)).norm()) / CLIP > 2

"""Zeroth-order training of 16-bit weights (review 30, utility): the losses a step differences keep float32's
resolution, and a fit whose perturbation or restore rounds in the weights' precision says so before its first step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_zodp.algorithms import MeZO
from lit_zodp.backbones import TinyMLP
from lit_zodp.backbones.base import per_example_loss
from lit_zodp.zo import PerturbationEngine
from lit_zodp.zo.estimators import central_differences
from tests.conftest import mlp


def bf16_mlp_batch(seed=0):
    torch.manual_seed(seed)
    model = TinyMLP(64, 10, 64).to(torch.bfloat16).eval()
    return model, torch.randn(64, 64).to(torch.bfloat16), torch.randint(0, 10, (64,))


def test_a_16_bit_models_per_example_losses_are_its_logits_cross_entropy_in_float32():
    """A bfloat16 model's losses were rounded to bfloat16 (a loss near 2.3 to a step of 0.016), so at ``lam`` 1e-3
    a central difference moved in steps of 7.8: its per-example error against the float64 directional derivative was
    0.50 of the derivatives' rms on a digits MLP, 0.27 with the cross-entropy taken in float32 (0.29 under bf16
    autocast, 0.03 in float32 weights)."""
    torch.manual_seed(0)
    cases = [bf16_mlp_batch(), (mlp().to(torch.float16), torch.randn(32, 10).half(), torch.randint(0, 3, (32,)))]
    for model, x, y in cases:
        with torch.no_grad():
            exact = F.cross_entropy(model(x).double(), y, reduction="none")
            losses = per_example_loss(model, x, y)
        assert losses.dtype == torch.float32
        torch.testing.assert_close(losses.double(), exact, rtol=1e-6, atol=1e-7)


def test_the_central_differences_of_a_bf16_model_resolve_its_logits_changes():
    """Per example, the difference of losses equals the float64 cross-entropy difference of the model's (bf16)
    logits at the two points, to float32 rounding: no longer quantised to the loss's bf16 step."""
    model, x, y = bf16_mlp_batch()
    engine = PerturbationEngine(list(model.parameters()))
    logits = []

    def losses():
        with torch.no_grad():
            out = model(x)
            logits.append(out.double())
            return per_example_loss(model, x, y)

    differences = central_differences(engine, seed=3, lam=1e-3, losses=losses)
    engine.restore_()
    exact = (F.cross_entropy(logits[0], y, reduction="none") - F.cross_entropy(logits[1], y, reduction="none")) / 2e-3
    assert (differences.double() - exact).abs().max() < 1e-3 * max(1.0, exact.abs().max().item())

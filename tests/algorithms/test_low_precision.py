"""Zeroth-order training of 16-bit weights (review 30, utility): the losses a step differences keep float32's
resolution, and a fit whose perturbation or restore rounds in the weights' precision says so before its first step."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from lit_zodp.algorithms import ALGORITHMS
from lit_zodp.backbones import TinyMLP
from lit_zodp.backbones.base import per_example_loss
from lit_zodp.errors import LitZodpWarning
from lit_zodp.zo import PerturbationEngine
from lit_zodp.zo.estimators import central_differences
from lit_zodp.zo.precision import low_precision_note, rounding_loss
from tests.conftest import blobs, mlp, poisson_loader, quiet_trainer


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


def trained_digits_like_mlp():
    """A 64-64-64-10 MLP trained by Adam on a fixed random problem: weights of a trained model's spread."""
    torch.manual_seed(0)
    x = torch.randn(512, 64)
    y = (x @ torch.randn(64, 10)).argmax(1)
    model = TinyMLP(64, 10, 64)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(100):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_measured_drift_is_the_engines_drift_at_lr_0(dtype):
    """2000 perturb-and-restore steps of the engine at ``lr`` 0: float32 weights come back bit for bit, 16-bit ones
    walk away (a digits MLP: 16% of their norm in bfloat16, 2.3% in float16), and :func:`rounding_loss`, measured on
    a sample of 8 simulated steps, predicts that walk to within 25%."""
    model = trained_digits_like_mlp().to(dtype)
    start = [p.detach().double().clone() for p in model.parameters()]
    predicted = rounding_loss(list(model.parameters()), 1e-3).drift(2000)
    engine = PerturbationEngine(list(model.parameters()))
    for seed in range(2000):
        central_differences(engine, seed, 1e-3, lambda: torch.zeros(1))
        engine.restore_and_update_({seed: 0.0}, lr=0.0)
    moved = math.sqrt(sum(float((p.detach().double() - w).pow(2).sum()) for p, w in zip(model.parameters(), start)) /
                      sum(float(w.pow(2).sum()) for w in start))
    assert moved > {torch.bfloat16: 0.1, torch.float16: 0.01}[dtype]
    assert 0.75 < predicted / moved < 1.25


def test_float32_weights_do_not_drift_and_are_not_measured():
    model = trained_digits_like_mlp()
    start = [p.detach().clone() for p in model.parameters()]
    engine = PerturbationEngine(list(model.parameters()))
    for seed in range(200):
        central_differences(engine, seed, 1e-3, lambda: torch.zeros(1))
        engine.restore_and_update_({seed: 0.0}, lr=0.0)
    assert max(float((p - w).abs().max()) for p, w in zip(model.parameters(), start)) < 1e-6
    assert rounding_loss(list(model.parameters()), 1e-3) is None


def test_the_perturbation_error_is_what_rounding_leaves_of_lam_u():
    """bfloat16 weights near 1 (a LayerNorm's) have a rounding step of 2^-7 = 0.0078: ``lam`` 1e-3 perturbs them not at
    all for |u| < 3.9 (the error is nearly all of lam*u); ``lam`` 0.1 by 1-2% of itself; float16 at 1e-3 in between."""
    ones = [torch.ones(4096, dtype=torch.bfloat16)]
    assert rounding_loss(ones, 1e-3).perturbation_error > 0.9
    assert rounding_loss(ones, 0.1).perturbation_error < 0.05
    assert 0.1 < rounding_loss([torch.ones(4096, dtype=torch.float16)], 1e-3).perturbation_error < 0.6


def fit_warnings(module, precision, steps=2):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(max_steps=steps, precision=precision).fit(module, poisson_loader(blobs(), 0.25))
    return [str(w.message) for w in caught if issubclass(w.category, LitZodpWarning)]


@pytest.mark.parametrize("name", ["MeZO", "DPZero", "DPMeZOBCD"])
def test_a_bf16_fit_says_what_rounding_costs_in_one_line_and_a_float32_fit_says_nothing(name):
    """Before review 30 a ``bf16-true`` zeroth-order fit ran silently; it now names lam, the dtype, the perturbation's
    rounding error and the drift over its planned steps, once, and trains on."""
    kwargs = {} if name == "MeZO" else {"noise_multiplier": 1.0}
    warned = fit_warnings(ALGORITHMS[name](mlp(), lr=0.01, lam=1e-3, seed=0, **kwargs), "bf16-true")
    notes = [w for w in warned if "weights in place" in w]
    assert len(notes) == 1 and "\n" not in notes[0]
    assert f"{name} perturbs bfloat16 weights in place at lam=0.001" in notes[0]
    assert "'32-true'" in notes[0]
    assert not [w for w in fit_warnings(ALGORITHMS[name](mlp(), lr=0.01, lam=1e-3, seed=0, **kwargs), "32-true")
                if "weights in place" in w]


def test_a_short_float16_fit_at_a_resolved_lam_is_not_warned_and_a_long_one_is():
    """float16 at ``lam`` 1e-2: the perturbation rounds by a few % and the drift grows as sqrt(steps): 100 planned steps
    stay under 1% of the weights' norm, 100,000 do not."""
    loss = rounding_loss(list(trained_digits_like_mlp().half().parameters()), 1e-2)
    assert loss.perturbation_error < 0.1
    assert low_precision_note(loss, 1e-2, "MeZO", 100) is None
    note = low_precision_note(loss, 1e-2, "MeZO", 100_000)
    assert "over the planned 100,000 steps" in note
    assert low_precision_note(loss, 1e-2, "MeZOBCD", 100_000, share_per_step=1e-4) is None

"""LR schedules stepped once per training step whose horizon ends before the fit (review 30, utility)."""

from __future__ import annotations

import math
import warnings
from functools import partial

import pytest
import torch
from torch.optim.lr_scheduler import (ChainedScheduler, ConstantLR, CosineAnnealingLR, LinearLR, PolynomialLR, SequentialLR,
                                      StepLR)

from lit_zodp.algorithms import ALGORITHMS
from lit_zodp.errors import LitZodpWarning
from tests.conftest import blobs, mlp, poisson_loader, quiet_trainer


def module(name, schedule):
    kwargs = {} if name in ("MeZO", "SGD") else {"noise_multiplier": 1.0}
    return ALGORITHMS[name](mlp(), lr=0.05, seed=0, lr_scheduler=schedule, **kwargs)


def fit(model, steps, **fit_kwargs):
    trainer = quiet_trainer(max_steps=steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, poisson_loader(blobs(), 0.25), **fit_kwargs)
    return trainer, [str(w.message) for w in caught
                     if issubclass(w.category, LitZodpWarning) and "lr_scheduler" in str(w.message)]


@pytest.mark.parametrize("name", ["MeZO", "DPZero", "SGD", "DPSGD"])
def test_a_polynomial_schedule_that_ends_before_the_fit_says_so_and_its_lr_is_then_0(name):
    """``PolynomialLR(total_iters=5)`` in a 20-step fit: the lr is 0 from step 5 on, so the weights stop moving there
    (on digits, MeZO: test accuracy 0.178 with the horizon written in epochs, 100, against 0.763 in steps, 2000). Before
    review 30 nothing said so; now one line gives the step the fit runs to and the option to set."""
    model = module(name, partial(PolynomialLR, total_iters=5, power=1.0))
    trainer, notes = fit(model, 5)
    after_five = [p.detach().clone() for p in model.backbone.parameters()]
    assert notes == []  # (a fit of 5 steps ends with the schedule)
    model = module(name, partial(PolynomialLR, total_iters=5, power=1.0))
    trainer, notes = fit(model, 20)
    assert notes == ["`lr_scheduler` PolynomialLR(total_iters=5) counts optimizer steps (these modules step it once per "
                     "training step, not per epoch), but this fit runs to step 20: after step 5 its lr is 0; "
                     "set total_iters: 20"]
    assert model.optimizers().param_groups[0]["lr"] == 0.0
    if name in ("MeZO", "SGD"):  # (no noise: the same 5 steps, then 15 at lr 0)
        for p, q in zip(model.backbone.parameters(), after_five):
            torch.testing.assert_close(p.detach(), q, rtol=0, atol=1e-6)


def test_a_cosine_schedule_in_epochs_climbs_back_and_is_named_with_its_period():
    _, notes = fit(module("MeZO", partial(CosineAnnealingLR, T_max=4)), 20)
    assert len(notes) == 1 and "CosineAnnealingLR(T_max=4)" in notes[0]
    assert "its lr climbs back to its maximum every 8 steps; set T_max: 20" in notes[0]


def test_schedules_that_fit_the_plan_or_have_no_horizon_say_nothing_and_a_resume_counts_its_position(tmp_path):
    for schedule in (partial(CosineAnnealingLR, T_max=20), partial(PolynomialLR, total_iters=30),
                     partial(StepLR, step_size=2), partial(LinearLR, start_factor=0.1, total_iters=3)):
        assert fit(module("MeZO", schedule), 20)[1] == []
    schedule = partial(PolynomialLR, total_iters=12, power=1.0)
    trainer, _ = fit(module("MeZO", schedule), 8)
    trainer.save_checkpoint(tmp_path / "eight.ckpt")
    assert fit(module("MeZO", schedule), 12, ckpt_path=tmp_path / "eight.ckpt")[1] == []
    notes = fit(module("MeZO", schedule), 16, ckpt_path=tmp_path / "eight.ckpt")[1]
    assert len(notes) == 1 and "runs to step 16: after step 12 its lr is 0" in notes[0]


def warmup_then_cosine(optimizer, T_max):
    return SequentialLR(optimizer, [LinearLR(optimizer, start_factor=0.1, total_iters=2),
                                    CosineAnnealingLR(optimizer, T_max=T_max)], milestones=[2])


def test_a_warm_up_then_a_cosine_in_epochs_is_judged_by_its_cosine_and_so_is_a_chained_one():
    """Review 33: ``SequentialLR`` (a warm-up of 2 steps, then ``CosineAnnealingLR(T_max=5)``) in a 20-step fit ended at
    lr 0.033 of 0.05, climbing back, and a ``ChainedScheduler`` holding the same cosine at the full 0.05,
    both unsaid: composite schedules were not judged. Their cosine now is, from the milestone where it starts."""
    model = module("MeZO", partial(warmup_then_cosine, T_max=5))
    _, notes = fit(model, 20)
    assert notes == ["`lr_scheduler` SequentialLR's CosineAnnealingLR(T_max=5) counts optimizer steps (these modules "
                     "step it once per training step, not per epoch), but this fit runs to step 20: after step 7 its "
                     "lr climbs back to its maximum every 10 steps; set T_max: 18"]
    # (the cosine's step 18, 8 into its period of 10: 0.65 of the maximum)
    assert model.optimizers().param_groups[0]["lr"] == pytest.approx(0.05 * (1 + math.cos(math.pi * 8 / 5)) / 2)
    model = module("MeZO", partial(warmup_then_cosine, T_max=18))
    assert fit(model, 20)[1] == [] and model.optimizers().param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    chained = partial(lambda optimizer: ChainedScheduler([ConstantLR(optimizer, factor=0.5, total_iters=2),
                                                          CosineAnnealingLR(optimizer, T_max=5)]))
    notes = fit(module("MeZO", chained), 20)[1]
    assert len(notes) == 1 and "ChainedScheduler's CosineAnnealingLR(T_max=5)" in notes[0]
    assert "runs to step 20: after step 5" in notes[0] and notes[0].endswith("set T_max: 20")

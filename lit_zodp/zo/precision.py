"""What the in-place passes of a zeroth-order step lose in 16-bit weights (review 30, utility).

The engine perturbs the weights in place, ``+lam u``, ``-2 lam u``, then restores ``+lam u`` (MeZO's seed trick),
each pass rounded to the weights' dtype. In bfloat16 (8 significant bits) or float16 (11) two things go wrong that
float32 weights do not show:

* ``lam |u|`` below half the weight's rounding step: ``w + lam u`` rounds back to ``w``, so the element is not
  perturbed and its share of the two-point difference is rounding noise (bfloat16 weights of ``|w| >= 0.25`` at
  ``lam = 1e-3`` for a median ``|u|``).
* Each restore leaves the rounding errors of the three passes: a zero-mean random walk of about one rounding step on
  a quarter to a third of the perturbed elements per step, whatever the data and the learning rate. A digits MLP
  trained to 0.917 test accuracy and run 2000 MeZO steps at ``lr = 0`` moved by 16% of its weights' norm in
  bfloat16 (accuracy 0.892) and by 2.3% in float16; in float32 by 2.5e-6 (the chunked engine's restore rounds in
  every dtype; review 34).

:func:`rounding_loss` measures both on the actual weights, once: a strided sample of each tensor (at most
``SAMPLE`` elements) goes through a few perturb-and-restore cycles exactly as the chunked engine rounds them, with
public directions of a fixed seed (weights only, no data: nothing private is read).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

#: Elements sampled per tensor (a fixed stride through it).
SAMPLE = 1 << 14
#: Perturb-and-restore cycles simulated per sampled element.
CYCLES = 8
#: Dtypes whose rounding step is large enough to matter at the papers' ``lam`` (1e-3).
LOW_PRECISION = (torch.bfloat16, torch.float16)
#: The warning's thresholds: the perturbation's relative rounding error, and a drift over the planned steps.
PERTURBATION_ERROR, DRIFT = 0.1, 0.01


@dataclass(frozen=True)
class RoundingLoss:
    """What rounding does to the 16-bit weights of a zeroth-order step.

    ``perturbation_error``: ``||fl(w + lam u) - w - lam u|| / ||lam u||`` over the sampled weights (1 where every
    ``w + lam u`` rounds back to ``w``). ``drift_per_step``: the root-mean-square movement that one perturb-and-restore
    leaves, relative to the weights' norm; a zero-mean random walk, so it grows as ``sqrt(steps)``. ``dtype``: the most
    numerous 16-bit dtype.
    """

    perturbation_error: float
    drift_per_step: float
    dtype: torch.dtype

    def drift(self, steps: float) -> float:
        return self.drift_per_step * math.sqrt(max(steps, 0.0))


def strided_sample(param: Tensor, size: int = SAMPLE) -> Tensor:
    """At most ``size`` elements of ``param`` at a fixed stride (a copy on the host, in the parameter's dtype)."""
    flat = param.detach().reshape(-1)
    return flat[::max(1, math.ceil(flat.numel() / size))].cpu().clone()


@torch.no_grad()
def rounding_loss(params: Sequence[Tensor], lam: float, *, cycles: int = CYCLES,
                  seed: int = 0) -> Optional[RoundingLoss]:
    """Simulate ``cycles`` steps' passes (``+lam u``, ``-2 lam u``, ``+lam u``, each rounded as the chunked engine
    rounds it) on a strided sample of each 16-bit tensor of ``params``, each sampled element standing for
    ``numel / sample`` of them. ``None``: no 16-bit weights."""
    generator = torch.Generator().manual_seed(seed)
    error = intended = moved = norm = 0.0
    counts: dict[torch.dtype, int] = {}
    for param in params:
        if param.dtype not in LOW_PRECISION or param.numel() == 0:
            continue
        w = strided_sample(param)
        exact, weight = w.double(), param.numel() / w.numel() / cycles
        counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
        for _ in range(cycles):
            u = torch.randn(w.shape, generator=generator).to(w.dtype)
            x = w.clone().add_(u, alpha=lam)
            error += weight * float((x.double() - exact - lam * u.double()).pow(2).sum())
            intended += weight * float((lam * u.double()).pow(2).sum())
            x.add_(u, alpha=-2.0 * lam).add_(u, alpha=lam)
            moved += weight * float((x.double() - exact).pow(2).sum())
        norm += weight * cycles * float(exact.pow(2).sum())
    if not counts:
        return None
    return RoundingLoss(math.sqrt(error / intended) if intended > 0 else 0.0,
                        math.sqrt(moved / norm) if norm > 0 else 0.0, max(counts, key=counts.get))


def low_precision_note(loss: Optional[RoundingLoss], lam: float, algorithm: str, steps: Optional[float],
                       share_per_step: float = 1.0) -> Optional[str]:
    """One line when rounding costs the estimate (``perturbation_error`` at least ``PERTURBATION_ERROR``) or the
    weights (a drift of at least ``DRIFT`` over ``steps``, each element perturbed on ``share_per_step`` of them:
    about ``1 / N`` for one of N blocks); ``None`` otherwise. Without a finite plan the drift is given per 1000 steps."""
    if loss is None:
        return None
    planned = steps is not None and math.isfinite(steps) and steps > 0
    horizon = steps if planned else 1000.0
    drift = loss.drift(horizon * share_per_step)
    if loss.perturbation_error < PERTURBATION_ERROR and drift < DRIFT:
        return None
    name = str(loss.dtype).replace("torch.", "")
    when = f"the planned {int(horizon):,} steps" if planned else f"{int(horizon):,} steps"
    return (f"{algorithm} perturbs {name} weights in place at lam={lam:g}: rounding moves the applied +lam*u by "
            f"{loss.perturbation_error:.0%} of itself (the two-point difference partly measures rounding), and each "
            f"restore leaves a rounding error, a random drift of about {drift:.1%} of the weights' norm over {when} "
            f"whatever the data and lr; train float32 weights (precision '32-true', or 'bf16-mixed', which keeps them "
            f"float32)")


__all__ = ["RoundingLoss", "low_precision_note", "rounding_loss", "strided_sample"]

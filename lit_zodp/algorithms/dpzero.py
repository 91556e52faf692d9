"""DPZero and its baselines (Zhang et al., "DPZero: Private Fine-Tuning of Language Models without
Backpropagation"): DPZero (Algorithm 2), DPGD-0th (Algorithm 1) and the non-private MeZO.

Choices where the paper is silent or differs from this library's accounting:

* Neighbours and normalisation. Alg. 1-2 are full-batch, ``(1/n) sum_i clip(.) + z`` with replace-one
  neighbours (sensitivity ``2C/n``, Sec. 2.1) and ``sigma`` set by advanced composition without
  subsampling (Thm. 3; :func:`~lit_zodp.privacy.calibration.dpzero_theory_sigma`). The experiments use
  mini-batches (App. B.2) and the paper states no accountant for them. Here batches are sampled as the
  DataModule describes (Poisson, rate ``q = B/n``, by default) and the released value is
  ``(sum_i clip(.) + N(0, (sigma C)^2)) / B`` under add/remove-one neighbours (sensitivity ``C``),
  accounted with the PRV accountant. The authors' code (github.com/Liang137/DPZero,
  ``opt/src/trainer.py``) adds ``N(0, (2 sigma C / B)^2)`` to the mean of the clipped differences of a
  shuffled fixed-size batch, ``sigma`` from Opacus's RDP accountant at ``q = B/n``: the same form up to
  the factor 2 of replace-one, which ``neighbours="replace_one", accountant="rdp"`` reproduce
  (``configs/dpzero``).
* Clipping. Alg. 2 line 3 clips the finite difference already divided by ``2 lam``, as here, so ``C``
  is on the scale of ``u^T grad f`` (Table 8's grid 50-400 at ``lam = 1e-3``), not of the raw
  difference of two losses.
* Directions. The theory (Sec. 3-4, Alg. 1-2 line 2) draws ``u`` on the ``sqrt(d)`` sphere; the
  experiments use ``u ~ N(0, I)`` (App. B.2), and Table 7 shows no notable difference. Both are
  available (``directions=``); Gaussian is the default, as in the experiments.
* Several directions per step (``num_directions = k > 1``) are not in the paper: each direction's
  scalar is clipped to ``C``, the k-vector of sums is released once (sensitivity ``sqrt(k) C``) and
  the step averages the directions.
* Output. Alg. 1-2 output a uniformly random iterate ``x_tau``; we keep the last iterate, which the
  authors' RoBERTa script tests (``roberta/examples/dpzero.sh``: one evaluation, at step T); their
  OPT script tests the best checkpoint on the dev set (``load_best_model_at_end``; our Table 4
  configs: ``test_ckpt: best``). The paper states neither.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lit_zodp.algorithms.zeroth_order import ZerothOrderModule
from lit_zodp.backbones.base import batch_size_of
from lit_zodp.errors import raise_if_any
from lit_zodp.privacy import GaussianRelease, StepPlan, clipped_fraction, clipped_sum

DERIVATIVES = "directional derivatives"
GRADIENT = "gradient estimate"


def stack_sums(sums: list) -> torch.Tensor:
    """The k directions' clipped sums as one k-vector (k = 1: a view, no kernel)."""
    return sums[0].unsqueeze(0) if len(sums) == 1 else torch.stack(sums)


class DPZero(ZerothOrderModule):
    """DPZero, Algorithm 2 of Zhang et al.

    Each step (t):
      line 2   draw u_t (public: seeded from the run seed and t);
      line 3   s_i = clip_C((f(x_t + lam u_t; xi_i) - f(x_t - lam u_t; xi_i)) / (2 lam)) per example;
               g = (sum_i s_i + z_t) / B with one scalar z_t ~ N(0, (sigma C)^2), B the expected size;
               x_{t+1} = x_t - alpha * g * u_t   (the restore x_t - lam u_t -> x_t is fused in).
    """

    non_private_twin = "MeZO"

    def step_plan(self) -> StepPlan:
        """One release of the k clipped sums (k = num_directions): sensitivity sqrt(k) C."""
        return (GaussianRelease(DERIVATIVES, sensitivity=math.sqrt(self.num_directions)),)

    def training_step(self, batch, batch_idx: int) -> None:
        (inputs, targets), _ = self.split_batch(batch)
        size = batch_size_of(inputs)
        seeds = self.direction_seeds()                                                  # line 2
        derivatives, differences = self.released_derivatives(seeds, inputs, targets, size)  # line 3: + z_t, / B
        self.update(dict(zip(seeds, derivatives.unbind())), scale=self.update_scale)  # x_{t+1}
        self.log_step(size, lambda: clipped_fraction(torch.cat(differences), self.clip))

    def released_derivatives(self, seeds: list, inputs, targets, size: int) -> tuple[torch.Tensor, list]:
        """Line 3 for each of the k directions: the per-example differences, and the k-vector of their clipped sums
        (float64: :func:`clipped_sum`) released once, ``+ z_t`` and ``/ B``, rounded to the losses' dtype after
        the noise (:attr:`loss_dtype`). The last direction's perturbation stays pending, to be fused into the update."""
        clipped_sums, differences = [], []
        for k, seed in enumerate(seeds):
            differences.append(self.directional_differences(seed, inputs, targets))
            clipped_sums.append(clipped_sum(differences[-1], self.clip))
            if k < len(seeds) - 1:
                self.restore()
        released = self.privacy.release(stack_sums(clipped_sums), DERIVATIVES, batch_size=size,
                                        dtype=self.loss_dtype)  # (the model's, never the batch's: review 33)
        return released, differences


class MeZO(DPZero):
    """Non-private ZO-SGD with the seed trick (Malladi et al.), the DPZero paper's baseline.

    The DPZero step with the non-private privacy component: ``x <- x - lr * mean_i clip_C(s_i) * u``,
    the mean over the realized batch, no noise. ``clip=inf`` (default) is plain MeZO, a finite
    ``clip`` the clipped MeZO of DPZero's Fig. 3.
    """

    private = False

    def __init__(self, backbone: nn.Module, *, clip: float = math.inf, **kwargs: Any) -> None:
        super().__init__(backbone, clip=clip, **kwargs)


class DPGD0th(ZerothOrderModule):
    """DPGD-0th, Algorithm 1 of Zhang et al. (the baseline DPZero improves on).

    Each example's full vector estimate ``g_i = s_i u`` is clipped in L2 norm and the noise is a
    d-dimensional ``N(0, (sigma C)^2 I)``: ``x <- x - alpha (sum_i clip_C(g_i) + z) / B``. Since
    ``||s_i u|| = |s_i| ||u||``, the vector clip is the scalar clip of ``s_i`` at ``C / ||u||``;
    the noise vector is generated chunk by chunk from a 128-bit secret key.
    """

    non_private_twin = "MeZO"
    vector_noise = True

    def __init__(self, backbone: nn.Module, **kwargs: Any) -> None:
        super().__init__(backbone, **kwargs)
        if self.num_directions != 1:
            raise_if_any([f"DPGD-0th (Alg. 1) uses one direction per step: expected `num_directions` 1, but got "
                          f"{self.num_directions}"])

    def step_plan(self) -> StepPlan:
        """One d-dimensional release of sensitivity C."""
        return (GaussianRelease(GRADIENT),)

    def training_step(self, batch, batch_idx: int) -> None:
        (inputs, targets), _ = self.split_batch(batch)
        size = batch_size_of(inputs)
        (seed,) = self.direction_seeds()                                                # line 2
        scalar_clip = self.clip / self.engine.direction_norm(seed)                      # ||clip(s_i u)|| <= C
        differences = self.directional_differences(seed, inputs, targets)              # g_i = s_i u
        clipped = clipped_sum(differences, scalar_clip)
        release = self.privacy.release_along(clipped, GRADIENT, batch_size=size)      # (S u + z) / B
        self.update({seed: release.coefficient.item()}, noise=release)                  # line 3
        self.log_step(size, lambda: clipped_fraction(differences, scalar_clip))


__all__ = ["DPGD0th", "DPZero", "MeZO"]

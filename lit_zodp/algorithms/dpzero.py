"""DPZero and its baselines (Zhang et al., "DPZero: Private Fine-Tuning of Language Models without
Backpropagation"): DPZero (Algorithm 2), DPGD-0th (Algorithm 1) and the non-private MeZO.

Choices where the paper is silent or differs from this library's accounting:

* Neighbours and normalisation. The paper writes ``(1/n) sum_i clip(.) + z`` with replace-one
  neighbours (sensitivity ``2C/n``). Here batches are Poisson-sampled with rate ``q = B/n`` and the
  released value is ``(sum_i clip(.) + N(0, (sigma C)^2)) / B`` under add/remove-one neighbours
  (sensitivity ``C``), accounted with the PRV accountant; the paper's Sec. 5 experiments use the
  same ``std = 2 sigma C / B`` form up to the factor 2 of replace-one.
* Directions. The theory (Sec. 3, Alg. 2 line 2) draws ``u`` on the ``sqrt(d)`` sphere; the
  experiments (Sec. 5) use ``u ~ N(0, I)``, and Table 7 shows no notable difference. Both are
  available (``directions=``); Gaussian is the default, as in the experiments.
* Several directions per step (``num_directions > 1``) are not in the paper: each direction's
  scalar is clipped to ``C`` and noised, and the step averages them (accounting in
  ``noise_multiplier_scale``).
* Output. The paper outputs a uniformly random iterate ``x_tau``; like its experiments we keep the
  last iterate (Lightning checkpoints give the others).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lit_zodp.backbones.base import batch_size_of
from lit_zodp.privacy import clip_scalars, clipped_fraction
from lit_zodp.privacy.mechanisms import Mechanism, SubsampledGaussian
from lit_zodp.zo import central_differences
from lit_zodp.algorithms.base import PrivateZerothOrderModule, ZerothOrderModule


class MeZO(ZerothOrderModule):
    """Non-private ZO-SGD with the seed trick (Malladi et al.), the DPZero paper's baseline.

    ``x <- x - lr * mean_i clip_C((f(x+lam u; xi_i) - f(x-lam u; xi_i)) / (2 lam)) * u``, the mean
    over the realized batch; ``clip=inf`` (default) is plain MeZO, a finite ``clip`` the clipped
    MeZO of DPZero's Fig. 3.
    """

    def __init__(self, backbone: nn.Module, *, clip: float = math.inf, **kwargs: Any) -> None:
        super().__init__(backbone, **kwargs)
        if not clip > 0:
            raise ValueError(f"Expected `clip` to be a positive float (or inf), but got {clip}")
        self.clip = float(clip)

    def training_step(self, batch, batch_idx: int) -> None:
        inputs, targets = batch
        size = batch_size_of(inputs)
        seeds = self.direction_seeds()
        means = []
        for k, seed in enumerate(seeds):
            differences = central_differences(self.zo_optimizer.engine, seed, self.lam,
                                              lambda: self.per_example_losses(inputs, targets))
            clipped = clip_scalars(differences, self.clip)
            means.append(self.reduce_sum(torch.stack([clipped.sum(), torch.tensor(float(size))])))
            if k < len(seeds) - 1:
                self.zo_optimizer.engine.restore_()
        count = max(means[0][1].item(), 1.0)
        self.apply_update({seed: m[0].item() / count / len(seeds) for seed, m in zip(seeds, means)})
        self.log_step_time(size)


class DPZero(PrivateZerothOrderModule):
    """DPZero, Algorithm 2 of Zhang et al.

    Each step (t):
      line 2   draw u_t (public: seeded from the run seed and t);
      line 3   s_i = clip_C((f(x_t + lam u_t; xi_i) - f(x_t - lam u_t; xi_i)) / (2 lam)) per example;
               g = (sum_i s_i + z_t) / B with one scalar z_t ~ N(0, (sigma C)^2);
               x_{t+1} = x_t - alpha * g * u_t   (the restore x_t - lam u_t -> x_t is fused in).
    """

    def training_step(self, batch, batch_idx: int) -> None:
        inputs, targets = batch
        size = batch_size_of(inputs)
        engine = self.zo_optimizer.engine
        seeds = self.direction_seeds()                                            # line 2
        clipped_sums, fractions = [], []
        for k, seed in enumerate(seeds):
            differences = central_differences(engine, seed, self.lam,             # line 3
                                              lambda: self.per_example_losses(inputs, targets))
            clipped_sums.append(clip_scalars(differences, self.clip).sum())
            fractions.append(clipped_fraction(differences, self.clip))
            if k < len(seeds) - 1:
                engine.restore_()
        derivatives = self.privatize(torch.stack(clipped_sums))                   # + z_t, / B
        self.apply_update({s: g.item() / len(seeds) for s, g in zip(seeds, derivatives)})
        self.record_step()
        self._log_step(size, sum(fractions) / len(fractions))

    def _log_step(self, size: int, clip_fraction: float) -> None:
        self.log("sigma", float(self.noise_multiplier), batch_size=max(size, 1))
        if self.log_private_stats:
            self.log("clip_fraction", clip_fraction, batch_size=max(size, 1))
        self.log_step_time(size)


class DPGD0th(DPZero):
    """DPGD-0th, Algorithm 1 of Zhang et al. (the baseline DPZero improves on).

    Each example's full vector estimate ``g_i = s_i u`` is clipped in L2 norm and the noise is a
    d-dimensional ``N(0, (sigma C)^2 I)``: ``x <- x - alpha (sum_i clip_C(g_i) + z) / B``. Since
    ``||s_i u|| = |s_i| ||u||``, the vector clip is the scalar clip of ``s_i`` at ``C / ||u||``;
    the noise vector is generated chunk by chunk from a seed drawn from the secret noise generator.
    """

    def __init__(self, backbone: nn.Module, **kwargs: Any) -> None:
        super().__init__(backbone, **kwargs)
        if self.num_directions != 1:
            raise ValueError(f"DPGD-0th (Alg. 1) uses one direction per step, got num_directions="
                             f"{self.num_directions}")

    def noise_multiplier_scale(self) -> float:
        return 1.0

    def step_mechanisms(self) -> list[tuple[Mechanism, int]]:
        if not self.is_private:
            return []
        return [(SubsampledGaussian(self.noise_multiplier, self.sample_rate), 1)]

    def training_step(self, batch, batch_idx: int) -> None:
        inputs, targets = batch
        size = batch_size_of(inputs)
        engine = self.zo_optimizer.engine
        (seed,) = self.direction_seeds()                                          # line 2
        direction_norm = engine.direction_norm(seed)
        differences = central_differences(engine, seed, self.lam,                 # g_i = s_i u
                                          lambda: self.per_example_losses(inputs, targets))
        scalar_clip = self.clip / direction_norm
        clipped_sum = self.reduce_sum(clip_scalars(differences, scalar_clip).sum())
        noise_seed = self._secret_seed()                                          # z ~ N(0, sigma^2 C^2 I)
        B = self.expected_batch_size
        self.zo_optimizer.set_coefficients(
            {seed: clipped_sum.item() / B},
            noise_coefficients={noise_seed: self.noise_multiplier * self.clip / B} if self.noise_multiplier else {})
        self.step_optimizer()                                                     # line 3
        self.record_step()
        self._log_step(size, clipped_fraction(differences, scalar_clip))

    def _secret_seed(self) -> int:
        """A seed for the noise vector, drawn from the secret noise stream (shared by DDP ranks)."""
        return int(torch.randint(0, 2**62, (1,), generator=self.noise.generator("cpu")).item())


__all__ = ["DPGD0th", "DPZero", "MeZO"]

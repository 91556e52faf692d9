"""A torch optimizer whose ``step()`` applies a seeded ZO update, so Lightning's loop sees a real step.

Lightning's ``global_step`` only advances when a registered optimizer steps; with this optimizer
``max_steps``, LR schedulers (they edit ``param_groups[i]["lr"]``), logging cadence and checkpoints
work for ZO methods. It holds no per-parameter state: the update is ``theta <- (1 - lr*wd) theta -
lr * sum_k c_k u_k`` with each ``u_k`` regenerated from its seed, fused with the restore of any
pending perturbation.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch.optim import Optimizer

from lit_zodp.privacy.errors import check_non_negative, raise_if_any
from lit_zodp.zo.directions import GaussianDirections
from lit_zodp.zo.perturbation import PerturbationEngine


class ZOSGD(Optimizer):
    """Zeroth-order SGD over seeded directions.

    Usage per step: perturb through ``self.engine``, then ``set_coefficients({seed: c})`` with the
    (privatized) directional derivative of each direction, then ``step()``.
    """

    def __init__(self, params: Iterable, lr: float = 1e-6, weight_decay: float = 0.0,
                 *, law: GaussianDirections | None = None, chunk_numel: int | None = None) -> None:
        raise_if_any([check_non_negative("lr", lr), check_non_negative("weight_decay", weight_decay)])
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        ordered = [p for group in self.param_groups for p in group["params"]]
        self.engine = PerturbationEngine(ordered, law, chunk_numel=chunk_numel)
        self._coefficients: dict[int, float] = {}
        self._noise: dict[int, float] = {}

    def set_coefficients(self, coefficients: Mapping[int, float],
                         noise_coefficients: Mapping[int, float] | None = None) -> None:
        """Directional derivatives ``{seed: c}`` that the next ``step()`` applies.

        ``noise_coefficients`` adds ``-lr * c * xi(seed)`` with ``xi ~ N(0, I_d)`` drawn from a
        (secret) seed: the d-dimensional noise of DPGD-0th, generated chunk by chunk.
        """
        self._coefficients = {int(k): float(v) for k, v in coefficients.items()}
        self._noise = {int(k): float(v) for k, v in (noise_coefficients or {}).items()}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lrs, decays = [], []
        for group in self.param_groups:
            lrs += [group["lr"]] * len(group["params"])
            decays += [group["weight_decay"]] * len(group["params"])
        self.engine.restore_and_update_(self._coefficients, lr=lrs, weight_decay=decays,
                                        gaussian_coefficients=self._noise)
        self._coefficients, self._noise = {}, {}
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: ZO steps never allocate ``.grad``."""

"""Evaluation metrics that backbones declare (:meth:`~lit_zodp.backbones.base.Backbone.evaluation_metrics`)."""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric


class MeanLoss(Metric):
    """The mean of the evaluated rows' losses, summed in float64 states (all batches, all DDP ranks). A
    ``MeanMetric`` with ``set_dtype(float64)`` cast every loss to float32 once the Trainer moved the module to its
    device (torchmetrics' ``_apply`` resets the cast dtype to float32), rounding the mean (review 40)."""

    full_state_update = False
    higher_is_better = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, losses: Tensor) -> None:
        """Add the values ``[B]`` of one batch."""
        self.total += losses.detach().to(self.total).sum()
        self.count += losses.numel()

    def compute(self) -> Tensor:
        return self.total / self.count.clamp_min(1)


class MeanScore(MeanLoss):
    """The mean of per-example scores (F1, exact match) over the evaluated set, like :class:`MeanLoss`."""

    higher_is_better = True


__all__ = ["MeanLoss", "MeanScore"]

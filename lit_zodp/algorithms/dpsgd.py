"""DP-SGD (Abadi et al. 2016, Alg. 1) and DP-Adam (Mulrooney et al., DP-GRAPE paper, Alg. 3), with their
non-private twins SGD and Adam: the first-order baselines of the DP-GRAPE and PAZO papers.

Both privatize the flat clipped per-example gradient once per step,
``G~ = (1/B) (sum_i clip(G_i, C) + N(0, C^2 sigma^2 I_d))`` (DP-GRAPE Alg. 3, line 2; B the expected
Poisson batch size, add/remove-one neighbours), then apply SGD with momentum or Adam to ``G~``
(post-processing). Choices where the paper is silent (Sec. 5 and App. D give no values): Adam's
``beta1 = 0.9, beta2 = 0.999, eps = 1e-8`` (torch's defaults, the paper's ``phi`` is ``eps``) and
decoupled weight decay (AdamW) when ``weight_decay > 0``; DP-SGD takes torch SGD's coupled L2 term instead.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from lit_zodp.algorithms.first_order import FirstOrderModule
from lit_zodp.errors import check_non_negative, check_positive, raise_if_any


class DPSGD(FirstOrderModule):
    """DP-SGD: clip per example, sum, one Gaussian, divide by the expected batch size, SGD step.

    Args (besides :class:`FirstOrderModule`'s): momentum: heavy-ball momentum of the SGD step.
    """

    non_private_twin = "SGD"

    def __init__(self, backbone: nn.Module, *, momentum: float = 0.0, **kwargs: Any) -> None:
        raise_if_any([check_non_negative("momentum", momentum)])
        super().__init__(backbone, **kwargs)
        self.momentum = momentum

    def make_optimizer(self, params):
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)


class DPAdam(FirstOrderModule):
    """DP-Adam, Algorithm 3 of the DP-GRAPE paper: Adam (bias-corrected, Alg. 2 lines 1-3) on ``G~``.

    Args (besides :class:`FirstOrderModule`'s): betas, eps: Adam's ``beta1, beta2`` and ``phi``.
    """

    non_private_twin = "Adam"

    def __init__(self, backbone: nn.Module, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 **kwargs: Any) -> None:
        raise_if_any([None if all(0 <= b < 1 for b in betas) and len(betas) == 2
                      else f"Expected `betas` two floats in [0, 1), but got {betas!r}",
                      check_positive("eps", eps)])
        super().__init__(backbone, **kwargs)
        self.betas = tuple(betas)
        self.eps = eps

    def make_optimizer(self, params):
        raise_if_any([eps_vanishing_error(self.eps, params)])
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


def eps_vanishing_error(eps: float, params: list[torch.Tensor]) -> Optional[str]:
    """Adam divides by ``sqrt(v) + eps`` in the parameters' dtype: where ``eps`` rounds to 0 there (1e-8 in float16,
    Lightning's ``precision="16-true"``), a coordinate whose ``v`` underflowed to 0 steps by ``m / 0``, and the weights
    were inf after DP-Adam's first step (review 20)."""
    vanishing = sorted({str(p.dtype) for p in params if torch.tensor(eps, dtype=p.dtype) == 0})
    if not vanishing:
        return None
    return (f"`eps`={eps:g} rounds to 0 in the parameters' dtype {vanishing[0]}, so Adam's update would divide by 0 "
            "where its second moment underflows: train in float32 or bfloat16 parameters (precision '32-true', "
            "'bf16-true' or a mixed precision), or raise `eps`")


class SGD(DPSGD):
    """Non-private SGD with the same step (clip=inf by default): the mean gradient over the realized batch."""

    private = False

    def __init__(self, backbone: nn.Module, *, clip: float = math.inf, **kwargs: Any) -> None:
        super().__init__(backbone, clip=clip, **kwargs)


class Adam(DPAdam):
    """Non-private Adam with the same step (clip=inf by default)."""

    private = False

    def __init__(self, backbone: nn.Module, *, clip: float = math.inf, **kwargs: Any) -> None:
        super().__init__(backbone, clip=clip, **kwargs)


__all__ = ["Adam", "DPAdam", "DPSGD", "SGD"]

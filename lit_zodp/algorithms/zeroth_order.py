"""The zeroth-order family base: the seeded in-place perturbation engine and the verbs of ZO papers.

The module owns the :class:`~lit_zodp.zo.PerturbationEngine` (perturb, central differences, the
fused restore-and-update); the registered :class:`~lit_zodp.zo.ZOSGD` optimizer only applies the
coefficients it is handed, so Lightning counts steps and the privacy component commits each one.
A private batch is forwarded only through ``private_losses`` (no autograd, eval mode).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import Tensor, nn

from lit_zodp.algorithms.base import AlgorithmModule
from lit_zodp.errors import check_non_negative, check_positive, check_positive_int, raise_if_any
from lit_zodp.privacy import DirectionRelease
from lit_zodp.zo import ZOSGD, PerturbationEngine, central_differences, derive_seed, make_direction_law

DIRECTION_LAWS = ("gaussian", "sphere")


class ZerothOrderModule(AlgorithmModule):
    """Base of the ZO algorithms.

    Args (besides :class:`AlgorithmModule`'s):
        weight_decay: decoupled weight decay, applied to tensors of 2+ dimensions only.
        lam: smoothing parameter ``lambda`` of the two-point estimator.
        num_directions: directions ``u`` per step (the estimate averages them).
        directions: ``"gaussian"`` (the papers' experiments) or ``"sphere"`` (radius ``sqrt(d)``).
    """

    abstract = True

    def __init__(self, backbone: nn.Module, *, weight_decay: float = 0.0, lam: float = 1e-3,
                 num_directions: int = 1, directions: str = "gaussian", **kwargs: Any) -> None:
        raise_if_any([
            check_non_negative("weight_decay", weight_decay),
            check_positive("lam", lam),
            check_positive_int("num_directions", num_directions),
            None if directions in DIRECTION_LAWS
            else f"Expected `directions` in {list(DIRECTION_LAWS)}, but got {directions!r}",
        ])
        super().__init__(backbone, **kwargs)
        self.weight_decay = weight_decay
        self.lam = lam
        self.num_directions = num_directions
        self.directions = directions
        self.engine: Optional[PerturbationEngine] = None

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.backbone.parameters() if p.requires_grad]

    def configure_optimizers(self):
        decay = [p for p in self.trainable_parameters() if p.ndim >= 2]
        no_decay = [p for p in self.trainable_parameters() if p.ndim < 2]
        groups = [g for g in ({"params": decay, "weight_decay": self.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        self.engine = PerturbationEngine([p for g in groups for p in g["params"]],
                                         make_direction_law(self.directions))
        return self.with_scheduler(self.attach_privacy(ZOSGD(groups, lr=self.lr, engine=self.engine)))

    @property
    def zo_optimizer(self) -> ZOSGD:
        optimizer = self.optimizers()
        return getattr(optimizer, "optimizer", optimizer)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Optional[int]:
        self.backbone.eval()  # the two-point passes must see the same function (no dropout)
        return super().on_train_batch_start(batch, batch_idx)

    # ------------------------------------------------------------------------------ verbs
    def direction_seeds(self) -> list[int]:
        """Seeds of this step's directions ``u_1..u_q``: public, from (run seed, step)."""
        return [derive_seed(self.run_seed, self.global_step, k) for k in range(self.num_directions)]

    def directional_differences(self, seed: int, inputs, targets) -> Tensor:
        """Per-example ``(f(x + lam u; xi_i) - f(x - lam u; xi_i)) / (2 lam)``; leaves ``x - lam u`` pending."""
        return central_differences(self.engine, seed, self.lam, lambda: self.private_losses(inputs, targets))

    def public_gradient(self, public_batch, params=None):
        """The public gradient at the UNPERTURBED point: call it before perturbing or after the update."""
        if self.engine is not None and self.engine.pending:
            raise RuntimeError("public_gradient() while a perturbation is pending: restore the parameters first")
        return super().public_gradient(public_batch, params)

    def restore(self) -> None:
        """Undo the pending perturbation (when the next direction is probed before the update)."""
        self.engine.restore_()

    def update(self, coefficients: Mapping[int, Tensor | float], scale: float = 1.0,
               noise: Optional[DirectionRelease] = None) -> None:
        """``x <- x - lr * scale * sum_k c_k u_k`` (minus the release's secret noise vector), fused with the restore."""
        terms = {seed: float(c) * scale for seed, c in coefficients.items()}
        noise_terms = []
        if noise is not None and noise.noise is not None:
            noise_terms = [(noise.noise, noise.noise_coefficient)]
        self.zo_optimizer.set_coefficients(terms, noise_terms)
        self.step_optimizer()


__all__ = ["ZerothOrderModule"]

"""An auditor's view of a private fit: each step's release along one canary row's clipped term, read from the weights.

The attacker of the threat model reads the weights before and after every step (consecutive checkpoints), and
knows the code, the config, the public directions and every private row but one, the canary. Where every other row
contributes exactly zero (say, all-zero inputs to a model without biases), the release's component along the
canary's clipped term is, in units of the clip ``C``: ``1 + sigma z`` in a step that holds the canary, ``sigma z``
in one that does not (``z`` standard normal). Fed to :mod:`lit_zodp.privacy.audit`, the scores of fits with and
without the canary bound the epsilon the weights show; their mean shift over their spread estimates the mechanism's
``mu = 1 / sigma``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor

from lit_zodp.algorithms.base import fit_steps
from lit_zodp.algorithms.zeroth_order import ZerothOrderModule
from lit_zodp.backbones.base import per_example_loss
from lit_zodp.errors import ConfigError
from lit_zodp.projection import ProjectedAdam
from lit_zodp.zo.seeds import derive_seed


class CanaryAudit(pl.Callback):
    """Records one score per training step: the step's release along the canary's clipped term, over ``C``.

    * Zeroth order, scalar releases (DPZero, DPMeZOBCD with ``block_optimizer="sgd"``, PAZO-M at ``alpha = 0``,
      PAZO-P): the k released coefficients are solved from ``theta' - theta = -lr a sum_j g_j u_j`` with the public
      ``u_j`` (the engine's: PAZO-P's ``G u_j``) and the module's ``update_scale`` ``a`` (``1 / k``); the score is
      ``(1/k) sum_j sign_j B g_j / C``, ``sign_j`` the sign of the canary's own central difference along ``u_j``
      (the attacker computes it), ``B`` the expected batch size.
    * Zeroth order, vector noise (DPGD-0th): ``-B (theta' - theta) . u / (lr |u| C)`` times that sign.
    * First order (DPSGD, DPAdam, DP-GRAPE): the released gradient ``g`` (``-(theta' - theta) / lr`` for SGD; Adam's
      first moment ``m / (1 - beta1)`` from the optimizer state, which a checkpoint holds) along the canary's gradient
      direction: ``B g . grad / (|grad| C)``; for DP-GRAPE both in the step's projected space (``grad`` projected
      by the public ``P``).

    ``restart_each_step`` (default): after each score the weights and the optimizer state return to the fit's
    start, so every step is an independent trial of one mechanism from the same weights (and the canary's loss
    never saturates). Weight decay, momentum carried between steps and Adam-updated blocks are refused. The canary
    is cast as the Trainer casts a batch (``precision="bf16-true"``, ``"16-true"``, ``"64-true"``).
    """

    def __init__(self, canary_inputs: Tensor, canary_target: Tensor, *, restart_each_step: bool = True) -> None:
        self.canary = (canary_inputs, canary_target)
        self._canary = self.canary  # (cast at each fit's start as the Trainer casts a batch)
        self.restart_each_step = restart_each_step
        self.scores: list[float] = []
        self._start: dict[str, Tensor] = {}
        self._before: dict[str, Tensor] = {}

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        problems = _unsupported(pl_module)
        if problems:
            raise ConfigError(f"CanaryAudit cannot read this module's releases from its weights: {problems}")
        self._start = self._trainable(pl_module)
        inputs, target = self.canary  # as the module's forwards see a batch (its device; precision "bf16-true", ...)
        self._canary = (trainer.precision_plugin.convert_input(inputs.to(pl_module.device)), target.to(pl_module.device))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._before = self._trainable(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step - 1  # the step just taken (Lightning counts it at the optimizer's step)
        after = self._trainable(pl_module)
        delta = {name: after[name] - self._before[name] for name in after}
        if isinstance(pl_module, ZerothOrderModule):
            score = self._zeroth_order_score(pl_module, step, delta)
        else:
            score = self._first_order_score(pl_module, step, delta)
        self.scores.append(score)
        if self.restart_each_step:
            self._restart(pl_module)

    # ------------------------------------------------------------------ scores
    def _zeroth_order_score(self, module: Any, step: int, delta: dict[str, Tensor]) -> float:
        names = self._engine_names(module)
        seeds = [derive_seed(module.run_seed, step, k) for k in range(module.num_directions)]
        drawn = [dict(zip(names, (u.detach().double() for u in module.engine.direction(seed)))) for seed in seeds]
        directions = [torch.cat([u[name].flatten() for name in names]) for u in drawn]
        change = torch.cat([delta[name].flatten() for name in names])
        signs = [self._canary_difference_sign(module, u) for u in drawn]
        size, clip = module.privacy.expected_batch_size, module.clip
        if getattr(module, "vector_noise", False):
            (u,) = directions
            return float(-size * (change @ u) / (module.lr * u.norm() * clip) * signs[0])
        basis = torch.stack(directions, dim=1)  # d x k
        coefficients = torch.linalg.solve(basis.T @ basis, basis.T @ (-change / (module.lr * module.update_scale)))
        return float(sum(sign * size * g / clip for sign, g in zip(signs, coefficients)) / len(seeds))

    def _canary_difference_sign(self, module: Any, directions: dict[str, Tensor]) -> float:
        """The sign of the canary's own ``f(theta + lam u) - f(theta - lam u)`` at the step's weights (``u`` by
        parameter name)."""
        inputs, target = self._canary

        def loss_at(sign: float) -> Tensor:
            weights = {name: value + sign * module.lam * directions[name] if name in directions else value
                       for name, value in self._before.items()}
            with _weights(module.backbone, weights):
                return per_example_loss(module.backbone, inputs, target).double().sum()

        with torch.no_grad():
            difference = loss_at(1.0) - loss_at(-1.0)
        if difference == 0:
            raise ConfigError("CanaryAudit: the canary's central difference is exactly 0 along a step's direction; "
                              "use a canary whose loss moves with every direction (large inputs)")
        return 1.0 if difference > 0 else -1.0

    def _first_order_score(self, module: Any, step: int, delta: dict[str, Tensor]) -> float:
        names = list(delta)
        gradients = self._canary_gradients(module, names)
        optimizer = module.optimizers().optimizer
        params = dict(module.backbone.named_parameters())
        if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW | ProjectedAdam):
            beta1 = optimizer.param_groups[0]["betas"][0]
            released = [optimizer.state[params[name]]["exp_avg"].double() / (1 - beta1) for name in names]
        else:
            released = [-delta[name] / module.lr for name in names]
        if hasattr(module, "projections_at"):  # DP-GRAPE: the release lives in the step's projected space
            by_name = dict(zip(module.engine.names, module.projections_at(step)))
            gradients = [g if by_name.get(name) is None else by_name[name].of_gradients(g)
                         for name, g in zip(names, gradients)]
        gradient = torch.cat([g.flatten() for g in gradients])
        released = torch.cat([r.flatten() for r in released])
        size, clip = module.privacy.expected_batch_size, module.clip
        return float(size * (released @ gradient) / (gradient.norm() * clip))

    def _canary_gradients(self, module: Any, names: list[str]) -> list[Tensor]:
        """The gradient of the canary's loss at the step's weights (its clipped term's direction), per parameter."""
        inputs, target = self._canary
        params = dict(module.backbone.named_parameters())
        with _weights(module.backbone, self._before), torch.enable_grad():
            loss = per_example_loss(module.backbone, inputs, target).sum()
            grads = torch.autograd.grad(loss, [params[name] for name in names])
        return [g.double() for g in grads]

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _trainable(module: Any) -> dict[str, Tensor]:
        return {name: p.detach().double().clone() for name, p in module.backbone.named_parameters()
                if p.requires_grad}

    @staticmethod
    def _engine_names(module: Any) -> list[str]:
        """The trainable parameters' names in the engine's order (its directions' order)."""
        name_of = {id(p): name for name, p in module.backbone.named_parameters()}
        return [name_of[id(p)] for p in module.engine.params]

    def _restart(self, module: Any) -> None:
        with torch.no_grad():
            for name, p in module.backbone.named_parameters():
                if name in self._start:
                    p.copy_(self._start[name].to(p.dtype))
        optimizer = module.optimizers().optimizer
        if not isinstance(module, ZerothOrderModule):
            optimizer.state.clear()


@contextlib.contextmanager
def _weights(backbone: torch.nn.Module, weights: dict[str, Tensor]):
    """``backbone`` in eval mode with ``weights`` (by name, rounded to each parameter's dtype) in place of its own,
    restored after: between steps, where the auditor computes what the attacker computes."""
    params = dict(backbone.named_parameters())
    saved = {name: params[name].detach().clone() for name in weights}
    was_training = backbone.training
    backbone.eval()
    try:
        with torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(value.to(params[name].dtype))
        yield
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                params[name].copy_(value)
        backbone.train(was_training)


def _unsupported(module: Any) -> Optional[str]:
    """What in ``module``'s configuration the weights-to-release reading above does not model, if anything."""
    if not getattr(module, "private", False):
        return "it is not a private module"
    if not getattr(module, "audit_through_update", True):
        return (f"{type(module).__name__}'s step moves the weights along a running estimate, not along one release "
                "(its releases are audited directly)")
    if getattr(module, "weight_decay", 0.0):
        return f"weight_decay={module.weight_decay} (set 0)"
    if getattr(module, "momentum", 0.0):
        return f"momentum={module.momentum} (set 0)"
    if getattr(module, "block_optimizer", "sgd") != "sgd":
        return f"block_optimizer={module.block_optimizer!r} (use 'sgd')"
    if getattr(module, "block_lr", "uniform") != "uniform":
        return f"block_lr={module.block_lr!r} (use 'uniform')"
    if getattr(module, "lr_scheduler_factory", None) is not None:
        return "an lr_scheduler (leave it unset)"
    if getattr(module, "alpha", 0.0):
        return (f"alpha={module.alpha}: PAZO-M's public gradient moves the weights beside the release (audit it at "
                "alpha 0: the release does not depend on alpha)")
    if hasattr(module, "private_weight") and module.private_weight(fit_steps(module.trainer)) < 1.0:
        return ("DPMD's weights show a_t times its release beside (1 - a_t) times the public gradient (audit it with a "
                "`total_steps` so large that a_t rounds to 1 over the run)")
    if hasattr(module, "find_subspace"):
        return ("GEP's weights show the sum of its embedding and residual releases, less than the two (post-processing): "
                "its releases are audited directly (tests/algorithms/test_gep.py)")
    if hasattr(module, "exploration"):
        return "PAZO-S's weights show only which public candidate its released losses chose (post-processing)"
    if getattr(module, "projected", None) and not hasattr(module, "projections_at"):
        return ("naive DP-GaLore's projection is post-processing of its full release, which the weights show only in "
                "part: audit it with a `rank` at least every layer's smaller side (nothing projected)")
    return None


__all__ = ["CanaryAudit"]

"""A torch optimizer whose ``step()`` applies a seeded ZO update, so Lightning's loop sees a real step.

Lightning's ``global_step`` only advances when a registered optimizer steps; with this optimizer
``max_steps``, LR schedulers (they edit ``param_groups[i]["lr"]``), logging cadence and checkpoints
work for ZO methods. It holds no per-parameter state: the update is ``theta <- (1 - lr*wd) theta -
lr * sum_k c_k u_k`` with each ``u_k`` regenerated from its seed, fused with the restore of any
pending perturbation.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from lit_zodp.errors import check_non_negative, raise_if_any
from lit_zodp.zo.perturbation import PerturbationEngine


class ZOSGD(Optimizer):
    """Zeroth-order SGD over seeded directions: applies what it is handed through ``engine``.

    Usage per step: the module perturbs through the engine, then ``set_coefficients({seed: c})``
    with the (privatized) directional derivative of each direction, then ``step()``.

    Args:
        params: parameters or param groups, in the engine's order.
        engine: the module's perturbation engine over exactly these parameters (``None``: build a
            chunked one): a :class:`PerturbationEngine`, or any engine with ``params``, ``pending``
            and ``restore_and_update_`` (the fused one takes device-tensor coefficients as they are).
    """

    def __init__(self, params: Iterable, lr: float = 1e-6, weight_decay: float = 0.0,
                 *, engine: Optional[PerturbationEngine] = None) -> None:
        raise_if_any([check_non_negative("lr", lr), check_non_negative("weight_decay", weight_decay)])
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        ordered = [p for group in self.param_groups for p in group["params"]]
        self.engine = engine or PerturbationEngine(ordered)
        if [id(p) for p in self.engine.params] != [id(p) for p in ordered]:
            raise ValueError("The engine must perturb exactly the optimizer's parameters, in param-group order")
        self._coefficients: dict[int, float] = {}
        self._extra: list[tuple] = []
        self._dense: list[tuple[Sequence[Tensor], float]] = []

    def set_coefficients(self, coefficients: Mapping[int, float | Tensor],
                         extra_terms: Sequence[tuple] = (),
                         dense_terms: Sequence[tuple[Sequence[Tensor], float]] = ()) -> None:
        """Directional derivatives ``{seed: c}`` that the next ``step()`` applies.

        ``extra_terms`` are ``(noise, c)`` pairs adding ``-lr * c * xi`` (the secret noise vector of
        DPGD-0th, drawn chunk by chunk from its 128-bit key into the float64 update; chunked engine
        only). The chunked engine takes Python floats (a device tensor is read once here); others get
        them as given. ``dense_terms`` are ``(tensors, c)`` pairs adding ``-lr * c * g`` for a public vector
        ``g`` held as one tensor per parameter (PAZO's public gradients), after the engine's pass.
        """
        chunked = isinstance(self.engine, PerturbationEngine)
        self._coefficients = {int(k): float(v) if chunked else v for k, v in coefficients.items()}
        if extra_terms and not chunked:
            raise ValueError(f"{type(self.engine).__name__} does not apply extra noise terms")
        self._extra = [(noise, float(c)) for noise, c in extra_terms]
        self._dense = [(list(tensors), float(c)) for tensors, c in dense_terms]
        for tensors, _ in self._dense:
            if len(tensors) != len(self.engine.params):
                raise ValueError(f"A dense term needs one tensor per parameter ({len(self.engine.params)}), "
                                 f"but got {len(tensors)}")

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
        extra = {"extra_terms": self._extra} if self._extra else {}
        self.engine.restore_and_update_(self._coefficients, lr=lrs, weight_decay=decays, **extra)
        for tensors, c in self._dense:
            for p, g, lr in zip(self.engine.params, tensors, lrs):
                p.add_(g.to(p.dtype), alpha=-lr * c)
        self._coefficients, self._extra, self._dense = {}, [], []
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: ZO steps never allocate ``.grad``."""

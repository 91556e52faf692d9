"""Low-rank gradient projections and Adam with projected moments (DP-GRAPE paper, Mulrooney et al., Alg. 1, 2, 4, 5).

* :func:`gaussian_projection`: the seeded projector ``P ~ N(0, 1/r)`` of shape ``[m, r]`` (Alg. 1 line 5,
  "generated from a random seed as needed", never stored), drawn with the engine's counter-based Philox law
  (:func:`lit_zodp.zo.philox.normal_range`), so CPU and CUDA give the same matrix and a resume on another
  device continues the same subspace. ``E[P P^T] = I_m``, so ``P P^T G`` is unbiased for ``G``.
* :func:`projection_side`: which side a weight ``[out, in]`` is projected on: the smaller dimension ``m``
  (the paper writes ``W in R^{m x n}`` with ``m <= n`` "without loss of generality"; App. D uses left and right
  projections). ``out <= in``: ``R = P^T G`` (``P [out, r]``, the output gradient is projected); else
  ``R = G P`` (``P [in, r]``, the activations are projected).
* :class:`SeededProjections`: the per-example engine's transform (:mod:`lit_zodp.per_example.transforms`)
  giving every projected weight its projector for the current period of ``F`` steps.
* :class:`ProjectedAdam`: Alg. 2, Adam whose moments ``M, V`` live in the projected space ``[r, n]`` (or ``[m, r]``)
  and whose step is projected back, ``W <- W - alpha P (M / (sqrt(V) + phi))``; unprojected tensors take plain Adam.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lit_zodp.errors import check_non_negative, raise_if_any
from lit_zodp.per_example.transforms import GradientTransform, Projection
from lit_zodp.zo.philox import normal_range
from lit_zodp.zo.seeds import derive_seed

#: Key of the projector stream: never shared with the zeroth-order direction seeds (``derive_seed(run, step, k)``).
PROJECTION_STREAM = 0x6A9E
#: Name components of the layers left unprojected by default (the paper leaves RoBERTa's LM head unprojected).
UNPROJECTED = ("lm_head", "classifier", "head")


def projection_side(shape: Sequence[int]) -> str:
    """``"left"`` (``P [out, r]``) when ``out <= in``, else ``"right"`` (``P [in, r]``): the smaller dimension."""
    out_features, in_features = shape
    return "left" if out_features <= in_features else "right"


def projector_seed(run_seed: int, period: int, index: int) -> int:
    """Seed ``s_l^t`` of tensor ``index``'s projector in period ``period`` (public: derived from the run seed)."""
    return derive_seed(derive_seed(run_seed, PROJECTION_STREAM, period), index)


def gaussian_projection(seed: int, rows: int, rank: int, device: torch.device | str = "cpu") -> Tensor:
    """``P [rows, rank]`` with i.i.d. ``N(0, 1/rank)`` entries (Alg. 1 line 5), float32, from Philox keyed by ``seed``."""
    return normal_range(seed, 0, rows * rank, device=device).view(rows, rank) / math.sqrt(rank)


def projected_names(module: nn.Module, rank: int, unprojected: Iterable[str] = UNPROJECTED) -> list[str]:
    """Names of the trainable weights DP-GRAPE projects: the ``weight`` of every ``nn.Linear`` whose smaller
    dimension exceeds ``rank`` (a projection onto ``r >= m`` dimensions saves nothing), held by that layer alone
    (a weight tied to an embedding keeps its full per-example gradient, as the embeddings do: "nonlinear layers are
    handled as in DP-Adam", Sec. 3.2), and no component of whose name equals one of ``unprojected`` (the paper leaves
    RoBERTa's LM head unprojected, Sec. 5.2)."""
    excluded = set(unprojected)
    holders: dict[int, int] = {}
    for layer in module.modules():
        for p in layer.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    names = []
    for name, layer in module.named_modules():
        weight = getattr(layer, "weight", None)
        if not (isinstance(layer, nn.Linear) and isinstance(weight, nn.Parameter) and weight.requires_grad):
            continue
        if min(weight.shape) <= rank or holders.get(id(weight), 0) != 1:
            continue
        if excluded & set(re.split(r"\.", name)):
            continue
        names.append(f"{name}.weight" if name else "weight")
    return names


class SeededProjections(GradientTransform):
    """The projectors of one fit: tensor ``index`` of ``names`` gets ``P ~ N_{s}(0, 1/r)`` on its smaller side, with
    ``s = projector_seed(run_seed, period, index)``; a new period (a new subspace) every ``frequency`` steps.

    Set :attr:`run_seed` and call :meth:`at_step` before each step; the matrices of the current period are kept (one
    ``[m, r]`` matrix per projected weight: ``r sum_l m_l`` numbers) and regenerated when the period changes.
    """

    def __init__(self, names: Iterable[str], rank: int, frequency: int) -> None:
        self.index = {name: i for i, name in enumerate(names)}
        self.rank, self.frequency = rank, frequency
        self.run_seed: Optional[int] = None
        self.period: Optional[int] = None
        self._matrices: dict[str, Projection] = {}

    def at_step(self, step: int) -> None:
        """Use the projectors of step ``step`` (0-based): period ``step // F``, so the subspace changes at the steps
        ``t`` with ``t mod F == 0`` (Alg. 1 line 3; the first period's seeds are drawn at initialization)."""
        period = step // self.frequency
        if period != self.period:
            self.period, self._matrices = period, {}

    def projection(self, name: str, param: Tensor) -> Optional[Projection]:
        if name not in self.index:
            return None
        cached = self._matrices.get(name)
        if cached is not None and cached.matrix.device != param.device:  # (a later fit of the module on another
            cached = None                                                  # device, within the same period)
        if cached is None:
            raise_if_any([None if self.run_seed is not None and self.period is not None else
                          "SeededProjections needs `run_seed` and `at_step(step)` before its first projection"])
            side = projection_side(param.shape)
            rows = param.shape[0] if side == "left" else param.shape[1]
            seed = projector_seed(self.run_seed, self.period, self.index[name])
            self._matrices[name] = Projection(gaussian_projection(seed, rows, self.rank, param.device), side)
        return self._matrices[name]


class ProjectedAdam(Optimizer):
    """Adam with moments in each tensor's projected space, the update projected back (DP-GRAPE Alg. 2).

    Each step it applies what it was handed (:meth:`hand`): one released gradient per parameter, in the projected
    shape with its :class:`~lit_zodp.per_example.transforms.Projection` (``M, V`` have that shape and survive a change
    of subspace unchanged: Alg. 2 neither resets nor re-projects them) or in the parameter's shape with ``None``
    (plain Adam). Bias correction as torch's Adam/AdamW (``phi`` added to ``sqrt(V / (1 - beta2^t))``), the same
    convention as :class:`~lit_zodp.algorithms.DPAdam`, so that DP-GRAPE and DP-Adam differ only by the projection
    (Alg. 2 line 1 folds the correction into ``alpha^t``, which scales ``phi`` by ``sqrt(1 - beta2^t)``; with
    ``phi = 1e-8`` the two agree to ~1e-8 relative); decoupled weight decay (AdamW) when ``weight_decay > 0``.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        raise_if_any([check_non_negative("lr", lr), check_non_negative("weight_decay", weight_decay)])
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self._handed: Optional[list[tuple[Tensor, Optional[Projection]]]] = None

    @property
    def ordered(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every floating state tensor to its parameter's dtype; the moments (and naive
        DP-GaLore's projector) are float32 whatever the parameters' dtype, so a resume of a bf16/fp16 model would
        round them and step apart from the uninterrupted run: the saved tensors are put back as saved (on the
        parameter's device)."""
        saved = {index: {key: value for key, value in values.items()
                         if isinstance(value, Tensor) and value.is_floating_point()}
                 for index, values in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        indices = [index for group in state_dict["param_groups"] for index in group["params"]]
        by_index = dict(zip(indices, self.ordered))
        for index, values in saved.items():
            param = by_index[index]
            for key, value in values.items():
                self.state[param][key] = value.detach().to(param.device, copy=True)

    def hand(self, gradients: Sequence[Tensor], projections: Sequence[Optional[Projection]]) -> None:
        """The released gradients (projected where a projection is given) that the next ``step()`` applies."""
        ordered = self.ordered
        raise_if_any([None if len(gradients) == len(projections) == len(ordered) else
                      f"Expected {len(ordered)} gradients and projections, but got {len(gradients)} and "
                      f"{len(projections)}"])
        self._handed = list(zip(gradients, projections))

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        """One Adam step of every tensor: the moments of all tensors with a few multi-tensor (``foreach``) kernels, as
        torch's AdamW, then each projected tensor's ``W -= alpha P (M / (sqrt(V) + phi))`` as one matrix product."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        raise_if_any([None if self._handed is not None else
                      "ProjectedAdam.step() needs the released gradients: call hand(gradients, projections) first"])
        handed = iter(self._handed)
        for group in self.param_groups:
            items = [(param, *next(handed)) for param in group["params"]]
            for same_step in self._by_step(items).values():
                self._step_tensors(same_step, group)
        self._handed = None
        return loss

    def _by_step(self, items: list) -> dict:
        """Each tensor's state (made at its first step), its step counter advanced; tensors grouped by (step, dtypes),
        which share their bias corrections and kernels (in a fit every tensor steps together: one group per dtype)."""
        groups: dict = {}
        for param, gradient, projection in items:
            state = self.state[param]
            if "step" not in state:  # (naive DP-GaLore keeps its projector here too)
                state["step"] = 0
                dtype = torch.promote_types(gradient.dtype, torch.float32)  # (moments of bf16 weights in float32)
                state["exp_avg"] = torch.zeros_like(gradient, dtype=dtype)
                state["exp_avg_sq"] = torch.zeros_like(gradient, dtype=dtype)
            raise_if_any([None if state["exp_avg"].shape == gradient.shape else
                          f"ProjectedAdam's moments have shape {tuple(state['exp_avg'].shape)}, but the handed "
                          f"gradient has {tuple(gradient.shape)}: the projection rank or the projected weights changed"])
            state["step"] += 1
            key = (state["step"], state["exp_avg"].dtype, param.dtype, param.device)
            groups.setdefault(key, []).append((param, gradient.to(state["exp_avg"].dtype), projection))
        return groups

    def _step_tensors(self, items: list, group: dict) -> None:
        params = [param for param, _, _ in items]
        grads = [gradient for _, gradient, _ in items]
        m = [self.state[param]["exp_avg"] for param in params]
        v = [self.state[param]["exp_avg_sq"] for param in params]
        (beta1, beta2), lr, eps, weight_decay = group["betas"], group["lr"], group["eps"], group["weight_decay"]
        t = self.state[params[0]]["step"]
        torch._foreach_lerp_(m, grads, 1 - beta1)                        # M^t = beta1 M + (1 - beta1) R~ (as torch)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)        # V^t = beta2 V + (1 - beta2) R~^2
        denominators = torch._foreach_sqrt(v)                           # torch's order of operations
        torch._foreach_div_(denominators, math.sqrt(1 - beta2 ** t))
        torch._foreach_add_(denominators, eps)
        step_size = lr / (1 - beta1 ** t)
        if weight_decay:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        plain = [i for i, (_, _, projection) in enumerate(items) if projection is None]
        if plain:
            same = params[0].dtype == m[0].dtype
            torch._foreach_addcdiv_([params[i] for i in plain],
                                    [m[i] if same else m[i].to(params[i].dtype) for i in plain],
                                    [denominators[i] if same else denominators[i].to(params[i].dtype) for i in plain],
                                    value=-step_size)
        for param, mi, denominator, (_, _, projection) in zip(params, m, denominators, items):
            if projection is not None:
                _add_projected_(param, mi.div(denominator), projection, -step_size)


def _add_projected_(param: Tensor, update: Tensor, projection: Projection, alpha: float) -> None:
    """``param += alpha P U`` (left) or ``alpha U P^T`` (right): one fused matrix product where the dtypes agree."""
    p = projection.matrix.to(update.dtype)
    if param.dtype != update.dtype:
        param.add_(projection.back(update).to(param.dtype), alpha=alpha)
    elif projection.side == "left":
        param.addmm_(p, update, alpha=alpha)
    else:
        param.addmm_(update, p.T, alpha=alpha)

__all__ = ["PROJECTION_STREAM", "ProjectedAdam", "UNPROJECTED", "SeededProjections", "gaussian_projection",
           "projected_names", "projection_side", "projector_seed"]

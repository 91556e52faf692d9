"""The engine's transform slot: rewrite per-example gradients before the flat norm and the clip.

Two kinds of rewrite, combinable in one :class:`GradientTransform`:

* **Projection** of a 2-D weight's per-example gradient ``G_i [out, in]`` onto a subspace,
  ``R_i = P^T G_i`` (``P [out, r]``, "left") or ``R_i = G_i P`` (``P [in, r]``, "right"). For a
  layer whose per-example gradient is a sum of outer products over positions,
  ``G_i = sum_t g_{i,t} a_{i,t}^T`` (Linear), the engine projects the *rows* instead,
  ``P^T G_i = sum_t (P^T g_{i,t}) a_{i,t}^T`` and ``G_i P = sum_t g_{i,t} (P^T a_{i,t})^T``, so
  ``B x out x in`` is never formed: DP-GRAPE (Mulrooney et al., Alg. 1 lines 4-6, "per-sample
  gradients are projected layer-by-layer during the backward pass") and GEP's embedding of
  per-example gradients into an anchor subspace (Yu et al. 2021). Any other layer (or the vmap
  fallback) gets the same projection applied to its materialised gradient. Works in every mode,
  including "ghost" (norms and book-keeping sums from the projected rows).
* **A generic rewrite** ``apply(name, param, grads [B, ...]) -> [B, ...]`` of materialised
  per-example gradients (e.g. DOPE-SGD's recentring ``g_i - c``); it needs mode "hooks" or "vmap".

A plain callable ``fn(name, param, grads)`` is accepted as a generic rewrite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Tuple

from torch import Tensor

from lit_zodp.errors import raise_if_any
from lit_zodp.per_example.rounding import outside_autocast

SIDES = ("left", "right")


@dataclass(frozen=True)
class Projection:
    """``R = P^T G`` (``side="left"``, ``matrix`` ``P [out, r]``: ``R [r, in]``) or ``R = G P``
    (``side="right"``, ``P [in, r]``: ``R [out, r]``) for a 2-D weight ``G [out, in]``.

    DP-GRAPE projects along the smaller dimension ``m = min(out, in)`` with ``P ~ N(0, 1/r)``;
    the choice of side and matrix belongs to the algorithm.
    """

    matrix: Tensor
    side: str = "left"

    def __post_init__(self) -> None:
        raise_if_any([
            None if self.side in SIDES else f"Expected `side` in {SIDES}, but got {self.side!r}",
            None if isinstance(self.matrix, Tensor) and self.matrix.dim() == 2 else
            f"Expected `matrix` to be a 2-D tensor [dim, r], but got "
            f"{tuple(self.matrix.shape) if isinstance(self.matrix, Tensor) else type(self.matrix).__name__}",
        ])

    def check(self, name: str, param: Tensor) -> None:
        """The projected dimension must match ``param``'s (``out`` for left, ``in`` for right)."""
        dim = param.shape[0 if self.side == "left" else -1] if param.dim() == 2 else None
        raise_if_any([
            None if param.dim() == 2 else
            f"A projection needs a 2-D parameter, but `{name}` has shape {tuple(param.shape)}",
            None if dim is None or dim == self.matrix.shape[0] else
            f"The {self.side} projection of `{name}` {tuple(param.shape)} needs a matrix with "
            f"{dim} rows, but got {tuple(self.matrix.shape)}",
        ])

    def of_gradients(self, grads: Tensor) -> Tensor:
        """Project materialised gradients ``[..., out, in]`` (in their dtype: autocast off, which made a released
        float32 gradient's projection bfloat16 in DP-GaLore's and the twins' steps under ``bf16-mixed``)."""
        p = self.matrix.to(grads.dtype)
        with outside_autocast(grads.device.type):
            return p.T @ grads if self.side == "left" else grads @ p

    def back(self, update: Tensor) -> Tensor:
        """``P U`` (left: ``U [r, in]``) or ``U P^T`` (right: ``U [out, r]``): a projected step in the weight's shape
        (in the update's dtype, autocast off)."""
        p = self.matrix.to(update.dtype)
        with outside_autocast(update.device.type):
            return p @ update if self.side == "left" else update @ p.T

    def of_rows(self, a: Tensor, g: Tensor) -> Tuple[Tensor, Tensor]:
        """Project the rows ``a [B, T, in]``, ``g [B, T, out]`` of ``G_i = sum_t g_t a_t^T``."""
        if self.side == "left":
            return a, g @ self.matrix.to(g.dtype)
        return a @ self.matrix.to(a.dtype), g


class GradientTransform:
    """Base of the transforms the engine applies to per-example gradients (see the module doc).

    Override :meth:`projection` (per parameter, called once per batch, so an algorithm may change
    its subspace between steps) and/or :meth:`apply` (a generic rewrite of materialised
    gradients, given after the projection).
    """

    def projection(self, name: str, param: Tensor) -> Optional[Projection]:
        """The subspace of ``name``'s per-example gradients this batch (``None``: not projected)."""
        return None

    def apply(self, name: str, param: Tensor, grads: Tensor) -> Tensor:
        """Rewrite materialised per-example gradients ``[B, ...]`` (default: unchanged)."""
        return grads

    @property
    def rewrites(self) -> bool:
        """Whether :meth:`apply` is overridden (then per-example gradients must be materialised)."""
        return type(self).apply is not GradientTransform.apply

    def rewrites_param(self, name: str, param: Tensor) -> bool:
        """Whether :meth:`apply` may change ``name``'s per-example gradients (default: whenever it is overridden)."""
        return self.rewrites

    def unapply_sum(self, name: str, param: Tensor, summed: Tensor, weight: float) -> Optional[Tensor]:
        """``sum_i w_i g_i`` from ``sum_i w_i apply(g_i)`` and ``weight = sum_i w_i``, where :meth:`apply` is affine
        (``None``: unknown). The gradient halves' retry compares a step's sum before the rewrite
        (:mod:`.gradient_halves`)."""
        return None if self.rewrites else summed


class Projections(GradientTransform):
    """Fixed projections by parameter name: ``Projections({"0.weight": Projection(P)})``."""

    def __init__(self, projections: Mapping[str, Projection]) -> None:
        self.projections = dict(projections)

    def projection(self, name: str, param: Tensor) -> Optional[Projection]:
        return self.projections.get(name)


class Recentring(GradientTransform):
    """``g_i - c`` for every example, ``c`` a public vector by parameter name (DOPE-SGD's recentred clipping: the clip
    then bounds each example's distance to ``c``). ``centers`` may be replaced between steps."""

    def __init__(self, centers: Optional[Mapping[str, Tensor]] = None) -> None:
        self.centers = dict(centers or {})

    def apply(self, name: str, param: Tensor, grads: Tensor) -> Tensor:
        center = self.centers.get(name)
        return grads if center is None else grads - center.to(grads.dtype)

    def rewrites_param(self, name: str, param: Tensor) -> bool:
        return name in self.centers

    def unapply_sum(self, name: str, param: Tensor, summed: Tensor, weight: float) -> Optional[Tensor]:
        """``sum_i w_i (g_i - c) + (sum_i w_i) c``."""
        center = self.centers.get(name)
        return summed if center is None else summed + weight * center.to(summed.dtype)


class _Function(GradientTransform):
    """A plain callable ``fn(name, param, grads) -> grads`` as a generic rewrite."""

    def __init__(self, fn: Callable[[str, Tensor, Tensor], Tensor]) -> None:
        self.fn = fn

    def apply(self, name: str, param: Tensor, grads: Tensor) -> Tensor:
        return self.fn(name, param, grads)


def as_transform(transform: Any) -> Optional[GradientTransform]:
    """``None``, a :class:`GradientTransform`, or a callable (wrapped as a generic rewrite)."""
    if transform is None or isinstance(transform, GradientTransform):
        return transform
    return _Function(transform)

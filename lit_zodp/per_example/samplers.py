"""Per-layer rules for per-example gradients, registered by layer type.

A rule receives a layer, the input ``a`` of one call and the gradient ``g`` of the *summed* loss
with respect to that call's output, both batch-first. Example ``i`` only reaches row ``i``, so row
``i`` of ``g`` is ``d loss_i / d out_i`` and each example's parameter gradient can be formed from
its own rows: the per-example gradient trick of Goodfellow (2015), "Efficient per-example gradient
computations", applied layer by layer as in Opacus' ``GradSampleModule``.

Each rule returns a dict keyed by the layer's *direct* parameter names (``"weight"``, ``"bias"``)
and skips frozen parameters. Besides ``grads`` (``[B, *param.shape]``) a rule may provide
``norms`` (squared per-example norms ``[B]`` without materialising the gradients, for "ghost"
clipping) and ``summed`` (the sum over examples, given rows of ``g`` already scaled by the clip
factors: the book-keeping step of Bu et al. 2023). Rules decide which parameters to return from
their ``requires_grad`` (the engine hides a parameter from a rule by passing a view of the layer
where it reads as frozen). A layer whose weight gradient is a sum of outer products,
``G_i = sum_t g_{i,t} a_{i,t}^T``, may also give ``weight_rows`` (the rows ``a``, ``g`` as
``[B, T, in]``, ``[B, T, out]``), which lets the engine project them before forming ``G_i``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_zodp.errors import raise_if_any
from lit_zodp.per_example.ghost import (embedding_norm_sq, gram_norm_sq, outer_norm_sq, prefer_ghost, row_norm_sq,
                                        summed_norm_sq)

LayerRule = Callable[[nn.Module, Tensor, Tensor], Dict[str, Tensor]]
#: ``directions(param, dtype) -> (v [S_0, K], u [S_1 * ... * S_n, K])`` for a parameter of shape ``S`` (``u`` is
#: ``None`` for a parameter of at most one dimension, ``v [numel, K]``): ``K`` secret random directions
#: ``v_k u_k^T`` in the parameter's space (:meth:`Sampler.project`).
Directions = Callable[[Tensor, torch.dtype], Tuple[Tensor, Optional[Tensor]]]
ProjectedRule = Callable[[nn.Module, Tensor, Tensor, Directions], Dict[str, Tensor]]


@dataclass(frozen=True)
class Sampler:
    """The rules for one layer type; ``supports`` rejects configurations the rules do not cover."""

    grads: LayerRule
    norms: Optional[LayerRule] = None
    summed: Optional[LayerRule] = None
    supports: Optional[Callable[[nn.Module], bool]] = None
    weight_rows: Optional[Callable[[nn.Module, Tensor, Tensor], Tuple[Tensor, Tensor]]] = None
    parameters: Optional[FrozenSet[str]] = None
    #: A call's rows as positions ``[B, T, ...]`` (``a``) and ``[B, T, out]`` (``g``), in the form ``norms`` takes:
    #: the rows of several calls concatenated along ``T`` are one call's, whose gradient is the calls' sum.
    positions: Optional[Callable[[nn.Module, Tensor, Tensor], Tuple[Tensor, Tensor]]] = None
    projected: Optional[ProjectedRule] = None

    def project(self, layer: nn.Module, a: Tensor, g: Tensor, directions: Directions) -> Dict[str, Tensor]:
        """``v_k^T G_i u_k`` per example and direction, ``[B, K]`` in float64, of the per-example gradients ``G_i``
        this rule forms from ``(a, g)`` (what the alignment check compares, :mod:`.alignment`); without a
        ``projected`` rule, from ``grads`` materialised a few rows at a time."""
        if self.projected is not None:
            return self.projected(layer, a, g, directions)
        params = sum(p.numel() for p in layer.parameters(recurse=False)) or 1
        chunk = max(1, max(g.numel(), MATERIALISED_ELEMENTS) // params)
        parts: Dict[str, list] = {}
        for start in range(0, len(g), chunk):
            rows = slice(start, start + chunk)
            for name, grads in self.grads(layer, a[rows], g[rows]).items():
                parts.setdefault(name, []).append(projected_rows(grads, *directions(getattr(layer, name),
                                                                                    torch.float64)))
        return {name: torch.cat(chunks) for name, chunks in parts.items()}

    def sum_over_examples(self, layer: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
        """``sum_i G_i``; without a ``summed`` rule, materialise and reduce."""
        if self.summed is not None:
            return self.summed(layer, a, g)
        return {name: grad.sum(0) for name, grad in self.grads(layer, a, g).items()}

    def norms_sq(self, layer: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
        """Squared per-example norms; without a ``norms`` rule, materialise and reduce."""
        if self.norms is not None:
            return self.norms(layer, a, g)
        return {name: _row_norm_sq(grad) for name, grad in self.grads(layer, a, g).items()}


_SAMPLERS: Dict[type, Sampler] = {}

#: The direct parameters of the built-in rules' layers.
WEIGHT_AND_BIAS = ("weight", "bias")


def register_sampler(*layer_types: type, norms: Optional[LayerRule] = None,
                     summed: Optional[LayerRule] = None,
                     supports: Optional[Callable[[nn.Module], bool]] = None,
                     weight_rows: Optional[Callable[[nn.Module, Tensor, Tensor], Tuple[Tensor, Tensor]]] = None,
                     parameters: Optional[Iterable[str]] = None,
                     positions: Optional[Callable[[nn.Module, Tensor, Tensor], Tuple[Tensor, Tensor]]] = None,
                     projected: Optional[ProjectedRule] = None):
    """Decorator registering ``fn(layer, a, g) -> {name: [B, *shape]}`` for ``layer_types``.

    ``register_sampler(nn.Linear)(fn)`` replaces any earlier rule for ``nn.Linear``. ``parameters``:
    the direct parameter names the rule forms; a layer holding others (the old-style
    ``torch.nn.utils.weight_norm``'s ``weight_g``/``weight_v`` on a Linear) gets no rule (``None``: any).
    ``positions``: see :attr:`Sampler.positions`; ``projected``: see :meth:`Sampler.project`.
    """
    raise_if_any([None if layer_types else "Expected at least one layer type in `register_sampler`"]
                 + [None if isinstance(t, type) and issubclass(t, nn.Module)
                    else f"Expected `layer_types` to be nn.Module subclasses, but got {t!r}"
                    for t in layer_types])

    def decorator(fn: LayerRule) -> LayerRule:
        for layer_type in layer_types:
            _SAMPLERS[layer_type] = Sampler(fn, norms, summed, supports, weight_rows,
                                            None if parameters is None else frozenset(parameters), positions,
                                            projected)
        return fn

    return decorator


def sampler_for(layer: nn.Module) -> Optional[Sampler]:
    """The rule for ``layer``: its own type's, else the nearest registered base class whose
    ``forward`` it inherits unchanged (a subclass with its own ``forward`` gets none)."""
    _register_timm_norms()
    for cls in type(layer).__mro__:
        sampler = _SAMPLERS.get(cls)
        if sampler is None:
            continue
        if type(layer).forward is not cls.forward or not _holds_only(layer, sampler.parameters):
            return None
        return sampler if sampler.supports is None or sampler.supports(layer) else None


def _holds_only(layer: nn.Module, names: Optional[FrozenSet[str]]) -> bool:
    return names is None or all(local in names for local, _ in layer.named_parameters(recurse=False))
    return None


# --------------------------------------------------------------------------------------- helpers

#: Per-example gradient elements :meth:`Sampler.project` materialises at once (at least a call's output gradient's).
MATERIALISED_ELEMENTS = 2 ** 22


def scaled_rows(x: Tensor) -> Tuple[Tensor, Tensor]:
    """``x [B, ...]`` in float64 with each row divided by its largest magnitude (a zero row by 1), and those
    magnitudes: a float64 row's projections neither under- nor overflow where its values do not."""
    wide = x.double()
    if wide.dim() < 2 or wide[0].numel() == 0:
        return wide, torch.zeros(len(x), dtype=torch.float64, device=x.device)
    scale = wide.abs().flatten(1).amax(1)
    return wide / torch.where(scale > 0, scale, 1.0).view(-1, *[1] * (wide.dim() - 1)), scale


def wide_positions(x: Tensor) -> Tuple[Tensor, Tensor]:
    """Rows ``x [B, T, d]`` in float64 and a scale per position ``[B, T]`` that multiplies them back: 1 for ``x`` of at
    most float32, whose products float64 holds exactly; each position's largest magnitude for float64 ``x``. Scaled
    per position, not per row, so that products of two rows' positions are as small as the credited values are: each
    row scaled by its own largest value (41aae33) made a live position's product ``1e-57`` of the scales, 0 in
    float32, while a dead position set the scale (red-team review 79, finding 1: 2.26 C)."""
    wide = x.double()
    if x.dtype != torch.float64 or x.shape[-1] == 0:
        return wide, torch.ones(x.shape[:-1], dtype=torch.float64, device=x.device)
    scale = wide.abs().amax(-1)
    return wide / torch.where(scale > 0, scale, 1.0)[..., None], scale


def projected_rows(grads: Tensor, v: Tensor, u: Optional[Tensor]) -> Tensor:
    """``v_k^T G_i u_k`` ``[B, K]`` (float64) of materialised per-example gradients ``G [B, *S]``
    (:data:`Directions`)."""
    rows, scale = scaled_rows(grads.reshape(len(grads), v.shape[0], -1))
    projected = rows[..., 0] @ v if u is None else ((rows @ u) * v).sum(1)
    return projected * scale[:, None]


def _row_norm_sq(per_example: Tensor) -> Tensor:
    """``||G_i||^2`` per row of materialised gradients (any shape: ``[B]`` for a 0-dim parameter), an upper bound in
    float64 (:func:`~lit_zodp.per_example.ghost.row_norm_sq`)."""
    return row_norm_sq(per_example.reshape(len(per_example), -1))


def _trainable(layer: nn.Module, name: str) -> bool:
    param = getattr(layer, name, None)
    return isinstance(param, Tensor) and param.requires_grad


def _common_dtype(a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Autocast may leave the input and the output gradient in different dtypes."""
    dtype = torch.promote_types(a.dtype, g.dtype)
    return a.to(dtype), g.to(dtype)


def _sum_over(x: Tensor, dims: tuple[int, ...]) -> Tensor:
    """``x.sum(dims)`` that is the identity for ``dims == ()`` (``sum(())`` would reduce all)."""
    return x.sum(dims) if dims else x


def _as_sequences(a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``[B, T..., d]`` -> ``[B, T, d]``: the positions of one example are a sequence of length T."""
    a, g = _common_dtype(a, g)
    return a.reshape(a.shape[0], -1, a.shape[-1]), g.reshape(g.shape[0], -1, g.shape[-1])


# ------------------------------------------------------------------------------------------ Linear


def outer_grads(a: Tensor, g: Tensor) -> Tensor:
    """``G_i = sum_t g_{i,t} a_{i,t}^T`` ``[B, out, in]`` from ``a [B, T, in]``, ``g [B, T, out]``
    (Goodfellow 2015)."""
    return torch.bmm(g.transpose(1, 2), a)


def outer_norms_sq(a: Tensor, g: Tensor) -> Tensor:
    """``||G_i||^2``: the ghost norm where cheaper (Li et al. 2022; Bu et al. 2022 mixed rule), else from the
    materialised ``G_i``; both guarded against the rounding of the flattened sum (:func:`outer_norm_sq`)."""
    if prefer_ghost(a.shape[1], a.shape[-1] * g.shape[-1]):
        return gram_norm_sq(a, g)
    return outer_norm_sq(a, g)


def outer_summed(a: Tensor, g: Tensor) -> Tensor:
    """``sum_i G_i = sum_{i,t} g_{i,t} a_{i,t}^T``: one matmul over all rows."""
    return g.flatten(0, 1).T @ a.flatten(0, 1)


def _linear_grads(layer: nn.Linear, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    """The weight's outer products; the bias gets ``sum_t g_{i,t}``."""
    a, g = _as_sequences(a, g)
    out = {}
    if _trainable(layer, "weight"):
        out["weight"] = outer_grads(a, g)
    if _trainable(layer, "bias"):
        out["bias"] = g.sum(1)
    return out


def _linear_norms(layer: nn.Linear, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    a, g = _as_sequences(a, g)
    out = {}
    if _trainable(layer, "weight"):
        out["weight"] = outer_norms_sq(a, g)
    if _trainable(layer, "bias"):
        out["bias"] = summed_norm_sq(g)
    return out


def _linear_summed(layer: nn.Linear, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    a, g = _as_sequences(a, g)
    out = {}
    if _trainable(layer, "weight"):
        out["weight"] = outer_summed(a, g)
    if _trainable(layer, "bias"):
        out["bias"] = g.sum(1).sum(0)  # each example's rows first: a record's rows never meet another's (review 15)
    return out


def _linear_rows(layer: nn.Linear, a: Tensor, g: Tensor) -> Tuple[Tensor, Tensor]:
    return _as_sequences(a, g)


def _linear_projected(layer: nn.Linear, a: Tensor, g: Tensor, directions: Directions) -> Dict[str, Tensor]:
    """``v^T G_i u = sum_t (g_{i,t} . v)(a_{i,t} . u)`` and ``sum_t g_{i,t} . v`` for the bias, no ``[B, out, in]``
    (float64: :func:`wide_positions`)."""
    a, g = _as_sequences(a, g)
    g, g_scale = wide_positions(g)
    out = {}
    if _trainable(layer, "weight"):
        v, u = directions(layer.weight, torch.float64)
        a, a_scale = wide_positions(a)
        out["weight"] = ((a @ u) * (g @ v) * (a_scale * g_scale)[..., None]).sum(1)
    if _trainable(layer, "bias"):
        v, _ = directions(layer.bias, torch.float64)
        out["bias"] = ((g @ v) * g_scale[..., None]).sum(1)
    return out


register_sampler(nn.Linear, parameters=WEIGHT_AND_BIAS, norms=_linear_norms, summed=_linear_summed,
                 weight_rows=_linear_rows, positions=_linear_rows, projected=_linear_projected)(_linear_grads)


# --------------------------------------------------------------------------------------- Embedding


def _embedding_supported(layer: nn.Embedding) -> bool:
    """``max_norm`` rewrites the weight in forward; ``scale_grad_by_freq`` couples examples."""
    return layer.max_norm is None and not layer.scale_grad_by_freq and not layer.sparse


def _embedding_rows(layer: nn.Embedding, idx: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``[B, T...]`` indices and ``[B, T..., D]`` gradients -> ``[B, T]`` and ``[B, T, D]``."""
    return idx.reshape(idx.shape[0], -1), g.reshape(g.shape[0], -1, layer.embedding_dim)


def _embedding_grads(layer: nn.Embedding, idx: Tensor, g: Tensor) -> Dict[str, Tensor]:
    """Row ``v`` of ``G_i`` is the sum of ``g_{i,t}`` over positions with ``x_{i,t} = v``
    (a per-example scatter-add); the ``padding_idx`` row stays zero as in ``nn.Embedding``."""
    if not _trainable(layer, "weight"):
        return {}
    idx, g = _embedding_rows(layer, idx, g)
    grads = g.new_zeros(idx.shape[0], layer.num_embeddings, layer.embedding_dim)
    grads.scatter_add_(1, idx.unsqueeze(-1).expand_as(g), g)
    if layer.padding_idx is not None:
        grads[:, layer.padding_idx] = 0
    return {"weight": grads}


def _embedding_norms(layer: nn.Embedding, idx: Tensor, g: Tensor) -> Dict[str, Tensor]:
    """Ghost norm with a one-hot Gram matrix where cheaper than the ``[B, V, D]`` scatter."""
    if not _trainable(layer, "weight"):
        return {}
    rows, grads = _embedding_rows(layer, idx, g)  # (guarded even where the scatter would be cheaper: audit 13)
    return {"weight": embedding_norm_sq(rows, grads, layer.padding_idx)}


def _embedding_summed(layer: nn.Embedding, idx: Tensor, g: Tensor) -> Dict[str, Tensor]:
    """``sum_i G_i``: one ``index_add`` of all rows into ``[V, D]``."""
    if not _trainable(layer, "weight"):
        return {}
    idx, g = _embedding_rows(layer, idx, g)
    total = g.new_zeros(layer.num_embeddings, layer.embedding_dim)
    total.index_add_(0, idx.flatten(), g.flatten(0, 1))
    if layer.padding_idx is not None:
        total[layer.padding_idx] = 0
    return {"weight": total}


def _embedding_projected(layer: nn.Embedding, idx: Tensor, g: Tensor, directions: Directions) -> Dict[str, Tensor]:
    """``v^T G_i u = sum_t v[x_{i,t}] (g_{i,t} . u)`` over positions not at ``padding_idx``, no ``[B, V, D]``
    (float64: :func:`wide_positions`)."""
    if not _trainable(layer, "weight"):
        return {}
    idx, g = _embedding_rows(layer, idx, g)
    g, scale = wide_positions(g)
    v, u = directions(layer.weight, torch.float64)
    picked = v[idx]
    if layer.padding_idx is not None:
        picked = picked * (idx != layer.padding_idx).unsqueeze(-1)
    return {"weight": (picked * (g @ u) * scale[..., None]).sum(1)}


register_sampler(nn.Embedding, parameters=WEIGHT_AND_BIAS, norms=_embedding_norms, summed=_embedding_summed,
                 supports=_embedding_supported, positions=_embedding_rows,
                 projected=_embedding_projected)(_embedding_grads)


# ----------------------------------------------------------------------------------- Normalisation


def _affine_grads(layer: nn.Module, normalised: Tensor, g: Tensor, dims: tuple[int, ...],
                  shape: tuple[int, ...]) -> Dict[str, Tensor]:
    """``y = w * x_hat + b``: ``dw_i = sum g * x_hat`` and ``db_i = sum g`` over the ``dims`` of
    one example that the affine parameters are shared across."""
    normalised, g = _common_dtype(normalised, g)
    out = {}
    if _trainable(layer, "weight"):
        out["weight"] = _sum_over(g * normalised, dims).reshape(-1, *shape)
    if _trainable(layer, "bias"):
        out["bias"] = _sum_over(g, dims).reshape(-1, *shape)
    return out


def _affine_norms(layer: nn.Module, normalised: Tensor, g: Tensor, positions_first) -> Dict[str, Tensor]:
    """Squared norms of :func:`_affine_grads`, guarded as :func:`summed_norm_sq` (audit 13: the sums are
    formed apart from the rows measured, so positions that cancel must not hide their scale);
    ``positions_first`` reshapes ``[B, ...]`` terms to ``[B, positions, parameter elements]``."""
    normalised, g = _common_dtype(normalised, g)
    out = {}
    if _trainable(layer, "weight"):
        out["weight"] = summed_norm_sq(positions_first(g * normalised))
    if _trainable(layer, "bias"):
        out["bias"] = summed_norm_sq(positions_first(g))
    return out


def _last_dims_first(layer: nn.Module):
    """``[B, positions..., *normalized_shape]`` -> ``[B, positions, elements]`` (LayerNorm, RMSNorm)."""
    elements = math.prod(layer.normalized_shape)
    return lambda terms: terms.reshape(terms.shape[0], -1, elements)


def _layer_normalised(layer: nn.Module, a: Tensor) -> Tensor:
    return F.layer_norm(a, tuple(layer.normalized_shape), eps=layer.eps)


def _layer_norm_grads(layer: nn.LayerNorm, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    """LayerNorm normalises the last ``len(normalized_shape)`` dims; the dims between the batch
    and those are positions of one example and are summed."""
    shape = tuple(layer.normalized_shape)
    return _affine_grads(layer, _layer_normalised(layer, a), g, tuple(range(1, a.dim() - len(shape))), shape)


def _layer_norm_norms(layer: nn.LayerNorm, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    return _affine_norms(layer, _layer_normalised(layer, a), g, _last_dims_first(layer))


def _group_normalised(layer: nn.GroupNorm, a: Tensor) -> Tensor:
    return F.group_norm(a, layer.num_groups, eps=layer.eps)


def _group_norm_grads(layer: nn.GroupNorm, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    """GroupNorm on ``[B, C, *]`` normalises each example's channel groups; the affine
    parameters are per channel, summed over the spatial dims."""
    return _affine_grads(layer, _group_normalised(layer, a), g, tuple(range(2, a.dim())), (layer.num_channels,))


def _group_norm_norms(layer: nn.GroupNorm, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    return _affine_norms(layer, _group_normalised(layer, a), g,
                         lambda terms: terms.reshape(terms.shape[0], layer.num_channels, -1).transpose(1, 2))


def _rms_normalised(layer: nn.Module, a: Tensor) -> Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the normalised dims (``eps=None``: the dtype's machine epsilon, as in
    ``nn.RMSNorm``)."""
    shape = tuple(layer.normalized_shape)
    dims = tuple(range(a.dim() - len(shape), a.dim()))
    eps = torch.finfo(a.dtype).eps if layer.eps is None else layer.eps
    return a * torch.rsqrt(a.pow(2).mean(dims, keepdim=True) + eps)


def _rms_norm_grads(layer: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    """RMSNorm, ``y = w * x / sqrt(mean(x^2) + eps)``: the weight-only case of the affine rule."""
    shape = tuple(layer.normalized_shape)
    return _affine_grads(layer, _rms_normalised(layer, a), g, tuple(range(1, a.dim() - len(shape))), shape)


def _rms_norm_norms(layer: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    return _affine_norms(layer, _rms_normalised(layer, a), g, _last_dims_first(layer))


register_sampler(nn.LayerNorm, parameters=WEIGHT_AND_BIAS, norms=_layer_norm_norms)(_layer_norm_grads)
register_sampler(nn.GroupNorm, parameters=WEIGHT_AND_BIAS, norms=_group_norm_norms)(_group_norm_grads)
if hasattr(nn, "RMSNorm"):
    register_sampler(nn.RMSNorm, parameters=WEIGHT_AND_BIAS, norms=_rms_norm_norms)(_rms_norm_grads)


def _register_timm_norms() -> None:
    """timm's ``LayerNorm`` and ``RmsNorm`` re-implement ``forward`` (optionally fused) with the
    maths of the rules above; registered once timm is imported, so it stays optional."""
    norm = sys.modules.get("timm.layers.norm")
    if norm is None or getattr(norm, "LayerNorm", None) in _SAMPLERS:
        return
    register_sampler(norm.LayerNorm, parameters=WEIGHT_AND_BIAS, norms=_layer_norm_norms)(_layer_norm_grads)
    if hasattr(norm, "RmsNorm"):
        register_sampler(norm.RmsNorm, parameters=WEIGHT_AND_BIAS, norms=_rms_norm_norms)(_rms_norm_grads)

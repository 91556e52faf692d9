"""The clipped gradients against their halves: is the gradient the engine clips each example's own?

The forward checks (:func:`.checks.refuse_batch_mixing`, the engine's halves) compare the module's outputs and its
layers' inputs row by row, each row on a scale that includes the batch's median row (:func:`.checks.rows_differ`),
and see nothing of a backward. Red-team review 65 left two breaks of them open, each on one removal:

* records that are most of a small batch set that median: three records of huge features and one honest example,
  whose features a detached batch mean (1e-4) moves within the tolerance the records set: 1.77 C released;
* a user's ``autograd.Function`` that scales the backward alone by a batch statistic: the alignment check's identity
  ``G_w[r] = w_r G_1[r]`` is row-linear, so it holds, and the forward is the identity: 2.5 C released.

Here, at the steps whose forward is checked, the engine's module runs again, forward and backward, on the whole batch
and on two secret random halves of it, each without the other, every Bernoulli draw at its mean
(:class:`.checks.MeanOfRandomDraws`). Each row's output gradient is weighted by the step's clip factor,
``v_r = c_r dL_r / d out_r``. For a module whose examples are independent,

    sum over the halves h of  d/dtheta sum_{r in h} <v_r, out_r(x_h)>   =   d/dtheta sum_r <v_r, out_r(x)>

to rounding (any fixed weights give an identity; these make row ``r``'s term its clipped gradient, of norm at most
``C``). The tolerance is ``u (sum_r c_r ||g_r|| + ||G_whole|| + ||G_half1|| + ||G_half2||)`` with
``u = min(sqrt(eps), 256 eps)`` (:func:`tolerance_unit`). The first term is at most ``B C`` whatever the records, and a
record can widen the others only by a ``u`` share of what it moves. Where an example's share of the sum moves by much
more than that (both attacks above: ``O(C)``), the difference shows. Compared in the space the engine clips in (its projections). Sampled, not proved: mixing that shows
only on some splits, or below the tolerance (about ``2 u B C``), passes.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from lit_zodp.errors import PrivacyConfigError
from lit_zodp.per_example.checks import MeanOfRandomDraws, beyond_tolerance, in_place_index, random_halves
from lit_zodp.per_example.reference import is_batched
from lit_zodp.per_example.rounding import forward_autocast, no_forward_autocast, working_eps
from lit_zodp.per_example.tape import ModuleCall
from lit_zodp.privacy.training_randomness import secret_streams

Gradients = List[Optional[Tensor]]

#: The tolerance's unit in ``eps``: honest gaps measured 0.30-0.35 ``eps`` of the norms' term (the packaged MiniLM,
#: ``T <= 64``, and a timm ViT-tiny, ``B = 32``, float32, every mode, C = 1e-3 and 1), so ``256 eps`` leaves a margin
#: of about 700 for deeper reductions. ``sqrt(eps)`` (2896 ``eps`` in float32) let mixing that grows with ``B`` through
#: (red-team review 67: 1.56 C at ``B = 256``); it stays the cap where it is smaller (bfloat16: 16 ``eps``).
TOLERANCE_EPS = 256


def tolerance_unit(eps: float) -> float:
    """``min(sqrt(eps), TOLERANCE_EPS eps)``: the multiple of the norms' term a gap may reach."""
    return min(eps ** 0.5, TOLERANCE_EPS * eps)


def refuse_gradient_mixing(calls: Sequence[ModuleCall], weights: Tensor, norms: Tensor, params: Sequence[Tensor], *,
                           project: Callable[[int, Tensor], Tensor], dtype: torch.dtype, device_type: str,
                           keep_call_shape: bool = False, devices: Sequence[torch.device] = (),
                           without_autocast: bool = False) -> None:
    """Refuse the step if the clip-weighted gradient of the whole batch is not the sum of its halves' (module doc).

    Args:
        calls: The calls of the engine's module in the step, each with its output gradients (``call.grads``).
        weights: The step's clip factors ``[B]`` (0: not in the sum).
        norms: The per-example norms ``[B]`` the factors were computed from (in the clipped space).
        params: The parameters clipped.
        project: ``(i, gradient of params[i]) -> the gradient in the clipped space`` (the engine's projections).
        dtype: Of the computation, for the tolerance (:func:`.rounding.working_eps`).
        keep_call_shape: Run each half in the call's batch shape (copies of its first row, weight 0).
        devices: The CUDA devices whose random streams the recomputation must leave alone.
        without_autocast: Recompute without the forward's autocast (a model of float32 parameters and inputs run
            under a bfloat16 autocast: every run is the check's own, so it may run in float32, and its tolerance is
            float32's, not ``sqrt(2^-7)`` of the norms, which let 2.4 C through at ``B = 16``: red-team review 67).
    """
    size = len(weights)
    calls = [call for call in calls if call.grads]
    if size < 2 or not calls:
        return
    shares = torch.where(weights > 0, weights.double() * norms.double(), 0.0)  # c_r ||g_r|| (<= C)
    with no_forward_autocast() if without_autocast else contextlib.nullcontext():
        unit = tolerance_unit(working_eps(device_type, dtype))
    tolerance_of_rows = unit * float(shares.nan_to_num(0.0).sum())
    run = functools.partial(_clip_weighted_gradient, calls, size=size, params=params, keep_call_shape=keep_call_shape,
                            devices=devices, device_type=device_type, without_autocast=without_autocast)
    weights = weights.double().cpu()
    for rows in (torch.arange(size), (weights > 0).nonzero().flatten()):
        if len(rows) < 2:
            return
        halves = random_halves(len(rows))
        gap, scale = _gap_and_scale(run, _alone(rows, weights, halves), project)
        if math.isfinite(gap) and math.isfinite(scale):
            break  # (a row weighted 0 whose recomputation is not finite spoils the sums: compared without it)
    else:
        return
    ratio = _beyond(gap, tolerance_of_rows + unit * scale)
    if ratio > 1:  # measured again with each half in the batch's shape, each row in its place (as the forward's)
        gap, scale = _gap_and_scale(run, _in_place(rows, weights, halves), project)
        ratio = _beyond(gap, tolerance_of_rows + unit * scale)
    if not ratio <= 1:
        raise PrivacyConfigError(
            "The per-example gradients depend on their batch-mates: the clip-weighted gradient of the engine's module "
            "on the whole batch differs from the sum of its two halves' (each computed without the other) by "
            f"{beyond_tolerance(ratio)}. A forward or backward that mixes examples (a batch statistic, "
            "including one that only a custom autograd.Function's backward reads) breaks per-example clipping; "
            "compute each example's loss and gradient from its own row")


def _beyond(gap: float, tolerance: float) -> float:
    """``gap / tolerance``; 0 where the sums agree exactly (all gradients 0: a tolerance of 0), NaN if not finite."""
    return 0.0 if gap == 0 else gap / tolerance


Part = Tuple[Tensor, Tensor]  # (the rows run, their weights)


def _alone(rows: Tensor, weights: Tensor, halves: Tuple[Tensor, Tensor]) -> List[Part]:
    """The whole of ``rows``, then each half alone."""
    return [(rows, weights[rows]), *((rows[half], weights[rows[half]]) for half in halves)]


def _in_place(rows: Tensor, weights: Tensor, halves: Tuple[Tensor, Tensor]) -> List[Part]:
    """The whole of ``rows``, then each half in its shape (:func:`.checks.in_place_index`), the other half's positions
    at weight 0 (red-team review 20's cancelling row rounds with the row count)."""
    parts = [(rows, weights[rows])]
    for half in halves:
        position = in_place_index(half, len(rows))
        mine = torch.zeros(len(rows), dtype=torch.bool)
        mine[half] = True
        parts.append((rows[position], torch.where(mine, weights[rows[position]], 0.0)))
    return parts


def _clip_weighted_gradient(calls: Sequence[ModuleCall], part: Part, *, size: int, params: Sequence[Tensor],
                            keep_call_shape: bool, devices: Sequence[torch.device], device_type: str,
                            without_autocast: bool = False) -> Gradients:
    """``d/dtheta sum_calls sum_k w_k <dL_{r_k}/d out, out_k>``, the module run on the rows ``r`` of ``part`` alone
    (``w``: their weights)."""
    index, weights = part
    rows = len(index)
    padded = torch.cat([index, index[:1].expand(size - rows)]) if keep_call_shape else index
    row_weights = torch.cat([weights, weights.new_zeros(len(padded) - rows)])
    outputs: List[Tensor] = []
    cotangents: List[Tensor] = []
    for call in calls:
        inputs = [x[padded.to(x.device)].detach() if is_batched(x, size) else
                  x.detach() if isinstance(x, Tensor) else x for x in call.inputs]
        args, kwargs = tree_unflatten(inputs, call.spec)
        autocast = contextlib.nullcontext() if without_autocast else forward_autocast(device_type)
        with secret_streams(devices), torch.enable_grad(), MeanOfRandomDraws(), autocast:
            flat = tree_flatten(call.module(*args, **kwargs))[0]
        for j, grad in call.grads.items():
            out = flat[j] if j < len(flat) else None
            batch_dim = _batch_dim(grad, size)
            if batch_dim and isinstance(out, Tensor) and out.dim() == grad.dim():
                out, grad = out.movedim(batch_dim, 0), grad.movedim(batch_dim, 0)
            cotangent = _cotangent(out, grad, padded, row_weights)
            if cotangent is not None:
                outputs.append(out)
                cotangents.append(cotangent)
    if not outputs:
        return [None] * len(params)
    return list(torch.autograd.grad(outputs, list(params), cotangents, allow_unused=True))


def _batch_dim(grad: Tensor, size: int) -> Optional[int]:
    """The dimension of an output gradient that holds the step's ``size`` examples: 0 where it has ``size`` rows,
    else the only dimension of that size (a sequence-first ``[T, B, ...]`` or transposed ``[classes, B]`` output:
    skipped, the check saw nothing of a backward scaled by a batch statistic behind it, 5.8 C released, red-team
    review 67); ``None``: none or several (not comparable)."""
    if grad.dim() == 0:
        return None
    if grad.shape[0] == size:
        return 0
    found = [d for d, n in enumerate(grad.shape) if n == size]
    return found[0] if len(found) == 1 else None


def _cotangent(out, grad: Tensor, padded: Tensor, row_weights: Tensor) -> Optional[Tensor]:
    """``c_r dL_r/d out_r`` for the recomputed output's rows; a recomputation of fewer positions than the step's
    (a forward trimming its batch to its longest row) takes the positions both hold, whose loss alone can depend on
    them (a padded position's gradient is 0). ``None``: not comparable (the forward checks see those)."""
    if not (isinstance(out, Tensor) and out.requires_grad and out.dim() == grad.dim() and out.dim() > 0
            and len(out) == len(padded)):
        return None
    if any(mine > theirs for mine, theirs in zip(out.shape[1:], grad.shape[1:])):
        return None
    rows = grad[padded.to(grad.device)][(slice(None), *(slice(0, n) for n in out.shape[1:]))]
    scale = row_weights.to(rows.device).view(-1, *[1] * (rows.dim() - 1))
    return torch.where(scale > 0, rows.double() * scale, 0.0).to(out.dtype)


def _gap_and_scale(run: Callable[[Part], Gradients], parts: Sequence[Part],
                   project: Callable[[int, Tensor], Tensor]) -> Tuple[float, float]:
    """``||G_whole - G_half1 - G_half2||`` and ``||G_whole|| + ||G_half1|| + ||G_half2||`` over every parameter, in
    the clipped space (one host synchronisation). ``run(part)``: the gradients of those rows. Each half's gradient
    is subtracted from the whole's in place as it comes, so at most two gradients of the parameters live at once
    (a step's own clipped sum is one)."""
    difference = run(parts[0])
    norms_sq = [_norm_sq(difference, project)]
    for part in parts[1:]:
        half = run(part)
        norms_sq.append(_norm_sq(half, project))
        for i, gradient in enumerate(half):
            if gradient is not None:
                difference[i] = -gradient if difference[i] is None else difference[i].sub_(gradient)
        del half
    values = torch.stack([_norm_sq(difference, project), *norms_sq]).sqrt().tolist()
    return values[0], sum(values[1:])


def _norm_sq(gradients: Gradients, project: Callable[[int, Tensor], Tensor]) -> Tensor:
    """``sum_p ||project(g_p)||^2`` (each norm in the gradient's dtype, no copy of it; a 0-d float64 tensor)."""
    terms = [torch.linalg.vector_norm(project(i, g)).double() ** 2 for i, g in enumerate(gradients) if g is not None]
    return torch.stack(terms).sum() if terms else torch.zeros((), dtype=torch.float64)

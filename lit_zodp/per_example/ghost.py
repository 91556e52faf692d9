"""Per-example gradient norms without per-example gradients ("ghost" norms).

For a layer whose per-example gradient is a sum of outer products over the ``T`` positions of one
example, ``G_i = sum_t g_{i,t} a_{i,t}^T``, the squared Frobenius norm is

    ``||G_i||^2 = sum_{s,t} (a_{i,s} . a_{i,t}) (g_{i,s} . g_{i,t})``

(Li et al. 2022, "Large language models can be strong differentially private learners", Sec. 4,
the ghost norm; Goodfellow 2015 for ``T = 1``). It costs ``O(T^2 (d_in + d_out))`` per example
instead of ``O(T d_in d_out)``; Bu et al. 2022 ("Scalable and efficient training of large
convolutional neural networks with differential privacy", mixed ghost clipping) choose per layer
whichever is cheaper, which is :func:`prefer_ghost`.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from lit_zodp.per_example.rounding import HALF_DTYPES, MatmulRounding, sum_rounding


def prefer_ghost(positions: int, weight_numel: int) -> bool:
    """Bu et al. 2022's layerwise rule: the ghost norm if ``2 T^2 < d_in d_out``."""
    return 2 * positions * positions < weight_numel


def at_least_float32(x: Tensor) -> Tensor:
    """Half precision widened to float32 (other dtypes, integer indices included, unchanged): half-precision
    Gram matrices overflow (float16) or lose the norm (bfloat16), and half-precision sums round at ``2^-8``."""
    return x.float() if x.dtype in HALF_DTYPES else x


#: ``R``: an example's norm bound is at least ``S_i / R``, so its clipped rows sum, in norms, to at most ``R C``
#: (:func:`guarded_norm_sq`, audit 14).
CANCELLATION_LIMIT = 256.0


def active_positions(a: Optional[Tensor], g: Tensor) -> Tensor:
    """Per example, the positions whose term ``g_t a_t^T`` is not identically zero (``a = None``: ``a_t = 1``), as
    float64 ``[B]``: the count of additions that can round in the sums the guards bound. An exact zero adds exactly,
    so padding (zero output gradients at masked positions) adds nothing to an example's rounding. The guards take
    this count, never the batch's padded length ``T``: with ``T``, a batch-mate's length moved every other example's
    bound by ``(T + 2) u S_i`` and its clipped share with it; 256 identical IMDB rows padded to 400 instead of 20
    moved the others' clipped sum by 2.4e-3 C in "ghost" and "bookkeeping" (review 61)."""
    rows = _nonzero_rows(g)
    if a is not None:
        rows = rows & _nonzero_rows(a)
    return rows.sum(1).to(torch.float64)


def _nonzero_rows(x: Tensor) -> Tensor:
    """Whether each row (last dimension) has a non-zero (or NaN) entry: its sum of magnitudes, which cannot underflow
    to 0 (no squares) and costs a tenth of ``(x != 0).any(-1)`` on CPU."""
    return torch.linalg.vector_norm(x, ord=1, dim=-1) != 0


def _nonzero_terms(a: Tensor, g: Tensor) -> Tensor:
    """``[B, T]``: whether ``g_t a_t^T`` may be non-zero: both rows non-zero, or either not finite (``0 * inf`` is
    NaN, which the example's norm must show so that its factor is 0)."""
    size_a, size_g = (torch.linalg.vector_norm(x, ord=1, dim=-1) for x in (a, g))
    return (size_a != 0) & (size_g != 0) | ~torch.isfinite(size_a) | ~torch.isfinite(size_g)


def guarded_norm_sq(gram: Tensor, scale: Tensor, length: Union[int, Tensor], positions: Union[int, Tensor],
                    rounding: MatmulRounding) -> Tensor:
    """An upper bound of ``||G_i||^2`` from its float64 ghost value, safe against cancellation.

    ``sum_{s,t} (a_s . a_t)(g_s . g_t)`` has terms up to ``S_i^2``, ``S_i = sum_t ||a_t|| ||g_t||``
    (``>= ||G_i||``), while ``||G_i||^2`` may be far smaller: a record with ``x_1 = M u + d_1``,
    ``x_2 = -M u + d_2`` cancels. Rounded in float32 such a norm came out 0.29x the true one (3.4 C
    released, second audit). In float64 the error is at most ``gamma S_i^2`` with
    ``gamma = 2 (length + T^2) 2^-53`` (dot products of ``length`` terms, a sum of ``T^2``), so
    ``sqrt(max(gram, 0) + gamma S_i^2)`` bounds the norm. The clipped sum is then a matmul over
    the ``T`` positions (:mod:`.rounding`): converting its operands moves the example's share by
    at most ``rounding.product S_i``, accumulating by ``(T + 2) u S_i``; adding both keeps
    ``||f_i G_i||`` at most ``C``. For ordinary examples (``S_i ~ sqrt(T) ||G_i||``) the bound
    exceeds the norm by ~``T^1.5 u``, 1e-4 at ``T = 128`` in float32; with TF32 operands by about
    ``2^-9 sqrt(T)``, 0.02 at ``T = 128``.

    That accounting assumes the sum adds an example's ``T`` rows in one run. BLAS does not: MKL restarts its
    accumulators per block of rows, sums use vector lanes, cuBLAS may split the rows, atomics interleave. A
    record whose ``+M u`` and ``-M u`` rows fall on two sides of such a split leaves an accumulator near
    ``f_i S_i`` (up to ``C / ((T + 2) u)``, 2.4e6 C at ``T = 5``) while other examples' rows are added to it, each
    rounded at ``u f_i S_i``: 1.45 C was released at ``B = 512`` (audit 14). So the bound is also at least
    ``S_i / R`` (:data:`CANCELLATION_LIMIT`): ``f_i S_i <= R C``, and the same record moves the sum by 2.6e-4 C.
    It changes no ordinary example: ``S_i / ||G_i||`` is at most 14 on ViT-tiny (``T = 197``); a BERT
    attention's key bias, whose gradient is 0 by the softmax's shift invariance, reaches 1e8, but its
    ``S_i / R`` is below float32's resolution of the example's total norm. ``T`` (``positions``) is each example's
    count of :func:`active_positions` (a tensor ``[B]``), not the batch's padded length (review 61)."""
    gamma = 2.0 * (length + positions * positions) * 2.0 ** -53
    rounded = rounding.product + (positions + 2) * rounding.accumulation
    bound = (gram.clamp_min(0) + gamma * scale.pow(2)).sqrt() + rounded * scale
    return torch.maximum(bound, scale / CANCELLATION_LIMIT).pow(2)


#: Elements of the float64 copies of one chunk of examples' rows (8 MiB): the largest temporary
#: the ghost norms form beyond the ``[B, T, T]`` Gram matrices.
GHOST_CHUNK = 1 << 20


def _example_chunks(batch: int, per_example: int) -> list:
    size = max(1, GHOST_CHUNK // max(1, per_example))
    return [slice(start, start + size) for start in range(0, batch, size)]


def gram_norm_sq(a: Tensor, g: Tensor) -> Tensor:
    """``||sum_t g_t a_t^T||_F^2`` per example from ``a [B, T, d_in]`` and ``g [B, T, d_out]``: an
    upper bound exact to float64 rounding (:func:`guarded_norm_sq`), formed a chunk of examples at a time
    (:data:`GHOST_CHUNK`); an example with one non-zero term takes :func:`_one_term_norm_sq` whatever ``T``."""
    dtype = torch.promote_types(a.dtype, g.dtype)
    rounding = sum_rounding(dtype, a.device.type)
    active = _nonzero_terms(a, g)
    if a.shape[1] == 1:
        return _one_term_norm_sq(a.squeeze(1), g.squeeze(1), active.squeeze(1), rounding)
    counts = active.sum(1).to(torch.float64)
    norms = torch.cat([_guarded_gram(a[rows].double(), g[rows].double(), counts[rows], rounding)
                       for rows in _example_chunks(a.shape[0], a.shape[1] * (a.shape[2] + g.shape[2]))])
    return _with_one_term_examples(norms, a, g, active, rounding)


def _one_term_norm_sq(a: Tensor, g: Tensor, active: Tensor, rounding: MatmulRounding) -> Tensor:
    """``||g a^T||^2 = ||a||^2 ||g||^2`` of rows ``[B, d]`` (Goodfellow 2015): no cancellation, and converted operands
    grow the share by ``1 + product``; exactly 0 where ``active`` is false (a zero row)."""
    value = row_norm_sq(a) * row_norm_sq(g) * (1 + rounding.product) ** 2
    return torch.where(active, value, 0.0)


def _with_one_term_examples(norms: Tensor, a: Tensor, g: Tensor, active: Tensor, rounding: MatmulRounding) -> Tensor:
    """``norms`` with the examples whose only non-zero term is one position's replaced by :func:`_one_term_norm_sq`
    of that position: a one-token row padded to ``T`` gets the bound it gets at ``T = 1`` (review 61)."""
    single = active.sum(1) == 1
    if not bool(single.any()):
        return norms
    index = single.nonzero().squeeze(1)
    position = active[index].to(torch.uint8).argmax(1)
    rows = _one_term_norm_sq(a[index, position], g[index, position], torch.ones_like(index, dtype=torch.bool),
                             rounding)
    return norms.index_put((index,), rows.to(norms.dtype))


def _guarded_gram(a: Tensor, g: Tensor, active: Tensor, rounding: MatmulRounding) -> Tensor:
    gram = (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
    scale = (a.norm(dim=-1) * g.norm(dim=-1)).sum(1)
    return guarded_norm_sq(gram, scale, a.shape[-1] + g.shape[-1], active, rounding)


def outer_norm_sq(a: Tensor, g: Tensor) -> Tensor:
    """``||sum_t g_t a_t^T||_F^2`` per example from the materialised ``[B, d_out, d_in]`` in float64 (where cheaper
    than the Gram matrices; ``a = 1`` gives a bias's ``||sum_t g_t||^2``), guarded as :func:`guarded_norm_sq`; an
    example with one non-zero term takes :func:`_one_term_norm_sq`, as in :func:`gram_norm_sq`.

    The clipped sum is one reduction over every example's rows, so an example whose positions cancel (``x_1 = M u``,
    ``x_2 = -M u``) measures about 0 alone yet moves the others' partial sums by about ``u S_i``: unguarded, 3.1 C
    at B = 64 and 7.3 C at B = 256 were released in "bookkeeping" mode (audit 13)."""
    dtype = torch.promote_types(a.dtype, g.dtype)
    rounding = sum_rounding(dtype, a.device.type)
    positions = a.shape[1]
    active = _nonzero_terms(a, g)
    counts = active.sum(1).to(torch.float64)
    out = []
    for rows in _example_chunks(a.shape[0], a.shape[2] * g.shape[2] + positions * (a.shape[2] + g.shape[2])):
        a64, g64 = a[rows].double(), g[rows].double()
        norm_sq = torch.bmm(g64.transpose(1, 2), a64).pow(2).sum((1, 2))
        scale = (a64.norm(dim=-1) * g64.norm(dim=-1)).sum(1)
        out.append(guarded_norm_sq(norm_sq, scale, counts[rows], counts[rows], rounding))
    if not out:
        return a.new_zeros(0, dtype=torch.float64)
    return _with_one_term_examples(torch.cat(out), a, g, active, rounding)


#: float32's and float64's unit roundoffs, for the error bounds of :func:`row_norm_sq` and :func:`summed_norm_sq`.
FLOAT32_UNIT = 2.0 ** -24
FLOAT64_UNIT = 2.0 ** -53
#: Below this magnitude a float32 square underflows (``2^-63``, squared below the smallest normal ``2^-126``).
SMALLEST_SQUARED = 2.0 ** -63


def _gamma(n, unit: float = FLOAT32_UNIT):
    """``gamma_n = n u / (1 - n u)``: the relative error bound of ``n`` roundings (Higham, Accuracy and Stability of
    Numerical Algorithms, Lemma 3.1), one more rounding for the float64 arithmetic of the bound itself."""
    return (n + 1) * unit / (1 - (n + 1) * unit)


#: Elements per float32 block of :func:`row_norm_sq`.
NORM_BLOCK = 64


def row_norm_sq(rows: Tensor) -> Tensor:
    """An upper bound of ``||r_i||^2`` per row of ``rows [B, n]``, in float64: float32 sums of squares over blocks of
    :data:`NORM_BLOCK` elements (each square within ``gamma_{k+2}``, so scaled up by it; a square that underflows
    hides at most ``2^-126``, added per element), the blocks added in float64. One float32 norm of a long row adds its squares into a
    few lane accumulators that drop squares below half an ulp: a crafted 4096 x 2048 gradient measured 1.0 for a
    true 1.0154, and the share released was 1.0154 C (review 15). Float64 rows are summed as they are."""
    if rows.dtype == torch.float64:
        return rows.pow(2).sum(1) * (1 + _gamma(rows.shape[1], FLOAT64_UNIT))
    rows = at_least_float32(rows)
    count, width = rows.shape
    whole = width // NORM_BLOCK * NORM_BLOCK
    blocks = rows[:, :whole].reshape(count, whole // NORM_BLOCK, NORM_BLOCK)
    total = torch.linalg.vector_norm(blocks, dim=-1).double().pow(2).sum(1)
    if whole < width:
        total = total + rows[:, whole:].double().pow(2).sum(1)
    return total * (1 + _gamma(NORM_BLOCK + 2)) + width * SMALLEST_SQUARED ** 2


#: Elements of the float64 copy of one slice of materialised rows (:func:`float64_norm_sq`; the engine's dense sums):
#: 32 MiB.
DENSE_CHUNK = 1 << 22


def float64_norm_sq(grads: Tensor) -> Tensor:
    """An upper bound of ``||G_i||^2`` per example of rows ``[B, ...]``, tight, in float64: the squares of float32,
    bfloat16 and float16 values are exact in float64 (none under- or overflows, where a float32 sum of squares loses
    every value below ``1e-19`` and overflows above ``1e19``), their float64 sum within ``gamma_d`` in any order, then a
    square root and its square (``gamma_{d+4}`` in all), a slice of examples at a time (:data:`DENSE_CHUNK`); float64
    rows take :func:`row_norm_sq` (whose squares underflow below ``1e-154``).
    A float64 ``vector_norm`` of float32 rows: 1.9 ms for ``[64, 16384]`` (1 thread), half of ``double().pow(2)``."""
    flat = grads.flatten(1) if grads.dim() > 1 else grads.reshape(-1, 1)  # (a 0-dim parameter's rows are [B])
    if flat.dtype == torch.float64 or len(flat) == 0:
        return row_norm_sq(flat.double())
    step, width = max(1, DENSE_CHUNK // max(1, flat.shape[1])), flat.shape[1]
    norms = torch.cat([torch.linalg.vector_norm(flat[start:start + step], dim=1, dtype=torch.float64)
                       for start in range(0, len(flat), step)])
    return norms.pow(2) * (1 + _gamma(width + 4, FLOAT64_UNIT))


def summed_norm_sq(g: Tensor) -> Tensor:
    """``||sum_t g_t||^2`` per example of ``g [B, T, d]`` (a bias; a normalisation layer's terms), guarded as
    :func:`outer_norm_sq` with ``a_t = 1``, from float32 sums and :func:`row_norm_sq`'s bounds.

    The float64 copies of :func:`outer_norm_sq` cost 0.54 s of a 7.8 s ViT-tiny step (B = 64, 2 CPU threads; biases
    and LayerNorms). In float32, whatever the order of the additions, ``b_hat = fl(sum_t g_t)`` is within
    ``gamma_{T-1} S_i`` of ``b = sum_t g_t`` (``S_i = sum_t ||g_t||``), so ``||b|| + rounded S_i <= ||b_hat|| +
    (gamma_{T-1} + rounded) S_i``, both norms bounded by :func:`row_norm_sq` and the sum path's own rounding included
    as in :func:`guarded_norm_sq` (and its floor ``S_i / R``). Float64 rows keep :func:`outer_norm_sq`. A float32
    overflow (rows near 1e19) gives an infinite bound: the example's factor is 0."""
    if g.dtype == torch.float64:
        return outer_norm_sq(g.new_ones(g.shape[0], g.shape[1], 1), g)
    g = at_least_float32(g)
    rounding = sum_rounding(g.dtype, g.device.type)
    count, positions, width = g.shape
    norm = row_norm_sq(g.sum(1)).sqrt()
    nonzero = _nonzero_rows(g)
    row_bounds = row_norm_sq(g.reshape(count * positions, width)).view(count, positions)
    scale = torch.where(nonzero, row_bounds, 0.0).sqrt().sum(1)  # (zero rows: no underflow term, review 61)
    active = nonzero.sum(1).to(torch.float64)  # (not the padded length T: :func:`active_positions`)
    scale = scale * (1 + _gamma(active, FLOAT64_UNIT))  # (the float64 square roots and their sum)
    rounded = _gamma((active - 1).clamp_min(0)) + rounding.product + (active + 2) * rounding.accumulation
    return torch.maximum(norm * (1 + _gamma(1, FLOAT64_UNIT)) + rounded * scale, scale / CANCELLATION_LIMIT).pow(2)


def embedding_norm_sq(idx: Tensor, g: Tensor, padding_idx: Optional[int] = None) -> Tensor:
    """Embedding gradients are outer products with one-hot inputs, so ``a_s . a_t = [x_s = x_t]``:
    ``||G_i||^2 = sum_{s,t} [x_{i,s} = x_{i,t}] (g_{i,s} . g_{i,t})`` (the ghost norm with a
    one-hot Gram matrix, as in Opacus' embedding norm sampler), guarded as :func:`guarded_norm_sq`
    (``||a_t|| = 1``). Padding positions get no gradient.

    ``idx [B, T]`` integer indices, ``g [B, T, D]``.
    """
    rounding = sum_rounding(g.dtype, g.device.type)
    return torch.cat([_guarded_embedding(idx[rows], g[rows].double(), padding_idx, rounding)
                      for rows in _example_chunks(g.shape[0], g.shape[1] * g.shape[2])])


def _guarded_embedding(idx: Tensor, g: Tensor, padding_idx: Optional[int], rounding: MatmulRounding) -> Tensor:
    if padding_idx is not None:
        g = g * (idx != padding_idx).unsqueeze(-1).to(g.dtype)
    same = (idx.unsqueeze(2) == idx.unsqueeze(1)).to(g.dtype)
    gram = (same * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
    return guarded_norm_sq(gram, g.norm(dim=-1).sum(1), g.shape[-1], active_positions(None, g), rounding)

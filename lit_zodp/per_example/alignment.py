"""The alignment check: is row ``i`` of a recorded call's output example ``i``'s alone?

The layer rules and the vmap fallback credit row ``i`` of a call to example ``i``. That holds when
only ``loss_i`` reaches row ``i`` of the call's output: then the gradient of ``loss_i`` through the
call is formed from row ``i`` alone, whatever the activations. A call's shape cannot tell: a
time-first layer (``nn.TransformerEncoderLayer(batch_first=False)``, ``[T, B, D]``) with ``T = B``,
or a shared ``[Q, D]`` table with ``Q = B``, has ``B`` leading rows that mix every example, and
crediting them per example gave 1.4-1.6 C in the second audit of this engine.

The check is exact up to rounding and shape-independent. Back-propagate ``sum_i loss_i`` and
``sum_i w_i loss_i`` with random weights ``w_i`` (signs times ``[1, 2)``). If only ``loss_r``
reaches row ``r``, its two gradients satisfy ``G_w[r] = w_r G_1[r]``. Otherwise
``G_w[r] - w_r G_1[r] = sum_{i != r} (w_i - w_r) dloss_i/dout[r]``, which is non-zero for almost
every ``w``. Rows are compared through ``K =`` :data:`PROJECTIONS` random bilinear projections, so
no gradient is kept beyond the call at hand: the root mean square over ``k`` of
``u_k^T (G_w[r] - w_r G_1[r]) v_k`` estimates ``||G_w[r] - w_r G_1[r]||_F`` (``E[(u^T E v)^2] =
||E||_F^2`` for standard Gaussian ``u, v``) and must be at most ``2 sqrt(eps) |w_r| ||G_1[r]||``, the
tolerance of the coverage check (:mod:`.coverage`) with ``||G_w[r]||`` taken as ``|w_r| ||G_1[r]||``,
which it is when the rows agree (so only the first pass takes norms). When they do not, ``G_w[r] -
w_r G_1[r] = E != 0`` passes only if its estimate falls below a bound that does not grow with ``E``:
probability 0 as ``||E||`` grows, and the two bounds differ by at most ``sqrt(eps) ||E||``. Why ``K``
pairs and not one: a single projection is ``||E||`` times a standard normal, whose tail refuses honest
rows. In bfloat16 the rounding of a deep backward leaves honest rows at up to 0.12-0.15 of the
tolerance (ViT-tiny, MiniLM, RoBERTa-base, GPT-2; ``benchmarks/ghost_check_margin.py``); one
projection reached 0.42-0.74 within 60 steps, and extrapolated to 0.2-2.6 refused honest steps per
10,000-step run. The mean of ``K = 8`` squares exceeds the tolerance only if ``chi2_8 > 8 / rho^2``
(``rho = 0.2``: ``chi2_8 > 200``, probability below ``1e-38``); and a mismatch of twice the tolerance
passes one row with probability 0.019 (``chi2_8 < 2``) instead of 0.38 (``|N| < 0.5``).
Cost: two backwards, on a batch whose call structure (with which calls are aligned by shape) is new
to the engine.

Examples whose loss is not finite are left out of both sums (``where``), and their rows are not
compared (their rows may be nan). A non-finite projection, a nan or a mismatch in another row reads as
misaligned, the safe answer: those parameters are recomputed on the whole module.

The weights and projections come from a generator seeded by the OS, so the check neither depends
on nor advances the user's seeded random streams.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch import Tensor

from lit_zodp.per_example.rounding import working_eps
from lit_zodp.per_example.tape import Tape
from lit_zodp.privacy.training_randomness import secret_cpu_generator

#: ``("layer" | "module", position in the tape's calls of that kind)``
CallKey = Tuple[str, int]


def _random_weights(losses: Tensor, generator: torch.Generator) -> Tensor:
    """``w_i = +-(1 + U[0, 1))``: distinct, bounded away from 0 (no division blows up the tolerance)."""
    magnitude = 1.0 + torch.rand(len(losses), generator=generator, dtype=torch.float64)
    sign = torch.randint(0, 2, (len(losses),), generator=generator).to(torch.float64) * 2 - 1
    return (sign * magnitude).to(device=losses.device, dtype=losses.dtype)


#: Projection pairs ``(u_k, v_k)`` per row: the root mean square of ``K`` projections estimates the
#: gap's norm without one Gaussian's tail (module docstring).
PROJECTIONS = 8


def _projection_dtype(dtype: torch.dtype) -> torch.dtype:
    """The gradient's own dtype, so a bfloat16 gradient is not copied to float32: ``G[r] V`` is
    accumulated in float32 and rounded once to bfloat16 (``2^-8`` relative), far inside the tolerance
    ``2 sqrt(eps) = 2^-2.5``. Float16 is widened: the projection can overflow where ``G`` does not."""
    return torch.float32 if dtype == torch.float16 else dtype


class _RowSummaries:
    """Per row of each observed output gradient, ``u_k^T G[r] v_k`` for ``k < K`` (the row as
    positions x features; ``u_k, v_k`` Gaussian: a mean square of ``||G[r]||_F^2``; ``G[r] V`` then a
    weighted sum over positions, reading the gradient once), with ``U, V`` redrawn identically in every
    pass from ``(seed, T, D)``; with ``norms``, ``||G[r]||`` too (the pass compared against:
    :func:`_disagreeing` needs no other norm, which saves a read of every gradient). The hooks run
    between backward kernels: a few operations each, compared after the pass."""

    def __init__(self, keys: Dict[int, CallKey], seed: int, *, norms: bool = True):
        self.keys, self.seed, self.norms = keys, seed, norms
        self.values: Dict[Tuple[CallKey, int], Tuple[Tensor, Optional[Tensor], float]] = {}
        self._drawn: Dict[tuple, Tuple[Tensor, Tensor, float]] = {}

    def __call__(self, call: object, index: int, grad: Tensor) -> None:
        key = self.keys.get(id(call))
        if key is None or grad.dim() == 0:
            return
        u, v, eps = self._pairs(grad)
        rows = (grad if grad.dtype == v.dtype else grad.to(v.dtype)).reshape(grad.shape[0], u.shape[0], v.shape[0])
        norm = torch.linalg.vector_norm(rows.flatten(1), dim=1) if self.norms else None
        projected = (torch.matmul(rows, v).to(u.dtype) * u).sum(1)  # [B, K]
        self.values[(key, index)] = (projected, norm, eps)

    def _pairs(self, grad: Tensor) -> Tuple[Tensor, Tensor, float]:
        """``U [T, K]`` and ``V [D, K]`` for rows ``[T, D]`` of ``grad`` (``D`` its last dimension), drawn
        once per shape and pass (calls of one shape share them: each call's comparison is still against
        secret Gaussian pairs drawn independently of its gradients), and the tolerance's ``sqrt(eps)``
        (the projection is a matmul: TF32 operands)."""
        found = (grad.shape[1:], grad.dtype, grad.device)
        if found not in self._drawn:
            features = grad.shape[-1] if grad.dim() > 1 else 1
            positions = math.prod(grad.shape[1:]) // features
            wide = torch.promote_types(grad.dtype, torch.float32)
            generator = torch.Generator(device=grad.device)
            generator.manual_seed((self.seed + 1_000_003 * positions + 7919 * features) % 2**63)
            u = torch.randn(positions, PROJECTIONS, generator=generator, device=grad.device, dtype=wide)
            v = torch.randn(features, PROJECTIONS, generator=generator, device=grad.device, dtype=wide)
            eps = working_eps(grad.device.type, grad.dtype) ** 0.5
            self._drawn[found] = (u, v.to(_projection_dtype(grad.dtype)), eps)
        return self._drawn[found]


def _backward_observed(total: Tensor, tape: Tape, summaries: _RowSummaries, edges: List) -> None:
    tape.observer = summaries
    try:
        torch.autograd.backward(total, inputs=edges, retain_graph=True)
    finally:
        tape.observer = None


def misaligned_calls(tape: Tape, losses: Tensor, candidates: Iterable[CallKey]) -> Set[CallKey]:
    """The ``candidates`` (calls aligned by shape) whose output rows are reached by other examples' losses.

    Leaves the graph retained and the tape's recordings untouched.
    """
    calls = {"layer": tape.layer_calls, "module": tape.module_calls}
    keys = {id(calls[kind][position]): (kind, position) for kind, position in candidates}
    if not keys or len(losses) < 2:
        return set()  # one example: every row is its own
    edges = [e for kind, position in keys.values() for e in calls[kind][position].output_edges()]
    ok = torch.isfinite(losses.detach())
    zero = torch.zeros((), dtype=losses.dtype, device=losses.device)
    generator = secret_cpu_generator()
    weights = _random_weights(losses, generator)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    unit, weighted = _RowSummaries(keys, seed), _RowSummaries(keys, seed, norms=False)
    _backward_observed(torch.where(ok, losses, zero).sum(), tape, unit, edges)
    _backward_observed(torch.where(ok, weights * losses, zero).sum(), tape, weighted, edges)
    observed = {key for key, _ in unit.values} | {key for key, _ in weighted.values}
    return _disagreeing(unit.values, weighted.values, observed, weights, ok)


def _disagreeing(unit: dict, weighted: dict, calls: Iterable[CallKey], weights: Tensor, ok: Tensor) -> Set[CallKey]:
    """The ``calls`` with ``G_w[r] != w_r G_1[r]`` on some output, rows of non-finite examples aside,
    in one comparison: an output reached in one pass only disagrees; the gap is the root mean square
    over the projections and the tolerance takes the norms of ``unit`` alone (module docstring); a gap
    that is not finite disagrees (``inf <= inf``)."""
    calls = set(calls)
    entries = [entry for entry in set(unit) | set(weighted) if entry[0] in calls]
    whole = [entry for entry in entries if entry in unit and entry in weighted
             and unit[entry][0].shape == weighted[entry][0].shape == (*weights.shape, PROJECTIONS)]
    failed = {entry[0] for entry in set(entries) - set(whole)}
    if not whole:
        return failed
    p1, n1, pw = (torch.stack([values[entry][i].to(weights.device) for entry in whole]).double()
                  for values, i in ((unit, 0), (unit, 1), (weighted, 0)))
    eps = torch.tensor([unit[entry][2] for entry in whole], dtype=torch.float64, device=weights.device)
    w = weights.to(torch.float64)
    gap = (pw - w[:, None] * p1).pow(2).mean(-1).sqrt()
    agree = (gap <= 2 * eps[:, None] * w.abs() * n1) & gap.isfinite() | ~ok
    return failed | {whole[i][0] for i in (~agree.all(1)).nonzero().flatten().tolist()}

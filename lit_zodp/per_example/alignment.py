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
every ``w``. Rows are compared through a random bilinear projection, so no gradient is kept beyond
the call at hand: ``|u^T (G_w[r] - w_r G_1[r]) v| <= sqrt(eps) (||G_w[r]|| + |w_r| ||G_1[r]||)``, the
tolerance of the coverage check (:mod:`.coverage`). Cost: two backwards, on a batch whose call
structure (with which calls are aligned by shape) is new to the engine.

Examples whose loss is not finite are left out of both sums (``where``), and their rows are not
compared (their rows may be nan). A nan or a mismatch in another row reads as misaligned, the safe
answer: those parameters are recomputed on the whole module.

The weights and projections come from a generator seeded by the OS, so the check neither depends
on nor advances the user's seeded random streams.
"""

from __future__ import annotations

import secrets
from typing import Dict, Iterable, List, Set, Tuple

import torch
from torch import Tensor

from lit_zodp.per_example.rounding import working_eps
from lit_zodp.per_example.tape import Tape

#: ``("layer" | "module", position in the tape's calls of that kind)``
CallKey = Tuple[str, int]


def _random_weights(losses: Tensor, generator: torch.Generator) -> Tensor:
    """``w_i = +-(1 + U[0, 1))``: distinct, bounded away from 0 (no division blows up the tolerance)."""
    magnitude = 1.0 + torch.rand(len(losses), generator=generator, dtype=torch.float64)
    sign = torch.randint(0, 2, (len(losses),), generator=generator).to(torch.float64) * 2 - 1
    return (sign * magnitude).to(device=losses.device, dtype=losses.dtype)


class _RowSummaries:
    """Per row of each observed output gradient, ``u^T G[r] v`` (the row as positions x features,
    ``u``, ``v`` Gaussian: non-zero for almost every ``u, v`` when ``G[r] != 0``, and of size
    ``||G[r]||``, without a random tensor of the gradient's size) and ``||G[r]||``, in float64, with
    ``u, v`` redrawn identically in every pass from ``(seed, call, output index)``."""

    def __init__(self, keys: Dict[int, CallKey], seed: int):
        self.keys, self.seed = keys, seed
        self.values: Dict[Tuple[CallKey, int], Tuple[Tensor, Tensor, float]] = {}

    def __call__(self, call: object, index: int, grad: Tensor) -> None:
        key = self.keys.get(id(call))
        if key is None or grad.dim() == 0:
            return
        kind, position = key
        dtype = torch.promote_types(grad.dtype, torch.float32)
        rows = grad.to(dtype).reshape(grad.shape[0], -1, grad.shape[-1] if grad.dim() > 1 else 1)
        generator = torch.Generator(device=grad.device)
        generator.manual_seed((self.seed + 1_000_003 * position + 7919 * index + (kind == "module")) % 2**63)
        u = torch.randn(rows.shape[1], generator=generator, device=grad.device, dtype=dtype)
        v = torch.randn(rows.shape[2], generator=generator, device=grad.device, dtype=dtype)
        projection = ((rows @ v) @ u).double()
        norm = torch.linalg.vector_norm(rows, dim=(1, 2)).double()
        eps = working_eps(grad.device.type, grad.dtype) ** 0.5  # the projection is a matmul (TF32 operands)
        self.values[(key, index)] = (projection, norm, eps)


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
    generator = torch.Generator().manual_seed(secrets.randbits(63))
    weights = _random_weights(losses, generator)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    unit, weighted = _RowSummaries(keys, seed), _RowSummaries(keys, seed)
    _backward_observed(torch.where(ok, losses, zero).sum(), tape, unit, edges)
    _backward_observed(torch.where(ok, weights * losses, zero).sum(), tape, weighted, edges)
    observed = {key for key, _ in unit.values} | {key for key, _ in weighted.values}
    return {key for key in observed if not _rows_agree(unit.values, weighted.values, key, weights, ok)}


def _rows_agree(unit: dict, weighted: dict, call: CallKey, weights: Tensor, ok: Tensor) -> bool:
    """``G_w[r] = w_r G_1[r]`` on every output of the call, rows of non-finite examples aside; an
    output reached in one pass only disagrees."""
    outputs = {entry for entry in set(unit) | set(weighted) if entry[0] == call}
    for entry in outputs:
        if entry not in unit or entry not in weighted or len(unit[entry][0]) != len(weights):
            return False
        (p1, n1, eps), (pw, nw, _) = unit[entry], weighted[entry]
        w = weights.to(torch.float64).to(p1.device)
        gap = (pw - w * p1).abs()
        tolerance = eps * (nw + w.abs() * n1)
        agree = (gap <= tolerance) | ~ok.to(p1.device)
        if not bool(agree.all()):
            return False
    return True

"""The coverage check: do the per-example gradients add up to the batch gradient?

A layer rule sees only the calls of its layer. A parameter also used elsewhere (a weight reused
through ``F.linear``, ``nn.MultiheadAttention``'s ``out_proj`` that is never called) would get
per-example gradients missing those uses. Since ``sum_i g_{i,p}`` must equal the gradient of
``sum_i loss_i``, which the engine's backward computes anyway, comparing the two finds them.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from lit_zodp.per_example.rounding import working_eps

#: Elements per slice of :func:`difference_norm` (4 MiB in float32): the largest temporary it forms.
DIFFERENCE_CHUNK = 1 << 20


def wide_norm(x: Tensor, chunk: int = DIFFERENCE_CHUNK) -> Tensor:
    """``||x||`` in float64, ``chunk`` elements at a time (no float64 copy of a whole parameter): a float32 sum of
    squares is 0 below about ``1e-22`` and ``inf`` above ``1e19``, where the check read a gap of 0 or skipped the
    parameter as not finite (red-team review 78, finding 3). A float64 ``x``: its own norm."""
    flat = x.reshape(-1)
    if flat.dtype == torch.float64 or flat.numel() == 0:
        return flat.norm().double()
    return torch.stack([torch.linalg.vector_norm(piece, dtype=torch.float64) for piece in flat.split(chunk)]).norm()


def difference_norm(total: Tensor, full: Tensor, chunk: int = DIFFERENCE_CHUNK) -> Tensor:
    """``||total - full||`` in float64 (:func:`wide_norm`), the difference in ``full``'s dtype, slice by slice. The
    check runs while the graph is retained and both operands are alive; a whole difference would be a third copy of
    the largest parameter (MiniLM's 30522 x 384 word embedding: 45 MiB, enough to put a checked step's peak above
    Opacus' ghost clipping), a slice costs at most ``chunk`` elements."""
    if total.shape != full.shape or total.numel() <= chunk:
        return wide_norm(total.to(full.dtype) - full, chunk)
    pieces = zip(total.reshape(-1).split(chunk), full.reshape(-1).split(chunk))
    return torch.stack([wide_norm(mine.to(full.dtype) - theirs, chunk) for mine, theirs in pieces]).norm()


def uncovered(sums: Sequence[Optional[Tensor]], norms: Sequence[Optional[Tensor]],
              batch_grads: Sequence[Optional[Tensor]], device: torch.device,
              diffs: Optional[Dict[int, Tensor]] = None, others_norm_sq: float | Tensor = 0.0) -> List[int]:
    """Indices ``p`` with ``||sum_i g_{i,p} - g_p|| > sqrt(eps) (sum_i ||g_{i,p}|| + ||g||)``.

    Args:
        sums: ``sum_i g_{i,p}`` per parameter (``None``: not checked).
        norms: Per-example norms ``||g_{i,p}||`` ``[B]`` per parameter.
        batch_grads: The batch gradient ``g_p`` (``None``: unused parameter, not checked).
        diffs: ``||sum_i g_{i,p} - g_p||`` already taken (as the gradient arrived), in place of ``sums[p]``.
        others_norm_sq: ``||g_q||^2`` summed over the parameters not passed here (ghost mode drops those
            found covered as their gradients arrive): part of ``||g||``.

    ``g`` is the whole batch gradient: the tolerance covers rounding of a sum of ``B`` terms with
    cancellation, and parameters whose exact gradient is 0 (an attention key bias) but whose
    computed one is rounding noise at the scale of the others. Parameters with a non-finite batch
    gradient are skipped. One host synchronisation for all parameters.
    """
    taken = diffs or {}
    checked = [i for i, (s, g) in enumerate(zip(sums, batch_grads))
               if (s is not None or i in taken) and g is not None]
    if not checked:
        return []
    gaps, scales, fulls, eps = [], [], [], []
    for i in checked:
        total, full = sums[i], batch_grads[i]
        gap = taken[i] if i in taken else difference_norm(total, full)
        gaps.append(gap.double().to(device))
        scales.append(norms[i].double().sum().to(device))
        fulls.append(wide_norm(full).to(device))
        eps.append(working_eps(device.type, full.dtype if total is None else total.dtype, full.dtype) ** 0.5)
    diffs, scales, fulls = torch.stack(gaps), torch.stack(scales), torch.stack(fulls)
    finite = torch.isfinite(fulls)
    others = torch.as_tensor(others_norm_sq, dtype=torch.float64).to(device)
    whole = (torch.where(finite, fulls, 0).pow(2).sum() + others).sqrt()
    tolerance = torch.tensor(eps, dtype=torch.float64, device=device) * (scales + whole)
    failed = finite & ~(diffs <= tolerance)
    return [checked[k] for k in failed.nonzero().flatten().tolist()]

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

from typing import Optional

import torch
from torch import Tensor


def prefer_ghost(positions: int, weight_numel: int) -> bool:
    """Bu et al. 2022's layerwise rule: the ghost norm if ``2 T^2 < d_in d_out``."""
    return 2 * positions * positions < weight_numel


def _at_least_float32(x: Tensor) -> Tensor:
    """Half-precision Gram matrices overflow (float16) or lose the norm (bfloat16)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def gram_norm_sq(a: Tensor, g: Tensor) -> Tensor:
    """``||sum_t g_t a_t^T||_F^2`` per example from ``a [B, T, d_in]`` and ``g [B, T, d_out]``."""
    a, g = _at_least_float32(a), _at_least_float32(g)
    if a.shape[1] == 1:  # one position: ||g a^T||^2 = ||a||^2 ||g||^2 (Goodfellow 2015)
        return a.squeeze(1).pow(2).sum(-1) * g.squeeze(1).pow(2).sum(-1)
    gram_a = torch.bmm(a, a.transpose(1, 2))
    gram_g = torch.bmm(g, g.transpose(1, 2))
    return (gram_a * gram_g).sum((1, 2))


def embedding_norm_sq(idx: Tensor, g: Tensor, padding_idx: Optional[int] = None) -> Tensor:
    """Embedding gradients are outer products with one-hot inputs, so ``a_s . a_t = [x_s = x_t]``:
    ``||G_i||^2 = sum_{s,t} [x_{i,s} = x_{i,t}] (g_{i,s} . g_{i,t})`` (the ghost norm with a
    one-hot Gram matrix, as in Opacus' embedding norm sampler). Padding positions get no gradient.

    ``idx [B, T]`` integer indices, ``g [B, T, D]``.
    """
    g = _at_least_float32(g)
    if padding_idx is not None:
        g = g * (idx != padding_idx).unsqueeze(-1).to(g.dtype)
    same = (idx.unsqueeze(2) == idx.unsqueeze(1)).to(g.dtype)
    return (same * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))

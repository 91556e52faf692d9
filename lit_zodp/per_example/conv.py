"""Per-example gradients of ``nn.Conv1d`` and ``nn.Conv2d`` by unfolding (im2col).

A convolution is a linear layer applied at each output position ``l`` to the unfolded input patch
``u_{i,l}`` (``C_in / groups * prod(kernel)`` values), so ``G_i = sum_l g_{i,l} u_{i,l}^T`` per group:
the Linear rule with the output positions as the sequence (Goodfellow 2015; Opacus ``conv.py``;
the ghost norm of Bu et al. 2022 with ``T = L`` for ``groups = 1``).
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_zodp.per_example.ghost import gram_norm_sq, outer_norm_sq, prefer_ghost, summed_norm_sq
from lit_zodp.per_example.samplers import WEIGHT_AND_BIAS, _common_dtype, _trainable, register_sampler


def _pad_amounts(layer: nn.Module) -> list[int]:
    """Left/right padding per spatial dim in ``F.pad`` order (last dim first), including the
    asymmetric split that ``padding="same"`` uses for even effective kernels."""
    pairs = []
    for i, (k, d) in enumerate(zip(layer.kernel_size, layer.dilation)):
        if layer.padding == "valid":
            left = right = 0
        elif layer.padding == "same":
            left, right = d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2
        else:
            left = right = layer.padding[i]
        pairs.append((left, right))
    return [amount for pair in reversed(pairs) for amount in pair]


def _unfold(layer: nn.Module, a: Tensor) -> Tensor:
    """Input patches ``[B, C_in * prod(kernel), L]``, padded exactly as the layer's forward."""
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    a = F.pad(a, _pad_amounts(layer), mode=mode)
    kernel, stride, dilation = layer.kernel_size, layer.stride, layer.dilation
    if a.dim() == 3:  # Conv1d as a 1 x k Conv2d
        a, kernel, stride, dilation = a.unsqueeze(2), (1, *kernel), (1, *stride), (1, *dilation)
    return F.unfold(a, kernel, dilation=dilation, stride=stride)


def _grouped(layer: nn.Module, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Patches ``[B, groups, C_in/groups * K, L]`` and output gradients ``[B, groups, C_out/groups, L]``."""
    patches, g = _common_dtype(_unfold(layer, a), g)
    batch, groups = a.shape[0], layer.groups
    return patches.reshape(batch, groups, -1, patches.shape[-1]), g.reshape(batch, groups, -1, patches.shape[-1])


def _conv_grads(layer: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    """``G_i[group] = sum_l g_{i,l} u_{i,l}^T``, reshaped to the weight's ``[C_out, C_in/groups, *kernel]``."""
    out = {}
    if _trainable(layer, "weight"):
        patches, grads = _grouped(layer, a, g)
        per_group = torch.einsum("bgol,bgkl->bgok", grads, patches)
        out["weight"] = per_group.reshape(a.shape[0], *layer.weight.shape)
    if _trainable(layer, "bias"):
        out["bias"] = g.flatten(2).sum(2)
    return out


def _conv_norms(layer: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    """Ghost norm over the ``L`` output positions when ``groups = 1`` and cheaper (Bu et al. 2022)."""
    patches_len = g.flatten(2).shape[-1]
    ghost = layer.groups == 1 and prefer_ghost(patches_len, layer.weight.numel())
    out = {}
    if _trainable(layer, "weight"):  # each group's outer products, guarded (audit 13: 3.85 C released unguarded)
        patches, grads = _grouped(layer, a, g)
        rule = gram_norm_sq if ghost else outer_norm_sq
        out["weight"] = sum(rule(patches[:, k].transpose(1, 2), grads[:, k].transpose(1, 2))
                            for k in range(layer.groups))
    if _trainable(layer, "bias"):
        out["bias"] = summed_norm_sq(g.flatten(2).transpose(1, 2))
    return out


def _conv_summed(layer: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    """``sum_i G_i``: one contraction over examples and positions."""
    out = {}
    if _trainable(layer, "weight"):
        patches, grads = _grouped(layer, a, g)
        out["weight"] = torch.einsum("bgol,bgkl->gok", grads, patches).reshape(layer.weight.shape)
    if _trainable(layer, "bias"):
        out["bias"] = g.flatten(2).sum((0, 2))
    return out


register_sampler(nn.Conv1d, nn.Conv2d, parameters=WEIGHT_AND_BIAS, norms=_conv_norms,
                 summed=_conv_summed)(_conv_grads)

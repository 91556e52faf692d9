"""Per-example gradients of a convolution with Scaled Weight Standardization (Brock et al. 2021, NF-ResNets).

The layer convolves with ``W_hat_o = c_o x_hat_o``, ``x_hat_o = (W_o - mean(W_o)) / s_o``, ``s_o = sqrt(var(W_o) +
eps)``, ``c_o = gain_o gamma / sqrt(N)`` (row ``o`` of the weight flattened to ``[out, N]``). The conv rule
(:mod:`.conv`) gives each example's gradient of ``W_hat``, ``H_i = sum_l g_{i,l} u_{i,l}^T`` (unfolded patches
``u``); the raw parameters' gradients are that pulled back through the standardisation's Jacobian, per output
channel (the backward of a normalisation over ``N`` values):

    ``dW_{i,o} = (c_o / s_o) (H_{i,o} - mean(H_{i,o}) - x_hat_o mean(H_{i,o} * x_hat_o))``,
    ``dgain_{i,o} = gamma / sqrt(N) <H_{i,o}, x_hat_o>``,

linear in ``H_i``, so the sum over examples is the pull-back of the conv rule's sum. A rule on the conv's input
weight alone would be wrong here (the weight the conv reads is ``W_hat``, not ``W``); this one is exact, costs the
conv rule plus ``O(B out N)``, and never vmaps.

Norms ("ghost"/"bookkeeping"): each chunk of examples' ``H_i`` is formed in float64, its pulled-back norms taken in
closed form (:func:`_pulled_back_norms_sq`), then guarded as
:func:`~.ghost.outer_norm_sq` against the rounding of the float32 sum the book-keeping path forms: the pull-back of
channel ``o`` has operator norm at most ``c_o / s_o`` (the map ``I - 11^T/N - x_hat x_hat^T/N`` has eigenvalues in
``[0, 1]``) and the gain's at most ``gamma`` (``||x_hat_o|| <= sqrt(N)``), so the rows ``g_{i,l}`` are scaled by
those factors in the scale ``S_i`` of the guard. Memory: one chunk (:data:`~.ghost.GHOST_CHUNK`), not ``B x`` the
weight. Layers with ``groups > 1`` get no rule (the engine's vmap fallback).
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor, nn

from lit_zodp.per_example.conv import _unfold
from lit_zodp.per_example.ghost import _example_chunks, guarded_norm_sq, summed_norm_sq
from lit_zodp.per_example.rounding import sum_rounding
from lit_zodp.per_example.samplers import _common_dtype, _trainable, register_sampler

#: The direct parameters of a standardised convolution.
STANDARDIZED_CONV_PARAMETERS = ("weight", "bias", "gain")


def _rows(layer: nn.Module, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Patches ``[B, N, L]`` and output gradients ``[B, out, L]`` in one dtype."""
    patches, g = _common_dtype(_unfold(layer, a), g)
    return patches, g.reshape(g.shape[0], g.shape[1], -1)


def _standardization(layer: nn.Module, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``x_hat [out, N]``, ``c / s [out, 1]`` and ``gamma / sqrt(N)`` (a float) in ``dtype``, from the layer."""
    weight, gain = layer.weight.detach().to(dtype), layer.gain.detach().to(dtype)
    x_hat, std = layer.standardized(weight)
    return x_hat, layer.channel_scale(gain) / std, layer.gamma / layer.fan_in ** 0.5


def pull_back(layer: nn.Module, hat: Tensor, x_hat: Tensor, ratio: Tensor, gain_scale: float, *,
              in_place: bool = False) -> Dict[str, Tensor]:
    """The raw parameters' gradients from gradients ``hat [..., out, N]`` of ``W_hat`` (module doc). ``in_place``:
    the weight's is formed in ``hat``'s memory (three passes over ``B x`` the weight instead of seven: the
    per-example rows are memory-bound on CPU)."""
    out = {}
    projected = torch.einsum("...on,on->...o", hat, x_hat)  # <H_o, x_hat_o>
    if _trainable(layer, "gain"):
        out["gain"] = projected * gain_scale
    if _trainable(layer, "weight"):
        mean = hat.mean(-1, keepdim=True)
        weight = hat.mul_(ratio) if in_place else hat * ratio
        weight.sub_(mean * ratio).addcmul_(x_hat, projected.unsqueeze(-1) * ratio, value=-1.0 / x_hat.shape[-1])
        out["weight"] = weight.reshape(*hat.shape[:-2], *layer.weight.shape)
    return out


def _needs_weight_gradient(layer: nn.Module) -> bool:
    return _trainable(layer, "weight") or _trainable(layer, "gain")


def standardized_conv_grads(layer: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    """``[B, *shape]`` per trainable parameter."""
    out = {}
    if _needs_weight_gradient(layer):
        patches, grads = _rows(layer, a, g)
        # (under autocast the rows are in half precision; the forward standardises in the weight's dtype)
        hat = torch.bmm(grads, patches.transpose(1, 2)).to(torch.promote_types(grads.dtype, layer.weight.dtype))
        out.update(pull_back(layer, hat, *_standardization(layer, hat.dtype), in_place=True))
    if _trainable(layer, "bias"):
        out["bias"] = g.flatten(2).sum(2)
    return out


def standardized_conv_summed(layer: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    """``sum_i`` of the rows given (already scaled by the clip factors): the conv rule's sum, pulled back in float64
    (a rounding of the whole sum would move with each record, as :func:`~.engine._dense_sum` explains)."""
    out = {}
    if _needs_weight_gradient(layer):
        patches, grads = _rows(layer, a, g)
        hat = torch.einsum("bol,bkl->ok", grads, patches)
        pulled = pull_back(layer, hat.double(), *_standardization(layer, torch.float64), in_place=True)
        out.update({name: value.to(hat.dtype) for name, value in pulled.items()})
    if _trainable(layer, "bias"):
        out["bias"] = g.flatten(2).sum((0, 2))
    return out


def standardized_conv_norms(layer: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    """Upper bounds of the squared per-example norms ``[B]`` (float64), guarded (module doc)."""
    out: Dict[str, Tensor] = {}
    if _needs_weight_gradient(layer):
        patches, grads = _rows(layer, a, g)
        rounding = sum_rounding(grads.dtype, grads.device.type)
        x_hat, ratio, gain_scale = _standardization(layer, torch.float64)
        # float64 terms: the L products of each H entry, then sums of N (squares, sums, projections) and the difference
        positions, length = patches.shape[-1], 3 * patches.shape[1] + patches.shape[-1]
        factors = {"weight": ratio, "gain": torch.full_like(ratio, layer.gamma)}
        parts: Dict[str, list] = {}
        per_example = grads.shape[1] * (patches.shape[1] + positions) + patches.shape[1] * positions
        for rows in _example_chunks(grads.shape[0], per_example):
            u64, g64 = patches[rows].double(), grads[rows].double()
            patch_norms = u64.norm(dim=1)
            for name, norm_sq in _pulled_back_norms_sq(layer, torch.bmm(g64, u64.transpose(1, 2)), x_hat, ratio,
                                                       gain_scale).items():
                scale = ((g64 * factors[name].unsqueeze(0)).norm(dim=1) * patch_norms).sum(1)
                parts.setdefault(name, []).append(guarded_norm_sq(norm_sq, scale, length, positions, rounding))
        out.update({name: torch.cat(chunks) for name, chunks in parts.items()})
    if _trainable(layer, "bias"):
        out["bias"] = summed_norm_sq(g.flatten(2).transpose(1, 2))
    return out


def _pulled_back_norms_sq(layer: nn.Module, hat: Tensor, x_hat: Tensor, ratio: Tensor,
                          gain_scale: float) -> Dict[str, Tensor]:
    """``||dW_i||^2`` and ``||dgain_i||^2`` from float64 ``hat [c, out, N]`` (overwritten) without forming ``dW``:
    ``sum_o (c_o / s_o)^2 (||H_o||^2 - (1^T H_o)^2 / N - <H_o, x_hat_o>^2 (2 - rho_o) / N)``, ``rho_o =
    mean(x_hat_o^2)`` (``x_hat_o`` is orthogonal to 1 and ``||x_hat_o||^2 = N rho_o``). Its float64 rounding, at most
    about ``3 N 2^-53 sum_o (c_o / s_o)^2 ||H_o||^2 <= 3 N 2^-53 S^2``, is within the guard's ``gamma S^2`` term
    (``length = 3 N + L``)."""
    count = x_hat.shape[-1]
    squares = torch.linalg.vector_norm(hat, dim=-1).pow(2)
    sums = hat.sum(-1)
    projected = hat.mul_(x_hat).sum(-1)
    out = {}
    if _trainable(layer, "weight"):
        rho = x_hat.pow(2).mean(-1)
        per_channel = squares - sums.pow(2) / count - projected.pow(2) * (2 - rho) / count
        out["weight"] = (per_channel.clamp_min(0) * ratio.squeeze(-1).pow(2)).sum(-1)
    if _trainable(layer, "gain"):
        out["gain"] = (projected * gain_scale).pow(2).sum(-1)
    return out


def register_standardized_conv(*layer_types: type) -> None:
    """Register the rules for layers with ``weight``, ``gain``, ``bias`` and the methods ``standardized(weight)``,
    ``channel_scale(gain)``, the attributes ``gamma``, ``fan_in``
    (:class:`~lit_zodp.backbones.nfresnet.ScaledStdConv2d`); grouped convolutions get none."""
    register_sampler(*layer_types, parameters=STANDARDIZED_CONV_PARAMETERS, norms=standardized_conv_norms,
                     summed=standardized_conv_summed, supports=lambda layer: layer.groups == 1)(standardized_conv_grads)

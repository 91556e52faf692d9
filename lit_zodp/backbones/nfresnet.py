"""NF-ResNet-18: a ResNet-18 without any normalisation layer (Brock, De & Smith 2021, "Characterizing signal
propagation to close the performance gap in unnormalized ResNets", ICLR 2021; "Brock et al." below).

PAZO (Gong & Li, App. C.1) trains "a randomly initialized NFResNet18" on CIFAR-10 "to avoid information leakage from
the batchnorm layer"; its authors' code ("a custom NFResNet18") is not public, so this module follows Brock et al.'s
recipe on ResNet-18's layout and writes each choice where the paper or PAZO is silent:

* residual blocks ``h_{l+1} = h_l + alpha f_l(h_l / beta_l)`` (Brock et al., Sec. "Normalizer-free ResNets"),
  ``beta_l = sqrt(Var(h_l))`` predicted analytically: ``Var(h_{l+1}) = Var(h_l) + alpha^2``, reset to
  ``1 + alpha^2`` after each transition block, whose shortcut reads the downscaled ``relu(h / beta)`` (same
  section); ``alpha = 0.2`` (their choice);
* Scaled Weight Standardization (Sec. "Scaled Weight Standardization") on every convolution,
  ``W_hat = g gamma (W - mu) / (sigma sqrt(N))``, ``gamma = sqrt(2 / (1 - 1/pi))`` for convolutions reading a ReLU
  (the nonlinearity-specific gain that keeps ``Var(W_hat relu(z)) = 1``), a learnable per-channel gain ``g`` (as
  timm's ``ScaledStdConv2d``); conv biases are kept (no BatchNorm shift replaces them);
* pre-activation basic blocks (ResNet-18: two 3x3 convolutions, stages ``(2, 2, 2, 2)``, widths 64-128-256-512):
  branch ``relu(h / beta) -> conv3x3(stride) -> relu -> conv3x3``; the transition shortcut is ResNet-18's strided
  1x1 convolution (choice: timm's NF-ResNets average-pool first, ResNet-18 does not);
* the stem (choice): ``"imagenet"``, ResNet-18's 7x7/2 convolution and 3x3/2 max-pool (the default: PAZO's code
  resizes CIFAR to 224x224; the paper's App. C.1 does not say), or ``"cifar"``, a 3x3/1 convolution without pool
  for 32x32 inputs. The stem reads pixels, not a ReLU, so its gain ``gamma`` is 1 (choice; timm puts the ReLU gain
  on the stem too);
* the last convolution of each branch starts with gain 0 (``zero_init_last``, default True: SkipInit, De & Smith
  2020, as timm's NF-ResNets do with ``gain_init=0`` on the last conv), so each block starts as the identity (the
  variance prediction above then describes the net once the gains have grown, or with ``zero_init_last: false``);
* head: ReLU, global average pool, a Linear layer (weights ``N(0, 0.01^2)``, bias 0, as timm).

The standardised convolution :class:`ScaledStdConv2d` has an exact per-example gradient rule for the per-example
gradient engine (:mod:`lit_zodp.per_example.std_conv`), so DP-SGD does not fall back to vmap. No layer mixes the
examples of a batch.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_zodp.backbones._utils import as_float_input
from lit_zodp.backbones.base import Backbone, tensor_data_mismatch
from lit_zodp.errors import check_choice, check_positive, check_positive_int, raise_if_any
from lit_zodp.per_example.std_conv import register_standardized_conv

#: ``gamma`` of a ReLU (Brock et al.'s nonlinearity-specific gain): ``Var(relu(z)) = (1 - 1/pi) / 2``, ``z ~ N(0, 1)``.
RELU_GAIN = math.sqrt(2.0 / (1.0 - 1.0 / math.pi))
#: Added to each output channel's variance before the square root (timm's ``ScaledStdConv2d`` default).
WS_EPS = 1e-6
STEMS = ("imagenet", "cifar")
STAGE_WIDTHS = (64, 128, 256, 512)
STAGE_DEPTHS = (2, 2, 2, 2)


class ScaledStdConv2d(nn.Conv2d):
    """``nn.Conv2d`` with Scaled Weight Standardization (Brock et al.) and a per-channel gain:

        ``W_hat_o = gain_o * gamma / sqrt(N) * (W_o - mean(W_o)) / sqrt(var(W_o) + eps)``

    over each output channel's ``N = C_in / groups * prod(kernel)`` weights (``var`` biased). The forward convolves
    with ``W_hat``; the weight is drawn ``N(0, 1/N)`` (timm's init; only its scale relative to ``eps`` matters).

    Args:
        gamma: The nonlinearity's gain (``RELU_GAIN`` after a ReLU, 1 on pixels).
        gain_init: Initial value of every channel's ``gain`` (0: the branch's output starts at 0).
        eps: Added to the variance.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0,
                 bias: bool = True, *, gamma: float = RELU_GAIN, gain_init: float = 1.0, eps: float = WS_EPS) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=bias)
        self.gamma, self.eps = float(gamma), float(eps)
        self.gain = nn.Parameter(torch.full((out_channels,), float(gain_init)))
        nn.init.normal_(self.weight, 0.0, self.fan_in ** -0.5)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @property
    def fan_in(self) -> int:
        return self.weight[0].numel()

    def standardized(self, weight: Tensor) -> tuple[Tensor, Tensor]:
        """``(x_hat [out, N], s [out, 1])``: ``(W_o - mean) / s_o``, ``s_o = sqrt(var(W_o) + eps)``."""
        flat = weight.flatten(1)
        centred = flat - flat.mean(1, keepdim=True)
        std = (centred.pow(2).mean(1, keepdim=True) + self.eps).sqrt()
        return centred / std, std

    def channel_scale(self, gain: Tensor) -> Tensor:
        """``c_o = gain_o gamma / sqrt(N)`` ``[out, 1]``."""
        return (gain * (self.gamma / math.sqrt(self.fan_in))).unsqueeze(1)

    def standardized_weight(self) -> Tensor:
        """``W_hat`` in the weight's shape."""
        x_hat, _ = self.standardized(self.weight)
        return (x_hat * self.channel_scale(self.gain)).view_as(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(x, self.standardized_weight(), self.bias, self.stride, self.padding, self.dilation,
                        self.groups)


register_standardized_conv(ScaledStdConv2d)


class NFBasicBlock(nn.Module):
    """``h + alpha * f(h / beta)`` with ``f = conv3x3 o relu o conv3x3 o relu`` (pre-activation; Brock et al.'s
    NF-ResNet block); a transition block's shortcut is a strided 1x1 convolution of ``relu(h / beta)``."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, *, alpha: float, beta: float,
                 zero_init_last: bool) -> None:
        super().__init__()
        self.alpha, self.beta = alpha, beta
        self.conv1 = ScaledStdConv2d(in_channels, out_channels, 3, stride, 1)
        self.conv2 = ScaledStdConv2d(out_channels, out_channels, 3, 1, 1, gain_init=0.0 if zero_init_last else 1.0)
        self.transition = stride != 1 or in_channels != out_channels
        self.shortcut = ScaledStdConv2d(in_channels, out_channels, 1, stride) if self.transition else None

    def forward(self, h: Tensor) -> Tensor:
        pre = F.relu(h) / self.beta
        shortcut = self.shortcut(pre) if self.shortcut is not None else h
        return shortcut + self.alpha * self.conv2(F.relu(self.conv1(pre)))


def expected_variances(depths: tuple[int, ...], alpha: float) -> list[float]:
    """``beta_l^2`` of every block's input, in order (Brock et al.'s analytic prediction): 1 after the stem,
    ``+ alpha^2`` per block, reset to ``1 + alpha^2`` after each stage's first (transition) block; then the variance
    of the last block's output."""
    variances, variance = [], 1.0
    for depth in depths:
        for index in range(depth):
            variances.append(variance)
            variance = (1.0 if index == 0 else variance) + alpha ** 2
    return variances + [variance]


class NFResNet18(Backbone):
    """ResNet-18 without normalisation (Brock et al. 2021's NF-ResNet recipe; see the module docstring).

    Args:
        num_classes: Output classes.
        in_chans: Image channels.
        width: Multiplier of the stage widths 64-128-256-512 (each rounded, at least 1).
        stem: ``"imagenet"`` (7x7/2 conv + 3x3/2 max-pool, for 224x224 inputs as PAZO's code) or ``"cifar"``
            (3x3/1 conv, no pool, for 32x32 inputs).
        alpha: The residual branches' scale (Brock et al. use 0.2).
        zero_init_last: Start each branch's last convolution with gain 0 (SkipInit; default as timm's NF-ResNets).
    """

    def __init__(self, num_classes: int = 10, in_chans: int = 3, width: float = 1.0, stem: str = "imagenet",
                 alpha: float = 0.2, zero_init_last: bool = True) -> None:
        super().__init__()
        raise_if_any([check_positive_int("num_classes", num_classes), check_positive_int("in_chans", in_chans),
                      check_positive("width", width), check_choice("stem", stem, STEMS),
                      check_positive("alpha", alpha)])
        self.num_classes, self.in_chans = num_classes, in_chans
        self.stem_type, self.alpha, self.width = stem, float(alpha), float(width)
        widths = [max(1, round(channels * width)) for channels in STAGE_WIDTHS]
        self.stem = _make_stem(stem, in_chans, widths[0])
        betas = [math.sqrt(v) for v in expected_variances(STAGE_DEPTHS, self.alpha)]
        blocks, channels = [], widths[0]
        for stage, (depth, out_channels) in enumerate(zip(STAGE_DEPTHS, widths)):
            for index in range(depth):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(NFBasicBlock(channels, out_channels, stride, alpha=self.alpha, beta=betas[len(blocks)],
                                           zero_init_last=zero_init_last))
                channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)
        nn.init.normal_(self.head.weight, 0.0, 0.01)
        nn.init.zeros_(self.head.bias)

    def data_mismatch(self, *, text: bool, example_shape: Optional[tuple[int, ...]]) -> Optional[str]:
        return tensor_data_mismatch(self, text, ("in_chans", self.in_chans), example_shape)

    def features(self, inputs: Tensor) -> Tensor:
        """The residual stream after the last block ``[B, C, H, W]``."""
        return self.blocks(self.stem(as_float_input(inputs, self.head.weight)))

    def forward(self, inputs: Tensor) -> Tensor:
        """Logits ``[B, num_classes]`` of images ``[B, in_chans, H, W]``."""
        return self.head(F.relu(self.features(inputs)).mean((2, 3)))


def _make_stem(stem: str, in_chans: int, channels: int) -> nn.Sequential:
    if stem == "imagenet":
        return nn.Sequential(ScaledStdConv2d(in_chans, channels, 7, 2, 3, gamma=1.0), nn.MaxPool2d(3, 2, 1))
    return nn.Sequential(ScaledStdConv2d(in_chans, channels, 3, 1, 1, gamma=1.0))


__all__ = ["NFBasicBlock", "NFResNet18", "RELU_GAIN", "ScaledStdConv2d", "expected_variances"]

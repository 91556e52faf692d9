"""Tiny from-scratch backbones for quick runs and tests: an MLP and a small CNN.

Neither uses batch normalisation, so every example's loss depends on that example alone in train
mode as well as in eval mode (what per-example clipping assumes).
"""

from __future__ import annotations

import math

from typing import Optional

from torch import Tensor, nn

from lit_zodp.backbones._utils import as_float_input, check_non_negative_int, check_positive_int
from lit_zodp.backbones.base import Backbone, tensor_data_mismatch
from lit_zodp.errors import ConfigError

_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}


def make_activation(name: str) -> nn.Module:
    """Activation module by name (``relu``, ``gelu``, ``tanh``, ``silu``)."""
    try:
        return _ACTIVATIONS[name.lower()]()
    except (KeyError, AttributeError):
        raise ConfigError(f"Expected the backbone's `activation` in {sorted(_ACTIVATIONS)}, but got {name!r}") from None


class TinyMLP(Backbone):
    """Multi-layer perceptron on flattened inputs.

    Args:
        in_features: Number of input features after flattening (64 for 8x8 digits).
        num_classes: Number of output classes.
        hidden: Width of each hidden layer.
        depth: Number of hidden layers; 0 gives multinomial logistic regression.
        activation: ``relu``, ``gelu``, ``tanh`` or ``silu``.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        hidden: int = 64,
        depth: int = 2,
        activation: str = "relu",
    ) -> None:
        super().__init__()
        self.in_features = check_positive_int("in_features", in_features)
        self.num_classes = check_positive_int("num_classes", num_classes)
        check_positive_int("hidden", hidden)
        check_non_negative_int("depth", depth)
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), make_activation(activation)]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def data_mismatch(self, *, text: bool, example_shape: Optional[tuple[int, ...]]) -> Optional[str]:
        features = math.prod(example_shape) if example_shape is not None else self.in_features
        if text or features == self.in_features:
            return tensor_data_mismatch(self, text)
        return (f"the backbone TinyMLP has `in_features` {self.in_features}, but the data's examples have shape "
                f"{tuple(example_shape)}: {features} features; set `in_features: {features}`")

    def forward(self, inputs: Tensor) -> Tensor:
        """Logits ``[B, num_classes]`` of inputs of any shape ``[B, ...]``."""
        x = as_float_input(inputs, self.net[0].weight).flatten(1)
        if x.shape[1] != self.in_features:
            raise ValueError(
                f"TinyMLP expects {self.in_features} features per example, got {x.shape[1]} "
                f"(examples of shape {tuple(inputs.shape[1:])}; no batch size: a Poisson batch's is private)"
            )
        return self.net(x)


class TinyCNN(Backbone):
    """Three 3x3 convolutions (two with stride 2), adaptive 2x2 average pooling, a linear head.

    Works for any image of side >= 2 (8x8 digits, 28x28 MNIST, 32x32 CIFAR). Accepts ``[B, C, H, W]``,
    ``[B, H, W]`` when ``in_channels == 1``, or flat square images ``[B, C*S*S]``.

    Args:
        in_channels: Image channels (1 for grey scale, 3 for RGB).
        num_classes: Number of output classes.
        width: Channels of the first convolution (the next two have ``2 * width``).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.in_channels = check_positive_int("in_channels", in_channels)
        self.num_classes = check_positive_int("num_classes", num_classes)
        check_positive_int("width", width)
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
        )
        self.head = nn.Linear(8 * width, num_classes)

    def data_mismatch(self, *, text: bool, example_shape: Optional[tuple[int, ...]]) -> Optional[str]:
        error = tensor_data_mismatch(self, text, ("in_channels", self.in_channels), example_shape)
        if error is not None or example_shape is None:
            return error
        # Flat examples are read as square images (review 29: other sizes failed at the first forward).
        if len(example_shape) == 1:
            if self._square_side(example_shape[0]) is None:
                return (f"the backbone TinyCNN reads flat examples as square images of `in_channels` "
                        f"{self.in_channels}, but the data's examples have {example_shape[0]} features: use TinyMLP "
                        f"(`in_features: {example_shape[0]}`)")
        elif len(example_shape) == 2 and self.in_channels != 1:
            return (f"the backbone TinyCNN has `in_channels` {self.in_channels}, but the data's images have shape "
                    f"{tuple(example_shape)} (one channel): set `in_channels: 1`")
        return None

    def forward(self, inputs: Tensor) -> Tensor:
        """Logits ``[B, num_classes]``."""
        x = self._as_images(as_float_input(inputs, self.head.weight))
        return self.head(self.features(x).flatten(1))

    def _square_side(self, features: int) -> Optional[int]:
        """The side ``S`` of the square images of ``in_channels`` that ``features`` flat values make, if any."""
        side = math.isqrt(features // self.in_channels)
        return side if self.in_channels * side * side == features else None

    def _as_images(self, x: Tensor) -> Tensor:
        """Reshape ``[B, H, W]`` or flat ``[B, C*S*S]`` inputs to ``[B, C, H, W]``."""
        if x.dim() == 3 and self.in_channels == 1:
            x = x.unsqueeze(1)
        elif x.dim() == 2:
            side = self._square_side(x.shape[1])
            if side is None:
                raise ValueError(
                    f"cannot read {x.shape[1]} features as square images with {self.in_channels} channel(s)"
                )
            x = x.reshape(x.shape[0], self.in_channels, side, side)
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"TinyCNN expects images [B, {self.in_channels}, H, W], got examples of shape {tuple(x.shape[1:])}"
            )
        return x


__all__ = ["TinyCNN", "TinyMLP", "make_activation"]

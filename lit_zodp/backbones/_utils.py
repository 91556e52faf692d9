"""Small helpers shared by the backbones: argument checks, empty-batch outputs, input coercion."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lit_zodp.errors import ConfigError


def check_positive_int(name: str, value: int) -> int:
    """Return ``value`` if it is a positive integer, else raise :class:`ConfigError` (a ``ValueError``: the CLI
    prints it as one line)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"Expected the backbone's `{name}` to be a positive int, but got {value!r}")
    return value


def check_non_negative_int(name: str, value: int) -> int:
    """Return ``value`` if it is an integer >= 0, else raise :class:`ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"Expected the backbone's `{name}` to be an int >= 0, but got {value!r}")
    return value


def check_probability(name: str, value: float) -> float:
    """Return ``value`` if it lies in ``[0, 1)``, else raise :class:`ConfigError`."""
    if not 0.0 <= float(value) < 1.0:
        raise ConfigError(f"Expected the backbone's `{name}` in [0, 1), but got {value!r}")
    return float(value)


def reference_parameter(module: nn.Module) -> Tensor:
    """First parameter of ``module`` (device and dtype reference)."""
    try:
        return next(module.parameters())
    except StopIteration:
        raise ValueError(f"{type(module).__name__} has no parameters") from None


def empty_logits(module: nn.Module, num_classes: int) -> Tensor:
    """Logits ``[0, num_classes]`` for an empty batch, on the module's device and dtype.

    When autograd is on, the result is joined (times zero) to every trainable parameter, so that
    ``loss.sum().backward()`` works and gives exact zero gradients instead of ``None``.
    """
    ref = reference_parameter(module)
    out = ref.new_zeros((0, num_classes))
    if torch.is_grad_enabled():
        trainable = [p for p in module.parameters() if p.requires_grad]
        if trainable:
            out = out + 0.0 * sum(p.sum().to(out.dtype) for p in trainable)
    return out


def as_float_input(x: Tensor, ref: Tensor) -> Tensor:
    """Move ``x`` to the device and dtype of ``ref`` (integer or float64 images included)."""
    if not isinstance(x, Tensor):
        raise ValueError(f"expected a tensor input, got {type(x).__name__}")
    return x.to(device=ref.device, dtype=ref.dtype)

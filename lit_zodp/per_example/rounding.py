"""How the engine's own arithmetic rounds: reduced-precision float32 matmuls and autocast.

A clipped sum is private only if each example's share of it has norm at most ``C``. The engine
forms that share from the same rows it measured, so only rounding separates the two, and two
PyTorch settings can make that rounding far coarser than float32:

* **Float32 matmul precision.** With TF32 allowed (``torch.backends.cuda.matmul.fp32_precision =
  "tf32"``, ``allow_tf32 = True`` or ``set_float32_matmul_precision("high" | "medium")``), CUDA
  converts each float32 operand to a 10-bit mantissa before multiplying and accumulates in float32;
  oneDNN on CPUs may use bfloat16 operands (``"medium"``). The bounds here take the conversion as
  truncation (``2^-10``, ``2^-7``) and the accumulation as round-toward-zero (``2^-23``), as
  measured on tensor cores (Fasi et al. 2021, "Numerical behavior of NVIDIA tensor cores").
* **Autocast** (Lightning's ``precision="bf16-mixed"`` or ``"16-mixed"``) runs every float32 matmul
  of the code inside it in half precision, the engine's sums included: the sum of B clipped
  gradients rounded in bfloat16 gave 2.0-2.1 C at B = 1024 in every mode. The engine runs all its
  work after the forward with autocast off (:func:`outside_autocast`), and re-enters the
  forward's autocast only to recompute a module's forward (:func:`forward_autocast`).

The settings are read per backend (the new ``fp32_precision`` API, else the legacy one):
``torch.get_float32_matmul_precision()`` raises once the two APIs have been mixed.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, NamedTuple, Optional

import torch


class MatmulRounding(NamedTuple):
    """``inputs``: relative error of converting each operand; ``accumulation``: unit roundoff of the sum."""

    inputs: float
    accumulation: float

    @property
    def product(self) -> float:
        """Relative error of one product of two converted operands: ``(1 + u)^2 - 1``."""
        return 2 * self.inputs + self.inputs * self.inputs


IEEE_FLOAT32 = MatmulRounding(0.0, 2.0 ** -24)
TF32 = MatmulRounding(2.0 ** -10, 2.0 ** -23)
BFLOAT16_OPERANDS = MatmulRounding(2.0 ** -7, 2.0 ** -23)
FLOAT64 = MatmulRounding(0.0, 2.0 ** -53)
_BY_SETTING = {"ieee": IEEE_FLOAT32, "tf32": TF32, "bf16": BFLOAT16_OPERANDS}
_LEGACY = {"highest": "ieee", "high": "tf32"}


def _setting(node: object) -> Optional[str]:
    value = getattr(node, "fp32_precision", None)
    return value if value in _BY_SETTING else None  # "none": inherit from the parent


def _legacy_setting(device_type: str) -> str:
    try:
        precision = torch.get_float32_matmul_precision()
    except RuntimeError:  # the legacy and new APIs were mixed: assume the coarsest
        return "bf16"
    return _LEGACY.get(precision, "tf32" if device_type == "cuda" else "bf16")


def float32_matmul_setting(device_type: str) -> str:
    """``"ieee"``, ``"tf32"`` or ``"bf16"``: how float32 matmuls on ``device_type`` may compute."""
    backends = torch.backends
    chains = {"cuda": [backends.cuda.matmul, backends], "cpu": [backends.mkldnn.matmul, backends.mkldnn, backends]}
    if hasattr(backends, "fp32_precision") and device_type in chains:
        for node in chains[device_type]:
            setting = _setting(node)
            if setting is not None:
                return setting
        return "ieee"
    return _legacy_setting(device_type)


def float32_conv_setting(device_type: str) -> str:
    """``"ieee"`` or ``"tf32"``: how cuDNN's float32 convolutions on ``device_type`` may compute (TF32 by default in
    torch: ``torch.backends.cudnn.allow_tf32``, or ``torch.backends.cudnn.conv.fp32_precision``). Only CUDA has
    them; the engine's own convolution arithmetic is an unfold and a matmul (:func:`sum_rounding`)."""
    if device_type != "cuda":
        return "ieee"
    cudnn = torch.backends.cudnn
    if hasattr(cudnn, "fp32_precision"):
        for node in (getattr(cudnn, "conv", None), cudnn, torch.backends):
            setting = _setting(node)
            if setting is not None:
                return setting
        return "ieee"
    return "tf32" if cudnn.allow_tf32 else "ieee"


#: Whether the model whose rows or losses are being compared has convolutions (:func:`model_convolutions`).
_CONVOLUTIONS: contextvars.ContextVar[bool] = contextvars.ContextVar("convolutions", default=False)


def has_convolutions(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds a convolution layer (``nn.Conv1d/2d/3d`` and their transposes, subclasses too)."""
    return any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in module.modules())


@contextlib.contextmanager
def model_convolutions(present: bool) -> Iterator[None]:
    """Inside: :func:`working_eps` knows whether the compared results went through the model's convolutions."""
    token = _CONVOLUTIONS.set(present)
    try:
        yield
    finally:
        _CONVOLUTIONS.reset(token)


def sum_rounding(dtype: torch.dtype, device_type: str) -> MatmulRounding:
    """Of the sums the engine forms from rows of ``dtype`` (widened to at least float32)."""
    if torch.promote_types(dtype, torch.float32) == torch.float64:
        return FLOAT64
    return _BY_SETTING[float32_matmul_setting(device_type)]


#: The autocast dtype the current batch's forward ran under (``None``: no autocast), for the
#: tolerances of checks that compare the engine's float32 results with autograd's.
_FORWARD_AUTOCAST: contextvars.ContextVar[Optional[torch.dtype]] = contextvars.ContextVar("forward_autocast",
                                                                                          default=None)


def _has_autocast(device_type: str) -> bool:
    available = getattr(torch.amp, "is_autocast_available", None)
    return available(device_type) if available is not None else device_type in ("cuda", "cpu")


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype of the autocast now enabled on ``device_type`` (``None``: none)."""
    if not _has_autocast(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


@contextlib.contextmanager
def outside_autocast(device_type: str) -> Iterator[None]:
    """Autocast off for the engine's norms and sums, the forward's autocast dtype remembered."""
    token = _FORWARD_AUTOCAST.set(autocast_dtype(device_type) or _FORWARD_AUTOCAST.get())
    off = torch.autocast(device_type, enabled=False) if _has_autocast(device_type) else contextlib.nullcontext()
    try:
        with off:
            yield
    finally:
        _FORWARD_AUTOCAST.reset(token)


def forward_autocast_dtype() -> Optional[torch.dtype]:
    """The autocast dtype the current batch's forward ran under (``None``: none)."""
    return _FORWARD_AUTOCAST.get()


@contextlib.contextmanager
def no_forward_autocast() -> Iterator[None]:
    """Inside, the forward counts as run without autocast (a check whose recomputations run in float32 takes
    float32's :func:`working_eps`)."""
    token = _FORWARD_AUTOCAST.set(None)
    try:
        yield
    finally:
        _FORWARD_AUTOCAST.reset(token)


def forward_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """The forward's autocast again (a recomputation must run the forward's function)."""
    dtype = _FORWARD_AUTOCAST.get()
    return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


HALF_DTYPES = (torch.float16, torch.bfloat16)


def working_eps(device_type: str, *dtypes: torch.dtype) -> float:
    """Relative precision of results formed from ``dtypes`` on ``device_type``: the machine epsilon
    of the least precise dtype, the forward's autocast dtype included, and no finer than a float32
    matmul's product when a dtype is float32 (TF32 operands: ``2^-9``), nor than a cuDNN convolution's
    product in a model with convolutions (:func:`model_convolutions`; torch's default on CUDA is TF32:
    an H200 run sent an NF-ResNet layer to the exact fallback, and emulated TF32 convolutions sent 27-36
    of its 62 parameters there, every mode)."""
    forward = autocast_dtype(device_type) or _FORWARD_AUTOCAST.get()
    eps = max(torch.finfo(d).eps for d in (*dtypes, *([forward] if forward is not None else [])))
    if any(torch.promote_types(d, torch.float32) == torch.float32 for d in dtypes):
        eps = max(eps, sum_rounding(torch.float32, device_type).product)
        if _CONVOLUTIONS.get():
            eps = max(eps, _BY_SETTING[float32_conv_setting(device_type)].product)
    return eps


__all__ = ["HALF_DTYPES", "MatmulRounding", "autocast_dtype", "float32_conv_setting", "float32_matmul_setting",
           "forward_autocast", "forward_autocast_dtype", "has_convolutions", "model_convolutions",
           "no_forward_autocast", "outside_autocast", "sum_rounding", "working_eps"]

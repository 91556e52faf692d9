"""Secret Gaussian noise drawn on the GPU, keyed by 128 secret bits: no host draw, no host-to-device copy.

A DP-SGD release on RoBERTa-large adds 355M noise values per step. Drawn on the host with NumPy (about
10 ns each) and copied over, that is seconds per step; drawn where the sum lives, it is one pass over
memory. torch's own CUDA generator takes a 64-bit seed, below the 128 bits the threat model asks for
(DESIGN.md: the attacker has the code, the config, the run seed and the checkpoints), so the noise
has its own counter-based law:

* **Key.** Philox4x32-10 (Salmon et al. 2011) has a 64-bit key and a 128-bit counter. The key
  ``(k0, k1)`` and the counter's two high words ``(s0, s1)`` are four 32-bit words drawn, fresh for
  each release, from the run's secret NumPy stream (:class:`~lit_zodp.privacy.noise.NoiseSource`,
  itself keyed by 256 bits of OS entropy): 128 secret bits per release, never stored.
* **Counter.** The low words ``(c0, c1)`` hold the 64-bit pair index ``q``: values ``2q`` and
  ``2q + 1`` of the vector come from counter ``(q mod 2^32, q >> 32, s0, s1)``.
* **Normals.** The four words make two 53-bit uniforms, ``u1 = (a + 1/2) 2^-53`` (never 0) and
  ``u2 = b 2^-53``; Box-Muller in float64 gives ``r cos(2 pi u2)`` and ``r sin(2 pi u2)`` with
  ``r = sqrt(-2 ln u1) <= 8.66``. The float32 draws of ``tl.randn`` (31-bit uniforms floored at
  1e-7) would cut the tail at 5.7 sigma; here the law is cut at 8.66 sigma, where the Gaussian's
  tail mass is about 5e-18 per coordinate.
* **Add.** ``out = x + std * z`` is computed in float64 and rounded once to ``out``'s dtype: float32, or
  float64 where a caller sums more terms before its own rounding (DPGD-0th's noise vector); a float64 ``x``
  (a clipped sum of scalars) may be rounded to a float32 ``out``.

:func:`reference_noised` is the same law in plain torch on any device (tests; the Triton kernel runs on
CPU under ``TRITON_INTERPRET=1``). The CUDA kernel's ``log``/``sin``/``cos`` are libdevice's float64
functions, within an ulp of the correctly rounded ones, so kernel and reference agree to float32
rounding; the Philox words are bitwise equal.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from lit_zodp.zo import philox

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

_MASK32 = 0xFFFFFFFF
_TWO_POW_MINUS_53 = 2.0 ** -53
_TWO_PI = 6.283185307179586
#: Pairs of values per Triton program (4 warps: 8 pairs, 16 values per thread).
PAIRS_PER_BLOCK = 1024


@dataclass(frozen=True)
class SecretKey:
    """128 secret bits: the Philox key ``(k0, k1)`` and the counter's high words ``(s0, s1)``.

    ``repr`` shows no bits, so the key cannot reach a log by accident.
    """

    k0: int
    k1: int
    s0: int
    s1: int

    def __post_init__(self) -> None:
        if any(not 0 <= w <= _MASK32 for w in (self.k0, self.k1, self.s0, self.s1)):
            raise ValueError("SecretKey words must be 32-bit unsigned integers")

    def __repr__(self) -> str:
        return "SecretKey(<128 secret bits>)"

    @classmethod
    def from_words64(cls, hi_lo: tuple[int, int]) -> "SecretKey":
        """The key of two 64-bit words (as NumPy's ``integers(0, 2**64, 2)`` returns them)."""
        a, b = (int(w) & ((1 << 64) - 1) for w in hi_lo)
        return cls(a & _MASK32, a >> 32, b & _MASK32, b >> 32)


KERNEL_DTYPES = (torch.float32, torch.float64)


def device_noise_available(tensor: Tensor) -> bool:
    """Whether :func:`add_gaussian` can draw on ``tensor``'s device (CUDA, Triton, float32 or float64)."""
    return triton is not None and tensor.is_cuda and tensor.dtype in KERNEL_DTYPES


def add_gaussian(x: Tensor, std: float, key: SecretKey, *, pair_base: int = 0, out: Tensor | None = None) -> Tensor:
    """``x + std * z`` with ``z`` the secret normal vector of ``key`` (flat order), by the Triton kernel.

    ``pair_base`` shifts the pair counter (a chunk of a longer vector starts at pair ``pair_base``).
    ``out``: where to write (``x`` itself for in place); default a new tensor of ``x``'s dtype. A float64 ``x``
    may be written to a float32 ``out``: a clipped sum formed in float64 is rounded once, after the noise.
    """
    if not x.is_contiguous() or x.dtype not in KERNEL_DTYPES:
        raise ValueError("add_gaussian needs a contiguous float32 or float64 tensor")
    out = torch.empty_like(x) if out is None else out
    if out.dtype not in KERNEL_DTYPES or out.dtype.itemsize > x.dtype.itemsize or not out.is_contiguous() \
            or out.shape != x.shape:
        raise ValueError("add_gaussian writes a contiguous `out` of x's shape and dtype (or float32 for a float64 x)")
    numel = x.numel()
    if numel:
        pairs = (numel + 1) // 2
        grid = (triton.cdiv(pairs, PAIRS_PER_BLOCK),)
        _noise_kernel[grid](x, out, *scalar_arguments(numel, pair_base, key, std), PAIRS=PAIRS_PER_BLOCK)
    return out


def scalar_arguments(numel: int, pair_base: int, key: SecretKey, std: float) -> tuple:
    """The kernel's scalar arguments, typed so that Triton compiles ONE kernel whatever the key.

    Triton types a Python int by its value (int32 below 2**31, int64 above) and specialises it on
    ``== 1`` and divisibility by 16: a key word passed as is would pick one of 32 compiled variants per
    release, costing a compilation (tenths of a second) the first time each appears and showing, in the
    step time and in Triton's cache folder, a few bits of the secret key. So the words travel as signed
    int32 (their bits unchanged; the kernel reads them back as uint32) and are not specialised
    (``do_not_specialize``); nor are the public sizes, whose int32/int64 typing compiles at most twice.
    """
    words = tuple(w - (1 << 32) if w >= 1 << 31 else w for w in (key.k0, key.k1, key.s0, key.s1))
    return (numel, int(pair_base), *words, kernel_std(std))


@functools.lru_cache(maxsize=256)
def kernel_std(std: float) -> float:
    """``std`` as the kernel receives it (Triton passes float arguments as float32): the nearest
    float32 at or ABOVE ``std``, so rounding never lowers the noise below the calibrated one.
    Memoised (a fit releases at one public std; computing it takes a few tensor calls, 5 us a step)."""
    if not std >= 0 or std == float("inf"):
        raise ValueError(f"Expected a finite noise std >= 0, but got {std!r}")
    value = torch.tensor(std, dtype=torch.float32)
    if value.item() < std:
        value = torch.nextafter(value, torch.tensor(float("inf")))
    return value.item()


def reference_normals(numel: int, key: SecretKey, *, pair_base: int = 0, device="cpu") -> Tensor:
    """The law of :func:`add_gaussian` in plain torch: ``numel`` standard normals, float64."""
    pairs = (numel + 1) // 2
    q = torch.arange(pair_base, pair_base + pairs, dtype=torch.int64, device=device)
    s0 = torch.full_like(q, key.s0)
    s1 = torch.full_like(q, key.s1)
    w0, w1, w2, w3 = philox.philox4x32(q & _MASK32, q >> 32, s0, s1, key.k0, key.k1)
    a = _uniform53_bits(w0, w1)
    b = _uniform53_bits(w2, w3)
    u1 = (a.double() + 0.5) * _TWO_POW_MINUS_53
    u2 = b.double() * _TWO_POW_MINUS_53
    r = torch.sqrt(-2.0 * torch.log(u1))
    theta = _TWO_PI * u2
    return torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=1).view(-1)[:numel]


def reference_noised(x: Tensor, std: float, key: SecretKey, *, pair_base: int = 0, dtype=None) -> Tensor:
    """``x + std * z`` as :func:`add_gaussian` computes it (in float64, rounded once to ``dtype``: by default
    float32 unless ``x`` is float64)."""
    z = reference_normals(x.numel(), key, pair_base=pair_base, device=x.device).view(x.shape)
    if dtype is None:
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.double() + kernel_std(std) * z).to(dtype)


def _uniform53_bits(lo: Tensor, hi: Tensor) -> Tensor:
    """The top 53 bits of the 64-bit word ``hi:lo`` (int64 tensors holding uint32 values)."""
    return (hi << 21) | (lo >> 11)


if triton is not None:

    @triton.jit(do_not_specialize=["numel", "pair_base", "k0", "k1", "s0", "s1"])
    def _noise_kernel(x_ptr, out_ptr, numel, pair_base, k0, k1, s0, s1, std, PAIRS: tl.constexpr):
        """``PAIRS`` pairs of values: one Philox call, two 53-bit uniforms, one Box-Muller pair each.

        ``k0, k1, s0, s1``: the key's words as int32 bit patterns (:func:`scalar_arguments`).
        """
        pid = tl.program_id(0).to(tl.int64)
        q = pid * PAIRS + tl.arange(0, PAIRS).to(tl.int64) + pair_base.to(tl.int64)
        c0 = (q & 0xFFFFFFFF).to(tl.uint32)
        c1 = (q >> 32).to(tl.uint32)
        c2 = tl.zeros([PAIRS], dtype=tl.uint32) + s0.to(tl.uint32, bitcast=True)
        c3 = tl.zeros([PAIRS], dtype=tl.uint32) + s1.to(tl.uint32, bitcast=True)
        seed = (k1.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | k0.to(tl.uint32, bitcast=True).to(tl.uint64)
        w0, w1, w2, w3 = tl.philox(seed, c0, c1, c2, c3)
        a = (w1.to(tl.uint64) << 21) | (w0.to(tl.uint64) >> 11)
        b = (w3.to(tl.uint64) << 21) | (w2.to(tl.uint64) >> 11)
        u1 = (a.to(tl.float64) + 0.5) * 1.1102230246251565e-16   # 2^-53
        u2 = b.to(tl.float64) * 1.1102230246251565e-16
        r = tl.sqrt(-2.0 * tl.log(u1))
        theta = 6.283185307179586 * u2
        z = tl.interleave(r * tl.cos(theta), r * tl.sin(theta))  # values 2q, 2q + 1
        offs = pid * 2 * PAIRS + tl.arange(0, 2 * PAIRS).to(tl.int64)
        mask = offs < numel.to(tl.int64)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        y = x.to(tl.float64) + std * z
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)  # one rounding (none for float64)


__all__ = ["KERNEL_DTYPES", "PAIRS_PER_BLOCK", "SecretKey", "add_gaussian", "device_noise_available", "kernel_std",
           "reference_noised", "reference_normals", "scalar_arguments"]

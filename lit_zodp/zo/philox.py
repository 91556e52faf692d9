"""Triton's counter-based normal generator in plain torch: Philox4x32-10, then Box-Muller.

Philox (Salmon, Moraes, Dror, Shaw 2011, "Parallel random numbers: as easy as 1, 2, 3") maps a
128-bit counter and a 64-bit key to four 32-bit words; 10 rounds of a multiply-xor bijection with a
Weyl-sequence key schedule. This module reproduces, on any device, what ``triton.language.random``
computes (triton 3.x):

- ``randint4x(seed, offset)``: key ``(k0, k1) = (seed mod 2^32, (seed >> 32) mod 2^32)`` (Triton's
  ``philox`` takes the seed as a 64-bit integer and splits it in two halves), counter
  ``(offset mod 2^32, offset >> 32, 0, 0)`` (Triton uses the high word for 64-bit offsets);
- ``uint_to_uniform_float``: the word read as int32, ``x < 0 -> ~x``, times ``4.6566127342e-10``
  in float32: a uniform on ``[0, 1)`` with 31 bits;
- ``pair_uniform_to_normal``: Box-Muller in float32, ``u1 = max(1e-7, u1)``, ``r = sqrt(-2 log u1)``,
  ``th = 2 pi u2``, ``(r cos th, r sin th)``.

The integer words and the uniforms are bitwise Triton's. The transcendental functions are not
correctly rounded in any backend: Triton's interpreter calls numpy's float32 ``log/cos/sin``, and
CUDA compiles a polynomial ``log`` (flush-to-zero FMAs) and ``sqrt.approx`` (seen in the PTX for sm_90),
with the hardware's ``cos/sin.approx`` in the fused engine (``tl.cos/sin`` are polynomials too). ``math="exact"`` (the default) evaluates them, and the square root, in float64 and
rounds once: a correctly rounded, device-independent reference. ``math="numpy"`` calls numpy's
float32 functions on CPU, which is what ``TRITON_INTERPRET=1`` executes: bitwise ``tl.randn``. The
two differ by up to 4 float32 ulps of ``z`` (the maximum over 4e5 draws); the Philox words never
differ.

The engine's law (:func:`normal`, used by :mod:`lit_zodp.zo.fused`): element ``g`` of the flat
parameter layout takes output ``g mod 4`` of ``tl.randn4x(seed, g // 4)``, so one Philox call and two
Box-Muller transforms feed four consecutive elements (``tl.randn`` spends a call per element).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

#: Philox4x32 constants (Salmon et al. 2011, Sec. 5; ``triton/language/random.py``).
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
N_ROUNDS = 10

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
#: ``uint_to_uniform_float``'s scale, ``(2^23 - 1) / 2^23 * 2^-31`` rounded to float32.
_UNIFORM_SCALE = 4.6566127342e-10
#: Box-Muller's angle scale, 2 pi (float32 ``c = fl(2 pi)`` once multiplied in float32).
TWO_PI = 6.283185307179586
_U1_FLOOR = 1.0e-7
_MATHS = ("exact", "numpy")


def seed_key(seed: int) -> tuple[int, int]:
    """The Philox key ``(k0, k1)`` of a seed: its value mod ``2^64`` split into low and high words.

    This is Triton's mapping (``philox`` casts the seed to uint64, ``k0`` = low half, ``k1`` = high
    half), so the engine's 63-bit public seeds (:func:`lit_zodp.zo.seeds.derive_seed`) key Philox
    directly, without truncation. Negative seeds wrap (two's complement), as in a uint64 cast.
    """
    value = int(seed) & _MASK64
    return value & _MASK32, value >> 32


def seed_as_int64(seed: int) -> int:
    """The seed's 64 bits as a signed int64 (how the kernels receive seeds in a device table)."""
    value = int(seed) & _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mul_hi_lo(a: Tensor, b: int) -> tuple[Tensor, Tensor]:
    """High and low 32-bit words of ``a * b`` (``a``: uint32 values held in int64, ``b``: a constant).

    Split ``b`` in 16-bit halves so that no partial product leaves int64: exact on every device.
    """
    p_hi = a * (b >> 16)  # < 2^48
    p_lo = a * (b & 0xFFFF)  # < 2^48
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & _MASK32
    return hi, lo


def philox4x32(c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: int, k1: int,
               rounds: int = N_ROUNDS) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-``rounds`` of the counters ``(c0..c3)`` (int64 tensors of uint32 values) under key ``(k0, k1)``.

    One round (Salmon et al. 2011, Eq. 4, Triton's ``philox_impl``): ``c0' = hi(B c2) ^ c1 ^ k0``,
    ``c2' = hi(A c0) ^ c3 ^ k1``, ``c1' = lo(B c2)``, ``c3' = lo(A c0)``; the key then advances by
    the Weyl constants.
    """
    for _ in range(rounds):
        hi_b, lo_b = _mul_hi_lo(c2, PHILOX_ROUND_B)
        hi_a, lo_a = _mul_hi_lo(c0, PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _MASK32
        k1 = (k1 + PHILOX_KEY_B) & _MASK32
    return c0, c1, c2, c3


def randint4x(seed: int, offsets: Tensor, rounds: int = N_ROUNDS) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``tl.randint4x(seed, offsets)`` for int64 ``offsets >= 0``: four int64 tensors of uint32 values."""
    offsets = offsets.to(torch.int64)
    k0, k1 = seed_key(seed)
    zero = torch.zeros_like(offsets)
    return philox4x32(offsets & _MASK32, offsets >> 32, zero, zero, k0, k1, rounds)


def uint_to_uniform(x: Tensor) -> Tensor:
    """``tl.uint_to_uniform_float`` for uint32 words: float32 uniforms on ``[0, 1)``, bitwise Triton's."""
    x = torch.where(x >= 1 << 31, x ^ _MASK32, x)  # as int32: x < 0 -> ~x
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32, device=x.device)


def _unary(name: str, x: Tensor, math: str) -> Tensor:
    """float32 ``log``/``cos``/``sin``: correctly rounded (``"exact"``) or numpy's float32 (``"numpy"``)."""
    if math == "exact":
        return getattr(torch, name)(x.double()).to(torch.float32)
    if math == "numpy":
        return torch.from_numpy(getattr(np, name)(x.cpu().numpy())).to(x.device)
    raise ValueError(f"Expected `math` in {_MATHS}, but got {math!r}")


def _sqrt(x: Tensor) -> Tensor:
    """Correctly rounded float32 square root, as IEEE (and numpy) define it.

    torch's vectorised float32 ``sqrt`` on CPU is not always correctly rounded; in float64 it is, and
    rounding a float64 square root of a float32 to float32 is innocuous (53 >= 2 * 24 + 2 bits).
    """
    return x.double().sqrt().to(torch.float32)


def box_muller(u1: Tensor, u2: Tensor, math: str = "exact") -> tuple[Tensor, Tensor]:
    """``tl.pair_uniform_to_normal``: two float32 standard normals from two float32 uniforms."""
    u1 = torch.maximum(u1, torch.tensor(_U1_FLOOR, dtype=torch.float32, device=u1.device))
    th = torch.tensor(TWO_PI, dtype=torch.float32, device=u2.device) * u2
    r = _sqrt(-2.0 * _unary("log", u1, math))
    return r * _unary("cos", th, math), r * _unary("sin", th, math)


def randn(seed: int, offsets: Tensor, math: str = "exact") -> Tensor:
    """``tl.randn(seed, offsets)``: one Philox call per element, the cosine half of Box-Muller."""
    i1, i2, _, _ = randint4x(seed, offsets)
    return box_muller(uint_to_uniform(i1), uint_to_uniform(i2), math)[0]


def randn4x(seed: int, offsets: Tensor, math: str = "exact") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``tl.randn4x(seed, offsets)``: four normals per Philox call."""
    i1, i2, i3, i4 = randint4x(seed, offsets)
    n1, n2 = box_muller(uint_to_uniform(i1), uint_to_uniform(i2), math)
    n3, n4 = box_muller(uint_to_uniform(i3), uint_to_uniform(i4), math)
    return n1, n2, n3, n4


def normal(seed: int, offsets: Tensor, math: str = "exact") -> Tensor:
    """The engine's direction law: element ``g`` is output ``g mod 4`` of ``randn4x(seed, g // 4)``.

    A pure function of ``(seed, g)``: the direction of an element does not depend on how the
    parameters are split into tensors or blocks. ``offsets``: int64 global element indices >= 0.
    """
    offsets = offsets.to(torch.int64)
    counters, lane = torch.unique(offsets >> 2, return_inverse=True)
    outputs = torch.stack(randn4x(seed, counters, math), dim=1)  # (counters, 4)
    return outputs[lane, offsets & 3]


def normal_range(seed: int, start: int, numel: int, math: str = "exact",
                 device: torch.device | str = "cpu") -> Tensor:
    """``normal(seed, start + arange(numel))`` for a contiguous range (no de-duplication needed)."""
    first, last = start >> 2, (start + numel + 3) >> 2
    counters = torch.arange(first, last, dtype=torch.int64, device=device)
    block = torch.stack(randn4x(seed, counters, math), dim=1).view(-1)
    skip = start - 4 * first
    return block[skip:skip + numel]

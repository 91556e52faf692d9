"""Secret randomness: the DP noise, drawn from at least 128 bits of OS entropy and never checkpointed.

Threat model (DESIGN.md): the attacker has the code, the config, the run seed and every
checkpoint. So the noise is never derived from the run seed, and its generator state is never
saved. torch's CPU generator keeps only 32 bits of its seed (a space searched in hours), so the
noise is drawn with NumPy's bit generators instead, keyed by the whole secret:

* scalar and small releases: a PCG64DXSM stream whose 128-bit state is derived by ``SeedSequence``
  from a 256-bit OS-entropy secret (every bit of the secret changes the stream);
* large releases on the host (more than ``HOST_PART`` values: DP-SGD's d-dimensional sum): parts of
  ``HOST_PART`` values, each from its own PCG64DXSM keyed by 128 bits fresh from that stream, filled
  on torch's intra-op threads (NumPy releases the GIL while it fills);
* d-dimensional noise vectors (DPGD-0th): a Philox-4x64 key of 128 bits, fresh from the stream for
  each release, with the chunk index in the counter, so the perturbation engine generates the
  vector chunk by chunk, in any order and on any device, without storing it;
* on CUDA (with Triton), both are drawn on the device instead, by a Philox kernel keyed by 128 bits
  fresh from the stream for each release (:mod:`lit_zodp.privacy.device_noise`): no host draw and
  no host-to-device copy of a d-dimensional vector.

Under DDP rank 0's secret is broadcast once at fit start and every rank adds the same draw after
the all-reduce (the secret is shared inside the training job, never outside it). NumPy's
generators are not cryptographically secure PRNGs: the secrecy is that of the 256-bit seed.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from lit_zodp.errors import check_non_negative, raise_if_any
from lit_zodp.privacy.device_noise import SecretKey, add_gaussian, device_noise_available
from lit_zodp.zo.parallel import map_on_threads

#: Bits of OS entropy behind every secret stream (noise and Poisson sampling).
SECRET_BITS = 256
#: Values per independently keyed part of a large host draw (parts fill in parallel).
HOST_PART = 1 << 20
#: Draws of at most this many values (DPZero's per-step scalars) come from a pool refilled
#: ``SCALAR_POOL`` standard normals at a time: one NumPy call per ~thousand steps instead of one per
#: step. The pool is secret like the generator's state: in memory only, never in a checkpoint.
SCALAR_DRAW, SCALAR_POOL = 64, 4096
HOST_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}  # drawn in the tensor's own precision

TEST_SEED_WARNING = (
    "`{name}` is set: the {what} is reproducible from it, so the run is NOT differentially private. "
    "Use it only in tests; leave it unset (None) to draw {bits} bits from the OS.")


def secret_seed() -> int:
    """A fresh ``SECRET_BITS``-bit secret from the operating system's entropy pool."""
    return int.from_bytes(os.urandom(SECRET_BITS // 8), "little")


def secret_generator(seed: int) -> np.random.Generator:
    """A NumPy generator whose state depends on every bit of ``seed`` (``SeedSequence`` hashing)."""
    return np.random.Generator(np.random.PCG64DXSM(np.random.SeedSequence(int(seed))))


def warn_test_seed(name: str, what: str) -> None:
    warnings.warn(TEST_SEED_WARNING.format(name=name, what=what, bits=SECRET_BITS), UserWarning, stacklevel=3)


class NoiseSource:
    """The secret Gaussian noise of one training run.

    Args:
        seed: a test-only seed (warns: the noise is then reproducible). ``None`` (default) draws
            ``SECRET_BITS`` bits from the OS.

    There is deliberately no ``state_dict``: the noise state never enters a checkpoint, and a
    resumed run draws from a fresh secret.
    """

    def __init__(self, seed: Optional[int] = None) -> None:
        self.seeded_by_user = seed is not None
        if self.seeded_by_user:
            warn_test_seed("noise_seed", "DP noise")
        self._rng = secret_generator(secret_seed() if seed is None else int(seed))

    @classmethod
    def from_secret(cls, secret: int) -> "NoiseSource":
        """A source keyed by a secret drawn from the OS elsewhere (rank 0's, broadcast under DDP)."""
        source = cls.__new__(cls)
        source.seeded_by_user = False
        source._rng = secret_generator(secret)
        return source

    def gaussian(self, shape, std: float, *, device="cpu", dtype=torch.float32) -> Tensor:
        """A draw of ``N(0, std^2)`` with the given shape, on ``device``."""
        raise_if_any([check_non_negative("noise std", std)])
        precision = np.float64 if dtype == torch.float64 else np.float32  # float32 for fp32/bf16/fp16
        host = torch.from_numpy(self._host_draw(math.prod(shape), std, precision)).view(tuple(shape))
        if torch.device(device).type == "cuda":  # pinned + non_blocking: no wait on the device's queue
            return host.pin_memory().to(device=device, dtype=dtype, non_blocking=True)
        return host.to(device=device, dtype=dtype)

    def noised(self, x: Tensor, std: float) -> Tensor:
        """``x + N(0, std^2 I)`` (a new tensor): drawn on the GPU where it can be, else on the host."""
        if device_noise_available(x):  # add_gaussian checks std, as gaussian() does
            return add_gaussian(x.contiguous(), std, self.device_key())
        if x.device.type == "cpu" and x.dtype in HOST_DTYPES and isinstance(std, float) and 0 <= std < math.inf:
            noise = torch.from_numpy(self._host_draw(x.numel(), std, HOST_DTYPES[x.dtype]))
            return x + (noise if x.dim() == 1 else noise.view(x.shape))
        return x + self.gaussian(x.shape, std, device=x.device, dtype=x.dtype)

    def _host_draw(self, numel: int, std: float, precision) -> np.ndarray:
        """``numel`` draws of ``N(0, std^2)``: from the scalar pool, one stream up to ``HOST_PART``, else
        keyed parts on threads."""
        if numel <= SCALAR_DRAW and precision is np.float32:
            return self._pooled(numel) * precision(std)
        if numel <= HOST_PART:
            draw = np.asarray(self._rng.standard_normal(numel, dtype=precision))
            draw *= precision(std)
            return draw
        out = np.empty(numel, dtype=precision)
        starts = range(0, numel, HOST_PART)
        keys = self._rng.integers(0, 2**64, size=(len(starts), 2), dtype=np.uint64)  # 128 fresh bits per part

        def fill(j: int) -> None:
            part = out[starts[j]:starts[j] + HOST_PART]
            secret = int(keys[j, 0]) | (int(keys[j, 1]) << 64)
            secret_generator(secret).standard_normal(out=part, dtype=precision)
            part *= precision(std)

        map_on_threads(fill, len(starts))
        return out

    def _pooled(self, numel: int) -> np.ndarray:
        """The next ``numel`` standard normals (float32) of the pool, refilled from the stream when short."""
        pool, start = getattr(self, "_pool", None), getattr(self, "_pool_next", 0)
        if pool is None or start + numel > len(pool):
            pool, start = self._rng.standard_normal(SCALAR_POOL, dtype=np.float32), 0
            self._pool = pool
        self._pool_next = start + numel
        return pool[start:start + numel]

    def device_key(self) -> SecretKey:
        """128 fresh secret bits for one draw of the device kernel."""
        return SecretKey.from_words64(self._fresh_128_bits())

    def vector_key(self) -> "SecretGaussianVector":
        """A fresh 128-bit key of a d-dimensional standard normal vector, generated lazily by chunk."""
        return SecretGaussianVector(self._fresh_128_bits())

    def _fresh_128_bits(self) -> tuple[int, int]:
        """Two 64-bit words from the secret stream."""
        return tuple(int(k) for k in self._rng.integers(0, 2**64, size=2, dtype=np.uint64))


class SecretGaussianVector:
    """``xi ~ N(0, I_d)`` keyed by 128 secret bits; chunk ``i`` is drawn from Philox(key, counter=i).

    A direction law for the perturbation engine (``independent_chunks``, ``fill_chunk_``): the
    engine adds ``c * xi`` chunk by chunk without ever storing ``xi``. Chunk ``i`` uses the Philox
    counter block ``i * 2**192``, so no two chunks share a counter.
    """

    name = "secret_gaussian"
    independent_chunks = True

    def __init__(self, key: tuple[int, int]) -> None:
        self.key = np.array(key, dtype=np.uint64)

    def chunk_scale(self, chunks, seed) -> float:
        return 1.0

    def fill_chunk_(self, out: Tensor, seed: int, index: int, generator: Optional[torch.Generator] = None) -> Tensor:
        """Chunk ``index`` (float32) into ``out``; ``seed`` and ``generator`` are unused (the key is the seed).

        On CUDA the chunk is drawn on the device (:mod:`~lit_zodp.privacy.device_noise`, the same 128-bit
        key, pairs from ``index * 2**40``); on CPU by NumPy's Philox-4x64.
        """
        if device_noise_available(out) and out.is_contiguous():
            out.zero_()
            return add_gaussian(out, 1.0, SecretKey.from_words64(tuple(self.key)), pair_base=index << 40, out=out)
        rng = np.random.Generator(np.random.Philox(key=self.key, counter=[0, 0, 0, index]))
        host = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=torch.float32)
        rng.standard_normal(out=host.numpy(), dtype=np.float32)
        if host is not out:
            out.copy_(host)
        return out


__all__ = ["HOST_PART", "NoiseSource", "SECRET_BITS", "SecretGaussianVector", "secret_generator", "secret_seed"]

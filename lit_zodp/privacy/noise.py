"""Secret randomness: the DP noise, drawn from at least 128 bits of OS entropy and never checkpointed.

Threat model (DESIGN.md): the attacker has the code, the config, the run seed and every
checkpoint. So the noise is never derived from the run seed, and its generator state is never
saved. torch's CPU generator keeps only 32 bits of its seed (a space searched in hours), so the
noise is drawn with NumPy's bit generators instead. Every key is the next output of a keyed-BLAKE2b
counter stream whose 256-bit key hashes a 256-bit OS-entropy secret (a cryptographic PRF: no key
can be computed from the noise another key made, unlike the state of a PCG stream from its outputs):

* scalar and small releases (the zeroth-order modules' every release): a pool of float64 standard normals
  from a cryptographic keystream, SHAKE-256 of a fresh 256-bit key, by Box-Muller on 53-bit uniforms
  (:func:`keystream_normals`), re-keyed at every refill. A PCG stream is not cryptographic: an attacker who
  knows every other example of a full batch sees the noise exactly wherever the target is absent, and a
  PCG state recovered from such values would predict the rest of its stream (audit, 2026-11-28);
* mid-size releases (up to ``HOST_PART`` values): such a generator, re-keyed after every
  ``HOST_PART`` values drawn from it;
* larger releases (DP-SGD's d-dimensional sum): parts of ``HOST_PART`` values, each from its own
  generator with a fresh 128-bit key, filled on torch's intra-op threads (NumPy releases the GIL);
* d-dimensional noise vectors (DPGD-0th): a Philox-4x64 key of 128 fresh bits per release, with
  the chunk index in the counter, so the perturbation engine generates the vector chunk by chunk, in
  any order and on any device, without storing it, and adds it to its float64 sum of the update
  before the one rounding into the parameter;
* on CUDA (with Triton), releases beyond ``SCALAR_DRAW`` values and the noise vectors are drawn on the
  device instead, by a Philox kernel with a fresh 128-bit key per release
  (:mod:`lit_zodp.privacy.device_noise`). Small releases take the host's keystream pool on every device:
  their few values are added where the sum lives, in float64, as on the host, with the same bits.

A host release is ``fl(x + std z)`` computed in float64 from a float64 normal ``z`` and rounded ONCE
to ``x``'s dtype, as the device kernel does. A float32 normal scaled and added in float32 (rounded
three times) has holes: which float32 outputs can occur depends on ``x``, so an output can be
impossible without a given example (13-17% of releases in the third audit; Mironov 2012, Jin et al.
2022). Rounding a float64 result once leaves every float32 output near ``x`` reachable.

Under DDP rank 0's secret is broadcast once at fit start and every rank adds the same draw after
the all-reduce (the secret is shared inside the training job, never outside it). A test-only
``noise_seed`` takes the secret's place (reproducible, and it warns).
"""

from __future__ import annotations

import array
import hashlib
import math
import os
import warnings
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from lit_zodp.errors import LitZodpWarning, check_non_negative, check_positive, raise_if_any
from lit_zodp.privacy.device_noise import KERNEL_DTYPES, SecretKey, add_gaussian, device_noise_available
from lit_zodp.transfer import to_device_without_waiting
from lit_zodp.zo.parallel import map_on_threads

#: Bits of OS entropy behind every secret stream (noise and Poisson sampling).
SECRET_BITS = 256
#: Values per independently keyed part of a large host draw (parts fill in parallel).
HOST_PART = 1 << 20
#: Draws of at most this many values (DPZero's per-step scalars) come from a pool refilled
#: ``SCALAR_POOL`` standard normals at a time: one NumPy call per ~thousand steps instead of one per
#: step. The pool is secret like the generator's state: in memory only, never in a checkpoint.
SCALAR_DRAW, SCALAR_POOL = 64, 4096
#: Released on the host (float64 sum, one rounding), with their NumPy dtypes.
HOST_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}
#: The ``array`` type codes of the same dtypes: a scalar release rounds its float64 values once to ``x``'s dtype by
#: C's conversion (round to nearest even, overflow to inf: NumPy's ``astype`` bit for bit) into an ``array.array``
#: that a tensor then views. In a step's cold caches that is 8 us where ``np.array`` + ``from_numpy`` took 12.5
#: and ``torch.tensor`` 14.5 (quickstart, AMD EPYC).
SCALAR_TYPECODES = {torch.float32: "f", torch.float64: "d"}

TEST_SEED_WARNING = (
    "`{name}` is set: the {what} is reproducible from it, so the run is NOT differentially private. "
    "Use it only in tests; leave it unset (None) to draw {bits} bits from the OS.")


def secret_seed() -> int:
    """A fresh ``SECRET_BITS``-bit secret from the operating system's entropy pool."""
    return int.from_bytes(os.urandom(SECRET_BITS // 8), "little")


def secret_generator(seed: int) -> np.random.Generator:
    """A NumPy generator whose state depends on every bit of ``seed`` (``SeedSequence`` hashing)."""
    return np.random.Generator(np.random.PCG64DXSM(np.random.SeedSequence(int(seed), pool_size=SECRET_BITS // 32)))


def keystream_normals(key: int, count: int) -> np.ndarray:
    """``count`` float64 standard normals from SHAKE-256 of the 256-bit ``key``: a cryptographic keystream (no
    output predicts another without the key), turned into uniforms ``(k + 1) 2^-53`` in ``(0, 1]`` and paired by
    Box-Muller, ``r = sqrt(-2 ln u1)``, ``z = (r cos 2 pi u2, r sin 2 pi u2)``. The radius cannot pass
    ``sqrt(106 ln 2) = 8.57`` (``P(|z| > 8.57)`` is about 1e-17 for an exact normal: far below any delta)."""
    pairs = (count + 1) // 2
    stream = hashlib.shake_256(int(key).to_bytes(SECRET_BITS // 8, "little")).digest(16 * pairs)
    uniforms = ((np.frombuffer(stream, dtype="<u8") >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53
    radius = np.sqrt(-2.0 * np.log(uniforms[0::2]))
    angle = 2.0 * np.pi * uniforms[1::2]
    normals = np.empty(2 * pairs)
    normals[0::2], normals[1::2] = radius * np.cos(angle), radius * np.sin(angle)
    return normals[:count]


def warn_test_seed(name: str, what: str) -> None:
    warnings.warn(TEST_SEED_WARNING.format(name=name, what=what, bits=SECRET_BITS), LitZodpWarning, stacklevel=3)


def _std_and_divisor_valid(std, divisor) -> bool:
    """``0 <= std < inf`` and ``0 < divisor < inf`` by comparisons only: a release's check, its messages
    (``lit_zodp.errors``) built only on failure. False for NaN and for what does not compare with floats."""
    try:
        return bool(0.0 <= std < math.inf and 0.0 < divisor < math.inf)
    except TypeError:
        return False


#: Forks this process descends from (counted in each child): a noise source keyed before a fork refuses to draw
#: after it, since parent and child would add the same noise.
_FORKS = [0]


def _count_fork() -> None:
    _FORKS[0] += 1


os.register_at_fork(after_in_child=_count_fork)


class ForkedNoiseError(RuntimeError):
    """A noise source used in a process forked after it was keyed."""


class NoiseSource:
    """The secret Gaussian noise of one training run.

    Args:
        seed: a test-only seed (warns: the noise is then reproducible). ``None`` (default) draws
            ``SECRET_BITS`` bits from the OS.

    There is deliberately no ``state_dict``: the noise state never enters a checkpoint, and a
    resumed run draws from a fresh secret.
    """

    def __init__(self, seed: Optional[int] = None, *, stream: int = 0) -> None:
        self.seeded_by_user = seed is not None
        if self.seeded_by_user:
            warn_test_seed("noise_seed", "DP noise")
        self._key_with(secret_seed() if seed is None else int(seed), stream)

    @classmethod
    def from_secret(cls, secret: int) -> "NoiseSource":
        """A source keyed by a secret drawn from the OS elsewhere (rank 0's, broadcast under DDP)."""
        source = cls.__new__(cls)
        source.seeded_by_user = False
        source._key_with(secret)
        return source

    def _key_with(self, secret: int, stream: int = 0) -> None:
        """Every draw is keyed by keyed-BLAKE2b(secret, counter): the same keys on every rank sharing the
        secret, and no key can be computed from the noise another key produced. A test seed's ``stream``
        (a continuation's steps so far) gives each continuation of a test-seeded run its own draws."""
        text = str(int(secret)) if stream == 0 else f"{int(secret)}/{int(stream)}"
        self._key = hashlib.blake2b(text.encode(), digest_size=SECRET_BITS // 8).digest()
        self._counter = 0
        self._forks = _FORKS[0]
        self._pool: Optional[list] = None  # the scalar pool (secret: in memory only) and its next unused value
        self._pool_next = 0
        self._device_divisor: Optional[tuple] = None  # ((device, B), B on that device): public, for the releases there

    def _refuse_after_fork(self) -> None:
        """A forked child holds its parent's key, counter, pool and stream: its draws would repeat the
        parent's. (Lightning's DDP ranks key their own source after they start; DataLoader workers draw none.)"""
        if self._forks != _FORKS[0]:
            raise ForkedNoiseError(
                "This secret noise source was keyed before the process forked: the child would add the same noise as "
                "its parent. Make the noise source in the process that releases (PrivacyComponent.plan does).")

    def gaussian(self, shape, std: float, *, device="cpu", dtype=torch.float32) -> Tensor:
        """A draw of ``N(0, std^2)`` with the given shape, on ``device`` (drawn and scaled in float64)."""
        raise_if_any([check_non_negative("noise std", std)])
        host = torch.from_numpy(self._host_noised(np.zeros(math.prod(shape)), float(std))).view(tuple(shape))
        return to_device_without_waiting(host, device, dtype)

    def noised(self, x: Tensor, std: float, *, divisor: float = 1.0, dtype: Optional[torch.dtype] = None) -> Tensor:
        """``(x + N(0, std^2 I)) / divisor``, a new tensor of ``dtype`` (default ``x``'s). On the host it is computed
        in float64 and rounded once; on the GPU (where the kernel can draw) ``x + std z`` is rounded once by the
        kernel and then divided. The division is post-processing of the noised value either way. A float64 ``x``
        released as float32 (a clipped sum, :func:`~lit_zodp.privacy.clipped_sum`) is rounded only then."""
        if not _std_and_divisor_valid(std, divisor):
            raise_if_any([check_non_negative("noise std", std), check_positive("divisor", divisor)])
        dtype = x.dtype if dtype is None else dtype
        small = 0 < x.numel() <= SCALAR_DRAW  # DPZero's scalars
        if small and not x.is_cpu and x.device.type != "mps" and dtype in HOST_DTYPES:  # (mps has no float64)
            return self._scalars_noised_on_device(x, float(std), float(divisor), dtype)
        if x.is_cpu and x.dtype in HOST_DTYPES and dtype in HOST_DTYPES:
            if small:  # Python floats: two tensor calls per release
                flat = x.dim() == 1
                noisy = self._scalars_noised((x if flat else x.reshape(-1)).tolist(), float(std), float(divisor))
                out = torch.frombuffer(array.array(SCALAR_TYPECODES[dtype], noisy), dtype=dtype)
                return out if flat else out.view(x.shape)
            host = x.detach().numpy()
            noisy = self._host_noised(host.reshape(-1), float(std), divisor, HOST_DTYPES[dtype])
            return torch.from_numpy(noisy.reshape(host.shape))
        if device_noise_available(x) and dtype in KERNEL_DTYPES:
            out = torch.empty(x.shape, dtype=dtype, device=x.device)
            noisy = add_gaussian(x.contiguous(), std, self.device_key(), out=out)
            return noisy if divisor == 1 else noisy / divisor
        host = x.detach().to("cpu", torch.float64).reshape(-1).numpy()
        return torch.from_numpy(self._host_noised(host, float(std), divisor)).view(x.shape).to(x.device, dtype)

    def _scalars_noised(self, values: list, std: float, divisor: float) -> list:
        """``(x_i + std z_i) / divisor`` in float64 for at most ``SCALAR_DRAW`` values, ``z`` the next standard
        normals of the pool (Python floats: in a step's cold caches, a few NumPy calls on a scalar cost tens of us)."""
        return [(value + std * z) / divisor for value, z in zip(values, self._pool_normals(len(values)))]

    def _scalars_noised_on_device(self, x: Tensor, std: float, divisor: float, dtype: torch.dtype) -> Tensor:
        """:meth:`_scalars_noised` where ``x`` lives (an accelerator): the same float64 operations, so the same bits,
        rounded once to ``dtype``. The noise comes from the host's pool, the keystream every zeroth-order release
        draws from on any device; one value travels as a kernel argument, several in one copy from pinned memory
        (neither waits for the device)."""
        noise = [std * z for z in self._pool_normals(x.numel())]
        if len(noise) == 1:
            total = x.double() + noise[0]
        else:
            noise_there = to_device_without_waiting(torch.tensor(noise, dtype=torch.float64), x.device)
            total = x.double() + noise_there.view(x.shape)
        # by a tensor there, into ``dtype`` at once: CUDA divides by a host scalar as a product with its reciprocal,
        # which differs from the quotient in a third of float64 values
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
        return torch.div(total, self._divisor_on(x.device, divisor), out=out)

    def _divisor_on(self, device: torch.device, divisor: float) -> Tensor:
        """``divisor`` as a float64 tensor on ``device``, copied there once (a fit's divisor is its constant B)."""
        if self._device_divisor is None or self._device_divisor[0] != (device, divisor):
            there = to_device_without_waiting(torch.tensor(divisor, dtype=torch.float64), device)
            self._device_divisor = ((device, divisor), there)
        return self._device_divisor[1]

    def _pool_normals(self, count: int) -> list:
        """The pool's next ``count`` (at most ``SCALAR_POOL``) standard normals, refilled from a fresh key when short."""
        if self._forks != _FORKS[0]:  # (inline: every DPZero release passes here)
            self._refuse_after_fork()
        pool, start = self._pool, self._pool_next
        if pool is None or start + count > len(pool):
            pool, start = keystream_normals(self._fresh_secret(SECRET_BITS), SCALAR_POOL).tolist(), 0
            self._pool = pool
        end = self._pool_next = start + count
        return pool[start:end]

    def _host_noised(self, x: np.ndarray, std: float, divisor: float = 1.0,
                     dtype: Optional[np.dtype] = None) -> np.ndarray:
        """``fl((x + std z) / divisor)`` with ``z ~ N(0, I)`` in float64, rounded once to ``dtype`` (default
        ``x``'s): from the scalar pool, one stream up to ``HOST_PART``, else keyed parts on threads."""
        numel, dtype = x.size, x.dtype if dtype is None else dtype
        if numel <= SCALAR_DRAW:
            return np.asarray(self._scalars_noised(x.tolist(), std, divisor)).astype(dtype)
        if numel <= HOST_PART:
            return self._noised_part(self._stream(numel), x, std, divisor, dtype)
        out = np.empty(numel, dtype=dtype)
        starts = range(0, numel, HOST_PART)
        keys = [self._fresh_secret(128) for _ in starts]

        def fill(j: int) -> None:
            part = slice(starts[j], starts[j] + HOST_PART)
            out[part] = self._noised_part(secret_generator(keys[j]), x[part], std, divisor, dtype)

        map_on_threads(fill, len(starts))
        return out

    @staticmethod
    def _noised_part(rng: np.random.Generator, x: np.ndarray, std: float, divisor: float, dtype) -> np.ndarray:
        total = rng.standard_normal(x.size)  # float64
        total *= std
        total += x
        if divisor != 1:
            total /= divisor
        return total.astype(dtype)

    def _stream(self, numel: int) -> np.random.Generator:
        """A generator for the next ``numel`` values: re-keyed whenever ``HOST_PART`` values were drawn from it."""
        self._refuse_after_fork()
        drawn = getattr(self, "_stream_drawn", HOST_PART)
        if drawn + numel > HOST_PART:
            self._stream_rng, drawn = secret_generator(self._fresh_secret(SECRET_BITS)), 0
        self._stream_drawn = drawn + numel
        return self._stream_rng

    def device_key(self) -> SecretKey:
        """128 fresh secret bits for one draw of the device kernel."""
        return SecretKey.from_words64(self._fresh_128_bits())

    def vector_key(self) -> "SecretGaussianVector":
        """A fresh 128-bit key of a d-dimensional standard normal vector, generated lazily by chunk."""
        return SecretGaussianVector(self._fresh_128_bits())

    def _fresh_128_bits(self) -> tuple[int, int]:
        """Two fresh secret 64-bit words."""
        key = self._fresh_secret(128)
        return key & (2**64 - 1), key >> 64

    def _fresh_secret(self, bits: int) -> int:
        """``bits`` (at most 512) fresh secret bits: the next output of the keyed-BLAKE2b counter stream."""
        self._refuse_after_fork()
        self._counter += 1
        digest = hashlib.blake2b(self._counter.to_bytes(8, "little"), key=self._key, digest_size=bits // 8).digest()
        return int.from_bytes(digest, "little")


class SecretGaussianVector:
    """``xi ~ N(0, I_d)`` keyed by 128 secret bits, added chunk by chunk in float64 and never stored.

    DPGD-0th's noise vector: the perturbation engine sums each chunk of its update in float64 and
    calls :meth:`add_scaled_` on that sum, then rounds the chunk once (``fl(theta + private + c xi)``,
    as every host release is rounded). Chunk ``i`` is drawn from Philox(key, counter block ``i``), so
    any chunk can be drawn alone, in any order, on any device.
    """

    name = "secret_gaussian"

    def __init__(self, key: tuple[int, int]) -> None:
        self.key = np.array(key, dtype=np.uint64)

    def add_scaled_(self, total: Tensor, alpha: float, index: int) -> Tensor:
        """``total += alpha * xi_index`` in place, ``total`` a float64 chunk and ``xi_index`` float64.

        On CUDA the chunk is drawn on the device (:mod:`~lit_zodp.privacy.device_noise`, the same 128-bit
        key, pairs from ``index * 2**40``; a negative ``alpha`` adds ``|alpha| xi`` to ``-total``, then
        negates: both exact); on CPU by NumPy's Philox-4x64 from counter block ``index * 2**192``.
        """
        if total.dtype != torch.float64:
            raise ValueError(f"A secret noise vector is summed in float64, but got a {total.dtype} chunk")
        alpha = float(alpha)
        if device_noise_available(total) and total.is_contiguous():
            if alpha < 0:
                total.neg_()
            add_gaussian(total, abs(alpha), SecretKey.from_words64(tuple(self.key)), pair_base=index << 40, out=total)
            return total.neg_() if alpha < 0 else total
        rng = np.random.Generator(np.random.Philox(key=self.key, counter=[0, 0, 0, index]))
        xi = torch.from_numpy(rng.standard_normal(total.numel())).view(total.shape)  # float64
        return total.add_(xi.to(total.device), alpha=alpha)


__all__ = ["ForkedNoiseError", "HOST_PART", "NoiseSource", "SECRET_BITS", "SecretGaussianVector", "keystream_normals",
           "secret_generator", "secret_seed"]

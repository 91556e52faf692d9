"""Direction laws of the two-point estimator, generated chunk by chunk from a seed.

A law turns a seed into the direction ``u`` as a stream of chunks aligned with the parameters, so the
full vector never exists in memory. ``GaussianDirections``: ``u ~ N(0, I_d)`` (DPZero's experiments,
MeZO). ``SphereDirections``: ``u`` uniform on the sphere of radius ``sqrt(d)`` (DPZero Alg. 1-2,
Sec. 3), i.e. ``sqrt(d) z / ||z||`` with one global norm across all tensors.

Chunk ``i`` of ``z(seed)`` is a ``randn`` draw of a generator seeded with ``chunk_seed(seed, i)``: it
depends on ``(seed, i)`` and the chunk layout only, so chunks can be generated in any order and on
several threads (:mod:`lit_zodp.zo.parallel`) with bitwise the same direction, on every process.
"""

from __future__ import annotations

import functools
import math
from typing import Iterator, Sequence

import torch
from torch import Tensor

from lit_zodp.zo.parallel import Scratch, for_each_chunk

#: Chunk size on CPU: a chunk of ``z`` (128 KiB) stays in cache between its generation and its use,
#: each op on it runs single-threaded inside torch, and chunks are spread over the intra-op threads.
DEFAULT_CHUNK = 1 << 15
#: Chunk size on accelerators, where each chunk costs kernel launches (16 MiB of scratch).
DEFAULT_ACCELERATOR_CHUNK = 1 << 22

_MASK64 = (1 << 64) - 1


def default_chunk_numel(params: Sequence[Tensor]) -> int:
    """``DEFAULT_CHUNK`` for CPU parameters, ``DEFAULT_ACCELERATOR_CHUNK`` if any lives on a GPU."""
    if any(p.device.type != "cpu" for p in params):
        return DEFAULT_ACCELERATOR_CHUNK
    return DEFAULT_CHUNK


def parameter_chunks(params: Sequence[Tensor], chunk_numel: int = DEFAULT_CHUNK) -> list[Tensor]:
    """Flat views of at most ``chunk_numel`` elements covering ``params`` in order."""
    chunks = []
    for p in params:
        chunks.extend(flat_view(p).split(chunk_numel))
    return chunks


def flat_view(p: Tensor) -> Tensor:
    """``p`` as one flat view in the order of its storage: a contiguous tensor's own order; a dense one of another
    layout (``channels_last``, a transposed weight) its memory order, which an i.i.d. direction does not care about.
    Before, ``model.to(memory_format=torch.channels_last)`` failed every zeroth-order fit at its start with torch's
    ``view size is not compatible with input tensor's size and stride`` (review 34). A tensor with gaps or
    overlaps, which no in-place pass can write as one buffer, is refused."""
    if p.is_contiguous():
        return p.view(-1)
    dense = p.permute(sorted(range(p.dim()), key=lambda d: -p.stride(d)))
    if not dense.is_contiguous():
        raise ValueError(f"A parameter of shape {tuple(p.shape)} and strides {p.stride()} is not one dense buffer, "
                         "which the zeroth-order engine perturbs in place: make it contiguous (`.contiguous()`)")
    return dense.view(-1)


def unflattened_like(flat: Tensor, p: Tensor) -> Tensor:
    """``flat`` (in :func:`flat_view`'s order of ``p``) as a tensor of ``p``'s shape and layout (a view where ``p`` is
    contiguous: MeZO-BCD's block Adam reads every step's direction through here)."""
    if p.is_contiguous():
        return flat.view(p.shape)
    out = torch.empty_like(p, dtype=flat.dtype, device=flat.device)
    flat_view(out).copy_(flat)
    return out


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers with good avalanche."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=64)
def _seed_base(seed: int) -> int:
    return _mix64(int(seed) & _MASK64)


def chunk_seed(seed: int, index: int) -> int:
    """Seed of chunk ``index`` of the direction ``seed``: a hash of ``seed`` plus ``index``.

    Consecutive offsets keep the chunks of one direction on distinct generator seeds, also where
    the generator keeps only the low 32 bits of its seed (torch's CPU Mersenne Twister).
    """
    return (_seed_base(seed) + index) & _MASK64


class GaussianDirections:
    """``u ~ N(0, I_d)``: chunk ``i`` is a ``randn`` draw of a generator seeded by ``chunk_seed(seed, i)``."""

    name = "gaussian"
    #: Chunk ``i`` of ``u`` is ``scale * fill_chunk_(i)``: the engine generates chunks in any order and
    #: on several threads. The engine refuses laws without this property.
    independent_chunks = True

    def chunk_scale(self, chunks: Sequence[Tensor], seed: int) -> float:
        return 1.0

    def fill_chunk_(self, out: Tensor, seed: int, index: int, generator: torch.Generator) -> Tensor:
        """Standard normal draw (float32) of chunk ``index`` into ``out`` (on ``generator``'s device)."""
        generator.manual_seed(chunk_seed(seed, index))
        return torch.randn(out.shape, generator=generator, out=out)

    def raw_chunks(self, chunks: Sequence[Tensor], seed: int) -> Iterator[Tensor]:
        """Standard normal draws (float32) shaped like each chunk. One buffer, reused: consume each first."""
        scratch = Scratch(max((c.numel() for c in chunks), default=0))
        for index, chunk in enumerate(chunks):
            out = scratch.buffer(chunk.device, chunk.numel())
            yield self.fill_chunk_(out, seed, index, scratch.generator(chunk.device))

    def directions(self, chunks: Sequence[Tensor], seed: int) -> Iterator[Tensor]:
        """The direction ``u`` chunk by chunk. Buffers are reused: consume each before the next."""
        scale = self.chunk_scale(chunks, seed)
        for z in self.raw_chunks(chunks, seed):
            yield z if scale == 1.0 else z.mul_(scale)

    def sum_of_squares(self, chunks: Sequence[Tensor], seed: int) -> float:
        """``||z(seed)||^2`` of the raw draws, accumulated in float64 chunk by chunk, in order."""

        def square(index: int, scratch: Scratch) -> float:
            chunk = chunks[index]
            z = self.fill_chunk_(scratch.buffer(chunk.device, chunk.numel()), seed, index,
                                 scratch.generator(chunk.device))
            return float(z.double().pow(2).sum())

        return math.fsum(for_each_chunk(chunks, square))


class SphereDirections(GaussianDirections):
    """``u = sqrt(d) z / ||z||``: uniform on the sphere of radius ``sqrt(d)`` (DPZero Alg. 2, line 2).

    The global norm costs one extra generation pass per seed; the last few norms are cached.
    """

    name = "sphere"
    cache_size = 16

    def __init__(self) -> None:
        self._norms: dict[tuple[int, int], float] = {}

    def radius(self, dim: int) -> float:
        return math.sqrt(dim)

    def chunk_scale(self, chunks: Sequence[Tensor], seed: int) -> float:
        dim = sum(c.numel() for c in chunks)
        key = (seed, dim)
        if key not in self._norms:
            if len(self._norms) >= self.cache_size:
                self._norms.pop(next(iter(self._norms)))
            self._norms[key] = math.sqrt(self.sum_of_squares(chunks, seed))
        return self.radius(dim) / self._norms[key]


LAWS = {"gaussian": GaussianDirections, "sphere": SphereDirections}


def make_direction_law(name: str) -> GaussianDirections:
    if name not in LAWS:
        raise ValueError(f"Expected `directions` in {sorted(LAWS)}, but got {name!r}")
    return LAWS[name]()

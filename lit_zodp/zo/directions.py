"""Direction laws of the two-point estimator, generated chunk by chunk from a seed.

A law turns a seed into the direction ``u`` as a stream of chunks aligned with the parameters, so the
full vector never exists in memory. ``GaussianDirections``: ``u ~ N(0, I_d)`` (DPZero's experiments,
MeZO). ``SphereDirections``: ``u`` uniform on the sphere of radius ``sqrt(d)`` (DPZero Alg. 1-2,
Sec. 3), i.e. ``sqrt(d) z / ||z||`` with one global norm across all tensors.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import torch
from torch import Tensor

DEFAULT_CHUNK = 1 << 20


def parameter_chunks(params: Sequence[Tensor], chunk_numel: int = DEFAULT_CHUNK) -> list[Tensor]:
    """Flat views of at most ``chunk_numel`` elements covering ``params`` in order."""
    chunks = []
    for p in params:
        chunks.extend(p.view(-1).split(chunk_numel))
    return chunks


class GaussianDirections:
    """``u ~ N(0, I_d)``: each chunk is a fresh ``randn`` draw of the seeded generator."""

    name = "gaussian"

    def chunk_scale(self, chunks: Sequence[Tensor], seed: int) -> float:
        return 1.0

    def raw_chunks(self, chunks: Sequence[Tensor], seed: int) -> Iterator[Tensor]:
        """Standard normal draws (float32) shaped like each chunk, from a generator seeded by ``seed``."""
        generators: dict[torch.device, torch.Generator] = {}
        buffers: dict[torch.device, Tensor] = {}
        for chunk in chunks:
            device = chunk.device
            if device not in generators:
                generators[device] = torch.Generator(device=device).manual_seed(seed)
                buffers[device] = torch.empty(max(c.numel() for c in chunks), device=device)
            out = buffers[device][: chunk.numel()]
            torch.randn(chunk.numel(), generator=generators[device], out=out)
            yield out

    def directions(self, chunks: Sequence[Tensor], seed: int) -> Iterator[Tensor]:
        """The direction ``u`` chunk by chunk. Buffers are reused: consume each before the next."""
        scale = self.chunk_scale(chunks, seed)
        for z in self.raw_chunks(chunks, seed):
            yield z if scale == 1.0 else z.mul_(scale)


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
            squares = sum(float(z.double().pow(2).sum()) for z in self.raw_chunks(chunks, seed))
            self._norms[key] = math.sqrt(squares)
        return self.radius(dim) / self._norms[key]


LAWS = {"gaussian": GaussianDirections, "sphere": SphereDirections}


def make_direction_law(name: str) -> GaussianDirections:
    if name not in LAWS:
        raise ValueError(f"Expected `directions` in {sorted(LAWS)}, but got {name!r}")
    return LAWS[name]()

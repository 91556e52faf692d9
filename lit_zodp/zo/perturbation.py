"""The seeded in-place perturbation engine (the MeZO seed trick, DESIGN.md).

Parameters move in place by multiples of a direction regenerated from its seed, tensor by tensor
and chunk by chunk, under ``no_grad``: no parameter copy, no ``.grad``, no optimizer state. The
engine remembers the perturbation it has applied (``pending``) so that the restore can be fused
into the update: DPZero's ``+lam, -2lam, +lam, -lr*g`` costs three passes over the parameters.

On CPU the passes run chunk-parallel over torch's intra-op threads (:mod:`lit_zodp.zo.parallel`):
each chunk of ``u`` is drawn from its own seed, so the result is bitwise that of one thread.

A :class:`DirectionCache` (opt-in; MeZO-BCD's small blocks) keeps ``u(seed)`` from the first pass, so
the other two passes only add it: on CPU drawing a normal costs about 25x adding it.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
from torch import Tensor

from lit_zodp.zo.directions import (GaussianDirections, default_chunk_numel, flat_view, parameter_chunks,
                                    unflattened_like)
from lit_zodp.zo.parallel import Scratch, for_each_chunk


class DirectionCache:
    """One float32 buffer holding ``u(seed)`` of one engine; engines that take turns share it.

    On CPU, drawing a standard normal costs about 25x adding it (torch's ``normal_`` ~4 ns per
    element, an in-place add ~0.15 ns), so the three passes of a step cost three draws of ``u``.
    An engine with a cache draws ``u`` once, in its first pass, into the cache; the ``-2 lam`` pass
    and the fused restore-and-update read it back. The values are bitwise those drawn without a
    cache. Memory: one float32 element per element of the largest engine using it (MeZO-BCD: one
    block), allocated on first use.
    """

    def __init__(self, numel: int) -> None:
        self.numel = int(numel)
        self._buffer: Tensor | None = None
        self._holder: tuple[int, int] | None = None  # (id(engine), seed) whose u the buffer holds

    def buffer(self, device: torch.device) -> Tensor:
        if self._buffer is None or self._buffer.device != device:
            self._buffer = torch.empty(self.numel, dtype=torch.float32, device=device)
            self._holder = None
        return self._buffer

    def holds(self, engine: object, seed: int) -> bool:
        return self._holder == (id(engine), seed)

    def fill(self, engine: object, seed: int | None) -> None:
        """Record whose direction the buffer holds (``None``: being overwritten)."""
        self._holder = None if seed is None else (id(engine), seed)


class PerturbationEngine:
    """Applies ``theta += s * u(seed)`` and fused restore-and-update passes.

    Args:
        params: the parameters, in a fixed order (the order defines the direction).
        law: the direction law (Gaussian, sphere, ...).
        chunk_numel: largest block generated at once; peak extra memory is one chunk per thread.
            ``None``: ``DEFAULT_CHUNK`` (32768) on CPU, ``DEFAULT_ACCELERATOR_CHUNK`` on GPUs. The
            direction of a seed depends on the chunk layout.
        cache: keep the direction of the last perturbation in this :class:`DirectionCache` (at least
            ``dim`` elements), so a step draws ``u`` once instead of three times. ``None``: no cache.
    """

    def __init__(self, params: Sequence[Tensor], law: GaussianDirections | None = None,
                 *, chunk_numel: int | None = None, cache: DirectionCache | None = None) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("The perturbation engine needs at least one trainable parameter")
        self.law = law or GaussianDirections()
        if not _chunkwise(self.law):
            raise ValueError(f"{type(self.law).__name__} must draw each chunk independently "
                             "(`independent_chunks = True` and `fill_chunk_`), as the engine's passes need")
        self.chunk_numel = chunk_numel or default_chunk_numel(self.params)
        self.pending: dict[int, float] = {}
        self._chunks = parameter_chunks(self.params, self.chunk_numel)
        self._owner = _chunk_owners(self.params, self.chunk_numel)
        if cache is not None and cache.numel < self.dim:
            raise ValueError(f"The direction cache holds {cache.numel} elements, fewer than the engine's {self.dim}")
        self.cache = cache
        self._cache_views: list[Tensor] | None = None

    def __getstate__(self) -> dict:
        """A copy (a callback's ``deepcopy`` of the module: an EMA or teacher model) or pickle holds no chunk views: they
        are views of a split that a pass wrote, which torch refuses to deep-copy (every zeroth-order module's deepcopy
        raised ``RuntimeError: Output 0 of Split is a view ...``, during a fit and after it, review 24). They are made
        again from the copy's parameters."""
        return {**self.__dict__, "_chunks": None, "_cache_views": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._chunks = parameter_chunks(self.params, self.chunk_numel)

    @property
    def dim(self) -> int:
        return sum(p.numel() for p in self.params)

    @torch.no_grad()
    def perturb_(self, seed: int, scale: float) -> None:
        """``theta += scale * u(seed)`` in place (drawing ``u`` into the cache, if any, unless it holds it)."""
        chunks = self._chunks
        direction = self._direction_source(seed, fill_cache=True)

        def work(index: int, scratch: Scratch) -> None:
            chunk = chunks[index]
            chunk.add_(_as_dtype(direction(index, scratch), chunk), alpha=scale)

        for_each_chunk(chunks, work)
        if self.cache is not None:
            self.cache.fill(self, seed)
        self._track(seed, scale)

    def _direction_source(self, seed: int, *, fill_cache: bool = False):
        """``(index, scratch) -> chunk index of u(seed)``: from the cache when it holds ``u(seed)``.

        ``fill_cache``: draw into the cache (which then holds nothing until the caller's pass ends).
        """
        law, cache = self.law, self.cache
        if cache is not None and cache.holds(self, seed):
            views = self._cached_chunks()
            return lambda index, scratch: views[index]
        chunks, factor = self._chunks, law.chunk_scale(self._chunks, seed)
        if cache is not None and fill_cache:
            views = self._cached_chunks()
            cache.fill(self, None)
            return lambda index, scratch: _direction_chunk(law, chunks[index], seed, index, factor, scratch,
                                                           out=views[index])
        return lambda index, scratch: _direction_chunk(law, chunks[index], seed, index, factor, scratch)

    def _cached_chunks(self) -> list[Tensor]:
        """The cache's buffer split like the parameter chunks (views, made once per buffer)."""
        buffer = self.cache.buffer(self._chunks[0].device)
        if self._cache_views is None or self._cache_views[0]._base is not buffer:
            self._cache_views = list(buffer[:self.dim].split([c.numel() for c in self._chunks]))
        return self._cache_views

    @torch.no_grad()
    def restore_and_update_(self, coefficients: Mapping[int, float] | None = None,
                            *, lr: Sequence[float] | float = 0.0,
                            weight_decay: Sequence[float] | float = 0.0,
                            extra_terms: Sequence[tuple] = ()) -> None:
        """One pass: remove every pending perturbation, then ``theta <- (1-lr*wd) theta - lr * sum_k c_k u_k``.

        ``lr`` and ``weight_decay`` are scalars or one value per parameter (from param groups).
        ``extra_terms`` are ``(noise, c)`` pairs adding ``-lr * c * xi`` for a secret vector ``xi`` that
        ``noise.add_scaled_(total, alpha, index)`` adds to a float64 chunk (DPGD-0th's noise vector).
        With no coefficients this is an exact restore.
        """
        lrs = _per_param(lr, len(self.params))
        decays = _per_param(weight_decay, len(self.params))
        terms = [(seed, self.pending.get(seed, 0.0), (coefficients or {}).get(seed, 0.0))
                 for seed in sorted(set(self.pending) | set(coefficients or {}))]
        noise = [(_noise_law(law), float(c)) for law, c in extra_terms]
        self._restore_and_update_chunkwise(terms, noise, lrs, decays)
        self.pending.clear()

    def _restore_and_update_chunkwise(self, terms: list, noise: list, lrs: list[float], decays: list[float]) -> None:
        """The fused pass chunk by chunk (chunk-parallel on CPU threads).

        With a noise vector (DPGD-0th) the chunk's new value is summed in float64, the noise drawn in
        float64 and added to that sum, and the sum rounded into the parameter ONCE, as every host
        release is (``fl(x + std z)``, :mod:`lit_zodp.privacy.noise`). Rounding ``theta - lr c u``
        first would release a noise-free function of the private ``c`` (a bf16 parameter would drop a
        noise below half an ulp altogether); float32 noise summed in float32 leaves holes whose place
        depends on the private term. The parameter changes only through this one rounding,
        post-processing of the noised release.
        """
        chunks, owners = self._chunks, self._owner
        sources = [self._direction_source(seed) for seed, _, _ in terms]

        def work(index: int, scratch: Scratch) -> None:
            chunk, owner = chunks[index], owners[index]
            shrink = 1.0 - lrs[owner] * decays[owner]
            if shrink != 1.0:
                chunk.mul_(shrink)
            total = chunk.double() if noise else None
            for (seed, pending, coefficient), direction in zip(terms, sources):
                alpha = -shrink * pending - lrs[owner] * coefficient
                if alpha == 0.0:
                    continue
                if total is not None:
                    total.add_(direction(index, scratch), alpha=alpha)  # float32 u, added in float64
                else:
                    chunk.add_(_as_dtype(direction(index, scratch), chunk), alpha=alpha)
            if total is not None:
                for law, c in noise:
                    law.add_scaled_(total, -lrs[owner] * c, index)
                chunk.copy_(total)  # the one rounding

        for_each_chunk(chunks, work)

    def restore_(self) -> None:
        """Undo every pending perturbation (exact up to floating point)."""
        if self.pending:
            self.restore_and_update_()

    def direction_norm(self, seed: int) -> float:
        """``||u(seed)||`` over all parameters (one generation pass, float64 accumulation)."""
        law, chunks = self.law, self._chunks
        factor = law.chunk_scale(chunks, seed)

        def square(index: int, scratch: Scratch) -> float:
            u = _direction_chunk(law, chunks[index], seed, index, factor, scratch)
            return float(u.double().pow(2).sum())

        return math.sqrt(math.fsum(for_each_chunk(chunks, square)))

    def direction(self, seed: int) -> list[Tensor]:
        """The full direction as tensors shaped like the parameters (tests and references only)."""
        flat = torch.cat([u.clone().float() for u in self.law.directions(self._chunks, seed)])
        return [unflattened_like(t, p) for t, p in zip(flat.split([p.numel() for p in self.params]), self.params)]

    def _track(self, seed: int, scale: float) -> None:
        total = self.pending.get(seed, 0.0) + scale
        if abs(total) <= 1e-12 * max(1.0, abs(scale)):
            self.pending.pop(seed, None)
        else:
            self.pending[seed] = total


def _noise_law(law):
    if not callable(getattr(law, "add_scaled_", None)):
        raise ValueError(f"{type(law).__name__} is not a noise vector: extra terms need "
                         "`add_scaled_(total, alpha, index)`")
    return law


def _chunkwise(law) -> bool:
    return bool(getattr(law, "independent_chunks", False))


def _as_dtype(u: Tensor, chunk: Tensor) -> Tensor:
    return u if u.dtype == chunk.dtype else u.to(chunk.dtype)


def _direction_chunk(law, chunk: Tensor, seed: int, index: int, factor: float, scratch: Scratch,
                     out: Tensor | None = None) -> Tensor:
    """Chunk ``index`` of ``u(seed)`` (float32, in ``out`` or ``scratch``'s buffer): ``factor * z_index``."""
    if out is None:
        out = scratch.buffer(chunk.device, chunk.numel())
    z = law.fill_chunk_(out, seed, index, scratch.generator(chunk.device))
    return z if factor == 1.0 else z.mul_(factor)


def _chunk_owners(params: Sequence[Tensor], chunk_numel: int) -> list[int]:
    owners = []
    for index, p in enumerate(params):
        owners.extend([index] * len(flat_view(p).split(chunk_numel)))
    return owners


def _per_param(value, count: int) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * count
    values = [float(v) for v in value]
    if len(values) != count:
        raise ValueError(f"Expected {count} per-parameter values, but got {len(values)}")
    return values

"""Public batches for the algorithms that use public data beside the private batch (PAZO, DOPE-SGD, DPMD).

A step's public batch comes with its private one from the DataModule (``public_in_step: true``: the training batch
is ``{"private": ..., "public": ...}``, the same public batch on every DDP rank), or, for a Trainer fed private
batches alone, from :meth:`PublicBatches.use_public_data`. Public data is data-independent of the private set by
declaration (a disjoint hold-out, or another corpus): it costs no privacy.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor
from torch.utils._pytree import tree_flatten

from lit_zodp.errors import ConfigError
from lit_zodp.privacy.fixed_shape import take_rows


class PublicBatches:
    """Mixin of an :class:`~lit_zodp.algorithms.AlgorithmModule` whose every step reads a public batch."""

    #: Every training step needs a public batch (the DataModule's ``public_in_step``).
    needs_public_batches = True

    def use_public_data(self, batches: Iterable) -> Any:
        """Take each step's public batch from ``batches`` (an iterable of ``(inputs, targets)``, e.g. a DataLoader,
        read again from its start when exhausted; step ``t`` takes batch ``t`` modulo its length, so a resumed fit
        continues the stream) where the training batch carries none: for a Trainer fed private batches alone. The
        batches are cast to the Trainer's precision and moved to the device as training batches are. The same batches
        must reach every DDP rank. Returns the module."""
        self._public_source = batches
        self._public_iterator = None
        return self

    def public_batches(self, batch, k: int = 1) -> list:
        """The step's public batch cut into ``k`` consecutive parts of (nearly) equal size (PAZO's ``B'_1..B'_k``)."""
        _, public = self.split_batch(batch)
        given = public is None  # (from `use_public_data`)
        if given:
            public = self._next_public_batch()
        if not getattr(self, "_public_ranks_checked", False):
            self._refuse_public_batches_differing_between_ranks(public)
        inputs, targets = public
        rows = len(targets)
        if rows < k:
            fix = (f"give `use_public_data` a loader of at least {k} rows in every batch (batch_size >= {k}, "
                   "drop_last=True)" if given else
                   f"set the DataModule's `public_batch_size` (the public loader's batch size) to at least {k}")
            raise ConfigError(f"{type(self).__name__} cuts each public batch into k={k} parts, but got {rows} public "
                              f"rows: {fix} (k times b')")
        bounds = [round(rows * j / k) for j in range(k + 1)]
        return [(take_rows(inputs, slice(a, b)), targets[a:b]) for a, b in zip(bounds, bounds[1:])]

    def finite_public_gradient(self, public_batch, params) -> list[Tensor]:
        """:meth:`public_gradient`, refused in one line where it is not finite (the public loss diverged at these
        weights): PAZO-M would write NaN into every weight, and PAZO-P's basis would lose the column silently. Refused
        before the step releases anything; the weights it is taken at are post-processing of earlier releases."""
        grads = self.public_gradient(public_batch, params)
        if not bool(torch.stack([g.isfinite().all() for g in grads]).all()):
            raise ConfigError(f"{type(self).__name__}: the public gradient at step {self.global_step} is not finite "
                              "(the public batch's loss is inf or NaN at these weights): lower `lr`, or check the "
                              "public data")
        return grads

    def _refuse_public_batches_differing_between_ranks(self, public) -> None:
        """Under DDP every rank must step along the same public gradients: a loader shuffled per rank, or Lightning's
        distributed sampler splitting a public loader passed to ``trainer.fit``, would make the replicas drift apart
        silently. Checked once per fit, on its first public batch (a digest all-reduced across ranks)."""
        self._public_ranks_checked = True
        world_size = self.trainer.world_size if self._trainer is not None else 1
        if world_size > 1 and public_batches_differ(public_digest(public), self.reduce_sum, world_size):
            raise ConfigError(f"{type(self).__name__}: the DDP ranks got different public batches; every rank must "
                              "read the same ones (the DataModule's `public_in_step` does; a loader of your own must "
                              "not be shuffled per rank or split by a distributed sampler)")

    def private_batch(self, batch):
        """The step's private ``(inputs, targets)``."""
        (inputs, targets), _ = self.split_batch(batch)
        return inputs, targets

    def __getstate__(self) -> dict:
        """A copy or pickle holds the public source, not an iterator over it (a DataLoader's iterator pickles not)."""
        return {**super().__getstate__(), "_public_iterator": None}

    def _next_public_batch(self):
        source = getattr(self, "_public_source", None)
        if source is None:
            raise ConfigError(f"{type(self).__name__} needs a public batch with every private one: give the DataModule "
                              "`public_in_step: true` and a public split (public_fraction > 0), train on "
                              "{'private': loader, 'public': loader}, or call `module.use_public_data(loader)`")
        if self._public_iterator is None:  # (this fit's first draw)
            self._public_iterator = self._public_stream_at(self.global_step)
        batch = next(self._public_iterator, None)
        if batch is None:
            self._public_iterator = iter(source)
            batch = next(self._public_iterator, None)
            if batch is None:
                raise ConfigError(f"{type(self).__name__}: the public data given to `use_public_data` is empty")
        if self._trainer is not None:  # (as Lightning's loop treats a training batch: a `*-true` precision's dtype)
            batch = self._trainer.precision_plugin.convert_input(batch)
        return move_data_to_device(batch, self.device)

    def _public_stream_at(self, step: int):
        """An iterator over the public source at step ``step``'s batch, ``step`` modulo its length (one batch a step):
        a fit resumed from a checkpoint continues the stream. A source without a length is read from its start."""
        length = len(self._public_source) if hasattr(self._public_source, "__len__") else 0
        iterator = iter(self._public_source)
        for _ in range(step % length if length else 0):
            next(iterator, None)
        return iterator

    def on_train_start(self) -> None:
        super().on_train_start()
        self._public_iterator = None  # (each fit finds its place in the stream from its step)
        self._public_ranks_checked = False


def public_digest(public) -> Tensor:
    """A float64 vector that differs between two public batches unless they hold the same rows in the same order: per
    tensor, the position-weighted sum of its rows' sums and its sum of squares."""
    parts = []
    for leaf in tree_flatten(public)[0]:
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            rows = leaf.detach().double().reshape(len(leaf), -1)
            positions = torch.arange(1, len(rows) + 1, dtype=torch.float64, device=rows.device)
            parts += [(rows.sum(1) * positions).sum(), rows.pow(2).sum()]
    return torch.stack(parts)


def public_batches_differ(digest: Tensor, reduce_sum, world_size: int) -> bool:
    """Whether the ranks' digests differ: their all-reduced sum is ``world_size`` times this rank's only if all agree
    (to float64 rounding)."""
    total = reduce_sum(digest.clone())
    return not torch.allclose(total, digest * world_size, rtol=1e-12, atol=1e-12)


__all__ = ["PublicBatches", "public_batches_differ", "public_digest"]

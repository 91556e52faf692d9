"""Public batches for the algorithms that use public data beside the private batch (PAZO, DOPE-SGD, DPMD).

A step's public batch comes with its private one from the DataModule (``public_in_step: true``: the training batch
is ``{"private": ..., "public": ...}``, the same public batch on every DDP rank), or, for a Trainer fed private
batches alone, from :meth:`PublicBatches.use_public_data`. Public data is data-independent of the private set by
declaration (a disjoint hold-out, or another corpus): it costs no privacy.
"""

from __future__ import annotations

from typing import Any, Iterable

from lightning.fabric.utilities.apply_func import move_data_to_device

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


__all__ = ["PublicBatches"]

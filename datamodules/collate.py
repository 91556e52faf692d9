"""Collation that survives empty Poisson batches.

Under Poisson sampling a batch may hold no example at all. ``default_collate([])`` fails, so an
empty batch is built from the collated *structure* of one example, every tensor sliced to zero rows:
shapes (after the batch dimension), dtypes and dict keys are those of a real batch. The template
example's values never leave this module (only ``[:0]`` slices of it do).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import torch
from torch.utils.data import Dataset
from torch.utils.data.dataloader import default_collate


def empty_like_batch(batch: Any) -> Any:
    """Slice every tensor of a collated batch to zero rows, keeping the nesting.

    Args:
        batch: a collated batch: a tensor, or a tuple/list/dict nesting of tensors.

    Returns:
        The same structure with each tensor ``t`` replaced by ``t[:0]``.
    """
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, Mapping):
        return type(batch)({key: empty_like_batch(value) for key, value in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(empty_like_batch(value) for value in batch))
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        return type(batch)(empty_like_batch(value) for value in batch)
    return batch


class EmptySafeCollate:
    """A collate function that returns a zero-row batch for an empty index list.

    Picklable (DataLoader workers), and caches the empty template after its first use.

    Args:
        dataset: the dataset the loader reads; ``dataset[0]`` gives the template of an empty batch.
        collate_fn: collation of non-empty batches; ``default_collate`` by default.
    """

    def __init__(self, dataset: Dataset, collate_fn: Optional[Callable[[list], Any]] = None) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn or default_collate
        self._empty: Any = None

    def __call__(self, examples: list) -> Any:
        if len(examples) > 0:
            return self.collate_fn(examples)
        if self._empty is None:
            self._empty = empty_like_batch(self.collate_fn([self.dataset[0]]))
        return self._empty

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_empty": None}


__all__ = ["EmptySafeCollate", "empty_like_batch"]

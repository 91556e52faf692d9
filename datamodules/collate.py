"""Collation that survives empty Poisson batches, and dynamic padding of tokenized text.

Under Poisson sampling a batch may hold no example at all. ``default_collate([])`` fails, so an
empty batch is built from the collated *structure* of one example, every tensor sliced to zero rows:
shapes (after the batch dimension), dtypes and dict keys are those of a real batch. The template
example's values never leave this module (only ``[:0]`` slices of it do).

Dynamic padding (:class:`PadToLongest`): text data modules store every row right-padded to
``max_length``; a batch is then cut to the longest row it holds (the last position any row attends to),
so a batch of short sentences costs short sequences. Only columns that are padding in *every* row are
dropped, from the right: token positions, ``<mask>`` positions and candidate spans (``candidate_mask``)
are unchanged, and models that mask padding (attention mask; RoBERTa/OPT positions from the ids or the
mask) give the same outputs as with fixed padding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import torch
from torch.utils.data import Dataset
from torch.utils.data.dataloader import default_collate

from lit_zodp.privacy.fixed_shape import cut_columns, used_lengths


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


def stacked_collate(examples: Any) -> Any:
    """Collate a :class:`~datamodules.datasets.StackedRows` batch (gathered by the dataset's ``__getitems__``) as its
    ``(inputs, targets)``; anything else with ``default_collate``."""
    from datamodules.datasets import StackedRows

    if isinstance(examples, StackedRows):
        return examples.inputs, examples.targets
    return default_collate(examples)


def trim_to_longest(inputs: Mapping[str, torch.Tensor], mask_key: str = "attention_mask") -> dict[str, torch.Tensor]:
    """Cut the sequence dimension of a tokenized batch to its longest row.

    Args:
        inputs: collated tensors; ``inputs[mask_key]`` is ``[..., L]`` (``[B, L]``, or ``[B, K, L]`` for
            candidate scoring) with 1 on real tokens.
        mask_key: the attention mask.

    Returns:
        The tensors whose leading shape is the mask's, narrowed to ``L' = 1 + the last position any row
        attends to`` (contiguous); other entries unchanged. A batch without rows is returned as is.
    """
    mask = inputs[mask_key]
    if mask.numel() == 0:
        return dict(inputs)
    longest = max(int(used_lengths(mask).max()), 1)
    if longest == mask.shape[-1]:
        return dict(inputs)
    return cut_columns(inputs, longest, mask_key)


class PadToLongest:
    """Collate ``(inputs, target)`` pairs of tokenized text and pad to the longest row of the batch
    (:func:`trim_to_longest`): the text data modules' default (``pad_to_max_length=False``).

    Picklable (DataLoader workers). Wrap it in :class:`EmptySafeCollate` for Poisson batches.
    """

    def __init__(self, mask_key: str = "attention_mask") -> None:
        self.mask_key = mask_key

    def __call__(self, examples: list) -> Any:
        inputs, targets = default_collate(examples)
        return trim_to_longest(inputs, self.mask_key), targets


def text_collate(pad_to_max_length: bool) -> Optional[Callable[[list], Any]]:
    """The collate function of a text data module: :class:`PadToLongest` (dynamic padding), or ``None``
    (``default_collate``: every row keeps its ``max_length`` columns) with ``pad_to_max_length``."""
    return None if pad_to_max_length else PadToLongest()


__all__ = ["EmptySafeCollate", "PadToLongest", "empty_like_batch", "stacked_collate", "text_collate",
           "trim_to_longest"]

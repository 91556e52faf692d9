"""Fixed-shape private forwards: each example's value computed the same way whatever its batch-mates.

Clipping bounds the sensitivity only if adding or removing one example leaves the *other* examples'
clipped values where they were. In exact arithmetic it does; in floating point it need not: batched
GPU kernels choose their reduction order by the shape of the call (cuBLAS tile sizes and split-K by
the number of rows, attention splits by the sequence length), so an example's loss moves by rounding
with the number of rows it is forwarded with and with the longest row of its batch (He et al.,
"Defeating Nondeterminism in LLM Inference", Thinking Machines Lab, 2025). The ZO modules divide
the loss difference by ``2 lam``, which amplifies that rounding (an audit measured up to 0.7 per
example in bf16).

:class:`FixedShapeForwards` forwards a private batch as chunks of exactly ``rows`` rows of one row
shape: the last chunk is filled with copies of its own first row, whose outputs are dropped. Every
private forward of a run then has one shape (or one per length bucket, chosen by the row alone), and
deterministic kernels compute a row of a given shape the same way whatever the other rows hold and
wherever it sits: an example's value depends on its own data only. Rows of one shape are the data's
part: text modules must pad every row to ``max_length`` (``pad_to_max_length: true``); a batch of
another row shape is refused.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor

from lit_zodp.backbones.base import Inputs, batch_size_of
from lit_zodp.errors import PrivacyConfigError

RowShape = tuple[tuple[str, tuple[int, ...]], ...]


def take_rows(inputs: Inputs, rows: slice | Tensor) -> Inputs:
    """The rows ``rows`` of a tensor or of every tensor of a dict (batch dimension first)."""
    if isinstance(inputs, Mapping):
        return {key: value[rows] for key, value in inputs.items()}
    return inputs[rows]


def split_rows(inputs: Inputs, targets: Tensor, size: Optional[int]) -> Iterator[tuple[Inputs, Tensor]]:
    """Consecutive chunks of at most ``size`` rows (``None``: the batch as one chunk)."""
    total = len(targets)
    if size is None or total <= size:
        yield inputs, targets
        return
    for start in range(0, total, size):
        part = slice(start, start + size)
        yield take_rows(inputs, part), targets[part]


def row_shape(inputs: Inputs) -> RowShape:
    """The shape of one row: each tensor's shape without its batch dimension."""
    items = inputs.items() if isinstance(inputs, Mapping) else (("inputs", inputs),)
    return tuple((key, tuple(value.shape[1:])) for key, value in items)


class FixedShapeForwards:
    """Chunks of exactly ``rows`` rows of one row shape for every private forward.

    ``lengths``: sequence-length buckets for text (a dict input with an ``attention_mask``): each row
    goes to the shortest bucket that holds its last attended token and is forwarded cut to that many
    columns, with rows of its own bucket only. The bucket is a function of the row alone, so the
    value still depends on the row alone; cutting only drops padding columns (as dynamic padding
    does). ``None``: every row at the data's full length.
    """

    def __init__(self, rows: int, lengths: Optional[Sequence[int]] = None, mask_key: str = "attention_mask") -> None:
        self.rows = rows
        self.lengths = None if lengths is None else sorted(set(lengths))
        self.mask_key = mask_key
        self.row_shape: Optional[RowShape] = None

    def chunks(self, inputs: Inputs, targets: Tensor) -> Iterator[tuple[Inputs, Tensor, Tensor]]:
        """``(inputs, targets, positions)`` of each chunk: ``rows`` rows, the first ``len(positions)``
        of which are the batch's rows ``positions``; the others copy the chunk's first row."""
        self.check_row_shape(inputs)
        for length, members in self._groups(inputs, targets.device):
            for start in range(0, len(members), self.rows):
                positions = members[start:start + self.rows]
                index = torch.cat([positions, positions[:1].expand(self.rows - len(positions))])
                rows = take_rows(inputs, index)
                yield (rows if length is None else cut_columns(rows, length, self.mask_key)), targets[index], positions

    def _groups(self, inputs: Inputs, device: torch.device) -> list[tuple[Optional[int], Tensor]]:
        """``(length, row positions)`` per bucket in use (one group of every row without buckets)."""
        if not self._bucketed(inputs) or batch_size_of(inputs) == 0:
            return [(None, torch.arange(batch_size_of(inputs), device=device))]
        mask = inputs[self.mask_key]
        width = mask.shape[-1]
        buckets = [length for length in self.lengths if length < width] + [width]
        bucket_of = torch.bucketize(used_lengths(mask), torch.tensor(buckets, device=mask.device))  # shortest >= used
        return [(buckets[b], torch.nonzero(bucket_of == b).flatten()) for b in bucket_of.unique().tolist()]

    def _bucketed(self, inputs: Inputs) -> bool:
        return self.lengths is not None and isinstance(inputs, Mapping) and self.mask_key in inputs

    def check_row_shape(self, inputs: Inputs) -> None:
        """Refuse a batch whose rows have another shape than the fit's (:func:`refuse_rows_of_several_shapes` sets it
        before the first step; an empty batch has no row to compare). The message names no shape: a row's length is
        private (review 21)."""
        if batch_size_of(inputs) == 0:
            return
        shape = row_shape(inputs)
        if self.row_shape is None:
            self.row_shape = shape
        elif shape != self.row_shape:
            raise PrivacyConfigError(SEVERAL_SHAPES)

    def refuse_rows_of_several_shapes(self, loader: Any) -> None:
        """Before a fit's first step, every row of a private loader's dataset collated alone must have one shape,
        which the fit's batches are then held to. Review 21: the shape was taken from the first batch, so data
        padded to each batch's longest row whose rows were all as long but one (10 tokens, one of 12) ran until the
        first Poisson batch that held that row and stopped there (DPZero after 1-5 of 30 steps, DPSGD after 1-20;
        all 30 without the row), printing its length. Now such data is refused before the first step, in one line
        naming no shape; a single row's collation is one dataset read per private row."""
        dataset, collate = loader.dataset, loader.collate_fn
        shapes = {row_shape(inputs_of(collate([dataset[i]]))) for i in range(len(dataset))}
        if len(shapes) > 1:
            raise PrivacyConfigError(SEVERAL_SHAPES)
        self.row_shape = next(iter(shapes), None)


#: The refusal of rows of several shapes under ``fixed_forward_rows`` (one line, no shape: review 21).
SEVERAL_SHAPES = ("`fixed_forward_rows` needs every private row in one shape, but the private data has rows of more "
                  "than one: pad every row to max_length (the data module's `pad_to_max_length: true`)")


def inputs_of(batch: Any) -> Inputs:
    """The inputs of a collated ``(inputs, targets)`` batch."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def used_lengths(mask: Tensor) -> Tensor:
    """Per row of ``mask [B, ..., L]``: 1 + the last position any of its entries attends to (0: none)."""
    attended = mask.flatten(1, -2).ne(0).any(1) if mask.dim() > 2 else mask.ne(0)
    return torch.where(attended, torch.arange(1, mask.shape[-1] + 1, device=mask.device), 0).amax(1)


def rows_ending_early(mask: Tensor) -> Tensor:
    """Per row of ``mask [B, ..., L]``: whether it is shorter than ``L`` (``used_lengths(mask) < L``), read from the
    last column alone: a row is shorter exactly when none of its entries attends to position ``L - 1``."""
    last = mask[..., -1]
    return last.flatten(1).eq(0).all(1) if last.dim() > 1 else last.eq(0)


def any_row_ends_early(mask: Tensor) -> bool:
    """``rows_ending_early(mask).any()`` for a host mask, read from its last column as a Python list: before a step,
    in cold caches, that took 15 us where the torch ops took 32 and NumPy's 57 (text_host, AMD EPYC)."""
    last = mask[..., -1]
    if last.dim() < 2:
        return 0 in last.reshape(-1).tolist()
    return any(not any(row) for row in last.flatten(1).tolist())  # (an empty batch: no row)


def cut_columns(inputs: Mapping[str, Tensor], length: int, mask_key: str = "attention_mask") -> dict[str, Tensor]:
    """The first ``length`` columns of every tensor laid out like ``inputs[mask_key]`` (its sequence
    dimension last; contiguous); other entries as they are."""
    mask = inputs[mask_key]
    dim = mask.dim() - 1
    return {key: value.narrow(dim, 0, length).contiguous()
            if isinstance(value, Tensor) and value.shape[:mask.dim()] == mask.shape else value
            for key, value in inputs.items()}


__all__ = ["SEVERAL_SHAPES", "FixedShapeForwards", "any_row_ends_early", "cut_columns", "inputs_of", "row_shape",
           "rows_ending_early", "split_rows", "take_rows", "used_lengths"]

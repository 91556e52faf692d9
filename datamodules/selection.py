"""Which pool examples are public: the choices of ``PublicPrivateDataModule(public_selection=...)``.

* ``"random"``: the first ``n_public`` of the ``data_seed`` permutation (the base class's carve, unchanged).
* ``"first"``: pool indices ``0 .. n_public - 1`` in file order, whatever their labels: the PAZO authors' CIFAR-10
  code takes training images 0-1999 as public (``xuchengong/PAZO``, ``trainers/model_base.py``; App. C.1: "4% of
  the training samples").
* ``"per_class"``: ``counts[c]`` examples of each class ``c`` (:func:`largest_remainder_counts` of the relative
  ``public_class_weights``), each class's examples taken in the ``data_seed`` permutation order: App. C.1's class
  profiles of the public set (Table 7: "slight imbalance" ``[1:...:0.85]``, "big imbalance" ``[1.0:0.9:...:0.1]``)
  and Tiny-ImageNet's "20 samples per class".

``"per_class"`` reads the labels of the whole pool, private rows included: the split is then a curation by label,
as in the paper, and the privacy guarantee is for the private set GIVEN that split (as for any data set a curator
prepared). Which rows are public depends on the permutation and on the labels of the rows before them in it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

from lit_zodp.errors import ConfigError, check_choice

PUBLIC_SELECTIONS = ("random", "first", "per_class")


def largest_remainder_counts(total: int, weights: Sequence[float]) -> list[int]:
    """Integer counts proportional to ``weights`` summing to ``total`` (Hamilton's largest-remainder method).

    Class ``c``'s quota is ``total * w_c / sum(w)``; each class gets the floor of its quota, and the ``total - sum of
    floors`` classes with the largest fractional parts get one more (ties: the lower class index first).

    Args:
        total: number of examples to share out, ``>= 0``.
        weights: relative weights, ``>= 0``, not all zero.
    """
    weight_sum = math.fsum(weights)
    quotas = [total * w / weight_sum for w in weights]
    counts = [math.floor(q) for q in quotas]
    left = total - sum(counts)
    by_remainder = sorted(range(len(weights)), key=lambda c: (-(quotas[c] - counts[c]), c))
    for c in by_remainder[:left]:
        counts[c] += 1
    return counts


def per_class_public(order: Sequence[int], labels: Sequence[int], counts: Sequence[int]) -> list[int]:
    """The first ``counts[c]`` indices of each class ``c`` in ``order``; refuses a class with fewer examples.

    Args:
        order: pool indices in the ``data_seed`` permutation order.
        labels: one class index per pool example, in ``[0, len(counts))``.
        counts: public examples wanted per class.
    """
    taken = [0] * len(counts)
    chosen = []
    for i in order:
        c = labels[i]
        if taken[c] < counts[c]:
            chosen.append(i)
            taken[c] += 1
    short = [c for c in range(len(counts)) if taken[c] < counts[c]]
    if short:
        c = short[0]
        raise ConfigError(f"`public_selection`='per_class' asks class {c} for {counts[c]} public examples, but the "
                          f"pool holds fewer: lower `public_fraction` or class {c}'s `public_class_weights` entry")
    return chosen


def class_weight_errors(selection: Any, weights: Optional[Sequence[Any]], num_classes: Optional[int]) -> list[str]:
    """Messages for a bad ``public_selection`` / ``public_class_weights`` pair (``num_classes`` when known)."""
    if selection not in PUBLIC_SELECTIONS:
        return [check_choice("public_selection", selection, PUBLIC_SELECTIONS)]
    if weights is None:
        return []
    if selection != "per_class":
        return [f"`public_class_weights` is for public_selection='per_class', but got "
                f"public_selection={selection!r}"]
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence) or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in weights):
        return [f"Expected `public_class_weights` to be a list of finite numbers, but got {weights!r}"]
    if num_classes is not None and len(weights) != num_classes:
        return [f"Expected `public_class_weights` to have one weight per class ({num_classes}), but got "
                f"{len(weights)}"]
    if any(w < 0 for w in weights):
        return [f"Expected `public_class_weights` >= 0, but got {list(weights)!r}"]
    if not any(w > 0 for w in weights):
        return ["Expected `public_class_weights` not all zero (they are relative class sizes of the public set)"]
    return []


def label_list(labels: Any, pool_size: int, num_classes: int, owner: str) -> list[int]:
    """The pool's labels as a list of ints in ``[0, num_classes)``; one line if they cannot be read or are out of
    range (``owner`` names the data module)."""
    if labels is None:
        raise ConfigError(f"`public_selection`='per_class' needs the pool's labels, but {owner} gives none (its "
                          "`load_splits` sets `DataSplits.train_labels`, or its pool has `.targets` / `.labels`)")
    values = labels.tolist() if hasattr(labels, "tolist") else list(labels)
    if len(values) != pool_size:
        raise ConfigError(f"{owner}: {len(values)} pool labels for a pool of {pool_size} examples")
    if any(not isinstance(v, int) or not 0 <= v < num_classes for v in values):
        raise ConfigError(f"`public_selection`='per_class': {owner}'s pool labels must be class indices in "
                          f"[0, {num_classes})")
    return values


__all__ = ["PUBLIC_SELECTIONS", "class_weight_errors", "label_list", "largest_remainder_counts", "per_class_public"]

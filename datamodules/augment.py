"""Augmentation of PUBLIC image batches (``PublicPrivateDataModule(public_augment=True)``).

The PAZO authors augment their public images (flip, translate, cutout: ``xuchengong/PAZO``,
``trainers/model_base.py``); the paper does not say how. Private, validation and test images are never augmented.

Each public image is, in this order (on the ``[C, H, W]`` tensor the data module yields: normalized, resized):

1. flipped left-right with probability ``flip_probability`` (0.5, as torchvision's ``RandomHorizontalFlip``);
2. shifted by ``(dy, dx)``, each uniform on the integers ``[-s, s]`` with ``s = floor(max_shift_fraction * side)``
   and zero-padded (``max_shift_fraction`` = 1/8: CIFAR's 4-pixel pad-and-crop of 32, He et al. 2016);
3. cut out: one square of ``floor(cutout_fraction * min(H, W))`` pixels is set to zero (``cutout_fraction`` = 1/2:
   DeVries & Taylor 2017's 16x16 squares on CIFAR-10's 32x32); its centre is uniform over the pixels and it is
   clipped at the border (their ``Cutout``), or, with ``cutout_inside``, its top-left corner is uniform over the
   positions that keep it whole (the PAZO code's ``Cutout``).

Zero is the value after normalization, i.e. the normalization mean colour: the PAZO code fills its square with the
data set's mean colour, so a zeroed square is theirs; their translation (``RandomAffine``) pads black, ours pads with
the mean colour. Two recipes (:data:`AUGMENT_RECIPES`): ``"standard"`` (the choices above, the default) and
``"pazo_code"`` (the authors' code on their 224-pixel images: shift up to 0.1 of the side as ``RandomAffine(translate=
(0.1, 0.1))``, an 8/224-side square kept inside the image).

Randomness is public and keyed: image ``j`` of public batch ``k`` draws from ``numpy.random.default_rng([tag,
seed, k, j])`` (:func:`augment_rng`), so the augmented stream depends on ``data_seed`` and the position in the stream
alone: the same on every DDP rank, after a resume at the saved position, and for any number of workers (the batch
sampler hands the dataset ``(k, j, index)`` keys, :class:`KeyedBatches`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, Sampler

from lit_zodp.errors import ConfigError

#: Tag of the augmentation seeds (distinct from the other data streams of ``data_seed``).
AUGMENT_TAG = 0x5A0A06
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class AugmentRecipe:
    """The parameters of the public image augmentation (see the module docstring for the sources)."""

    flip_probability: float = 0.5
    max_shift_fraction: float = 1 / 8
    cutout_fraction: float = 1 / 2
    cutout_inside: bool = False


AUGMENT_RECIPES = {
    "standard": AugmentRecipe(),
    "pazo_code": AugmentRecipe(flip_probability=0.5, max_shift_fraction=0.1, cutout_fraction=8 / 224,
                               cutout_inside=True),
}


@dataclass(frozen=True)
class AugmentDraw:
    """One image's random choices: ``flip``, the shift ``(dy, dx)`` and the cutout box ``[top, bottom) x [left,
    right)`` (empty when ``top == bottom``)."""

    flip: bool
    shift: tuple[int, int]
    box: tuple[int, int, int, int]


def augment_rng(seed: int, position: int, slot: int) -> np.random.Generator:
    """The public generator of image ``slot`` of public batch ``position`` (``seed``: the data seed)."""
    return np.random.default_rng([AUGMENT_TAG, seed & _MASK64, position, slot])


def draw_augmentation(recipe: AugmentRecipe, height: int, width: int, rng: np.random.Generator) -> AugmentDraw:
    """Draw one image's flip, shift and cutout box for an ``height x width`` image."""
    flip = bool(rng.random() < recipe.flip_probability)
    reach_y, reach_x = (math.floor(recipe.max_shift_fraction * side) for side in (height, width))
    shift = (int(rng.integers(-reach_y, reach_y + 1)), int(rng.integers(-reach_x, reach_x + 1)))
    length = math.floor(recipe.cutout_fraction * min(height, width))
    if recipe.cutout_inside:
        top, left = int(rng.integers(0, height - length + 1)), int(rng.integers(0, width - length + 1))
        box = (top, top + length, left, left + length)
    else:
        centre_y, centre_x = int(rng.integers(0, height)), int(rng.integers(0, width))
        top, left = max(0, centre_y - length // 2), max(0, centre_x - length // 2)
        box = (top, min(height, centre_y + length - length // 2), left, min(width, centre_x + length - length // 2))
    return AugmentDraw(flip, shift, box)


def shift_image(image: Tensor, dy: int, dx: int) -> Tensor:
    """``out[..., y, x] = image[..., y - dy, x - dx]`` where that pixel exists, else 0 (a zero-padded shift)."""
    height, width = image.shape[-2:]
    out = torch.zeros_like(image)
    if abs(dy) >= height or abs(dx) >= width:
        return out
    out[..., max(dy, 0):height + min(dy, 0), max(dx, 0):width + min(dx, 0)] = \
        image[..., max(-dy, 0):height + min(-dy, 0), max(-dx, 0):width + min(-dx, 0)]
    return out


def cut_out(image: Tensor, box: tuple[int, int, int, int]) -> Tensor:
    """A copy of ``image`` with the pixels of ``box = (top, bottom, left, right)`` set to zero."""
    return _zero_box(image.clone(), box)


def _zero_box(image: Tensor, box: tuple[int, int, int, int]) -> Tensor:
    """``image`` with the pixels of ``box`` set to zero, in place."""
    top, bottom, left, right = box
    image[..., top:bottom, left:right] = 0
    return image


def apply_augmentation(image: Tensor, draw: AugmentDraw) -> Tensor:
    """Flip, shift, then cut out a ``[C, H, W]`` image as ``draw`` says."""
    if draw.flip:
        image = image.flip(-1)
    return _zero_box(shift_image(image, *draw.shift), draw.box)  # (a new tensor: cut out in place, no copy)


class AugmentedDataset(Dataset):
    """A public image split whose items, asked for by a key ``(position, slot, index)``, are ``dataset[index]``
    augmented with the draw of :func:`augment_rng` ``(seed, position, slot)``; a plain ``index`` gives the raw item
    (the template of an empty batch).

    Args:
        dataset: the public split; items ``(image [C, H, W], target)``.
        recipe: the augmentation's parameters.
        seed: the data seed.
    """

    def __init__(self, dataset: Dataset, recipe: AugmentRecipe, seed: int) -> None:
        self.dataset, self.recipe, self.seed = dataset, recipe, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, tuple):
            return self.dataset[key]
        position, slot, index = key
        image, target = self.dataset[index]
        if not isinstance(image, Tensor) or image.ndim != 3:
            raise ConfigError(f"`public_augment` augments [C, H, W] images, but the public split's inputs are "
                              f"{type(image).__name__}{tuple(getattr(image, 'shape', ()))}: set public_augment: false")
        rng = augment_rng(self.seed, position, slot)
        return apply_augmentation(image, draw_augmentation(self.recipe, *image.shape[-2:], rng)), target


class KeyedBatches(Sampler[list[tuple[int, int, int]]]):
    """The batches of ``batches`` (lists of indices) as ``(position, slot, index)`` keys for
    :class:`AugmentedDataset`. ``position`` is the batch's place in the stream: with ``positioned``, ``batches``
    counts its own in ``batches.position`` (batches drawn so far, restored on a resume: the public step stream's
    :class:`~datamodules.base.PublicBatchSampler`); otherwise this sampler counts them from 0 (across passes)."""

    def __init__(self, batches: Iterable[list[int]], positioned: bool = False) -> None:
        self.batches, self.positioned, self.count = batches, positioned, 0

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        for batch in self.batches:
            position = self.batches.position - 1 if self.positioned else self.count  # type: ignore[attr-defined]
            self.count += 1
            yield [(position, slot, index) for slot, index in enumerate(batch)]


__all__ = ["AUGMENT_RECIPES", "AugmentDraw", "AugmentRecipe", "AugmentedDataset", "KeyedBatches",
           "apply_augmentation", "augment_rng", "cut_out", "draw_augmentation", "shift_image"]

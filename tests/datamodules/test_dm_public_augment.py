"""``public_augment``: flip / shift / cutout of the public training images only, keyed by data seed and position."""

import numpy as np
import pytest
import torch

from datamodules import DataSplits, ImageTensorDataset
from datamodules.augment import (
    AUGMENT_RECIPES,
    AugmentDraw,
    apply_augmentation,
    augment_rng,
    cut_out,
    draw_augmentation,
    shift_image,
)
from datamodules.vision import _VisionDataModule
from dm_helpers import IndexedDataModule, fake_trainer
from lit_zodp.errors import ConfigError, PrivacyConfigError

SIDE = 8


class RandomImages(_VisionDataModule):
    """``n`` random 8x8 RGB images (no pixel normalizes to 0, so zeros mark padding and cutout), 10 classes."""

    channels, side = 3, SIDE

    def __init__(self, n=80, **kwargs):
        self.n = n
        super().__init__(**kwargs)

    def load_splits(self):
        generator = torch.Generator().manual_seed(5)
        images = torch.randint(0, 256, (self.n + 10, SIDE, SIDE, 3), generator=generator, dtype=torch.uint8)
        labels = torch.arange(self.n + 10) % 10

        def dataset(rows):
            return ImageTensorDataset(images[rows], labels[rows], (127.5 / 255,) * 3, (0.25,) * 3)

        return DataSplits(train=dataset(slice(0, self.n)), test=dataset(slice(self.n, None)), num_classes=10)


def make(**kwargs):
    options = dict(batch_size=8, public_fraction=0.25, public_batch_size=6, public_in_step=True, val_fraction=0.1,
                   sampling_seed=1, data_seed=3)
    dm = RandomImages(**{**options, **kwargs})
    dm.setup("fit")
    return dm


def stream(loader, count):
    batches = []
    for _, batch in zip(range(count), loader):
        batches.append(batch)
    return batches


def expected_augmented(raw_images, seed, position, recipe="standard"):
    """The augmentation of one raw public batch at ``position``, from the pure functions."""
    return torch.stack([apply_augmentation(image, draw_augmentation(AUGMENT_RECIPES[recipe], SIDE, SIDE,
                                                                    augment_rng(seed, position, slot)))
                        for slot, image in enumerate(raw_images)])


# ------------------------------------------------------------------------------- the three operations
def crafted():
    return torch.arange(1, 2 * 5 * 6 + 1, dtype=torch.float32).view(2, 5, 6)  # no zero pixel


def test_flip_mirrors_the_columns():
    image = crafted()
    flipped = apply_augmentation(image, AugmentDraw(flip=True, shift=(0, 0), box=(0, 0, 0, 0)))
    assert torch.equal(flipped, image[..., torch.arange(5, -1, -1)])


@pytest.mark.parametrize("dy, dx", [(1, -2), (-2, 3), (0, 0), (4, 5), (-5, 0)])
def test_shift_is_a_zero_padded_copy(dy, dx):
    image = crafted()
    shifted = shift_image(image, dy, dx)
    for y in range(5):
        for x in range(6):
            source = (y - dy, x - dx)
            inside = 0 <= source[0] < 5 and 0 <= source[1] < 6
            expected = image[:, source[0], source[1]] if inside else torch.zeros(2)
            assert torch.equal(shifted[:, y, x], expected)


def test_cutout_zeroes_its_box_and_nothing_else():
    image = crafted()
    out = cut_out(image, (1, 4, 2, 6))
    mask = torch.zeros(5, 6, dtype=torch.bool)
    mask[1:4, 2:6] = True
    assert (out[:, mask] == 0).all() and torch.equal(out[:, ~mask], image[:, ~mask])
    assert image.min() > 0  # the input is not modified


def test_an_augmented_image_is_the_flipped_shifted_copy_outside_the_square():
    image = crafted()
    draw = AugmentDraw(flip=True, shift=(1, -1), box=(0, 2, 3, 5))
    out = apply_augmentation(image, draw)
    reference = shift_image(image.flip(-1), 1, -1)
    mask = torch.zeros(5, 6, dtype=torch.bool)
    mask[0:2, 3:5] = True
    assert (out[:, mask] == 0).all() and torch.equal(out[:, ~mask], reference[:, ~mask])


def test_draws_follow_the_standard_recipe():
    """2,000 draws on a 32x32 image: shifts uniform on [-4, 4] (every value seen), flips near 1/2 (4 standard
    deviations: 0.5 +- 4 * sqrt(0.25 / 2000) = 0.5 +- 0.045), a 16-pixel square clipped only at the border."""
    recipe = AUGMENT_RECIPES["standard"]
    draws = [draw_augmentation(recipe, 32, 32, augment_rng(0, k, 0)) for k in range(2000)]
    assert {d.shift[0] for d in draws} == set(range(-4, 5)) == {d.shift[1] for d in draws}
    assert abs(np.mean([d.flip for d in draws]) - 0.5) < 0.045
    for d in draws:
        top, bottom, left, right = d.box
        assert 0 <= top <= bottom <= 32 and 0 <= left <= right <= 32
        assert bottom - top == 16 or top == 0 or bottom == 32
        assert right - left == 16 or left == 0 or right == 32
    inside = [draw_augmentation(AUGMENT_RECIPES["pazo_code"], 224, 224, augment_rng(0, k, 0)) for k in range(200)]
    assert all(d.box[1] - d.box[0] == 8 == d.box[3] - d.box[2] and abs(d.shift[0]) <= 22 for d in inside)


# ------------------------------------------------------------------------------- the data module
def test_public_batches_are_augmented_and_nothing_else_is():
    raw, augmented = make(), make(public_augment=True)
    raw_public = stream(raw.train_dataloader()["public"], 4)
    aug_public = stream(augmented.train_dataloader()["public"], 4)
    for k, (plain, changed) in enumerate(zip(raw_public, aug_public)):
        assert torch.equal(plain[1], changed[1]) and not torch.equal(plain[0], changed[0])
        assert torch.equal(changed[0], expected_augmented(plain[0], 3, k))
    private = [stream(dm.train_dataloader()["private"], 5) for dm in (raw, augmented)]  # the same sampling seed
    assert all(torch.equal(plain[0], other[0]) for plain, other in zip(*private))
    for name in ("val_dataloader", "test_dataloader"):
        for plain, other in zip(getattr(raw, name)(), getattr(augmented, name)()):
            assert torch.equal(plain[0], other[0])
    assert augmented.built_example_shape() == (3, SIDE, SIDE)


def test_the_same_data_seed_and_position_give_the_same_batches_on_every_rank():
    first, second, rank1 = make(public_augment=True), make(public_augment=True), make(public_augment=True)
    rank1.trainer = fake_trainer(1, 2)
    batches = [stream(dm.train_dataloader()["public"], 3) for dm in (first, second, rank1)]
    for a, b, c in zip(*batches):
        assert torch.equal(a[0], b[0]) and torch.equal(a[0], c[0])
    other_seed = stream(make(public_augment=True, data_seed=4).train_dataloader()["public"], 1)[0]
    assert not torch.equal(other_seed[0], batches[0][0][0])


def test_a_resume_continues_the_augmented_stream():
    dm = make(public_augment=True)
    loader = iter(dm.train_dataloader()["public"])
    [next(loader) for _ in range(3)]
    state = dm.state_dict()
    expected = [next(loader) for _ in range(3)]
    resumed = RandomImages(batch_size=8, public_fraction=0.25, public_batch_size=6, public_in_step=True,
                           val_fraction=0.1, sampling_seed=1, data_seed=3, public_augment=True)
    resumed.load_state_dict(state)
    resumed.setup("fit")
    got = stream(resumed.train_dataloader()["public"], 3)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(expected, got))


def test_public_dataloader_keeps_its_order_and_augments_by_position():
    raw, augmented = make(), make(public_augment=True)
    plain = stream(raw.public_dataloader(batch_size=7), 6)  # 20 public images: passes of 3 batches
    changed = stream(augmented.public_dataloader(batch_size=7), 6)
    for k, (a, b) in enumerate(zip(plain, changed)):
        assert torch.equal(a[1], b[1]) and torch.equal(b[0], expected_augmented(a[0], 3, k))
    again = stream(augmented.public_batches(batch_size=7), 6)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(changed, again))
    unaugmented = stream(augmented.public_dataloader(batch_size=7, augment=False), 2)
    assert torch.equal(unaugmented[0][0], plain[0][0])


def test_workers_give_the_same_augmented_stream():
    alone = stream(make(public_augment=True).train_dataloader()["public"], 3)
    workers = stream(make(public_augment=True, num_workers=2).train_dataloader()["public"], 3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(alone, workers))


def test_augmenting_non_images_is_refused_in_one_line():
    with pytest.raises(PrivacyConfigError, match="IndexedDataModule's inputs are not images") as error:
        IndexedDataModule(n=50, public_augment=True)
    assert "\n" not in str(error.value)
    with pytest.raises(PrivacyConfigError, match="public_augment_recipe"):
        RandomImages(public_augment=True, public_augment_recipe="autoaugment")


def test_public_inputs_that_are_not_images_are_refused_at_the_first_batch():
    dm = make(public_augment=True)
    pool = dm.public_dataset.dataset
    pool.images, pool.mean, pool.std = pool.images.flatten(1), torch.zeros(1), torch.ones(1)  # inputs now [192]
    with pytest.raises(ConfigError, match=r"augments \[C, H, W\] images"):
        next(iter(dm.public_dataloader()))

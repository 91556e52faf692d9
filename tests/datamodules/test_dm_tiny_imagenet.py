"""Tiny-ImageNet from a fabricated ``tiny-imagenet-200`` folder in the real layout (a few tiny JPEGs)."""

import os

import numpy as np
import pytest
import torch
from PIL import Image

import datamodules.vision as vision
from datamodules import TinyImageNetDataModule
from datamodules.vision import IMAGENET_MEAN, IMAGENET_STD
from lit_zodp.errors import ConfigError

WNIDS = ["n01443537", "n01629819", "n01641577"]
PER_CLASS, SIDE = 5, 16


def fake_tiny_imagenet(data_dir, per_class=PER_CLASS):
    """``per_class`` training JPEGs per class (class 1's first one greyscale) and 4 annotated validation JPEGs."""
    root = data_dir / "tiny-imagenet-200"
    rng = np.random.default_rng(0)
    (root / "val" / "images").mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(WNIDS) + "\n")

    def save(path, grey=False):
        shape = (SIDE, SIDE) if grey else (SIDE, SIDE, 3)
        Image.fromarray(rng.integers(0, 256, size=shape, dtype=np.uint8)).save(path)

    for c, wnid in enumerate(WNIDS):
        folder = root / "train" / wnid / "images"
        folder.mkdir(parents=True)
        (root / "train" / wnid / f"{wnid}_boxes.txt").write_text("")
        for k in range(per_class):
            save(folder / f"{wnid}_{k}.JPEG", grey=(c == 1 and k == 0))
    lines = []
    for k, c in enumerate([2, 0, 1, 2]):
        save(root / "val" / "images" / f"val_{k}.JPEG")
        lines.append(f"val_{k}.JPEG\t{WNIDS[c]}\t0\t0\t{SIDE - 1}\t{SIDE - 1}")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return root


def decoded(path):
    """What the data module should yield for one file: PIL's RGB decode, normalized with ImageNet's constants."""
    with Image.open(path) as image:
        array = np.asarray(image.convert("RGB"))
    pixels = torch.as_tensor(array.copy(), dtype=torch.float32).permute(2, 0, 1) / 255
    return (pixels - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(IMAGENET_STD).view(3, 1, 1)


def make(data_dir, **kwargs):
    dm = TinyImageNetDataModule(data_dir=str(data_dir), **{"batch_size": 2, "cache": False, **kwargs})
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_reads_the_standard_layout(tmp_path):
    root = fake_tiny_imagenet(tmp_path)
    dm = make(tmp_path)
    assert dm.num_classes == 3 and len(dm.pool_dataset) == 15 and len(dm.test_dataset) == 4
    assert dm.pool_dataset.targets.tolist() == [0] * 5 + [1] * 5 + [2] * 5  # class index = line of wnids.txt
    assert dm.test_dataset.targets.tolist() == [2, 0, 1, 2]  # val_annotations.txt order and labels
    for index, path in [(0, f"train/{WNIDS[0]}/images/{WNIDS[0]}_0.JPEG"),
                        (5, f"train/{WNIDS[1]}/images/{WNIDS[1]}_0.JPEG"),
                        (14, f"train/{WNIDS[2]}/images/{WNIDS[2]}_4.JPEG")]:
        assert torch.allclose(dm.pool_dataset[index][0], decoded(root / path), atol=1e-6)
    grey = dm.pool_dataset.images[5]  # the greyscale file, repeated to three equal channels
    assert torch.equal(grey[0], grey[1]) and torch.equal(grey[1], grey[2])
    assert torch.allclose(dm.test_dataset[3][0], decoded(root / "val/images/val_3.JPEG"), atol=1e-6)
    assert dm.example_shape == (3, SIDE, SIDE) and TinyImageNetDataModule.known_num_classes == 200


def test_resizes_to_image_size(tmp_path):
    fake_tiny_imagenet(tmp_path)
    inputs, _ = next(iter(make(tmp_path, image_size=24).test_dataloader()))
    assert tuple(inputs.shape) == (4, 3, 24, 24)


def test_per_class_public_split_takes_the_same_count_of_every_class(tmp_path):
    """The paper's 20 of 500 per class (4%), here 2 of 10: ``public_fraction: 0.2, public_selection: per_class``."""
    fake_tiny_imagenet(tmp_path, per_class=10)
    dm = make(tmp_path, public_fraction=0.2, public_selection="per_class", data_seed=5)
    targets = dm.pool_dataset.targets
    assert [int((targets[dm.public_indices] == c).sum()) for c in range(3)] == [2, 2, 2]
    assert [int((targets[dm.private_indices] == c).sum()) for c in range(3)] == [8, 8, 8]
    assert not set(dm.public_indices) & set(dm.private_indices)


def test_the_cache_is_written_once_and_gives_identical_tensors(tmp_path, monkeypatch):
    root = fake_tiny_imagenet(tmp_path)
    first = make(tmp_path, cache=True)
    caches = [name for name in os.listdir(root) if name.startswith("lit_zodp_decoded_")]
    assert len(caches) == 1 and caches[0].endswith(".npz")

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded again despite the cache")

    monkeypatch.setattr(vision, "decode_images", no_decoding)
    second = make(tmp_path, cache=True)
    for a, b in [(first.pool_dataset, second.pool_dataset), (first.test_dataset, second.test_dataset)]:
        assert torch.equal(a.images, b.images) and torch.equal(a.targets, b.targets)
    (root / "train" / WNIDS[0] / "images" / f"{WNIDS[0]}_0.JPEG").unlink()  # another file list: another key
    with pytest.raises(AssertionError, match="decoded again"):
        make(tmp_path, cache=True)


@pytest.mark.parametrize("damage, message", [
    (lambda root: (root / "wnids.txt").unlink(), "wnids.txt is missing"),
    (lambda root: [p.unlink() for p in (root / "train" / WNIDS[2] / "images").iterdir()], "no images in"),
    (lambda root: (root / "val" / "images" / "val_1.JPEG").unlink(), "lists val_1.JPEG but"),
    (lambda root: (root / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn99999999\n"), "not in wnids.txt"),
])
def test_a_partial_folder_is_refused_in_one_line_naming_the_layout(tmp_path, damage, message):
    damage(fake_tiny_imagenet(tmp_path))
    with pytest.raises(ConfigError, match=message) as error:
        make(tmp_path)
    assert "\n" not in str(error.value) and "train/<wnid>/images/*.JPEG" in str(error.value)


def test_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="Tiny-ImageNet not found: no folder .*tiny-imagenet-200"):
        make(tmp_path)


def test_images_of_another_size_are_refused(tmp_path):
    root = fake_tiny_imagenet(tmp_path)
    Image.new("RGB", (SIDE + 4, SIDE)).save(root / "train" / WNIDS[1] / "images" / f"{WNIDS[1]}_2.JPEG")
    with pytest.raises(ConfigError, match=f"{WNIDS[1]}_2.JPEG is 20x16, but the first image is 16x16"):
        make(tmp_path)


def test_setup_after_prepare_data_reuses_the_arrays_it_decoded(tmp_path, monkeypatch):
    """One process's prepare_data decodes (and caches); its setup takes those arrays, neither decoding nor reading the
    cache back (about 6 s for the full set). Another file list is decoded again."""
    root = fake_tiny_imagenet(tmp_path)
    dm = TinyImageNetDataModule(data_dir=str(tmp_path), cache=True, batch_size=4, public_fraction=0.0)
    dm.prepare_data()

    def refused(what):
        def call(*args, **kwargs):
            raise AssertionError(what)
        return call

    monkeypatch.setattr(vision.np, "load", refused("read back"))
    monkeypatch.setattr(vision, "decode_images", refused("decoded again"))
    dm.setup("fit")
    assert len(dm.pool_dataset) == 15
    (root / "train" / WNIDS[0] / "images" / f"{WNIDS[0]}_0.JPEG").unlink()  # another file list: another key
    with pytest.raises(AssertionError, match="decoded again"):
        dm.decoded_arrays()

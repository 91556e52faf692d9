"""Gaussian blobs: a tiny, fast, fully offline classification task for tests and smoke runs."""

from __future__ import annotations

from typing import Any, Optional

import torch

from datamodules.base import DataSplits, PublicPrivateDataModule
from datamodules.datasets import TensorPairDataset
from lit_zodp.errors import check_positive, check_positive_int


def gaussian_blobs(n: int, centers: torch.Tensor, generator: torch.Generator) -> TensorPairDataset:
    """``n`` points ``centers[y] + N(0, I)`` with uniformly random labels ``y``."""
    num_classes, n_features = centers.shape
    labels = torch.randint(num_classes, (n,), generator=generator)
    features = centers[labels] + torch.randn(n, n_features, generator=generator)
    return TensorPairDataset(features, labels)


class SyntheticClassificationDataModule(PublicPrivateDataModule):
    """Gaussian class blobs: features ``[n_features]`` (float32), labels in ``[0, num_classes)``.

    Class centers are ``N(0, class_sep^2 I)``; each point adds ``N(0, I)`` noise.

    Args:
        n_samples: size of the training pool (private + public + validation hold-outs).
        n_test: size of the test set (same distribution, independent draws).
        n_features: feature dimension.
        num_classes: number of classes.
        class_sep: scale of the class centers (larger = easier).
        seed: seed of the data generation (the split uses ``data_seed``).
        **kwargs: :class:`PublicPrivateDataModule` arguments.
    """

    def __init__(
        self,
        n_samples: int = 1024,
        n_test: int = 256,
        n_features: int = 16,
        num_classes: int = 2,
        class_sep: float = 2.0,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        self.n_samples = n_samples
        self.n_test = n_test
        self.n_features = n_features
        self.known_num_classes = num_classes
        self.class_sep = class_sep
        self.seed = seed
        super().__init__(**kwargs)

    @property
    def example_shape(self) -> tuple[int]:
        """One input's shape ``[n_features]`` (a backbone that cannot read it is refused at setup)."""
        return self.built_example_shape() or (self.n_features,)

    def config_errors(self) -> list[Optional[str]]:
        return super().config_errors() + [
            check_positive_int("n_samples", self.n_samples),
            check_positive_int("n_test", self.n_test),
            check_positive_int("n_features", self.n_features),
            check_positive_int("num_classes", self.known_num_classes),
            check_positive("class_sep", self.class_sep),
        ]

    def load_splits(self) -> DataSplits:
        generator = torch.Generator().manual_seed(self.seed)
        centers = self.class_sep * torch.randn(self.known_num_classes, self.n_features, generator=generator)
        train = gaussian_blobs(self.n_samples, centers, generator)
        test = gaussian_blobs(self.n_test, centers, generator)
        return DataSplits(train=train, test=test, num_classes=self.known_num_classes)


__all__ = ["SyntheticClassificationDataModule", "gaussian_blobs"]

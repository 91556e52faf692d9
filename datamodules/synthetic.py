"""Synthetic data: Gaussian blobs (a tiny, fast, fully offline classification task for tests and smoke runs), the
rows of DPZero's synthetic quadratic (Sec. 5.1, App. B.1) and the rows of robust phase retrieval (Kornowski, Liu &
Talwar; experiment E2 of the reading notes)."""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from torch.utils.data import Dataset

from datamodules.base import DataSplits, PublicPrivateDataModule, check_int
from datamodules.collate import stacked_collate
from datamodules.datasets import RowsDataset, TensorPairDataset
from lit_zodp.errors import check_finite, check_positive, check_positive_int


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


class SyntheticRowsDataModule(PublicPrivateDataModule):
    """The conventions of the synthetic row problems (:class:`QuadraticDataModule`, :class:`PhaseRetrievalDataModule`):
    float64 rows ``[example_shape]`` served a batch at a time (:class:`RowsDataset`), targets zeros (one dummy class:
    the losses have no labels), a dimension ``dim``, ``n_train`` rows in the pool and ``n_test`` in the test set, an
    int ``seed`` of the rows, and ``epoch_steps`` full batches per Lightning epoch.

    Args:
        dim: the problem's dimension ``d``.
        n_train: rows in the training pool.
        n_test: rows in the test set.
        seed: seed of the rows (the split uses ``data_seed``).
        epoch_steps: full batch only: steps per Lightning epoch (each step is the whole set; the epoch is only
            Lightning's loop unit: ``check_val_every_n_epoch``, the per-epoch hooks). One step per epoch spent about
            3 ms of Lightning's epoch machinery per step at ``d = 20``, half the step.
        **kwargs: :class:`PublicPrivateDataModule` arguments.
    """

    def __init__(self, *, dim: int, n_train: int, n_test: int, seed: int = 0, epoch_steps: int = 1,
                 **kwargs: Any) -> None:
        self.dim = dim
        self.n_train = n_train
        self.n_test = n_test
        self.seed = seed
        self.epoch_steps = epoch_steps
        self.known_num_classes = 1
        super().__init__(**kwargs)

    def config_errors(self) -> list[Optional[str]]:
        return super().config_errors() + [
            check_positive_int("dim", self.dim),
            check_positive_int("n_train", self.n_train),
            check_positive_int("n_test", self.n_test),
            check_positive_int("epoch_steps", self.epoch_steps),
            None if self.epoch_steps == 1 or self.sampling == "full_batch"
            else f"`epoch_steps` sets the epoch length of a full batch, but sampling={self.sampling!r}",
            check_int("seed", self.seed),
        ]

    @property
    def steps_per_epoch(self) -> int:
        """``epoch_steps`` full batches per epoch (the base class's sampler repeats the full batch as often)."""
        return self.epoch_steps if self.sampling == "full_batch" else super().steps_per_epoch

    def materialize(self, dataset: Dataset) -> RowsDataset:
        """Each kept split as one tensor of rows, served a batch at a time (:class:`RowsDataset`)."""
        return RowsDataset.of(dataset)

    def batch_collate(self):
        return stacked_collate


class QuadraticDataModule(SyntheticRowsDataModule):
    """The rows ``x_i`` of DPZero's synthetic quadratic (Zhang et al., Sec. 5.1 and App. B.1): each coordinate
    drawn independently from ``N(mean, std^2)`` (the paper: ``N(1, 1)``), ``n_train`` training rows (the pool,
    private unless ``public_fraction`` / ``val_fraction`` hold some out) and ``n_test`` test rows of the same
    distribution (the paper: 10,000 each). Inputs are float64 rows ``[dim]``; targets are zeros (one dummy
    class: the loss, :class:`~lit_zodp.backbones.QuadraticLoss`, has no labels). Validation uses the test
    set unless ``val_fraction`` holds rows out (the base class's convention).

    Sampling defaults to ``"full_batch"``: Algorithms 1 and 2 average the clipped values over all ``n``
    examples at every step (``(1/n) sum_i clip_C(.) + z_t``), and the code the paper's synthetic example is
    based on (Li et al. 2022, App. B.1) takes the mean gradient over the whole set at every step too. The
    step then costs one Gaussian mechanism on the whole set, accounted without subsampling; ``batch_size``
    is unused (``"poisson"`` with a ``batch_size`` gives mini-batches instead).

    Args:
        dim: the dimension ``d`` of the rows (App. B.1: 20 to 2000).
        n_train: rows in the training pool.
        n_test: rows in the test set.
        mean: mean of every coordinate.
        std: standard deviation of every coordinate.
        seed: seed of the rows (the split uses ``data_seed``).
        sampling: see :class:`PublicPrivateDataModule`; ``"full_batch"`` here.
        epoch_steps: full batch only: steps per Lightning epoch (:class:`SyntheticRowsDataModule`).
        **kwargs: :class:`PublicPrivateDataModule` arguments.
    """

    def __init__(
        self,
        dim: int = 100,
        n_train: int = 10_000,
        n_test: int = 10_000,
        mean: float = 1.0,
        std: float = 1.0,
        seed: int = 0,
        sampling: Literal["poisson", "full_batch", "single_pass", "shuffle"] = "full_batch",
        epoch_steps: int = 1,
        **kwargs: Any,
    ) -> None:
        self.mean = mean
        self.std = std
        super().__init__(dim=dim, n_train=n_train, n_test=n_test, seed=seed, epoch_steps=epoch_steps,
                         sampling=sampling, **kwargs)

    @property
    def example_shape(self) -> tuple[int]:
        """One row's shape ``[dim]`` (a backbone of another ``dim`` is refused at setup)."""
        return self.built_example_shape() or (self.dim,)

    def config_errors(self) -> list[Optional[str]]:
        return super().config_errors() + [
            check_finite("mean", self.mean),
            check_positive("std", self.std),
        ]

    def load_splits(self) -> DataSplits:
        generator = torch.Generator().manual_seed(self.seed)

        def rows(n: int) -> TensorPairDataset:
            values = self.mean + self.std * torch.randn(n, self.dim, generator=generator, dtype=torch.float64)
            return TensorPairDataset(values, torch.zeros(n, dtype=torch.long))

        train = rows(self.n_train)
        test = rows(self.n_test)
        return DataSplits(train=train, test=test, num_classes=1)


class PhaseRetrievalDataModule(SyntheticRowsDataModule):
    """The rows of robust phase retrieval (Kornowski, Liu & Talwar; E2 of the reading notes) for
    :class:`~lit_zodp.backbones.PhaseRetrievalLoss`: ``a_i`` uniform on the unit sphere ``S^{d-1}`` (normalised
    Gaussians, so each loss is 1-Lipschitz) and ``b_i = |<a_i, x*>|`` for the planted unit signal
    ``x* = planted_signal(dim, signal_seed)``, the backbone's. Each input is one float64 row ``[a_i, b_i]`` of
    ``dim + 1`` values (``b_i`` last); targets are zeros (one dummy class). ``n_train`` rows form the training pool
    (private unless ``public_fraction`` / ``val_fraction`` hold some out), ``n_test`` clean rows the test set.

    Outliers (the "robust" of the problem; the paper fixes no corruption model): ``round(outlier_fraction *
    n_train)`` training rows drawn at random get ``b_i`` replaced by ``|N(0, 1)|``, independent of ``a_i`` (of the
    order of ``|<a_i, x*>| ~ 1/sqrt(d)`` and above). Test rows are never corrupted; rows held out of the pool
    (``val_fraction``, ``public_fraction``) may be.

    Sampling defaults to the base class's ``"poisson"``; the paper's algorithm reads each example once
    (``sampling="single_pass"``).

    Args:
        dim: the dimension ``d`` of ``a_i`` and ``x*``.
        n_train: rows in the training pool.
        n_test: rows in the test set.
        signal_seed: the seed of ``x*`` (the backbone's must be the same: refused at setup otherwise).
        seed: seed of the rows and the outliers (a stream apart from the signal's: equal seeds are fine; the split
            uses ``data_seed``).
        outlier_fraction: the fraction of training rows with a corrupted ``b_i``, in ``[0, 1)``.
        sampling: see :class:`PublicPrivateDataModule`.
        epoch_steps: full batch only: steps per Lightning epoch (:class:`SyntheticRowsDataModule`).
        **kwargs: :class:`PublicPrivateDataModule` arguments.
    """

    def __init__(
        self,
        dim: int = 16,
        n_train: int = 10_000,
        n_test: int = 1_000,
        signal_seed: int = 0,
        seed: int = 0,
        outlier_fraction: float = 0.0,
        sampling: Literal["poisson", "full_batch", "single_pass", "shuffle"] = "poisson",
        epoch_steps: int = 1,
        **kwargs: Any,
    ) -> None:
        self.signal_seed = signal_seed
        self.outlier_fraction = outlier_fraction
        super().__init__(dim=dim, n_train=n_train, n_test=n_test, seed=seed, epoch_steps=epoch_steps,
                         sampling=sampling, **kwargs)

    @property
    def example_shape(self) -> tuple[int]:
        """One row's shape ``[dim + 1]`` (a backbone of another ``dim`` is refused at setup)."""
        return self.built_example_shape() or (self.dim + 1,)

    def config_errors(self) -> list[Optional[str]]:
        fraction = self.outlier_fraction
        return super().config_errors() + [
            check_int("signal_seed", self.signal_seed, minimum=0),
            None if isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 <= fraction < 1
            else f"Expected `outlier_fraction` in [0, 1), but got {fraction!r}",
        ]

    @property
    def signal(self) -> torch.Tensor:
        """The planted signal ``x*`` (float64, unit norm)."""
        from lit_zodp.backbones.phase_retrieval import planted_signal

        return planted_signal(self.dim, self.signal_seed)

    @property
    def n_outliers(self) -> int:
        """The number of training rows with a corrupted ``b_i``: ``round(outlier_fraction * n_train)``."""
        return round(self.outlier_fraction * self.n_train)

    def load_splits(self) -> DataSplits:
        from lit_zodp.backbones.phase_retrieval import ROWS_STREAM, seeded_generator, unit_rows

        generator = seeded_generator(self.seed, ROWS_STREAM)
        signal = self.signal

        def rows(n: int, outliers: int) -> TensorPairDataset:
            a = unit_rows(n, self.dim, generator)
            b = (a @ signal).abs()
            corrupted = torch.randperm(n, generator=generator)[:outliers]
            b[corrupted] = torch.randn(outliers, generator=generator, dtype=torch.float64).abs()
            return TensorPairDataset(torch.cat([a, b[:, None]], dim=1), torch.zeros(n, dtype=torch.long))

        train = rows(self.n_train, self.n_outliers)
        test = rows(self.n_test, 0)
        return DataSplits(train=train, test=test, num_classes=1)


__all__ = ["PhaseRetrievalDataModule", "QuadraticDataModule", "SyntheticClassificationDataModule",
           "SyntheticRowsDataModule", "gaussian_blobs"]

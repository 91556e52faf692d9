"""QuadraticDataModule (DPZero App. B.1 rows) and RowsDataset's batch-at-a-time loading."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Subset

from datamodules import QuadraticDataModule
from datamodules.collate import EmptySafeCollate, stacked_collate
from datamodules.datasets import RowsDataset, StackedRows, TensorPairDataset
from lit_zodp.errors import ConfigError
from lit_zodp.privacy import FullBatchSampler, PoissonBatchSampler


def built(**kwargs):
    data = QuadraticDataModule(**({"dim": 8, "n_train": 300, "n_test": 200} | kwargs))
    data.setup()
    return data


def test_rows_are_seeded_n_1_1_draws_of_the_configured_sizes():
    data = built(dim=8, n_train=4000, n_test=3000, seed=3)
    train, test = data.private_dataset.inputs, data.test_dataset.inputs
    assert train.shape == (4000, 8) and test.shape == (3000, 8) and train.dtype == torch.float64
    pooled = torch.cat([train, test])
    # mean 1, variance 1 per coordinate: 7000 draws each, 5 standard errors
    assert (pooled.mean(0) - 1).abs().max() < 5 / 7000 ** 0.5
    assert (pooled.var(0) - 1).abs().max() < 5 * (2 / 7000) ** 0.5
    assert not torch.equal(train[:3000], test)  # independent draws
    assert torch.equal(built(dim=8, n_train=4000, n_test=3000, seed=3).private_dataset.inputs, train)
    assert not torch.equal(built(dim=8, n_train=4000, n_test=3000, seed=4).private_dataset.inputs, train)
    assert data.num_classes == 1 and not data.private_dataset.targets.any()


def test_full_batch_by_default_and_the_base_class_conventions():
    data = built()
    assert data.sampling == "full_batch" and data.n_private == 300
    assert data.val_dataset is data.test_dataset  # no val_fraction: validation on the test set
    loader = data.train_dataloader()
    assert isinstance(loader.batch_sampler, FullBatchSampler)
    (inputs, targets), = list(loader)
    assert inputs.shape == (300, 8) and targets.shape == (300,)
    held_out = built(val_fraction=0.1, public_fraction=0.1)
    assert held_out.n_private == 240 and len(held_out.val_dataset) == 30 and len(held_out.public_dataset) == 30
    pool = torch.cat([held_out.private_dataset.inputs, held_out.val_dataset.inputs, held_out.public_dataset.inputs])
    assert len(torch.unique(pool, dim=0)) == 300  # disjoint parts of the pool
    poisson = built(sampling="poisson", batch_size=30, sampling_seed=0)
    assert isinstance(poisson.train_dataloader().batch_sampler, PoissonBatchSampler)
    assert poisson.sample_rate == pytest.approx(0.1)


def test_rows_dataset_gathers_a_batch_in_one_indexing():
    inputs, targets = torch.randn(10, 3, dtype=torch.float64), torch.arange(10)
    dataset = RowsDataset(inputs, targets)
    whole = dataset.__getitems__(list(range(10)))
    assert whole.inputs is inputs and whole.targets is targets  # a full batch in order: the stored tensors
    part = dataset.__getitems__([7, 2])
    assert torch.equal(part.inputs, inputs[[7, 2]]) and torch.equal(part.targets, targets[[7, 2]])
    assert len(dataset.__getitems__([])) == 0
    collate = EmptySafeCollate(dataset, stacked_collate)
    rows, labels = collate(dataset.__getitems__([]))
    assert rows.shape == (0, 3) and rows.dtype == torch.float64 and labels.shape == (0,)
    loader = DataLoader(dataset, batch_size=4, collate_fn=collate)
    assert torch.equal(torch.cat([x for x, _ in loader]), inputs)
    nested = RowsDataset.of(Subset(Subset(TensorPairDataset(inputs, targets), [1, 3, 5, 7]), [3, 0]))
    assert torch.equal(nested.inputs, inputs[[7, 1]]) and torch.equal(nested.targets, targets[[7, 1]])
    assert isinstance(whole, StackedRows) and stacked_collate([(inputs[0], targets[0])])[0].shape == (1, 3)


def test_epoch_steps_repeat_the_full_batch_within_an_epoch():
    data = built(epoch_steps=5)
    loader = data.train_dataloader()
    assert isinstance(loader.batch_sampler, FullBatchSampler) and len(loader) == 5 == data.steps_per_epoch
    assert all(x.shape == (300, 8) for x, _ in loader)
    assert loader.batch_sampler.description == built().train_dataloader().batch_sampler.description  # accounted alike
    with pytest.raises(ConfigError, match="`epoch_steps` sets the epoch length of a full batch, but sampling='poisson'"):
        QuadraticDataModule(sampling="poisson", epoch_steps=5)


def test_a_full_batch_ignores_the_batch_size():
    assert built(n_train=20, batch_size=64).n_private == 20
    with pytest.raises(ConfigError, match="exceeds the number of private examples"):
        built(n_train=20, batch_size=64, sampling="poisson")


@pytest.mark.parametrize("kwargs,message", [
    (dict(dim=0), "Expected `dim` to be a positive int, but got 0"),
    (dict(n_train=-3), "Expected `n_train` to be a positive int, but got -3"),
    (dict(n_test=1.5), "Expected `n_test` to be a positive int, but got 1.5"),
    (dict(std=0.0), "Expected `std` to be a positive float, but got 0.0"),
    (dict(mean=float("inf")), "Expected `mean` to be a finite float, but got inf"),
    (dict(sampling="everything"), "Expected `sampling` in"),
])
def test_bad_options_are_one_line_errors(kwargs, message):
    with pytest.raises(ConfigError, match=f"^Invalid configuration: {message}"):
        QuadraticDataModule(**kwargs)

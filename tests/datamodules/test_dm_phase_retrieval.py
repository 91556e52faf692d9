"""PhaseRetrievalDataModule (robust phase retrieval rows ``[a, b]``, E2 of the reading notes)."""

from __future__ import annotations

import pytest
import torch

from datamodules import PhaseRetrievalDataModule
from lit_zodp.backbones.phase_retrieval import planted_signal
from lit_zodp.errors import ConfigError, PrivacyConfigError
from lit_zodp.privacy import FullBatchSampler, PoissonBatchSampler


def built(**kwargs):
    data = PhaseRetrievalDataModule(**({"dim": 8, "n_train": 300, "n_test": 200} | kwargs))
    data.setup()
    return data


def clean(rows, signal):
    """Whether each row's ``b`` is ``|<a, x*>|``."""
    return (rows[:, -1] - (rows[:, :-1] @ signal).abs()).abs() < 1e-12


def test_rows_are_unit_a_and_b_the_modulus_of_the_planted_projection():
    data = built(dim=8, n_train=400, n_test=300, seed=3, signal_seed=5)
    train, test = data.private_dataset.inputs, data.test_dataset.inputs
    assert train.shape == (400, 9) and test.shape == (300, 9) and train.dtype == test.dtype == torch.float64
    assert data.example_shape == (9,) and data.num_classes == 1 and not data.private_dataset.targets.any()
    signal = planted_signal(8, 5)
    assert torch.equal(data.signal, signal)
    for rows in (train, test):
        torch.testing.assert_close(rows[:, :-1].norm(dim=1), torch.ones(len(rows), dtype=torch.float64))
        assert clean(rows, signal).all()
    # a ~ Unif(S^{d-1}): mean 0 and E[a a^T] = I / d (700 rows, loose bounds)
    a = torch.cat([train, test])[:, :-1]
    assert a.mean(0).abs().max() < 5 / (8 * 700) ** 0.5
    torch.testing.assert_close(a.T @ a / len(a), torch.eye(8, dtype=torch.float64) / 8, atol=0.03, rtol=0)
    assert torch.equal(built(dim=8, n_train=400, n_test=300, seed=3, signal_seed=5).private_dataset.inputs, train)
    assert not torch.equal(built(dim=8, n_train=400, n_test=300, seed=4, signal_seed=5).private_dataset.inputs,
                           train)
    assert not clean(built(dim=8, n_train=400, n_test=300, seed=3, signal_seed=6).test_dataset.inputs, signal).any()


@pytest.mark.parametrize("fraction", [0.1, 0.25])
def test_outliers_are_the_configured_fraction_of_the_training_pool_only(fraction):
    data = built(n_train=1000, n_test=500, outlier_fraction=fraction, seed=1)
    train, test = data.private_dataset.inputs, data.test_dataset.inputs
    corrupted = ~clean(train, data.signal)
    assert int(corrupted.sum()) == round(fraction * 1000) == data.n_outliers
    assert clean(test, data.signal).all()
    assert (train[:, -1] >= 0).all()  # (|N(0, 1)|: still a modulus)
    torch.testing.assert_close(train[:, :-1].norm(dim=1), torch.ones(1000, dtype=torch.float64))
    # the corrupted rows keep their a: the clean pool with the same seed has the same a's
    torch.testing.assert_close(built(n_train=1000, n_test=500, seed=1).private_dataset.inputs[:, :-1], train[:, :-1])
    assert clean(built(n_train=1000, n_test=500, seed=1).private_dataset.inputs, data.signal).all()


def test_poisson_by_default_and_the_other_samplings():
    data = built(batch_size=30)
    assert data.sampling == "poisson" and isinstance(data.train_dataloader().batch_sampler, PoissonBatchSampler)
    assert data.sample_rate == pytest.approx(0.1) and data.val_dataset is data.test_dataset
    full = built(sampling="full_batch", epoch_steps=2)
    loader = full.train_dataloader()
    assert isinstance(loader.batch_sampler, FullBatchSampler) and len(loader) == 2 == full.steps_per_epoch
    assert all(x.shape == (300, 9) and y.shape == (300,) for x, y in loader)
    single = built(sampling="single_pass", batch_size=30)
    assert single.steps_per_epoch == 10
    anchored = built(sampling="single_pass", batch_size=10, anchor_batch_size=40, anchor_period=4)
    sampler = anchored.train_dataloader().batch_sampler
    assert anchored.steps_per_epoch == len(sampler) == 17 and sampler.description.anchor_weight == 4.0
    with pytest.raises(PrivacyConfigError, match="`anchor_batch_size`=400 exceeds the number of private examples"):
        built(sampling="single_pass", batch_size=10, anchor_batch_size=400, anchor_period=4)
    held_out = built(val_fraction=0.1, public_fraction=0.1)
    assert held_out.n_private == 240 and len(held_out.val_dataset) == 30 and len(held_out.public_dataset) == 30


@pytest.mark.parametrize("kwargs,message", [
    (dict(dim=0), "Expected `dim` to be a positive int, but got 0"),
    (dict(n_train=-3), "Expected `n_train` to be a positive int, but got -3"),
    (dict(n_test=1.5), "Expected `n_test` to be a positive int, but got 1.5"),
    (dict(signal_seed=-1), "Expected `signal_seed` to be an int >= 0, but got -1"),
    (dict(seed="a"), "Expected `seed` to be an int, but got 'a'"),
    (dict(outlier_fraction=1.0), r"Expected `outlier_fraction` in \[0, 1\), but got 1.0"),
    (dict(outlier_fraction=-0.1), r"Expected `outlier_fraction` in \[0, 1\), but got -0.1"),
    (dict(epoch_steps=2), "`epoch_steps` sets the epoch length of a full batch, but sampling='poisson'"),
    (dict(sampling="everything"), "Expected `sampling` in"),
])
def test_bad_options_are_one_line_errors(kwargs, message):
    with pytest.raises(ConfigError, match=f"^Invalid configuration: {message}"):
        PhaseRetrievalDataModule(**kwargs)

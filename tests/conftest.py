"""Shared fixtures: a small classification problem behind a Poisson loader, and a quiet Trainer."""

import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before Lightning imports huggingface_hub, which reads it once

import lightning.pytorch as pl  # noqa: E402
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_zodp.privacy import SPEND_DIR_ENV, PoissonBatchSampler

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LitLogger.*")
torch.set_num_threads(min(2, torch.get_num_threads()))


def blobs(n=256, features=10, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x @ torch.randn(features, classes, generator=g)).argmax(1)
    return TensorDataset(x, y)


def collate_tensors(items):
    if not items:
        raise RuntimeError("use collate_with_empty")
    return torch.stack([i[0] for i in items]), torch.stack([i[1] for i in items])


def poisson_loader(dataset, sample_rate, *, seed=0, steps_per_epoch=None):
    """A private loader: Poisson batches, empty ones as zero-row tensors."""
    x0, y0 = dataset[0]

    def collate(items):
        if not items:
            return x0.unsqueeze(0)[:0], y0.unsqueeze(0)[:0]
        return collate_tensors(items)

    sampler = PoissonBatchSampler(len(dataset), sample_rate, seed=seed, steps_per_epoch=steps_per_epoch)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)


def mlp(features=10, classes=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 16), nn.Tanh(), nn.Linear(16, classes))


def quiet_trainer(**kwargs):
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    return pl.Trainer(**(defaults | kwargs))


@pytest.fixture(autouse=True)
def spend_log_per_test(tmp_path_factory, monkeypatch):
    """Each test's private runs keep their spend records apart (never in the user's state directory)."""
    directory = tmp_path_factory.mktemp("spend")
    monkeypatch.setenv(SPEND_DIR_ENV, str(directory))
    return directory


@pytest.fixture
def dataset():
    return blobs()


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests skip where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

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
# one thread per pytest-xdist worker (`-n 2`: two workers share the two cores), else two
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))


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


class FixedBatches(PoissonBatchSampler):
    """A Poisson sampler's type and description with fixed index lists: a test chooses which batches are empty."""

    def __init__(self, num_samples, batches):
        super().__init__(num_samples, 0.25, seed=0, steps_per_epoch=len(batches))
        self.batches = batches

    def __iter__(self):
        return iter([list(b) for b in self.batches])


def fixed_batches_loader(dataset, batches):
    """A private loader of ``batches`` (index lists, empty ones collated as zero-row tensors)."""
    empty = dataset.tensors[0][:0], dataset.tensors[1][:0]
    return DataLoader(dataset, batch_sampler=FixedBatches(len(dataset), batches),
                      collate_fn=lambda items: collate_tensors(items) if items else empty)


#: Per-algorithm settings under which the registry-wide tests (privacy contract, GPU) exercise what an algorithm adds:
#: a projection rank below both :func:`mlp` weights' smaller sides (10 and 3), so both are projected (one on each
#: side) and the biases are not.
ALGORITHM_KWARGS = {name: dict(rank=2) for name in ("DPGRAPE", "GRAPE", "DPGaLore", "GaLore")}
#: GEP on the suites' MLPs (227 parameters): 5 bases in 2 groups, so the embedding and the residual are both non-zero
ALGORITHM_KWARGS |= {name: dict(num_bases=6, num_groups=2) for name in ("GEP", "NonPrivateGEP")}
#: O2NC on the registry-wide suites' Poisson loaders: Alg. 4 (the tree of Alg. 3 needs a single pass, tested in
#: tests/algorithms/test_o2nc.py), with add/remove neighbours as the suites' noise checks assume, and a period of 3 so
#: a fit takes anchor and difference steps.
ALGORITHM_KWARGS |= {name: dict(oracle="multi_pass", period=3, num_directions=2) for name in ("DPO2NC", "O2NC")}
ALGORITHM_KWARGS["DPO2NC"] |= dict(neighbours="add_remove")
#: Variants ``"Class[variant]"`` (tests/test_privacy_contract.py's ``VARIANTS``) take their own options here. O2NC's
#: first-order oracle (Alg. 5: eq. 10's per-example gradients at points in the ball) on the same loaders and options;
#: ``O2NC[first_order]`` is its non-private twin.
ALGORITHM_KWARGS |= {f"{name}[first_order]": ALGORITHM_KWARGS[name] | dict(estimator="first_order")
                     for name in ("DPO2NC", "O2NC")}


def public_rows_like(backbone):
    """A fixed public batch (data-independent of every private set) for ``backbone``: 12 blob rows, or 12 token rows
    for a :class:`TokenBag`."""
    if isinstance(backbone, TokenBag):
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(1, 20, (12, 6), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.randint(0, 2, (12,), generator=g)
    leaves = [m for m in backbone.modules() if not list(m.children())]
    linears = [m for m in leaves if isinstance(m, nn.Linear)]
    features = leaves[0].in_features if isinstance(leaves[0], nn.Linear) else 10  # (blobs' rows, as the tests feed)
    return blobs(n=12, features=features, classes=linears[-1].out_features, seed=7).tensors


def with_public_data(module):
    """``module``, given a public batch for every step if its algorithm needs one (PAZO): the registry-wide suites
    feed private batches alone."""
    if getattr(module, "needs_public_batches", False):
        module.use_public_data([public_rows_like(module.backbone)])
    return module


def mlp(features=10, classes=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 16), nn.Tanh(), nn.Linear(16, classes))


class TokenBag(nn.Module):
    """Token-id inputs ``{"input_ids", "attention_mask"}``; ``masked=False`` averages the padding too
    (as FNet, which takes no attention mask), so a row's loss moved with its batch's longest row."""

    num_classes = 2

    def __init__(self, masked: bool):
        super().__init__()
        torch.manual_seed(0)
        self.masked = masked
        self.embed, self.head = nn.Embedding(20, 8), nn.Linear(8, 2)
        self.calls = 0

    def forward(self, input_ids, attention_mask):
        self.calls += 1
        states, mask = self.embed(input_ids), attention_mask.unsqueeze(-1).float()
        pooled = (states * mask).sum(1) / mask.sum(1) if self.masked else states.mean(1)
        return self.head(pooled)


def token_loader(sample_rate=0.3, n=64, full_length_batches=0):
    """Rows of 2-10 tokens (id 0 pads), Poisson batches padded to their longest row; the first
    ``full_length_batches`` batches cut every row to their shortest (no padding)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 11, (n,), generator=g)
    rows = [torch.randint(1, 20, (int(k),), generator=g) for k in lengths]
    labels = torch.randint(0, 2, (n,), generator=g)
    collated = [0]

    def collate(indices):
        collated[0] += bool(indices)  # (a fit start collates an empty list once: review 22)
        if collated[0] <= full_length_batches:
            width = min([len(rows[i]) for i in indices], default=1)
            ids = torch.stack([rows[i][:width] for i in indices]) if indices else torch.zeros(0, 1, dtype=torch.long)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels[list(indices)]
        width = max([len(rows[i]) for i in indices], default=1)
        ids = torch.zeros(len(indices), width, dtype=torch.long)
        for r, i in enumerate(indices):
            ids[r, :len(rows[i])] = rows[i]
        return {"input_ids": ids, "attention_mask": (ids != 0).long()}, labels[list(indices)]

    sampler = PoissonBatchSampler(n, sample_rate, seed=0)
    return DataLoader(list(range(n)), batch_sampler=sampler, collate_fn=collate)


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


def parametrize_configs(paths, default):
    """``parametrize`` over config ``paths`` (ids their stems), each marked ``slow`` unless its stem is in
    ``default``: the config tests' one run of each family by default, the rest with ``-m slow``."""
    return pytest.mark.parametrize("path", [p if p.stem in default else pytest.param(p, marks=pytest.mark.slow)
                                            for p in paths], ids=lambda p: p.stem)

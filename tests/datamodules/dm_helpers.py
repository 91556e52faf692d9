"""Small data modules and a stand-in trainer for the data module tests."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
from lightning.pytorch import LightningModule

from datamodules.base import DataSplits, PublicPrivateDataModule
from datamodules.datasets import TensorPairDataset


def indexed_pool(n: int, dict_inputs: bool = False, offset: int = 0) -> TensorPairDataset:
    """Examples whose input is their own index (so a batch reveals which examples it holds)."""
    index = torch.arange(offset, offset + n)
    if dict_inputs:
        inputs = {"input_ids": index[:, None].repeat(1, 3), "attention_mask": torch.ones(n, 3, dtype=torch.long)}
    else:
        inputs = index.float()[:, None]
    return TensorPairDataset(inputs, index % 3)


class IndexedDataModule(PublicPrivateDataModule):
    """A pool of ``n`` examples whose inputs are their indices; optional separate public source."""

    def __init__(
        self,
        n: int = 100,
        dict_inputs: bool = False,
        n_public_source: int = 0,
        train_ids: Optional[list] = None,
        public_ids: Optional[list] = None,
        train_groups: Optional[list] = None,
        **kwargs: Any,
    ) -> None:
        self.n = n
        self.dict_inputs = dict_inputs
        self.n_public_source = n_public_source
        self.train_ids = train_ids
        self.public_ids = public_ids
        self.train_groups = train_groups
        super().__init__(**kwargs)

    def load_splits(self) -> DataSplits:
        public = indexed_pool(self.n_public_source, self.dict_inputs, offset=10_000) if self.n_public_source else None
        return DataSplits(
            train=indexed_pool(self.n, self.dict_inputs),
            test=indexed_pool(10, self.dict_inputs, offset=20_000),
            public=public,
            num_classes=3,
            train_ids=self.train_ids,
            public_ids=self.public_ids,
            train_groups=self.train_groups,
        )


def pool_indices(batch) -> list[int]:
    """Pool indices held by a batch of :class:`IndexedDataModule`."""
    inputs, _ = batch
    column = inputs["input_ids"][:, 0] if isinstance(inputs, dict) else inputs[:, 0]
    return sorted(int(v) for v in column)


def fake_trainer(
    rank: int, world_size: int, broadcast: Optional[Callable] = None, use_distributed_sampler: bool = False
) -> SimpleNamespace:
    """The trainer attributes the data module reads, for one DDP rank without processes."""
    return SimpleNamespace(
        global_rank=rank,
        world_size=world_size,
        strategy=SimpleNamespace(broadcast=broadcast or (lambda obj, src=0: obj)),
        _accelerator_connector=SimpleNamespace(use_distributed_sampler=use_distributed_sampler),
    )


class Recorder(LightningModule):
    """A tiny LightningModule that records the pool indices of every training batch it sees."""

    def __init__(self, out_dir: Optional[str] = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.out_dir = out_dir
        self.batches: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.batches.append(pool_indices(batch))
        inputs, _ = batch
        return (self.weight**2).sum() + 0.0 * inputs.float().sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        """Under DDP each rank writes what it saw (spawned processes cannot return it)."""
        if self.out_dir is None:
            return
        # an in-memory fingerprint of the secret stream (never saved by the library): equal across ranks
        sampler = self.trainer.datamodule._batch_sampler
        record = {"stream": str(sampler.generator.bit_generator.state["state"]), "batches": self.batches}
        with open(os.path.join(self.out_dir, f"rank{self.global_rank}.json"), "w") as handle:
            json.dump(record, handle)

    def teardown(self, stage: str) -> None:
        """A spawned rank ends its gloo group itself: Lightning's atexit hook does not run in a
        multiprocessing child, and the group's threads torn down at its exit aborted the rank now and
        then ("terminate called without an active exception", SIGABRT after a finished fit)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

"""Collation of Poisson batches, including empty ones."""

import torch
from torch.utils.data import DataLoader

from datamodules.collate import EmptySafeCollate, empty_like_batch
from dm_helpers import indexed_pool


def test_empty_like_batch_keeps_structure():
    batch = ({"input_ids": torch.ones(4, 7, dtype=torch.long), "mask": torch.ones(4, 7)}, torch.arange(4))
    empty = empty_like_batch(batch)
    assert isinstance(empty, tuple) and set(empty[0]) == {"input_ids", "mask"}
    assert empty[0]["input_ids"].shape == (0, 7) and empty[0]["input_ids"].dtype == torch.long
    assert empty[0]["mask"].dtype == torch.float32
    assert empty[1].shape == (0,)


def test_tensor_items_empty_and_nonempty():
    dataset = indexed_pool(10)
    collate = EmptySafeCollate(dataset)
    inputs, targets = collate([])
    assert inputs.shape == (0, 1) and inputs.dtype == torch.float32
    assert targets.shape == (0,) and targets.dtype == torch.long
    inputs, targets = collate([dataset[2], dataset[5]])
    assert inputs[:, 0].tolist() == [2.0, 5.0] and targets.tolist() == [2, 2]


def test_dict_items_empty_batch_through_dataloader():
    dataset = indexed_pool(10, dict_inputs=True)
    loader = DataLoader(dataset, batch_sampler=[[], [1, 3], []], collate_fn=EmptySafeCollate(dataset))
    batches = list(loader)
    assert [b[1].shape[0] for b in batches] == [0, 2, 0]
    for inputs, targets in batches:
        assert inputs["input_ids"].shape[1:] == (3,) and inputs["input_ids"].dtype == torch.long
        assert inputs["attention_mask"].shape[0] == targets.shape[0]
        assert targets.dtype == torch.long

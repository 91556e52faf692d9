"""The data module inside a real Lightning Trainer: checkpoint resume, pickling after a fit and 2-process DDP
(gloo, CPU)."""

import json
import pickle
import warnings

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from dm_helpers import IndexedDataModule, Recorder
from lit_zodp.errors import PrivacyConfigError

DATA = dict(n=120, batch_size=12, public_fraction=0.1)  # 108 private, q = 1/9, 9 steps per epoch


def trainer(root, **kwargs) -> Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    options.update(kwargs)
    return Trainer(**options)


@pytest.fixture(autouse=True)
def quiet_lightning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|validation_step|ckpt_path|LeafSpec).*")
        yield


def test_resume_from_one_checkpoint_twice_draws_fresh_masks(tmp_path):
    """The sampling stream is reseeded from OS entropy at every fit start, resumed or not."""
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    first = Recorder()
    trainer(tmp_path / "b", max_epochs=1, callbacks=[checkpoint]).fit(first, IndexedDataModule(**DATA))
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["IndexedDataModule"] == {"sampling": "poisson"}
    continuations = []
    for name in ("c", "d"):
        resumed = Recorder()
        run = trainer(tmp_path / name, max_epochs=2, enable_checkpointing=False)
        run.fit(resumed, IndexedDataModule(**DATA), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
        assert len(resumed.batches) == 9
        continuations.append(resumed.batches)
    assert continuations[0] != continuations[1]


def test_a_data_module_pickled_after_a_fit_holds_no_sampling_stream(tmp_path):
    """The stream is dropped at the fit's teardown and never pickled, so a data module (or trainer) pickled
    after a fit cannot replay the private batches; pickled before its loaders exist (ddp_spawn), it fits."""
    datamodule = pickle.loads(pickle.dumps(IndexedDataModule(**DATA)))
    recorder = Recorder()
    trainer(tmp_path, max_steps=3, enable_checkpointing=False).fit(recorder, datamodule)
    assert len(recorder.batches) == 3 and datamodule._batch_sampler.generator is None
    blob = pickle.dumps(datamodule)  # holds the trainer and its loaders too
    assert b"PCG64" not in blob
    with pytest.raises(PrivacyConfigError, match="no secret stream"):
        next(iter(pickle.loads(blob)._batch_sampler))


@pytest.mark.slow  # (three fits, two of them 2-process spawns: ~50 s on 2 cores; run with -m slow)
def test_ddp_two_processes_union_equals_single_process(tmp_path):
    """Two gloo processes: with no seed, rank 0's secret is broadcast (both ranks hold the same stream);
    with a test seed, the union of the two ranks' batches is exactly the batch one process draws. The default
    suite checks both end to end (``tests/test_ddp.py``: two ranks' fits equal one process's, and with OS secrets
    every rank samples the same batches)."""
    ddp = trainer(
        tmp_path,
        max_epochs=1,
        enable_checkpointing=False,
        strategy="ddp_spawn",
        devices=2,
        use_distributed_sampler=False,
    )
    ddp.fit(Recorder(str(tmp_path)), IndexedDataModule(**DATA))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["stream"] == ranks[1]["stream"]
    seeded = trainer(tmp_path, max_epochs=1, enable_checkpointing=False, strategy="ddp_spawn", devices=2,
                     use_distributed_sampler=False)
    seeded.fit(Recorder(str(tmp_path)), IndexedDataModule(**DATA, sampling_seed=7))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert len(ranks[0]["batches"]) == len(ranks[1]["batches"]) == 9
    for part0, part1 in zip(ranks[0]["batches"], ranks[1]["batches"]):
        assert not set(part0) & set(part1)

    single = Recorder()
    datamodule = IndexedDataModule(**DATA, sampling_seed=7)
    trainer(tmp_path / "single", max_epochs=1, enable_checkpointing=False).fit(single, datamodule)
    assert [sorted(a + b) for a, b in zip(ranks[0]["batches"], ranks[1]["batches"])] == single.batches

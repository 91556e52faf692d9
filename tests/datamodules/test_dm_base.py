"""PublicPrivateDataModule: Poisson loader, validation, disjointness, DDP shards, checkpoint state."""

import math
import warnings

import pytest
import torch

from datamodules import PublicPrivateDataModule, SyntheticClassificationDataModule, check_disjoint
from datamodules.base import SHUFFLE_WARNING
from dm_helpers import IndexedDataModule, fake_trainer, pool_indices
from lit_zodp.errors import PrivacyConfigError
from lit_zodp.privacy.sampling import PoissonBatchSampler


def make(**kwargs) -> IndexedDataModule:
    dm = IndexedDataModule(**kwargs)
    dm.setup("fit")
    return dm


# ----------------------------------------------------------------------------- Poisson loader
def test_poisson_loader_mean_batch_size_matches_binomial():
    """Each batch size is Binomial(n, q): the mean of T batches has std sqrt(n q (1 - q) / T).

    The mean over T batches must lie within 5 of those standard deviations of n q = B.
    """
    n, batch_size, epochs = 1000, 50, 10
    dm = make(n=n, batch_size=batch_size, sampling_seed=0)
    loader = dm.train_dataloader()
    assert isinstance(loader.batch_sampler, PoissonBatchSampler)
    sizes = [len(targets) for _ in range(epochs) for _, targets in loader]
    q = dm.sample_rate
    assert q == batch_size / n and dm.steps_per_epoch == round(1 / q) == len(loader) == 20
    assert len(sizes) == epochs * dm.steps_per_epoch
    tolerance = 5 * math.sqrt(n * q * (1 - q) / len(sizes))
    assert abs(sum(sizes) / len(sizes) - n * q) <= tolerance
    assert len(set(sizes)) > 1  # sizes vary: not a fixed-size loader


@pytest.mark.parametrize("dict_inputs", [False, True])
def test_empty_batches_have_zero_rows_and_right_shapes(dict_inputs):
    dm = make(n=1000, batch_size=1, sampling_seed=3, dict_inputs=dict_inputs)  # q = 0.001
    batches = list(dm.train_dataloader())
    empty = [b for b in batches if len(b[1]) == 0]
    full = next(b for b in batches if len(b[1]) > 0)
    assert empty, "P(empty) = (1 - q)^n = 0.37 per step: an epoch of 1000 steps has empty batches"
    inputs, targets = empty[0]
    assert targets.shape == (0,) and targets.dtype == torch.long
    if dict_inputs:
        assert set(inputs) == set(full[0]) == {"input_ids", "attention_mask"}
        assert inputs["input_ids"].shape == (0, 3) and inputs["input_ids"].dtype == torch.long
    else:
        assert inputs.shape == (0, 1) and inputs.dtype == full[0].dtype == torch.float32


def test_poisson_batches_are_private_examples_only():
    dm = make(n=200, batch_size=20, public_fraction=0.25, val_fraction=0.1, sampling_seed=1)
    private = set(dm.private_indices)
    for batch in dm.train_dataloader():
        assert set(pool_indices(batch)) <= private


# -------------------------------------------------------------------------------- validation
def test_batch_size_not_positive_raises_before_training():
    for bad in (0, -4):
        with pytest.raises(PrivacyConfigError, match="batch_size"):
            IndexedDataModule(batch_size=bad)


def test_sample_rate_above_one_raises_at_setup():
    dm = IndexedDataModule(n=100, batch_size=64, public_fraction=0.5)  # n_private = 50 < B
    with pytest.raises(PrivacyConfigError, match=r"q = B / n_private"):
        dm.setup("fit")


def test_max_private_samples_below_batch_size_raises():
    with pytest.raises(PrivacyConfigError, match="exceeds the number of private examples"):
        make(n=100, batch_size=20, max_private_samples=10)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"public_fraction": 1.0}, "public_fraction"),
        ({"public_fraction": -0.1}, "public_fraction"),
        ({"public_fraction": 0.6, "val_fraction": 0.5}, "something must stay private"),
        ({"sampling": "uniform"}, "sampling"),
        ({"eval_batch_size": 0}, "eval_batch_size"),
        ({"max_private_samples": 0}, "max_private_samples"),
        ({"num_workers": -1}, "num_workers"),
        ({"sampling_seed": -1}, "sampling_seed"),
        ({"sampling": "single_pass", "num_workers": 2}, "`num_workers`=0 with sampling='single_pass'"),
        ({"anchor_batch_size": 8, "anchor_period": 2}, "`anchor_batch_size` is for sampling='single_pass'"),
        ({"sampling": "single_pass", "anchor_period": 3}, "`anchor_period`=3 needs an `anchor_batch_size`"),
    ],
)
def test_invalid_arguments_raise_privacy_config_error(kwargs, fragment):
    with pytest.raises(PrivacyConfigError, match=fragment):
        IndexedDataModule(**kwargs)


def test_all_errors_reported_at_once():
    with pytest.raises(PrivacyConfigError) as info:
        IndexedDataModule(batch_size=0, public_fraction=2.0, num_workers=-1)
    message = str(info.value)
    assert "batch_size" in message and "public_fraction" in message and "num_workers" in message


def test_public_fraction_too_small_for_pool_raises():
    with pytest.raises(PrivacyConfigError, match="holds no example"):
        make(n=100, batch_size=4, public_fraction=0.001)


def test_data_is_not_available_before_setup():
    dm = IndexedDataModule()
    with pytest.raises(RuntimeError, match="setup"):
        dm.train_dataloader()
    with pytest.raises(RuntimeError, match="setup"):
        _ = dm.n_private


def test_base_class_requires_load_splits():
    with pytest.raises(NotImplementedError):
        PublicPrivateDataModule().setup()


# --------------------------------------------------------------------------- public / private
def test_public_private_val_are_disjoint_and_cover_the_pool():
    dm = make(n=300, batch_size=10, public_fraction=0.2, val_fraction=0.1, data_seed=5)
    private, public, val = set(dm.private_indices), set(dm.public_indices), set(dm.val_indices)
    assert not private & public and not private & val and not public & val
    assert private | public | val == set(range(300))
    assert (len(public), len(val), dm.n_private) == (60, 30, 210)
    assert len(dm.public_dataset) == 60 and len(dm.val_dataset) == 30
    assert sorted(pool_indices(next(iter(dm.public_dataloader(batch_size=60))))) == sorted(public)


def test_split_depends_on_data_seed_only():
    a = make(n=100, batch_size=5, public_fraction=0.3, data_seed=1)
    b = make(n=100, batch_size=5, public_fraction=0.3, data_seed=1, sampling_seed=9)
    c = make(n=100, batch_size=5, public_fraction=0.3, data_seed=2)
    assert a.public_indices == b.public_indices != c.public_indices


def test_check_disjoint_raises_on_overlap():
    check_disjoint([0, 1, 2], [3, 4])
    with pytest.raises(PrivacyConfigError, match=r"shares indices .*\[2, 3\]"):
        check_disjoint([0, 1, 2, 3], [2, 3, 4])
    with pytest.raises(PrivacyConfigError, match="shares texts"):
        check_disjoint(["a review", "another"], ["a review"], what="texts")


def test_an_overlap_message_names_the_options_but_no_private_text_or_count():
    with pytest.raises(PrivacyConfigError, match=r"shares texts with .*`dedupe: true`.*`public_fraction`") as info:
        check_disjoint(["a review", "another", "third"], ["a review", "third"], what="texts")
    message = str(info.value)
    assert "\n" not in message and "review" not in message and "third" not in message and "2" not in message


@pytest.mark.parametrize("public_fraction,val_fraction", [(0.3, 0.0), (0.25, 0.2), (0.0, 0.3)])
def test_groups_are_carved_whole_so_no_group_straddles_the_private_split(public_fraction, val_fraction):
    """MultiRC-like pools (several rows per paragraph): every cut falls between groups."""
    groups = [i // 7 for i in range(100)]  # 15 groups of 7 rows (and one of 2)
    dm = make(n=100, batch_size=5, public_fraction=public_fraction, val_fraction=val_fraction, train_groups=groups)
    private = {groups[i] for i in dm.private_indices}
    public, val = {groups[i] for i in dm.public_indices}, {groups[i] for i in dm.val_indices}
    assert not private & public and not private & val and not public & val
    assert sorted(dm.public_indices + dm.val_indices + dm.private_indices) == list(range(100))
    assert abs(len(dm.public_indices) - 100 * public_fraction) < 7 and abs(len(dm.val_indices) - 100 * val_fraction) < 7
    ungrouped = make(n=100, batch_size=5, public_fraction=public_fraction, val_fraction=val_fraction)
    assert len(ungrouped.public_indices) == round(100 * public_fraction)  # without groups: exact counts


def test_a_separate_public_source_without_identifiers_warns_that_it_is_unchecked():
    with pytest.warns(UserWarning, match="not checked"):
        make(n=100, batch_size=5, n_public_source=3)


def test_private_rows_repeating_a_carved_public_rows_id_give_way():
    """Red-team review 17: such a repeat refused the fit, an un-noised bit about the private rows; the private side
    now gives way, as it does to a separate public source."""
    ids = [f"x{i}" for i in range(100)]
    first = make(n=100, batch_size=5, public_fraction=0.2, train_ids=ids)
    public, private = first.public_indices[0], first.private_indices[:3]
    for i in private:
        ids[i] = ids[public]
    dm = make(n=100, batch_size=5, public_fraction=0.2, train_ids=ids)
    assert dm.public_indices == first.public_indices and dm.private_indices == sorted(set(first.private_indices)
                                                                                       - set(private))


def _setup_output(ids, **kwargs):
    """What setting up prints or raises (warnings, then the error if any)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            make(n=60, batch_size=5, train_ids=ids, **kwargs)
            error = None
        except Exception as err:  # noqa: BLE001 (any refusal is output)
            error = f"{type(err).__name__}: {err}"
    return [str(w.message) for w in caught], error


@pytest.mark.parametrize("settings", [dict(val_fraction=0.2), dict(public_fraction=0.2),
                                      dict(public_fraction=0.2, val_fraction=0.2)])
def test_setup_says_the_same_whatever_one_private_rows_text_is(settings):
    """Red-team review 17: a warning printed only when a private text repeated a validation text, and a refusal when
    it repeated a public one, were deterministic bits about a private row for whoever reads the output. The private
    row's text here is, in turn, a validation text, a public text and a text found nowhere else."""
    ids = [f"x{i}" for i in range(60)]
    carve = make(n=60, batch_size=5, train_ids=ids, **settings)
    target = carve.private_indices[-1]
    outputs = []
    for text in {ids[i] for i in carve.val_indices[:1] + carve.public_indices[:1]} | {"found nowhere else"}:
        changed = list(ids)
        changed[target] = text
        outputs.append(_setup_output(changed, **settings))
    assert len(outputs) >= 2 and all(output == outputs[0] for output in outputs)


def test_private_rows_equal_to_a_separate_public_example_are_dropped_from_the_private_side():
    ids = [f"x{i}" for i in range(100)]
    dm = make(n=100, batch_size=5, public_fraction=0.1, n_public_source=3, train_ids=ids,
              public_ids=["y", "x7", "x8"])
    shared = {7, 8} - set(dm.public_indices)
    assert dm.n_private == 90 - len(shared) and not shared & set(dm.private_indices)
    assert len(dm.public_dataset) == 10 + 3  # the public source is kept whole


def test_separate_public_source_and_cap():
    ids = [f"x{i}" for i in range(100)]
    dm = make(n=100, batch_size=5, n_public_source=30, train_ids=ids, public_ids=[f"y{i}" for i in range(30)])
    assert dm.public_indices == [] and len(dm.public_dataset) == 30 and dm.n_private == 100
    dm = make(n=100, batch_size=5, public_fraction=0.1, n_public_source=30, max_public_samples=25)
    assert len(dm.public_indices) == 10 and len(dm.public_dataset) == 25


def test_no_public_split():
    dm = make(n=50, batch_size=5)
    assert dm.public_dataset is None and dm.public_dataloader() is None
    with pytest.raises(RuntimeError, match="no public split"):
        next(dm.public_batches())


def test_public_batches_cycle_forever():
    dm = make(n=100, batch_size=5, public_fraction=0.1, public_batch_size=4)
    batches = [b for _, b in zip(range(7), dm.public_batches())]  # 10 public examples: 3 batches a pass
    assert [len(t) for _, t in batches] == [4, 4, 2, 4, 4, 2, 4]


# -------------------------------------------------------------------------------- shuffle mode
def test_shuffle_mode_warns_and_gives_fixed_size_batches():
    with pytest.warns(UserWarning, match="assumes Poisson"):
        dm = IndexedDataModule(n=103, batch_size=10, sampling="shuffle", sampling_seed=0)
    assert "epsilon" in SHUFFLE_WARNING
    dm.setup()
    batches = [pool_indices(b) for b in dm.train_dataloader()]
    assert dm.steps_per_epoch == len(batches) == 10 and all(len(b) == 10 for b in batches)
    assert len(set(sum(batches, []))) == 100  # without replacement within an epoch


def test_poisson_mode_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        IndexedDataModule(batch_size=5)


# ------------------------------------------------------------------------------------ DDP
@pytest.mark.parametrize("sampling", ["poisson", "shuffle"])
def test_ddp_shards_union_equals_single_process_batch(sampling):
    kwargs = dict(n=400, batch_size=40, sampling=sampling, sampling_seed=123, public_fraction=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        single, rank0, rank1 = make(**kwargs), make(**kwargs), make(**kwargs)
    rank0.trainer, rank1.trainer = fake_trainer(0, 2), fake_trainer(1, 2)
    loaders = [dm.train_dataloader() for dm in (single, rank0, rank1)]
    assert len(loaders[0]) == len(loaders[1]) == len(loaders[2])
    for epoch in range(2):
        for full, part0, part1 in zip(*loaders):
            ids0, ids1 = pool_indices(part0), pool_indices(part1)
            assert sorted(ids0 + ids1) == pool_indices(full)
            assert not set(ids0) & set(ids1)


def test_ddp_rank0_seed_is_broadcast():
    broadcasts = []

    def broadcast(obj, src=0):
        broadcasts.append((obj, src))
        return 4242  # what rank 0 sent

    dm = make(n=100, batch_size=10)
    dm.trainer = fake_trainer(1, 2, broadcast=broadcast)
    dm.train_dataloader()
    assert len(broadcasts) == 1 and broadcasts[0][1] == 0 and broadcasts[0][0].bit_length() > 128
    reference = make(n=100, batch_size=10, sampling_seed=4242)
    reference.trainer = fake_trainer(1, 2)
    assert [pool_indices(b) for b in dm.train_dataloader()] == [pool_indices(b) for b in reference.train_dataloader()]


def test_ddp_requires_distributed_sampler_off():
    dm = make(n=100, batch_size=10)
    dm.trainer = fake_trainer(0, 2, use_distributed_sampler=True)
    with pytest.raises(PrivacyConfigError, match="use_distributed_sampler=False"):
        dm.train_dataloader()


def test_eval_loaders_full_set_per_rank_or_sharded():
    dm = make(n=100, batch_size=10, eval_batch_size=4)
    dm.trainer = fake_trainer(1, 2)
    assert sum(len(t) for _, t in dm.test_dataloader()) == 10  # full test set on every rank
    assert dm.val_dataset is dm.test_dataset  # no val hold-out: validate on the test set
    sharded = make(n=100, batch_size=10, eval_batch_size=4, shard_eval=True)
    shards = []
    for rank in (0, 1):
        sharded.trainer = fake_trainer(rank, 2)
        shards.append(sum((pool_indices(b) for b in sharded.val_dataloader()), []))
    assert sorted(shards[0] + shards[1]) == list(range(20_000, 20_010))


def test_sharded_evaluation_warns_when_the_sampler_repeats_rows(recwarn):
    """shard_eval pads a split that does not divide among the ranks with repeated rows (DistributedSampler), which
    every logged mean (loss, accuracy, a generative QA's F1) then counts twice: 10 rows on 3 ranks repeat 2 (measured
    with QADataModule's 5 test rows on 2 ranks: F1 0.667 logged for 0.6). Said once, on rank 0; silent when the rows
    divide or every rank evaluates the full set."""
    import warnings as _warnings

    from lit_zodp.errors import LitZodpWarning

    def said(shard_eval, world, rank=0):
        dm = make(n=100, batch_size=10, eval_batch_size=4, shard_eval=shard_eval)
        dm.trainer = fake_trainer(rank, world)
        with _warnings.catch_warnings(record=True) as caught:
            _warnings.simplefilter("always")
            rows = sum((pool_indices(b) for b in dm.test_dataloader()), [])
        return [str(w.message) for w in caught if issubclass(w.category, LitZodpWarning)], rows

    messages, rows = said(True, 3)
    assert len(rows) == 4  # 10 rows padded to 12: rank 0 holds 4
    assert len(messages) == 1 and "10 test rows" in messages[0] and "repeats 2" in messages[0]
    assert "shard_eval: false" in messages[0] and "\n" not in messages[0]
    assert said(True, 3, rank=1)[0] == [] and said(True, 2)[0] == [] and said(False, 3)[0] == []


def test_worker_processes_collate_empty_batches_and_sampler_stays_in_main_process():
    dm = make(n=300, batch_size=1, sampling_seed=2, num_workers=1)  # q = 1/300: many empty batches
    reference = make(n=300, batch_size=1, sampling_seed=2)
    got = [pool_indices(b) for b in dm.train_dataloader()]
    assert got == [pool_indices(b) for b in reference.train_dataloader()]
    assert [] in got


# ----------------------------------------------------------------------------- checkpoints
def test_checkpointed_state_holds_no_secret_and_a_restored_module_draws_fresh_masks(tmp_path):
    first = make(n=500, batch_size=25)
    iterator = iter(first.train_dataloader())
    for _ in range(3):
        next(iterator)
    torch.save(first.state_dict(), tmp_path / "dm.pt")
    state = torch.load(tmp_path / "dm.pt", weights_only=True)
    assert state == {"sampling": "poisson"}
    continued = [pool_indices(next(iterator)) for _ in range(5)]
    twins = []
    for _ in range(2):  # two continuations of one checkpoint must not share masks
        resumed = make(n=500, batch_size=25)
        resumed.load_state_dict(state)
        twins.append([pool_indices(b) for _, b in zip(range(5), resumed.train_dataloader())])
    assert twins[0] != twins[1] and continued not in twins


def test_reloading_the_train_loader_never_replays_masks():
    dm = make(n=200, batch_size=20, sampling_seed=5)
    first = [pool_indices(b) for b in dm.train_dataloader()]
    second = [pool_indices(b) for b in dm.train_dataloader()]
    assert first != second
    fresh = make(n=200, batch_size=20, sampling_seed=5)
    assert [pool_indices(b) for b in fresh.train_dataloader()] == first


def test_state_dict_before_training_is_harmless():
    dm = make(n=100, batch_size=10)
    assert dm.state_dict() == {"sampling": "poisson"}
    dm.load_state_dict({})
    dm.load_state_dict(dm.state_dict())
    assert len(list(dm.train_dataloader())) == 10


# ------------------------------------------------------------------------- CLI / hparams
def test_constructor_arguments_visible_to_jsonargparse():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(SyntheticClassificationDataModule, "data")
    config = parser.parse_args(["--data.batch_size=7", "--data.sampling_seed=3", "--data.n_features=4"])
    init = parser.instantiate_classes(config)
    dm = init.data
    assert (dm.batch_size, dm.sampling_seed, dm.n_features, dm.sampling) == (7, 3, 4, "poisson")
    with pytest.raises(Exception):
        parser.parse_args(["--data.sampling=uniform"])


@pytest.mark.parametrize("name", ["DigitsDataModule", "MovieReviewsDataModule", "CIFAR10DataModule"])
def test_subclass_mode_sees_base_arguments(name):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(PublicPrivateDataModule, "data")
    arguments = ["--data.init_args.batch_size=3", "--data.init_args.public_fraction=0.1"]
    config = parser.parse_args([f"--data.class_path=datamodules.{name}", *arguments])
    assert config.data.init_args.batch_size == 3 and config.data.init_args.public_fraction == 0.1
    assert config.data.init_args.sampling == "poisson" and config.data.init_args.sampling_seed is None


def test_hparams_exclude_the_sampling_seed():
    dm = SyntheticClassificationDataModule(batch_size=8, sampling_seed=77, n_features=5)
    assert dm.hparams["batch_size"] == 8 and dm.hparams["n_features"] == 5
    assert "sampling_seed" not in dm.hparams


# ------------------------------------------------------------------------ public batches in the step
def test_public_in_step_hands_each_private_batch_a_public_one_the_same_on_every_rank():
    kwargs = dict(n=400, batch_size=20, public_fraction=0.25, public_batch_size=16, public_in_step=True,
                  sampling_seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        single, rank1 = make(**kwargs), make(**kwargs)
    rank1.trainer = fake_trainer(1, 2)
    loaders = [single.train_dataloader(), rank1.train_dataloader()]
    assert set(loaders[0]) == {"private", "public"}
    assert len(loaders[0]["public"]) == len(loaders[0]["private"])
    public = [pool_indices(b) for b in loaders[0]["public"]]
    assert public == [pool_indices(b) for b in loaders[1]["public"]]  # identical on every rank, not sharded
    assert all(len(b) == 16 for b in public)
    assert not set(sum(public, [])) & set(single.private_indices)  # public examples never private
    assert single.n_private == len(single.private_indices) == 300


def test_the_public_stream_position_is_checkpointed():
    dm = make(n=400, batch_size=20, public_fraction=0.25, public_in_step=True)
    stream = iter(dm.train_dataloader()["public"])
    [next(stream) for _ in range(3)]
    state = dm.state_dict()
    assert state["public_position"] == 3
    expected = [pool_indices(next(stream)) for _ in range(4)]
    resumed = make(n=400, batch_size=20, public_fraction=0.25, public_in_step=True)
    resumed.load_state_dict(state)
    got = [pool_indices(b) for _, b in zip(range(4), resumed.train_dataloader()["public"])]
    assert got == expected


def test_public_in_step_without_a_public_split_is_refused():
    dm = make(n=100, batch_size=10, public_in_step=True)
    with pytest.raises(PrivacyConfigError, match="public_fraction"):
        dm.train_dataloader()


def test_the_split_id_is_spelled_alike_in_every_process():
    """Review, 2026-11-28: ids hashed by ``repr`` differ between processes (a frozenset's order follows
    PYTHONHASHSEED; a default repr holds an address), which refused legitimate resumes: such ids leave only the
    indices in the digest; NumPy ints read as ints."""
    import os
    import subprocess
    import sys

    import numpy as np

    from datamodules.base import split_id

    held_out = ([0, 2], [5])
    as_sets = [frozenset({f"a{i}", f"b{i}", f"c{i}"}) for i in range(6)]
    assert split_id(6, 3, held_out, as_sets) == split_id(6, 3, held_out)
    assert split_id(6, 3, held_out, [np.int64(i) for i in range(6)]) == split_id(6, 3, held_out, list(range(6)))
    assert split_id(6, 3, held_out, [f"row{i}" for i in range(6)]) != split_id(6, 3, held_out)
    assert split_id(6, 3, held_out) != split_id(6, 3, ([0, 2], [4]))
    assert split_id(6, 3, held_out) != split_id(6, 3, ([0], [2, 5]))  # (a row moved from public to validation)
    # (one other process, of another hash seed than this one's: each import of the module takes ~10 s on 2 cores)
    script = ("from datamodules.base import split_id; "
              "print(split_id(6, 3, ([0, 2], [5]), [(f'r{i}', i) for i in range(6)]))")
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    there = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
    assert there == split_id(6, 3, ([0, 2], [5]), [(f"r{i}", i) for i in range(6)])


def _split_id_with_row(row: int, text: str, **kwargs) -> tuple[IndexedDataModule, str]:
    ids = [f"text {i}" for i in range(100)]
    ids[row] = text
    dm = make(n=100, batch_size=10, public_fraction=0.2, val_fraction=0.2, train_ids=ids, **kwargs)
    return dm, dm.split_id


def test_the_split_id_holds_nothing_of_a_private_rows_content():
    """Red-team review 17: the digest kept in every checkpoint hashed the private rows' ids (a text module's texts),
    so an attacker who knew the other rows read a row off the checkpoint by hashing each candidate. It is now a
    function of the held-out rows and the sizes; those rows' content and place still change it."""
    dm, _ = _split_id_with_row(0, "text 0")
    private, public, validation = dm.private_indices[0], dm.public_indices[0], dm.val_indices[0]
    assert len({_split_id_with_row(private, text)[1] for text in ("POSITIVE", "NEGATIVE", f"text {private}")}) == 1
    assert _split_id_with_row(public, "POSITIVE")[1] != _split_id_with_row(public, "NEGATIVE")[1]
    assert _split_id_with_row(validation, "POSITIVE")[1] != _split_id_with_row(validation, "NEGATIVE")[1]
    assert make(n=100, batch_size=10, public_fraction=0.2, val_fraction=0.2, data_seed=1).split_id != \
        make(n=100, batch_size=10, public_fraction=0.2, val_fraction=0.2).split_id


def test_the_movie_review_modules_split_id_holds_nothing_of_a_private_review(tmp_path):
    """The same for the packaged text module (configs/movie_reviews/*): its ids are the review texts."""
    import csv

    from datamodules import MovieReviewsDataModule

    rows = [(f"review number {i} was {'good' if i % 2 else 'bad'}", i % 2, "rotten_tomatoes") for i in range(40)]

    def module_with(first_text):
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.csv"
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label", "source"])
            writer.writerows([(first_text, 1, "rotten_tomatoes")] + rows[1:])
        dm = MovieReviewsDataModule(source="rotten_tomatoes", tokenizer="minilm", max_length=16, batch_size=4,
                                    data_path=str(path), test_fraction=0.25)
        dm.setup("fit")
        return dm

    first = module_with("alice: test result POSITIVE")
    row = [i for i, text in enumerate(first.pool_dataset.texts) if text == "alice: test result POSITIVE"]
    assert row and row[0] in first.private_indices  # the review is a private row
    assert first.split_id == module_with("alice: test result NEGATIVE").split_id

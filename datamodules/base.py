"""``PublicPrivateDataModule``: private (Poisson-sampled) and public splits with the privacy checks.

A subclass implements :meth:`PublicPrivateDataModule.load_splits` (the training *pool*, an optional
separate public source, val/test sets and the number of classes). The base class carves the pool into
disjoint public / validation / private parts with ``data_seed``, drops the private rows equal to a
separate public example (the private side gives way: the public split depends on its source alone),
checks the parts are disjoint, and serves:

* ``train_dataloader()``: the PRIVATE loader, sampled as ``sampling`` says (its description is what
  the privacy component accounts, read from the loader's batch sampler):
  ``"poisson"`` (default): every example joins a batch independently with probability
  ``q = batch_size / n_private`` (batches vary in size, may be empty); ``"full_batch"``: every example
  every step; ``"single_pass"``: each example in exactly one step of the run; ``"shuffle"``:
  fixed-size shuffled batches, an opt-in that warns (the accountant assumes Poisson). Under DDP
  every rank draws the same global batch (rank 0's secret, broadcast) and keeps its shard, so the
  union over ranks is exactly the single-process batch.
* ``public_dataloader()`` / ``public_batches()``: the public split (no privacy cost), the same stream
  on every rank. Which pool rows are public is ``public_selection`` (random, the first ones, or a count per class:
  :mod:`datamodules.selection`); ``public_augment`` flips, shifts and cuts out the public training images
  (:mod:`datamodules.augment`).
* ``val_dataloader()`` / ``test_dataloader()``: plain sequential loaders. Under DDP every rank
  evaluates the FULL set by default (identical metrics on each rank, no synchronization needed);
  ``shard_eval=True`` shards with ``DistributedSampler(shuffle=False)`` instead (a few examples are
  repeated when the size is not divisible by the world size, as with Lightning's own sampler, and
  the logged means count them twice: that warns).

DDP requires ``Trainer(use_distributed_sampler=False)``: the data module does the distributed sampling.

The Poisson and shuffle streams are secret (amplification by subsampling assumes the batches are):
a fresh 256-bit OS-entropy secret at every fit start, never written to a checkpoint, never pickled and
dropped when the fit ends (``teardown``), so a resumed run or two continuations of one checkpoint never
share a mask (but both spend privacy: each ledger counts its own lineage only, see the README).
``sampling_seed`` makes them reproducible for tests only (it warns, and is kept out of ``hparams``).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import (
    BatchSampler,
    ConcatDataset,
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    Subset,
)

from datamodules.augment import AUGMENT_RECIPES, AugmentedDataset, KeyedBatches
from datamodules.collate import EmptySafeCollate
from datamodules.selection import (
    class_weight_errors,
    label_list,
    largest_remainder_counts,
    per_class_public,
)
from lit_zodp.errors import (ConfigError, LitZodpWarning, PrivacyConfigError, check_bool, check_choice,
                             check_positive_int, raise_if_any)
from lit_zodp.privacy.noise import secret_seed, warn_test_seed
from lit_zodp.privacy.sampling import (
    SHUFFLE_WARNING,
    FullBatchSampler,
    PoissonBatchSampler,
    PrivateBatchSampler,
    ShuffleBatchSampler,
    SinglePassBatchSampler,
    anchor_errors,
    mark_private_data,
    single_pass_steps,
)

SAMPLINGS = ("poisson", "full_batch", "single_pass", "shuffle")

# Fixed seed for subsampling val/test sets (max_eval_samples): the same evaluation examples for every
# data_seed, so runs stay comparable.
EVAL_SUBSET_SEED = 0
# Offset of the public shuffling generator's seed from data_seed (public order, not secret).
PUBLIC_SEED_OFFSET = 1_000_003


@dataclass
class DataSplits:
    """What :meth:`PublicPrivateDataModule.load_splits` returns.

    Attributes:
        train: the training pool; the private set (and the in-distribution public and validation
            hold-outs) are carved out of it.
        num_classes: number of classes of the labels.
        test: test set, or ``None``.
        val: a given validation set, or ``None`` (then ``val_fraction`` or the test set is used).
        public: a separate public source (e.g. another corpus), or ``None``.
        train_ids: one hashable identifier per pool example (e.g. the text), to check that the
            private set shares no example with the public splits; ``None`` checks indices only.
        public_ids: identifiers of the ``public`` examples, in the same space as ``train_ids``. The
            private rows with one of these ids are dropped: the private set is defined after this filter
            by the fixed public source (``n_private`` counts the rows left), and the public split never
            depends on the private rows.
        val_ids: identifiers of the given ``val`` examples, in the same space (public: the split id hashes them).
        train_groups: one hashable per pool example naming the unit it belongs to (MultiRC: its
            passage), or ``None``: the public and validation hold-outs are carved as whole groups,
            so no group has rows on both sides of the private split.
        val_groups: groups of the given ``val`` examples.
        val_from_train_file: the given ``val`` rows were drawn from the file the pool was drawn from (row by row: with
            ``train_groups``, a group can then have rows on both sides, which warns).
        deduplicated: no id repeats in the pool and a ``val`` drawn from its file (repeats dropped before drawing).
            Without it, validation rows carved from the pool or drawn from its file may repeat a private row's id,
            which warns.
        train_labels: one class index per pool example, read only by ``public_selection: per_class``; ``None``
            reads the pool's ``.targets`` (image and tensor sets) or ``.labels`` (text sets).

    What the splits say is decided from these declarations, never from the private rows' ids or groups: a warning
    printed only when a private text repeated a validation text was an un-noised bit about the private rows
    (red-team review 17).
    """

    train: Dataset
    num_classes: int
    test: Optional[Dataset] = None
    val: Optional[Dataset] = None
    public: Optional[Dataset] = None
    train_ids: Optional[Sequence[Hashable]] = None
    public_ids: Optional[Sequence[Hashable]] = None
    val_ids: Optional[Sequence[Hashable]] = None
    train_groups: Optional[Sequence[Hashable]] = None
    val_groups: Optional[Sequence[Hashable]] = None
    val_from_train_file: bool = False
    deduplicated: bool = False
    train_labels: Optional[Sequence[int]] = None


def check_disjoint(private: Iterable[Hashable], public: Iterable[Hashable], *, what: str = "indices",
                   split: str = "public", fix: str = "set `dedupe: true` (one text on both sides) or lower "
                                                    "`public_fraction`") -> None:
    """Raise :class:`PrivacyConfigError` if the private and public collections share an element; the
    message names no private identifier and no count (shared indices only, which are positions).

    Args:
        private: indices (or identifiers) of the private examples.
        public: indices (or identifiers) of the public (or validation) examples.
        what: what the elements are, for the message ("indices", "texts", ...).
        split: the other split's name, for the message.
        fix: the options that resolve it, for the message.
    """
    overlap = set(private) & set(public)
    if not overlap:
        return
    shown = f" (e.g. {sorted(overlap)[:5]})" if what == "indices" else ""
    raise PrivacyConfigError(
        f"The {split} split shares {what} with the private split{shown}. It must be disjoint from the private "
        f"set, or its use is not free of privacy cost: {fix}."
    )


def _check_id_lengths(splits: DataSplits) -> None:
    """Refuse identifiers that do not match their examples one for one."""
    if splits.train_ids is not None and len(splits.train_ids) != len(splits.train):
        raise ValueError(f"{len(splits.train_ids)} train_ids for a pool of {len(splits.train)} examples")
    if splits.public is not None and splits.public_ids is not None and len(splits.public_ids) != len(splits.public):
        raise ValueError(f"{len(splits.public_ids)} public_ids for {len(splits.public)} public examples")


def _groups_together(order: list[int], groups: Sequence[Hashable]) -> list[int]:
    """``order`` with each group's rows moved next to its first row (groups in order of first row)."""
    rows: dict[Hashable, list[int]] = {}
    for i in order:
        rows.setdefault(groups[i], []).append(i)
    return [i for members in rows.values() for i in members]


def _boundary_at_or_below(order: list[int], groups: Optional[Sequence[Hashable]], cut: int, floor: int) -> int:
    """The largest position ``<= cut`` (and ``>= floor``) not inside a group of ``order``."""
    cut = min(cut, len(order))
    if groups is None:
        return cut
    while floor < cut < len(order) and groups[order[cut]] == groups[order[cut - 1]]:
        cut -= 1
    return cut


def split_id(pool_size: int, n_private: int, held_out: Sequence[Sequence[int]] = (),
             ids: Optional[Sequence[Hashable]] = None, public_source_ids: Optional[Sequence[Hashable]] = None,
             seed: Optional[int] = None, given_val_ids: Optional[Sequence[Hashable]] = None) -> str:
    """Which rows are not private: a SHA-256 of the data seed, the pool size, the private count, the pool indices of
    each held-out part (public, validation) with their ids where the data has them (spelled alike in every process),
    a validation split's ids drawn elsewhere (a k-shot dev drawn from the training file by the seed) and a separate
    public source's ids. The privacy plan keeps it, and a resume on another split is refused
    (:meth:`~lit_zodp.privacy.PrivacyComponent.plan`): rows accounted as private could have become public or
    validation rows, used and logged without noise (audit, 2026-11-28: another ``data_seed``, same fractions).

    Nothing in it is a private row's: the checkpoint and every copy of it hold it. Its first version hashed the private
    rows' ids, which are a text module's texts, so an attacker who knew the other rows read a row off the checkpoint by
    hashing each candidate (red-team review 17). The private count is the sample rate's, which the plan keeps and
    prints anyway; it does count the private rows a public row's id made give way (:meth:`_drop_public_ids`), as
    ``n`` counts a row that is there. Not seen: the same private rows in another order (a single pass then continues
    by position over other rows: resume on the file it started with)."""
    digest = hashlib.sha256(f"{seed}|{pool_size}|{n_private}".encode())
    for part in held_out:
        indices = sorted(part)
        digest.update(f"|{len(indices)}|".encode() + np.asarray(indices, dtype="<i8").tobytes())
        _hash_ids(digest, [ids[i] for i in indices] if ids is not None else None)
    digest.update(b"|validation drawn elsewhere|")
    _hash_ids(digest, given_val_ids)
    digest.update(b"|public source|")
    _hash_ids(digest, public_source_ids)
    return digest.hexdigest()


def _hash_ids(digest: Any, ids: Optional[Sequence[Hashable]]) -> None:
    """Add ``ids`` to ``digest`` where each has one spelling in every process (see :func:`_canonical_id`)."""
    canonical = [_canonical_id(value) for value in ids] if ids is not None else []
    if canonical and None not in canonical:
        digest.update("\x1f".join(canonical).encode())


def _canonical_id(value: Any) -> Optional[str]:
    """One spelling of an id in every process (str, bytes, int, or tuples of them); ``None`` for anything else (a
    frozenset's order follows PYTHONHASHSEED, a default ``repr`` holds an address)."""
    if isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, (str, bytes)) or (isinstance(value, int) and not isinstance(value, bool)):
        return repr(value)
    if isinstance(value, tuple):
        parts = [_canonical_id(v) for v in value]
        return None if None in parts else "(" + ",".join(parts) + ")"
    return None


def _check_fraction(name: str, value: Any) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not 0 <= value < 1:
        return f"Expected `{name}` in [0, 1), but got {value!r}"
    return None


def _check_optional_positive_int(name: str, value: Any) -> Optional[str]:
    return None if value is None else check_positive_int(name, value)


def check_int(name: str, value: Any, *, minimum: Optional[int] = None) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        return f"Expected `{name}` to be an int{bound}, but got {value!r}"
    return None


def _random_subset(dataset: Dataset, size: Optional[int], seed: int) -> Dataset:
    """A seeded random subset of ``size`` examples (the dataset itself if it is not larger)."""
    if size is None or len(dataset) <= size:
        return dataset
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    return Subset(dataset, sorted(order[:size].tolist()))


def attached_model(dm: LightningDataModule) -> Any:
    """The LightningModule of the Trainer the data module is attached to (``None`` outside a Trainer)."""
    trainer = getattr(dm, "trainer", None)
    return getattr(trainer, "lightning_module", None) if trainer is not None else None


def warn_validation_on_test(dm: "PublicPrivateDataModule", why: str, fix: str) -> None:
    """Warn when ``dm``'s validation loader reads its test set (no validation split was drawn): its metrics, and a
    checkpoint or early stop chosen by them, then select on the test set. Said on rank 0 only: under DDP every
    rank sets up, and the line came once per rank."""
    if dm._rank_and_world_size()[0] == 0 and dm.val_dataset is not None and dm.val_dataset is dm.test_dataset:
        warnings.warn(f"{why}: validation runs on the test set; {fix}", LitZodpWarning)


def fixed_test_split(size: int, test_fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """Sorted (train, test) indices of a seeded split that does not depend on ``data_seed``.

    Args:
        size: number of examples.
        test_fraction: fraction held out for testing.
        seed: seed of the permutation (fixed so the test set is the same for every run).
    """
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()
    n_test = round(test_fraction * size)
    return sorted(order[n_test:]), sorted(order[:n_test])


def check_test_fraction(value: Any) -> Optional[str]:
    """Message unless ``test_fraction`` is in (0, 1)."""
    if _check_fraction("test_fraction", value) or value == 0:
        return f"Expected `test_fraction` in (0, 1), but got {value!r}"
    return None


class PublicBatchSampler(Sampler[list[int]]):
    """Fixed-size batches of the PUBLIC split: an endless stream of seeded permutations, ``steps`` per pass of
    the loader. Batch ``k`` depends only on ``(seed, k)``, so every DDP rank draws the same batches and
    ``position`` (batches drawn so far) is the whole state. Public randomness: no privacy cost."""

    def __init__(self, num_samples: int, batch_size: int, *, steps: int, seed: int) -> None:
        self.num_samples, self.batch_size, self.steps, self.seed = num_samples, batch_size, steps, seed
        self.position = 0
        self._permutation: tuple[int, Optional[list[int]]] = (-1, None)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            self.position += 1
            yield self.batch(self.position - 1)

    def batch(self, k: int) -> list[int]:
        indices: list[int] = []
        start = k * self.batch_size
        while len(indices) < self.batch_size:
            epoch, offset = divmod(start + len(indices), self.num_samples)
            take = min(self.batch_size - len(indices), self.num_samples - offset)
            indices += self._order(epoch)[offset:offset + take]
        return indices

    def _order(self, epoch: int) -> list[int]:
        if self._permutation[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._permutation = (epoch, torch.randperm(self.num_samples, generator=generator).tolist())
        return self._permutation[1]


class PublicPrivateDataModule(LightningDataModule):
    """Base data module with a Poisson-sampled private split and a disjoint public split.

    Args:
        batch_size: EXPECTED private batch size ``B``; the sample rate is ``q = B / n_private``.
        eval_batch_size: batch size of the validation and test loaders.
        sampling: ``"poisson"`` (default), ``"full_batch"``, ``"single_pass"`` or ``"shuffle"``
            (fixed-size shuffled batches; warns, since the reported epsilon does not hold for it).
        sampling_seed: TEST ONLY (warns): a known seed of the Poisson/shuffle stream voids
            amplification by subsampling. ``None`` draws a fresh OS secret at every fit start.
        anchor_batch_size, anchor_period: an anchored single pass (``sampling: single_pass`` only; both or neither):
            ``anchor_batch_size`` expected examples at the first step of every ``anchor_period`` steps, ``batch_size``
            at the others (Kornowski et al.'s Alg. 3: ``B1`` and ``B2``, the module's ``period``; Thm. 3.1 takes
            ``B1 = period * B2``). Only DPO2NC and O2NC with ``oracle: single_pass`` train on it.
        public_fraction: fraction of the pool held out as in-distribution public data, in [0, 1).
        public_batch_size: batch size of the public loader; ``None`` uses ``batch_size``.
        public_in_step: hand every training step a public batch with its private one
            (``{"private": ..., "public": ...}``): fixed-size public batches, reshuffled each pass from
            ``data_seed``, identical on every DDP rank, position saved in checkpoints.
        max_public_samples: cap on the number of public examples (pool hold-out first, then the
            separate public source).
        public_selection: which pool examples are public (:mod:`datamodules.selection`): ``"random"`` (default:
            the first of the ``data_seed`` permutation), ``"first"`` (the pool's first ones in file order, whatever
            their labels: the PAZO authors' CIFAR-10 code), ``"per_class"`` (a count per class from
            ``public_class_weights``, each class's examples in ``data_seed`` permutation order). The count is
            ``round(public_fraction * pool size)``, capped by ``max_public_samples``; ``val_fraction`` is then carved at
            random from the rest. ``"per_class"`` reads the pool's labels (:attr:`DataSplits.train_labels`): the
            split is a curation by label, as in the paper (App. C.1), and the privacy guarantee is for the private
            set given that split.
        public_class_weights: ``"per_class"`` only: relative public class sizes, one per class (default equal),
            turned into counts by the largest-remainder method
            (:func:`~datamodules.selection.largest_remainder_counts`).
            PAZO Table 7's big imbalance is ``[1.0, 0.9, ..., 0.1]``.
        public_augment: flip, shift and cut out the PUBLIC training batches (``public_in_step``,
            :meth:`public_dataloader`, :meth:`public_batches`), never the private, validation or test ones; image
            data modules only. Keyed by ``data_seed`` and the batch's position in the public stream
            (:mod:`datamodules.augment`).
        public_augment_recipe: ``"standard"`` (flip 1/2, shift up to 1/8 of the side, cutout of half the side
            centred anywhere) or ``"pazo_code"`` (the authors' code: shift up to 0.1, an 8/224-side square inside).
        val_fraction: fraction of the pool held out for validation, in [0, 1); ``0`` uses the given
            validation set, else the test set.
        data_seed: seed of the public / validation / private split of the pool.
        num_workers: DataLoader workers.
        max_private_samples: keep only this many private examples (quick runs).
        max_eval_samples: keep only this many validation and test examples (quick runs).
        shard_eval: under DDP, shard val/test over ranks instead of evaluating the full set on each.
    """

    #: number of classes when known without loading the data (e.g. for LightningCLI argument links)
    known_num_classes: Optional[int] = None
    #: whether the inputs are ``[C, H, W]`` images (``public_augment`` is refused otherwise)
    image_inputs: bool = False

    def __init__(
        self,
        batch_size: int = 64,
        eval_batch_size: int = 256,
        sampling: Literal["poisson", "full_batch", "single_pass", "shuffle"] = "poisson",
        sampling_seed: Optional[int] = None,
        anchor_batch_size: Optional[int] = None,
        anchor_period: int = 1,
        public_fraction: float = 0.0,
        public_batch_size: Optional[int] = None,
        public_in_step: bool = False,
        max_public_samples: Optional[int] = None,
        public_selection: Literal["random", "first", "per_class"] = "random",
        public_class_weights: Optional[list[float]] = None,
        public_augment: bool = False,
        public_augment_recipe: Literal["standard", "pazo_code"] = "standard",
        val_fraction: float = 0.0,
        data_seed: int = 0,
        num_workers: int = 0,
        max_private_samples: Optional[int] = None,
        max_eval_samples: Optional[int] = None,
        shard_eval: bool = False,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.sampling = sampling
        self.sampling_seed = sampling_seed
        self.anchor_batch_size = anchor_batch_size
        self.anchor_period = anchor_period
        self.public_fraction = public_fraction
        self.public_batch_size = public_batch_size
        self.public_in_step = public_in_step
        self.max_public_samples = max_public_samples
        self.public_selection = public_selection
        self.public_class_weights = public_class_weights
        self.public_augment = public_augment
        self.public_augment_recipe = public_augment_recipe
        self.val_fraction = val_fraction
        self.data_seed = data_seed
        self.num_workers = num_workers
        self.max_private_samples = max_private_samples
        self.max_eval_samples = max_eval_samples
        self.shard_eval = shard_eval
        raise_if_any(self.config_errors())
        self.save_hyperparameters(ignore=["sampling_seed"])
        if sampling == "shuffle":  # (once: every DDP rank builds its DataModule)
            rank_zero_warn(SHUFFLE_WARNING, category=LitZodpWarning)
        if sampling_seed is not None:
            warn_test_seed("sampling_seed", "private batch sampling")
        self._reset()

    # ----------------------------------------------------------------------------------- hooks
    def load_splits(self) -> Union[DataSplits, dict]:
        """Load the pool and the other splits (subclasses). A dict takes :class:`DataSplits` fields."""
        raise NotImplementedError

    def download_data(self) -> None:
        """Download files if needed; runs on one process per node (``prepare_data``)."""

    def materialize(self, dataset: Dataset) -> Dataset:
        """Turn a kept split into training-ready examples (e.g. tokenize texts); identity by default."""
        return dataset

    def batch_collate(self) -> Optional[Callable[[list], Any]]:
        """Collation of non-empty batches of every loader (``None``: ``default_collate``); the text data
        modules pad each batch to its longest row (:class:`datamodules.collate.PadToLongest`). Empty
        Poisson batches are handled around it (:class:`datamodules.collate.EmptySafeCollate`)."""
        return None

    def _collate(self, dataset: Dataset) -> EmptySafeCollate:
        return EmptySafeCollate(dataset, self.batch_collate())

    def config_errors(self) -> list[Optional[str]]:
        """Messages for invalid constructor arguments; subclasses extend the list (``None`` = fine)."""
        return [
            check_positive_int("batch_size", self.batch_size),
            check_positive_int("eval_batch_size", self.eval_batch_size),
            None
            if self.sampling in SAMPLINGS
            else f"Expected `sampling` in {SAMPLINGS}, but got {self.sampling!r}",
            None if self.sampling_seed is None else check_int("sampling_seed", self.sampling_seed, minimum=0),
            *anchor_errors(self.anchor_batch_size, self.anchor_period),
            None if self.anchor_batch_size is None or self.sampling == "single_pass" else
            f"`anchor_batch_size` is for sampling='single_pass' (an anchored single pass), but got "
            f"sampling={self.sampling!r}",
            _check_fraction("public_fraction", self.public_fraction),
            _check_fraction("val_fraction", self.val_fraction),
            self._fraction_sum_error(),
            _check_optional_positive_int("public_batch_size", self.public_batch_size),
            _check_optional_positive_int("max_public_samples", self.max_public_samples),
            *class_weight_errors(self.public_selection, self.public_class_weights, self.known_num_classes),
            *self._augment_errors(),
            check_int("data_seed", self.data_seed),
            check_int("num_workers", self.num_workers, minimum=0),
            self._single_pass_workers_error(),
            _check_optional_positive_int("max_private_samples", self.max_private_samples),
            _check_optional_positive_int("max_eval_samples", self.max_eval_samples),
        ]

    def _augment_errors(self) -> list[Optional[str]]:
        errors = [check_bool("public_augment", self.public_augment),
                  check_choice("public_augment_recipe", self.public_augment_recipe, AUGMENT_RECIPES)]
        if any(errors):
            return errors
        if self.public_augment and not self.image_inputs:
            return [f"`public_augment` flips, shifts and cuts out images, but {type(self).__name__}'s inputs are "
                    "not images: set public_augment: false"]
        return []

    def _single_pass_workers_error(self) -> Optional[str]:
        """Workers prefetch batches, which moves a single pass's position (checked against the ledger, and
        checkpointed) ahead of the steps taken: every such fit was refused with a wrong count (audit 7)."""
        if self.sampling != "single_pass" or not isinstance(self.num_workers, int) or self.num_workers == 0:
            return None
        return (f"Expected `num_workers`=0 with sampling='single_pass' (got {self.num_workers}): workers prefetch "
                "batches ahead of the steps, and the pass's position must count the steps taken")

    def _fraction_sum_error(self) -> Optional[str]:
        fractions = (self.public_fraction, self.val_fraction)
        if _check_fraction("public_fraction", fractions[0]) or _check_fraction("val_fraction", fractions[1]):
            return None
        if self.public_fraction + self.val_fraction >= 1:
            return (
                f"Expected `public_fraction` + `val_fraction` < 1 (something must stay private), but got "
                f"{self.public_fraction} + {self.val_fraction}"
            )
        return None

    # ----------------------------------------------------------------------------------- setup
    def _reset(self) -> None:
        self._ready = False
        self.pool_dataset: Optional[Dataset] = None
        self.private_dataset: Optional[Dataset] = None
        self.public_dataset: Optional[Dataset] = None
        self.val_dataset: Optional[Dataset] = None
        self.test_dataset: Optional[Dataset] = None
        self.private_indices: list[int] = []
        self.split_id: Optional[str] = None  # (see split_id)
        self.public_indices: list[int] = []
        self.val_indices: list[int] = []
        self._num_classes: Optional[int] = None
        self._batch_sampler: Optional[PrivateBatchSampler] = None
        self._pending_pass_state: Optional[dict] = None
        self._builds = 0
        self._public_sampler: Optional[PublicBatchSampler] = None
        self._pending_public_position: Optional[int] = None

    def prepare_data(self) -> None:
        self.download_data()

    def teardown(self, stage: str) -> None:
        """When a fit ends, drop the private sampler's secret stream: a pickled or copied data module (or
        trainer) could otherwise replay every private batch of the fit."""
        if stage == "fit" and self._batch_sampler is not None:
            self._batch_sampler.forget_stream()

    def setup(self, stage: Optional[str] = None) -> None:
        """Refuse an attached module that cannot read this data (:meth:`model_mismatch`, at every call, before any
        file is read), then load and split the data once (later calls for other stages are no-ops) and warn when
        validation falls back to the test set (:meth:`validation_fallback`)."""
        model = attached_model(self)
        error = self.model_mismatch(model) if model is not None else None
        if error is not None:
            raise ConfigError(error)
        if self._ready:
            return
        splits = self.load_splits()
        if isinstance(splits, dict):
            splits = DataSplits(**splits)
        self._build(splits)
        self._ready = True
        note = self.validation_fallback()
        if note is not None:
            warn_validation_on_test(self, *note)

    def model_mismatch(self, model: Any) -> Optional[str]:
        """One line when the LightningModule this data module is attached to cannot read its batches (the text
        modules name the backbone to use), else ``None`` (the default)."""
        return None

    def validation_fallback(self) -> Optional[tuple[str, str]]:
        """``(why, fix)`` of the warning said when validation reads the test set (no validation split drawn), or
        ``None`` (the default: no warning)."""
        return None

    def _build(self, splits: DataSplits) -> None:
        raise_if_any([check_positive_int("num_classes", splits.num_classes)])
        pool_size = len(splits.train)
        _check_id_lengths(splits)
        self._carve(pool_size, splits.train_groups, self._pool_labels(splits), splits.num_classes)
        self._drop_public_ids(splits)
        self._check_separation(splits)
        raise_if_any(self._size_errors(pool_size))
        self.pool_dataset = splits.train
        self._num_classes = splits.num_classes
        self.private_dataset = self.materialize(Subset(splits.train, self.private_indices))
        mark_private_data(self.private_dataset)  # (a private module refuses evaluation loaders reading it)
        self.public_dataset = self._build_public(splits)
        self.test_dataset = self._eval_split(splits.test)
        if self.val_indices:
            self.val_dataset = self._eval_split(Subset(splits.train, self.val_indices))
        else:
            self.val_dataset = self._eval_split(splits.val) if splits.val is not None else self.test_dataset
        self.split_id = split_id(pool_size, len(self.private_indices), (self.public_indices, self.val_indices),
                                 splits.train_ids, splits.public_ids if splits.public is not None else None,
                                 seed=self.data_seed, given_val_ids=splits.val_ids)

    def _carve(self, pool_size: int, groups: Optional[Sequence[Hashable]] = None,
               labels: Optional[list[int]] = None, num_classes: Optional[int] = None) -> None:
        """Split pool indices into public / validation / private parts: the public ones as ``public_selection``
        says (``labels`` for ``"per_class"``), then validation and private from the rest in ``data_seed`` permutation
        order; with ``groups``, each cut falls at the group boundary at or below it (whole groups on each side)."""
        order = torch.randperm(pool_size, generator=torch.Generator().manual_seed(self.data_seed)).tolist()
        if groups is not None:
            if len(groups) != pool_size:
                raise ValueError(f"{len(groups)} train_groups for a pool of {pool_size} examples")
            if self.public_selection != "random":
                raise ConfigError(f"`public_selection`={self.public_selection!r} does not carve whole groups, and "
                                  f"{type(self).__name__} groups its rows (e.g. passages): use 'random'")
            order = _groups_together(order, groups)
        n_public = round(self.public_fraction * pool_size)
        if self.max_public_samples is not None:
            n_public = min(n_public, self.max_public_samples)
        if self.public_selection == "random":
            public_end = _boundary_at_or_below(order, groups, n_public, 0)
            public, rest = order[:public_end], order[public_end:]
        else:
            public = self._selected_public(order, n_public, labels, num_classes)
            chosen = set(public)
            rest = [i for i in order if i not in chosen]
        val_end = _boundary_at_or_below(rest, groups, round(self.val_fraction * pool_size), 0)
        private = rest[val_end:]
        if self.max_private_samples is not None:
            private = private[: self.max_private_samples]
        self.public_indices = sorted(public)
        self.val_indices = sorted(rest[:val_end])
        self.private_indices = sorted(private)

    def _selected_public(self, order: list[int], n_public: int, labels: Optional[list[int]],
                         num_classes: Optional[int]) -> list[int]:
        """The public indices of ``"first"`` (``0 .. n_public - 1``) or ``"per_class"`` (the weights' counts)."""
        if self.public_selection == "first":
            return list(range(min(n_public, len(order))))
        if labels is None or num_classes is None:
            raise ConfigError("`public_selection`='per_class' needs the pool's labels and number of classes")
        weights = self.public_class_weights or [1.0] * num_classes
        return per_class_public(order, labels, largest_remainder_counts(n_public, weights))

    def _pool_labels(self, splits: DataSplits) -> Optional[list[int]]:
        """The pool's labels for ``public_selection: per_class`` (``None`` otherwise): :attr:`DataSplits.train_labels`,
        else the pool's ``.targets`` or ``.labels``; one line where none can be read or the weights do not fit."""
        if self.public_selection != "per_class":
            return None
        raise_if_any(class_weight_errors(self.public_selection, self.public_class_weights, splits.num_classes))
        labels = splits.train_labels
        for attribute in ("targets", "labels"):
            labels = labels if labels is not None else getattr(splits.train, attribute, None)
        return label_list(labels, len(splits.train), splits.num_classes, type(self).__name__)

    def _drop_public_ids(self, splits: DataSplits) -> None:
        """Drop the private rows whose id is a public example's, of a separate public source or of the public split
        carved from the pool: the private side gives way, so the public split is a function of its source and the
        carve alone, and no warning or refusal depends on a private row (before, a private id equal to a carved public
        one refused the fit: a bit about the private rows, red-team review 17). The private count, which the sample
        rate states, counts the rows left, as it counts a row that is there or not (``n`` is taken as public)."""
        public = set(splits.public_ids) if splits.train_ids is not None and splits.public_ids is not None else set()
        if splits.train_ids is not None:
            public.update(splits.train_ids[i] for i in self.public_indices)
        if public:
            self.private_indices = [i for i in self.private_indices if splits.train_ids[i] not in public]

    def _check_separation(self, splits: DataSplits) -> None:
        """Private examples must appear in no public split: by index (by construction: asserted here) and by id (the
        private rows give way, :meth:`_drop_public_ids`); the warnings about validation rows follow from how the data
        were drawn (:class:`DataSplits`), not from the rows."""
        check_disjoint(self.private_indices, self.public_indices)
        check_disjoint(self.private_indices, self.val_indices, what="indices", split="validation",
                       fix="lower `val_fraction`")
        if splits.train_groups is not None:
            private_groups = {splits.train_groups[i] for i in self.private_indices}
            check_disjoint(private_groups, [splits.train_groups[i] for i in self.public_indices], what="groups",
                           fix="carve the public split by whole groups")
            if splits.val_groups is not None and splits.val_from_train_file:
                warnings.warn(f"{type(self).__name__}: the validation rows are drawn row by row from the training "
                              "file, so their groups (e.g. passages) may also have rows in the private set; their "
                              "logged metrics would use those texts outside the privacy guarantee: hold validation "
                              "out with `val_fraction` (whole groups)", LitZodpWarning)
        unchecked = splits.public is not None and (splits.train_ids is None or splits.public_ids is None)
        if unchecked:
            warnings.warn(f"{type(self).__name__}: the separate public source comes without identifiers "
                          "(`train_ids` and `public_ids`), so the private rows equal to one of its examples "
                          "are not dropped (disjointness not checked)", LitZodpWarning)
        if splits.train_ids is not None:
            self._warn_validation_repeats(splits)

    def _warn_validation_repeats(self, splits: DataSplits) -> None:
        """Validation rows carved from a pool whose ids may repeat, or drawn from its file, may repeat a private
        example's text: the row-level guarantee holds (they are other rows), but their logged metrics would be a
        public use of a private text. Decided from the declarations alone (see :class:`DataSplits`)."""
        from_the_pool = bool(self.val_indices) or (splits.val_ids is not None and splits.val_from_train_file)
        if from_the_pool and not splits.deduplicated:
            warnings.warn(f"{type(self).__name__}: validation examples are drawn from the training data without "
                          "dropping repeated texts, so some may repeat a private example's text (other rows of the "
                          "same text); their logged metrics would use that text outside the privacy guarantee: set "
                          "`dedupe: true` to drop repeats before splitting", LitZodpWarning)

    def _size_errors(self, pool_size: int) -> list[Optional[str]]:
        n_private = len(self.private_indices)
        errors: list[Optional[str]] = []
        if pool_size == 0 or n_private == 0:
            errors.append(f"No private examples left (pool of {pool_size}); lower public_fraction/val_fraction")
        elif self.batch_size > n_private and self.sampling != "full_batch":  # (a full batch does not read it)
            errors.append(
                f"`batch_size`={self.batch_size} (the expected Poisson batch size B) exceeds the number of "
                f"private examples n_private={n_private}: the sample rate q = B / n_private = "
                f"{self.batch_size / n_private:.4g} > 1. Lower batch_size or use more private data."
            )
        if self.anchor_batch_size is not None and self.anchor_batch_size > n_private > 0:
            errors.append(f"`anchor_batch_size`={self.anchor_batch_size} exceeds the number of private examples "
                          f"n_private={n_private}")
        if self.public_fraction > 0 and not self.public_indices:
            errors.append(f"`public_fraction`={self.public_fraction} of a pool of {pool_size} holds no example")
        if self.val_fraction > 0 and not self.val_indices:
            errors.append(f"`val_fraction`={self.val_fraction} of a pool of {pool_size} holds no example")
        return errors

    def _build_public(self, splits: DataSplits) -> Optional[Dataset]:
        parts = []
        if self.public_indices:
            parts.append(self.materialize(Subset(splits.train, self.public_indices)))
        if splits.public is not None:
            room = None if self.max_public_samples is None else self.max_public_samples - len(self.public_indices)
            if room is None or room > 0:
                source = _random_subset(splits.public, room, self.data_seed + PUBLIC_SEED_OFFSET)
                parts.append(self.materialize(source))
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else ConcatDataset(parts)

    def _eval_split(self, dataset: Optional[Dataset]) -> Optional[Dataset]:
        if dataset is None:
            return None
        return self.materialize_evaluation(_random_subset(dataset, self.max_eval_samples, EVAL_SUBSET_SEED))

    def materialize_evaluation(self, dataset: Dataset) -> Dataset:
        """A validation or test split as the loaders read it: :meth:`materialize` unless a subclass adds what only
        evaluation reads (the gold answers of generative QA, :class:`~datamodules.qa.QADataModule`)."""
        return self.materialize(dataset)

    def built_example_shape(self) -> Optional[tuple[int, ...]]:
        """One input's shape as the built splits give it (after the data module's own transforms: a resize, a grey
        image repeated to RGB), read from the first non-private split (test, validation, public), which the backbone
        reads as it reads the private one; ``None`` before :meth:`setup`, without such a split, or for inputs that are
        not one tensor (tokenized text). Never read from the private set, so no refusal follows one private example
        (review 29: a shape from the configuration alone refused a subclass that converted grey images to RGB)."""
        for dataset in (self.test_dataset, self.val_dataset, self.public_dataset) if self._ready else ():
            if dataset is None or len(dataset) == 0:
                continue
            example = dataset[0]
            inputs = example[0] if isinstance(example, (tuple, list)) else example
            return tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else None
        return None

    def _require_setup(self) -> None:
        if not self._ready:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before the data is used")

    # ------------------------------------------------------------------------------ properties
    @property
    def n_private(self) -> int:
        """Number of private examples ``n`` (after the rows equal to a separate public example are dropped)."""
        self._require_setup()
        return len(self.private_indices)

    @property
    def sample_rate(self) -> float:
        """Poisson sample rate ``q = batch_size / n_private``."""
        return self.batch_size / self.n_private

    @property
    def num_classes(self) -> int:
        """Number of classes (known before ``setup()`` when the subclass sets ``known_num_classes``)."""
        if not self._ready and self.known_num_classes is not None:
            return self.known_num_classes
        self._require_setup()
        return self._num_classes

    @property
    def steps_per_epoch(self) -> int:
        """Private batches per epoch: ``round(1/q)`` (Poisson), ``n // B`` (shuffle), 1 (full batch),
        ``round(n / B)`` (single pass: the whole run)."""
        if self.sampling == "shuffle":
            return self.n_private // self.batch_size
        if self.sampling == "full_batch":
            return 1
        if self.sampling == "single_pass":
            return single_pass_steps(self.n_private, self.batch_size, self.anchor_batch_size, self.anchor_period)
        return max(1, round(1.0 / self.sample_rate))

    # ---------------------------------------------------------------------------- dataloaders
    def train_dataloader(self) -> DataLoader:
        """The PRIVATE loader (Poisson batches of expected size ``batch_size``, possibly empty)."""
        self._require_setup()
        rank, world_size = self._rank_and_world_size()
        self._check_distributed_sampler_off(world_size)
        sampler = self.private_batch_sampler(rank, world_size)
        private = DataLoader(
            self.private_dataset,
            batch_sampler=sampler,
            collate_fn=self._collate(self.private_dataset),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
        if not self.public_in_step:
            return private
        return {"private": private, "public": self._public_step_loader(len(sampler))}

    def _public_step_loader(self, steps: int) -> DataLoader:
        """One public batch per private step, the same stream on every rank (not sharded)."""
        if self.public_dataset is None:
            raise PrivacyConfigError("`public_in_step` needs a public split: set public_fraction > 0 (or give "
                                     "the data module a public source)")
        size = min(self.public_batch_size or self.batch_size, len(self.public_dataset))
        self._public_sampler = PublicBatchSampler(len(self.public_dataset), size, steps=steps,
                                                  seed=self.data_seed + PUBLIC_SEED_OFFSET)
        if self._pending_public_position is not None:
            self._public_sampler.position, self._pending_public_position = self._pending_public_position, None
        dataset, batches = self._public_source(self._public_sampler, self.public_augment, positioned=True)
        return DataLoader(dataset, batch_sampler=batches, collate_fn=self._collate(self.public_dataset),
                          num_workers=self.num_workers)

    def _public_source(self, batches: Any, augment: bool, positioned: bool = False) -> tuple[Dataset, Any]:
        """The public dataset and batch sampler a public loader reads: as they are, or, with ``augment``, the
        augmenting dataset and the batches as ``(position, slot, index)`` keys (:class:`~datamodules.augment.
        KeyedBatches`: ``positioned`` reads the position from the sampler, else counts the loader's batches from 0)."""
        if not augment:
            return self.public_dataset, batches
        recipe = AUGMENT_RECIPES[self.public_augment_recipe]
        return AugmentedDataset(self.public_dataset, recipe, self.data_seed), KeyedBatches(batches, positioned)

    def private_batch_sampler(self, rank: int = 0, world_size: int = 1) -> PrivateBatchSampler:
        """A new private batch sampler for ``rank`` of ``world_size``, as ``sampling`` describes.

        Built anew at every fit start (``train_dataloader``): a Poisson or shuffled sampler draws a
        fresh OS-entropy secret (rank 0's, broadcast under DDP) unless a test ``sampling_seed`` is
        given; a single-pass sampler continues its (public) pass where the checkpoint, or this
        DataModule's previous loader (a reload, a second fit), left it.
        """
        place = dict(rank=rank, world_size=world_size)
        if self.sampling == "single_pass":
            previous = getattr(self, "_batch_sampler", None)
            sampler = SinglePassBatchSampler(self.n_private, self.batch_size, seed=self.data_seed, **place,
                                             anchor_batch_size=self.anchor_batch_size, anchor_period=self.anchor_period)
            if self._pending_pass_state is not None:
                sampler.load_state_dict(self._pending_pass_state)
                self._pending_pass_state = None
            elif isinstance(previous, SinglePassBatchSampler) and previous.description == sampler.description:
                sampler.load_state_dict(previous.state_dict())  # a reloaded loader continues the pass
        elif self.sampling == "full_batch":
            sampler = FullBatchSampler(self.n_private, steps_per_epoch=self.steps_per_epoch, **place)
        else:
            seed = self._test_seed_for_this_build()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the test-seed and shuffle warnings were given at __init__
                if self.sampling == "shuffle":
                    sampler = ShuffleBatchSampler(self.n_private, self.batch_size, seed=seed, **place)
                else:
                    sampler = PoissonBatchSampler(self.n_private, self.sample_rate, seed=seed, **place)
            if seed is None:
                sampler.reseed(self._broadcast_secret(world_size))
        self._batch_sampler = sampler
        return sampler

    def public_dataloader(self, batch_size: Optional[int] = None, shuffle: bool = True,
                          augment: Optional[bool] = None) -> Optional[DataLoader]:
        """Loader over the public split (``None`` if there is none); the same order on every rank.

        Args:
            batch_size: defaults to ``public_batch_size``, else ``batch_size``.
            shuffle: reshuffle each pass with a generator seeded from ``data_seed`` (public, not secret).
            augment: augment the batches (``None``: ``public_augment``); batch ``k`` of this loader (counted across
                passes) is augmented with the draws of position ``k``, so a new loader replays the same stream.
        """
        self._require_setup()
        if self.public_dataset is None:
            return None
        generator = torch.Generator().manual_seed(self.data_seed + PUBLIC_SEED_OFFSET) if shuffle else None
        size = batch_size or self.public_batch_size or self.batch_size
        if not (self.public_augment if augment is None else augment):
            return DataLoader(self.public_dataset, batch_size=size, shuffle=shuffle, generator=generator,
                              collate_fn=self._collate(self.public_dataset), num_workers=self.num_workers)
        order = RandomSampler(self.public_dataset, generator=generator) if shuffle else range(len(self.public_dataset))
        dataset, batches = self._public_source(BatchSampler(order, size, drop_last=False), True)
        return DataLoader(dataset, batch_sampler=batches, collate_fn=self._collate(self.public_dataset),
                          num_workers=self.num_workers, generator=generator)  # (the loader draws from it too)

    def public_batches(self, batch_size: Optional[int] = None, augment: Optional[bool] = None) -> Iterator[Any]:
        """Endless iterator over shuffled public batches (reshuffled each pass; ``augment`` as in
        :meth:`public_dataloader`)."""
        loader = self.public_dataloader(batch_size, shuffle=True, augment=augment)
        if loader is None:
            raise RuntimeError(f"{type(self).__name__} has no public split (set public_fraction > 0)")
        while True:
            yield from loader

    def val_dataloader(self) -> Union[DataLoader, list]:
        """Sequential loader over the validation set (the test set when none is held out)."""
        self._require_setup()
        return [] if self.val_dataset is None else self._eval_loader(self.val_dataset, "validation")

    def test_dataloader(self) -> DataLoader:
        """Sequential loader over the test set."""
        self._require_setup()
        if self.test_dataset is None:
            raise RuntimeError(f"{type(self).__name__} has no test split")
        return self._eval_loader(self.test_dataset, "test")

    def _eval_loader(self, dataset: Dataset, what: str = "evaluation") -> DataLoader:
        rank, world_size = self._rank_and_world_size()
        sampler = None
        if self.shard_eval and world_size > 1:
            sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
            repeated = sampler.total_size - len(dataset)
            if repeated and rank == 0:
                warnings.warn(f"shard_eval: the {len(dataset)} {what} rows do not divide among {world_size} ranks, so "
                              f"the sampler repeats {repeated} of them and the logged means (loss, accuracy, F1) count "
                              "those twice; set shard_eval: false (every rank evaluates the full set) for exact means",
                              LitZodpWarning)
        return DataLoader(
            dataset,
            batch_size=self.eval_batch_size,
            shuffle=False,
            sampler=sampler,
            collate_fn=self._collate(dataset),
            num_workers=self.num_workers,
        )

    # ----------------------------------------------------------------------------- distributed
    def _rank_and_world_size(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return int(trainer.global_rank), int(trainer.world_size)

    def _check_distributed_sampler_off(self, world_size: int) -> None:
        connector = getattr(self.trainer, "_accelerator_connector", None)
        if world_size > 1 and getattr(connector, "use_distributed_sampler", False):
            raise PrivacyConfigError(
                "Under DDP the data module shards the Poisson-sampled private batches itself: create the "
                "Trainer with use_distributed_sampler=False (Lightning's sampler would break the sampling "
                "the accountant assumes)."
            )

    def _test_seed_for_this_build(self) -> Optional[int]:
        """The test ``sampling_seed`` for the first loader, a distinct stream for each later one (no replay)."""
        self._builds += 1
        if self.sampling_seed is None:
            return None
        return self.sampling_seed + ((self._builds - 1) << 256)

    def _broadcast_secret(self, world_size: int) -> int:
        """A fresh sampling secret; rank 0's under DDP, so every rank draws the same global batch."""
        secret = secret_seed()
        if world_size > 1 and self.trainer is not None:
            secret = self.trainer.strategy.broadcast(secret, src=0)
        return int(secret)

    # ---------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Public sampling state only: the kind of sampling, a single pass's and the public stream's position (which
        also keys the public augmentation).

        The Poisson or shuffle stream is secret and never saved; a resumed run draws a fresh one.
        """
        state: dict[str, Any] = {"sampling": self.sampling}
        if isinstance(self._batch_sampler, SinglePassBatchSampler):
            state["single_pass"] = self._batch_sampler.state_dict()
        if self._public_sampler is not None:
            state["public_position"] = self._public_sampler.position
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue a single pass and the public stream where the checkpoint left them (nothing secret)."""
        self._pending_pass_state = state_dict.get("single_pass")
        self._pending_public_position = state_dict.get("public_position")


__all__ = [
    "DataSplits",
    "PublicBatchSampler",
    "PublicPrivateDataModule",
    "SHUFFLE_WARNING",
    "check_disjoint",
    "check_int",
    "check_test_fraction",
    "fixed_test_split",
    "split_id",
]

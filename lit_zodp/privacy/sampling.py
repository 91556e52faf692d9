"""How the private examples enter the steps: sampling descriptions and the samplers that realize them.

A *sampling description* is what the accountant needs: the size ``n`` of the private set, the
expected batch size ``B`` that a release divides by, and the mechanism one step's Gaussian release
of multiplier ``z`` costs:

* :class:`PoissonSampling` (default): each example joins a batch independently with probability
  ``q = B / n``; a step costs a Poisson-subsampled Gaussian.
* :class:`FullBatchSampling`: every example in every step (``q = 1``); a step costs a Gaussian.
* :class:`SinglePassSampling`: each example is used in exactly one step of the whole run; steps
  touch disjoint data and compose in parallel (one Gaussian in total).
* :class:`ShuffledSampling`: fixed-size shuffled batches, an explicit opt-in that warns: it is
  accounted as Poisson sampling at ``q = B / n``, which it is not.

The samplers are batch samplers for a ``DataLoader``. Under DDP every rank draws the same global
batch (same stream) and keeps its shard (``index % world_size == rank``), so N ranks give the update
of one process. Which examples a Poisson or shuffled batch holds is secret (amplification by
subsampling needs it): those streams come from ``SECRET_BITS`` bits of OS entropy, are reseeded at
every fit start by the DataModule, and are never checkpointed, pickled or copied (a copy of a sampler
holds no stream, and the DataModule drops its sampler's stream when a fit ends).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Optional

import numpy as np
from torch.utils.data import Sampler

from lit_zodp.errors import (
    LitZodpWarning,
    PrivacyConfigError,
    check_positive_int,
    check_probability,
    check_rank,
    raise_if_any,
)
from lit_zodp.privacy.mechanisms import Gaussian, Mechanism, SinglePassGaussian, SubsampledGaussian
from lit_zodp.privacy.noise import secret_generator, secret_seed, warn_test_seed

SHUFFLE_WARNING = (
    "sampling='shuffle' draws fixed-size shuffled batches, but the reported epsilon assumes Poisson "
    "sampling (each example included independently with probability q = batch_size / n_private). "
    "The true epsilon of shuffled batches is not what is reported; use sampling='poisson' for a "
    "guarantee that holds.")


# ------------------------------------------------------------------------------ descriptions
@dataclass(frozen=True)
class PoissonSampling:
    """Poisson subsampling of rate ``sample_rate`` from ``n`` private examples."""

    n: int
    sample_rate: float
    name: ClassVar[str] = "poisson"

    @property
    def expected_batch_size(self) -> float:
        return self.sample_rate * self.n

    def mechanism(self, noise_multiplier: float) -> Mechanism:
        return SubsampledGaussian(noise_multiplier, self.sample_rate)


@dataclass(frozen=True)
class FullBatchSampling:
    """Every private example in every step."""

    n: int
    name: ClassVar[str] = "full_batch"
    sample_rate: ClassVar[float] = 1.0

    @property
    def expected_batch_size(self) -> float:
        return float(self.n)

    def mechanism(self, noise_multiplier: float) -> Mechanism:
        return Gaussian(noise_multiplier)


@dataclass(frozen=True)
class SinglePassSampling:
    """Each of the ``n`` examples used in exactly one of ``steps`` steps (one pass); ``start``: the
    sampler's position in the pass when the fit starts (a resumed pass continues where it stopped); ``seed``: the
    public seed of the pass's assignment of examples to steps.

    An *anchored* pass (``anchor_period`` > 1; Kornowski et al., Alg. 3's batch sizes ``B1`` and ``B2``) gives every
    ``anchor_period``-th step, from the pass's first, ``anchor_weight`` times the expected examples of the others:
    step ``t``'s expected size is ``weight(t) * expected_batch_size``."""

    n: int
    steps: int
    start: int = field(default=0, compare=False)
    seed: Optional[int] = field(default=None, compare=False)
    anchor_period: int = 1
    anchor_weight: float = 1.0
    name: ClassVar[str] = "single_pass"

    @property
    def assignment(self) -> list:
        """What fixes which step uses which example: a continued pass must have the same."""
        return [self.n, self.steps, self.seed, self.anchor_period, self.anchor_weight]

    @property
    def anchored(self) -> bool:
        return self.anchor_period > 1

    def is_anchor(self, position: int) -> bool:
        """Whether step ``position`` is an anchor (``0, anchor_period, ...`` of an anchored pass)."""
        return self.anchored and position % self.anchor_period == 0

    def weight(self, position: int) -> float:
        """Step ``position``'s expected size over a regular step's: ``anchor_weight`` at an anchor, else 1."""
        return self.anchor_weight if self.is_anchor(position) else 1.0

    @property
    def sample_rate(self) -> float:
        return 1.0 / self.steps

    @property
    def expected_batch_size(self) -> float:
        """A regular step's expected size, ``n`` over the pass's total weight (every step's, unanchored)."""
        return self.n / pass_weight(self.steps, self.anchor_period, self.anchor_weight)

    def mechanism(self, noise_multiplier: float) -> Mechanism:
        return SinglePassGaussian(noise_multiplier)


@dataclass(frozen=True)
class ShuffledSampling(PoissonSampling):
    """Fixed-size shuffled batches, accounted (wrongly, and with a warning) as Poisson at ``B / n``; every
    epsilon shown for it is marked (``PrivacyComponent.poisson_assumed``)."""

    name: ClassVar[str] = "shuffle"


SamplingDescription = PoissonSampling | FullBatchSampling | SinglePassSampling


# ---------------------------------------------------------------------------------- samplers
class PrivateBatchSampler(Sampler[list[int]]):
    """Base of the private batch samplers: one global stream, this rank's shard, a description.

    The privacy component trusts only instances of this class (never a duck-typed attribute), and
    checks ``rank``/``world_size`` against the trainer's.

    Args:
        num_samples: size ``n`` of the private set.
        rank, world_size: this process's shard (DDP); ``(0, 1)`` for one process.
        seed: a test-only seed (warns: the batches are then predictable). ``None`` draws a secret.

    A pickled or copied sampler holds no stream (it could be wound back to replay every past batch):
    iterating it refuses, unless it was built with a ``seed``, from which it restarts.
    """

    secret_stream: ClassVar[bool] = True

    def __init__(self, num_samples: int, *, rank: int = 0, world_size: int = 1,
                 seed: Optional[int] = None) -> None:
        raise_if_any([check_positive_int("num_samples", num_samples),
                      check_positive_int("world_size", world_size),
                      check_rank(rank, world_size)])
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.seeded_by_user = seed is not None
        if self.seeded_by_user and self.secret_stream:
            warn_test_seed("sampling_seed", "private batch sampling")
        self.reseed(seed)

    @property
    def description(self) -> SamplingDescription:
        raise NotImplementedError

    def reseed(self, seed: Optional[int] = None) -> None:
        """Restart the stream from ``seed`` (``None``: a fresh OS-entropy secret)."""
        self.generator = secret_generator(secret_seed() if seed is None else seed)

    def forget_stream(self) -> None:
        """Drop the stream (the DataModule does when a fit ends); iterating again refuses or restarts."""
        self.generator = None

    def __getstate__(self) -> dict:
        """The pickled or copied state, without the stream."""
        return {**self.__dict__, "generator": None}

    def stream(self) -> np.random.Generator:
        """The sampling stream; without one (a copy, or a fit ended) restart from ``seed`` or refuse."""
        if self.generator is None:
            if self.seed is None:
                raise PrivacyConfigError(
                    "This private batch sampler holds no secret stream (it was pickled or copied, or its fit "
                    "ended): build a new one, e.g. with the data module's train_dataloader()")
            self.reseed(self.seed)
        return self.generator

    def check_placement(self, rank: int, world_size: int) -> None:
        """Refuse a sampler built for another rank or world size than the trainer's."""
        if (self.rank, self.world_size) != (rank, world_size):
            raise PrivacyConfigError(
                f"The private batch sampler shards for rank {self.rank} of world_size {self.world_size}, "
                f"but this process is rank {rank} of {world_size}: every rank would sample the wrong share "
                "of the private set. Build it with rank=trainer.global_rank, world_size=trainer.world_size "
                "(a PublicPrivateDataModule does this).")

    def shard(self, selected: np.ndarray) -> list[int]:
        return selected[selected % self.world_size == self.rank].tolist()


class PoissonBatchSampler(PrivateBatchSampler):
    """Poisson-subsampled index lists (possibly empty): each example independently with rate ``q``.

    Args:
        sample_rate: inclusion probability ``q`` in ``(0, 1]``.
        steps_per_epoch: batches per epoch; defaults to ``round(1 / q)``.
    """

    def __init__(self, num_samples: int, sample_rate: float, *, steps_per_epoch: Optional[int] = None,
                 rank: int = 0, world_size: int = 1, seed: Optional[int] = None) -> None:
        errors = [check_probability("sample_rate", sample_rate)]
        if steps_per_epoch is not None:
            errors.append(check_positive_int("steps_per_epoch", steps_per_epoch))
        raise_if_any(errors)
        super().__init__(num_samples, rank=rank, world_size=world_size, seed=seed)
        self.sample_rate = float(sample_rate)
        self.steps_per_epoch = steps_per_epoch or max(1, round(1.0 / sample_rate))

    @property
    def description(self) -> PoissonSampling:
        return PoissonSampling(self.num_samples, self.sample_rate)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps_per_epoch):
            yield self.shard(np.flatnonzero(self.stream().random(self.num_samples) < self.sample_rate))


class FullBatchSampler(PrivateBatchSampler):
    """Every example in every step (full-batch, multi-pass); ``steps_per_epoch`` batches per epoch."""

    secret_stream = False  # nothing random

    def __init__(self, num_samples: int, *, steps_per_epoch: int = 1, rank: int = 0, world_size: int = 1) -> None:
        raise_if_any([check_positive_int("steps_per_epoch", steps_per_epoch)])
        super().__init__(num_samples, rank=rank, world_size=world_size)
        self.steps_per_epoch = steps_per_epoch

    @property
    def description(self) -> FullBatchSampling:
        return FullBatchSampling(self.num_samples)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        everyone = np.arange(self.num_samples)
        for _ in range(self.steps_per_epoch):
            yield self.shard(everyone)


class SinglePassBatchSampler(PrivateBatchSampler):
    """One pass: each example is assigned to one of ``steps = round(n / batch_size)`` steps, once.

    The assignment is i.i.d. per POSITION, so replacing one example changes one step's batch
    only (parallel composition needs this; a permutation cut into fixed-size batches would shift
    every later batch). Removing one shifts the later positions to other steps, so the privacy
    component accepts single-pass sampling with replace-one neighbours only. It is public randomness
    (the replace-one argument does not rely on its secrecy): ``seed`` is the public assignment seed
    and the position in the pass is checkpointed, so a resumed run continues the pass. A second
    pass raises.

    ``anchor_batch_size`` and ``anchor_period`` (given together): an anchored pass, the sizes of Kornowski et al.'s
    Alg. 3 (``B1`` at the first step of every period of ``Sigma``, ``B2 = batch_size`` at the others, Thm. 3.1:
    ``B1 = Sigma B2``). Each example goes to step ``t`` with probability proportional to its nominal size (i.i.d.
    per position, as above, where the paper draws fixed sizes "from unused samples"), and the pass has as many steps
    as bring its nominal sizes closest to ``n``; the last period may be cut short.
    """

    secret_stream = False

    def __init__(self, num_samples: int, batch_size: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, anchor_batch_size: Optional[int] = None, anchor_period: int = 1) -> None:
        raise_if_any([check_positive_int("batch_size", batch_size)] + anchor_errors(anchor_batch_size, anchor_period))
        super().__init__(num_samples, rank=rank, world_size=world_size, seed=seed)
        anchored = anchor_batch_size is not None
        self.anchor_period = anchor_period if anchored else 1
        self.anchor_weight = anchor_batch_size / batch_size if anchored else 1.0
        self.steps = single_pass_steps(num_samples, batch_size, anchor_batch_size, anchor_period)
        if anchored:
            weights = np.ones(self.steps)
            weights[::anchor_period] = self.anchor_weight
            self.assignment = self.generator.choice(self.steps, size=num_samples, p=weights / weights.sum())
        else:  # (the draw of every unanchored pass before anchors existed: a resumed run's assignment is unchanged)
            self.assignment = self.generator.integers(0, self.steps, size=num_samples)
        self.next_step = 0

    @property
    def description(self) -> SinglePassSampling:
        return SinglePassSampling(self.num_samples, self.steps, start=self.next_step, seed=self.seed,
                                  anchor_period=self.anchor_period, anchor_weight=self.anchor_weight)

    def __len__(self) -> int:
        return self.steps - self.next_step

    def __iter__(self) -> Iterator[list[int]]:
        if self.next_step >= self.steps:
            raise PrivacyConfigError(
                f"Single-pass sampling uses each private example once: the pass of {self.steps} steps is "
                "spent. Set max_epochs=1 (or max_steps <= the pass length) for single-pass runs.")
        while self.next_step < self.steps:
            step = self.next_step
            self.next_step += 1
            yield self.shard(np.flatnonzero(self.assignment == step))

    def state_dict(self) -> dict:
        return {"next_step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        self.next_step = int(state["next_step"])


def pass_weight(steps: int, anchor_period: int = 1, anchor_weight: float = 1.0) -> float:
    """The total weight of a pass of ``steps`` steps: 1 per step, ``anchor_weight`` per anchor (steps
    ``0, anchor_period, ...``)."""
    anchors = -(-steps // anchor_period) if anchor_period > 1 else 0
    return steps + (anchor_weight - 1.0) * anchors


def single_pass_steps(n: int, batch_size: int, anchor_batch_size: Optional[int] = None, anchor_period: int = 1) -> int:
    """The steps of a single pass over ``n`` examples: ``round(n / batch_size)``, at least 1; anchored, each step
    whose nominal size's midpoint fits in ``n`` (the same count, unanchored, but for ``round``'s halves to even)."""
    if anchor_batch_size is None:
        return max(1, round(n / batch_size))
    per_period = anchor_batch_size + (anchor_period - 1) * batch_size
    periods, left = divmod(n, per_period)
    steps = periods * anchor_period
    for size in [anchor_batch_size] + [batch_size] * (anchor_period - 1):
        if left < size / 2:
            break
        steps, left = steps + 1, left - size
    return max(1, steps)


def anchor_errors(anchor_batch_size: Optional[int], anchor_period: int) -> list[Optional[str]]:
    """An anchored pass's options: ``anchor_batch_size`` (a positive int, or ``None``) and ``anchor_period`` (> 1
    with one, 1 without)."""
    if anchor_batch_size is None:
        return [None if anchor_period == 1 else
                f"`anchor_period`={anchor_period} needs an `anchor_batch_size` (an anchored single pass takes both)"]
    errors = [check_positive_int("anchor_batch_size", anchor_batch_size), check_positive_int("anchor_period",
                                                                                            anchor_period)]
    if not errors[1] and anchor_period < 2:
        errors.append(f"Expected `anchor_period` >= 2 with an `anchor_batch_size` (one anchor every `anchor_period` "
                      f"steps), but got {anchor_period}")
    return errors


class ShuffleBatchSampler(PrivateBatchSampler):
    """Batches of exactly ``batch_size`` indices from a fresh permutation each epoch (drop last).

    An explicit opt-in (warns): the accountant's guarantee assumes Poisson sampling, not this.
    """

    def __init__(self, num_samples: int, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 seed: Optional[int] = None) -> None:
        errors = [check_positive_int("batch_size", batch_size)]
        if not errors[0] and isinstance(num_samples, int) and batch_size > num_samples:
            errors.append(f"Expected `batch_size` <= num_samples={num_samples}, but got {batch_size}")
        raise_if_any(errors)
        if rank == 0:  # (once per run: every rank builds its sampler)
            warnings.warn(SHUFFLE_WARNING, LitZodpWarning, stacklevel=2)
        super().__init__(num_samples, rank=rank, world_size=world_size, seed=seed)
        self.batch_size = batch_size

    @property
    def description(self) -> ShuffledSampling:
        return ShuffledSampling(self.num_samples, self.batch_size / self.num_samples)

    def __len__(self) -> int:
        return self.num_samples // self.batch_size

    def __iter__(self) -> Iterator[list[int]]:
        order = self.stream().permutation(self.num_samples)
        for step in range(len(self)):
            batch = order[step * self.batch_size:(step + 1) * self.batch_size]
            yield batch[self.rank::self.world_size].tolist()


#: Datasets a private fit of this process trains on, or a DataModule made its private split (by ``id``; an entry goes
#: with its dataset).
_PRIVATE_DATA: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def mark_private_data(dataset: Any) -> None:
    """Remember ``dataset`` as private training data for as long as it lives: a private module refuses evaluation
    loaders that read it, in any Trainer of this process (review 19: a Trainer's own record of its training loader is
    gone once it evaluates other loaders, and a new Trainer never had it)."""
    try:
        _PRIVATE_DATA[id(dataset)] = dataset
    except TypeError:  # (not weakly referenceable: the Trainer's own record still applies)
        pass


def is_private_data(dataset: Any) -> bool:
    """Whether ``dataset`` was marked with :func:`mark_private_data` (itself, not what it reads)."""
    return _PRIVATE_DATA.get(id(dataset)) is dataset


__all__ = [
    "FullBatchSampler",
    "FullBatchSampling",
    "PoissonBatchSampler",
    "PoissonSampling",
    "PrivateBatchSampler",
    "SHUFFLE_WARNING",
    "SamplingDescription",
    "ShuffleBatchSampler",
    "ShuffledSampling",
    "SinglePassBatchSampler",
    "SinglePassSampling",
    "anchor_errors",
    "is_private_data",
    "mark_private_data",
    "pass_weight",
    "single_pass_steps",
]

"""Poisson subsampling of the private set, the sampling the accountant assumes.

Every example joins a batch independently with probability ``q``; batch sizes vary and may be zero.
For DDP each rank draws the *same* Bernoulli mask over all ``n`` examples (a sampling generator
seeded identically on every rank) and keeps the selected indices of its own shard
(``index % world_size == rank``). The union over ranks is then exactly the batch one process would
draw, so N ranks give the same update as one process (DESIGN.md, "Distributed").
"""

from __future__ import annotations

import os
from typing import Iterator, Optional

import torch
from torch.utils.data import Sampler

from lit_zodp.privacy.errors import check_positive_int, check_probability, check_rank, raise_if_any


def entropy_seed() -> int:
    """A 63-bit seed from the operating system's entropy pool (never from the run seed)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


class SeededShardSampler(Sampler[list[int]]):
    """Base of batch samplers that draw global batches from one seeded generator and yield a rank's shard.

    Every rank seeds the same generator, so the shards of one step partition the global batch.
    The generator state is the sampler's whole state (``state_dict`` for checkpoints).
    """

    def __init__(self, num_samples: int, *, rank: int, world_size: int, seed: Optional[int]) -> None:
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.generator = torch.Generator().manual_seed(entropy_seed() if seed is None else seed)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


class PoissonBatchSampler(SeededShardSampler):
    """Batch sampler that yields Poisson-subsampled index lists (possibly empty).

    Args:
        num_samples: size ``n`` of the private set.
        sample_rate: inclusion probability ``q`` of each example, in ``(0, 1]``.
        steps_per_epoch: batches per epoch; defaults to ``round(1 / q)``.
        rank, world_size: this process's shard of the indices (DDP); ``(0, 1)`` for one process.
        seed: seed of the sampling generator; ``None`` draws it from OS entropy. Under DDP all ranks
            must pass the same seed (the DataModule broadcasts rank 0's).
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        *,
        steps_per_epoch: Optional[int] = None,
        rank: int = 0,
        world_size: int = 1,
        seed: Optional[int] = None,
    ) -> None:
        errors = [
            check_positive_int("num_samples", num_samples),
            check_probability("sample_rate", sample_rate),
            check_positive_int("world_size", world_size),
        ]
        if steps_per_epoch is not None:
            errors.append(check_positive_int("steps_per_epoch", steps_per_epoch))
        errors.append(check_rank(rank, world_size))
        raise_if_any(errors)
        super().__init__(num_samples, rank=rank, world_size=world_size, seed=seed)
        self.sample_rate = float(sample_rate)
        self.steps_per_epoch = steps_per_epoch or max(1, round(1.0 / sample_rate))

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps_per_epoch):
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            selected = mask.nonzero().flatten()
            yield selected[selected % self.world_size == self.rank].tolist()

"""Fixed-size shuffled batches: the non-Poisson option (its epsilon is NOT what the accountant reports).

The accountant's subsampled Gaussian assumes Poisson sampling. Shuffled fixed-size batches are offered
only because many reference implementations use them; the data module warns when they are chosen.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from lit_zodp.privacy.errors import check_positive_int, check_rank, raise_if_any
from lit_zodp.privacy.sampling import SeededShardSampler


class ShuffleBatchSampler(SeededShardSampler):
    """Batches of exactly ``batch_size`` indices from a fresh permutation each epoch (drop last).

    Like :class:`~lit_zodp.privacy.sampling.PoissonBatchSampler` under DDP, every rank draws the same
    permutation (same seed) and keeps the positions ``rank::world_size`` of each global batch, so the
    union over ranks is exactly the single-process batch.

    Args:
        num_samples: size ``n`` of the dataset.
        batch_size: global batch size ``B <= n``.
        rank, world_size: this process's share (DDP); ``(0, 1)`` for one process.
        seed: seed of the permutation generator; ``None`` draws it from OS entropy.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: Optional[int] = None,
    ) -> None:
        errors = [
            check_positive_int("num_samples", num_samples),
            check_positive_int("batch_size", batch_size),
            check_positive_int("world_size", world_size),
        ]
        if not errors[0] and not errors[1] and batch_size > num_samples:
            errors.append(f"Expected `batch_size` <= num_samples={num_samples}, but got {batch_size}")
        errors.append(check_rank(rank, world_size))
        raise_if_any(errors)
        super().__init__(num_samples, rank=rank, world_size=world_size, seed=seed)
        self.batch_size = batch_size

    def __len__(self) -> int:
        return self.num_samples // self.batch_size

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.num_samples, generator=self.generator)
        for step in range(len(self)):
            batch = order[step * self.batch_size : (step + 1) * self.batch_size]
            yield batch[self.rank :: self.world_size].tolist()


__all__ = ["ShuffleBatchSampler"]

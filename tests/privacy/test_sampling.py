import math

import pytest

from lit_zodp.privacy import PoissonBatchSampler, PrivacyConfigError


def test_mean_batch_size_is_q_n():
    n, q, steps = 2000, 0.03, 400
    sampler = PoissonBatchSampler(n, q, steps_per_epoch=steps, seed=0)
    sizes = [len(b) for b in sampler]
    mean = sum(sizes) / steps
    # the mean of `steps` Binomial(n, q) draws has std sqrt(n q (1-q) / steps); allow 5 of them
    assert abs(mean - n * q) < 5 * math.sqrt(n * q * (1 - q) / steps)
    variance = sum((s - mean) ** 2 for s in sizes) / (steps - 1)
    assert variance == pytest.approx(n * q * (1 - q), rel=0.3)
    assert all(len(set(b)) == len(b) for b in sampler)


def test_empty_batches_are_yielded():
    sampler = PoissonBatchSampler(10, 0.01, steps_per_epoch=50, seed=0)
    batches = list(sampler)
    assert len(batches) == 50
    assert sum(1 for b in batches if not b) > 30  # P(empty) = 0.99^10 ~ 0.9


def test_ranks_partition_the_single_process_batch():
    single = list(PoissonBatchSampler(101, 0.2, steps_per_epoch=5, seed=7))
    r0 = list(PoissonBatchSampler(101, 0.2, steps_per_epoch=5, seed=7, rank=0, world_size=2))
    r1 = list(PoissonBatchSampler(101, 0.2, steps_per_epoch=5, seed=7, rank=1, world_size=2))
    for s, a, b in zip(single, r0, r1):
        assert sorted(a + b) == s
        assert not set(a) & set(b)


def test_state_round_trip():
    a = PoissonBatchSampler(50, 0.2, steps_per_epoch=3, seed=1)
    list(a)
    state = a.state_dict()
    expected = list(a)
    b = PoissonBatchSampler(50, 0.2, steps_per_epoch=3, seed=2)
    b.load_state_dict(state)
    assert list(b) == expected


@pytest.mark.parametrize("kwargs,match", [
    (dict(sample_rate=1.5), "sample_rate"),
    (dict(sample_rate=0.0), "sample_rate"),
    (dict(num_samples=0), "num_samples"),
    (dict(rank=2, world_size=2), "rank"),
])
def test_bad_arguments(kwargs, match):
    args = dict(num_samples=10, sample_rate=0.5) | kwargs
    with pytest.raises(PrivacyConfigError, match=match):
        PoissonBatchSampler(**args)

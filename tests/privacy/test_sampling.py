"""Samplers and sampling descriptions: the law of each, DDP shards, the secret stream's entropy."""

import copy
import math
import pickle

import numpy as np
import pytest

from lit_zodp.privacy import (
    FullBatchSampler,
    PoissonBatchSampler,
    PrivacyConfigError,
    ShuffleBatchSampler,
    SinglePassBatchSampler,
    SinglePassGaussian,
    SinglePassSampling,
    SubsampledGaussian,
)
from lit_zodp.privacy.noise import secret_generator
from lit_zodp.privacy.sampling import single_pass_steps

pytestmark = pytest.mark.filterwarnings("ignore:`sampling_seed` is set", "ignore:sampling='shuffle'")


def test_mean_batch_size_is_q_n():
    n, q, steps = 400, 0.05, 2000
    sizes = [len(b) for b in PoissonBatchSampler(n, q, steps_per_epoch=steps, seed=0)]
    # mean of `steps` Binomial(n, q) draws: standard error sqrt(n q (1-q) / steps)
    assert abs(np.mean(sizes) - n * q) < 5 * math.sqrt(n * q * (1 - q) / steps)
    assert np.var(sizes) == pytest.approx(n * q * (1 - q), rel=0.2)


def test_empty_batches_are_yielded():
    batches = list(PoissonBatchSampler(10, 0.01, steps_per_epoch=50, seed=0))
    assert len(batches) == 50 and any(len(b) == 0 for b in batches)


def test_ranks_partition_the_single_process_batch():
    single = list(PoissonBatchSampler(101, 0.2, steps_per_epoch=5, seed=7))
    r0 = list(PoissonBatchSampler(101, 0.2, steps_per_epoch=5, seed=7, rank=0, world_size=2))
    r1 = list(PoissonBatchSampler(101, 0.2, steps_per_epoch=5, seed=7, rank=1, world_size=2))
    for s, a, b in zip(single, r0, r1):
        assert sorted(a + b) == s and not set(a) & set(b)


@pytest.mark.parametrize("bit", [32, 64, 200])
def test_sampling_seeds_differing_only_above_bit_32_and_64_draw_different_masks(bit):
    a = list(PoissonBatchSampler(500, 0.1, steps_per_epoch=3, seed=99))
    b = list(PoissonBatchSampler(500, 0.1, steps_per_epoch=3, seed=99 + (1 << bit)))
    assert a != b


def test_fresh_samplers_draw_fresh_secret_masks_and_have_no_state_to_checkpoint():
    a, b = PoissonBatchSampler(500, 0.1, steps_per_epoch=3), PoissonBatchSampler(500, 0.1, steps_per_epoch=3)
    assert list(a) != list(b)
    assert not hasattr(a, "state_dict")


def test_reseed_restarts_from_a_fresh_secret():
    sampler = PoissonBatchSampler(500, 0.1, steps_per_epoch=3, seed=1)
    first = list(sampler)
    sampler.reseed()
    assert list(sampler) != first


def test_descriptions_give_the_mechanism_and_the_expected_batch():
    poisson = PoissonBatchSampler(200, 0.1, seed=0).description
    assert poisson.expected_batch_size == pytest.approx(20) and poisson.mechanism(2.0) == SubsampledGaussian(2.0, 0.1)
    full = FullBatchSampler(200).description
    assert full.expected_batch_size == 200 and full.mechanism(2.0).kind == "gaussian"
    single = SinglePassBatchSampler(200, 20).description
    assert single.expected_batch_size == pytest.approx(20) and single.mechanism(2.0) == SinglePassGaussian(2.0)


def test_full_batch_yields_every_example_every_step():
    assert list(FullBatchSampler(7, steps_per_epoch=3)) == [list(range(7))] * 3
    r1 = list(FullBatchSampler(7, rank=1, world_size=2))
    assert r1 == [[1, 3, 5]]


def test_single_pass_uses_each_example_exactly_once_and_refuses_a_second_pass():
    sampler = SinglePassBatchSampler(1000, 50, seed=3)
    batches = list(sampler)
    assert len(batches) == 20
    assert sorted(i for b in batches for i in b) == list(range(1000))
    with pytest.raises(PrivacyConfigError, match="each private example once"):
        list(sampler)


def test_an_anchored_pass_uses_each_example_once_and_gives_each_anchor_b1_over_b2_times_the_examples():
    """Alg. 3's sizes (Kornowski et al.): ``B1 = 20`` at steps 0, 4, 8, ... and ``B2 = 5`` at the others. Each example
    is in one step; an anchor's expected size is ``anchor_weight`` times a regular step's, and the expected sizes
    add up to ``n``; the realized mean sizes over the pass match them (i.i.d. assignment by position)."""
    sampler = SinglePassBatchSampler(35_000, 5, seed=3, anchor_batch_size=20, anchor_period=4)
    description = sampler.description
    assert (description.anchor_period, description.anchor_weight, sampler.steps) == (4, 4.0, 4000)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(35_000))
    weights = np.array([description.weight(t) for t in range(sampler.steps)])
    assert weights[::4].tolist() == [4.0] * 1000 and set(weights[1::4]) == set(weights[3::4]) == {1.0}
    assert description.expected_batch_size * weights.sum() == pytest.approx(35_000)
    assert description.expected_batch_size == pytest.approx(5.0)
    sizes = np.array([len(b) for b in batches])
    assert sizes[weights == 4].mean() == pytest.approx(20.0, rel=0.03)
    assert sizes[weights == 1].mean() == pytest.approx(5.0, rel=0.03)
    assert description.mechanism(2.0) == SinglePassGaussian(2.0)


@pytest.mark.parametrize("n, period", [(999, 4), (61, 4), (200, 3), (7, 4)])
def test_an_anchored_pass_cut_short_in_its_last_period_still_spreads_n_over_its_expected_sizes(n, period):
    """Red-team review of the anchored pass: a pass whose last period is cut short (steps not a multiple of the
    period) still counts that period's anchor, so the expected sizes (each step's divisor) add up to ``n`` and each
    step's expected size matches the assignment's probabilities (the earlier tests had whole periods only)."""
    sampler = SinglePassBatchSampler(n, 5, seed=3, anchor_batch_size=20, anchor_period=period)
    description = sampler.description
    weights = np.array([description.weight(t) for t in range(sampler.steps)])
    assert sampler.steps % period or n < 20  # (the case under test: a partial last period)
    assert description.expected_batch_size * weights.sum() == pytest.approx(n)
    probabilities = weights / weights.sum()
    assert description.expected_batch_size * weights == pytest.approx(n * probabilities)


@pytest.mark.parametrize("n", [1, 7, 10, 34, 35, 36, 45, 47, 48, 61, 999])
def test_the_steps_of_an_anchored_pass_bring_its_nominal_sizes_closest_to_n(n):
    """Each step whose nominal size's midpoint fits in ``n``: brute force over the steps (20 at anchors, 5 between,
    period 4: 35 examples a period). Unanchored, ``round(n / B)`` as before anchors existed."""
    nominal = lambda t: 20 if t % 4 == 0 else 5  # noqa: E731
    steps, used = 0, 0
    while used + nominal(steps) / 2 <= n:
        used += nominal(steps)
        steps += 1
    assert single_pass_steps(n, 5, 20, 4) == max(1, steps)
    assert single_pass_steps(n, 5) == max(1, round(n / 5))


def test_an_unanchored_pass_draws_the_assignment_of_every_pass_before_anchors():
    """A run resumed across the change keeps its pass: the same uniform draw from the public seed."""
    sampler = SinglePassBatchSampler(500, 7, seed=11)
    expected = secret_generator(11).integers(0, round(500 / 7), size=500)
    assert np.array_equal(sampler.assignment, expected)
    assert sampler.description == SinglePassSampling(500, round(500 / 7)) and not sampler.description.anchored


def test_anchored_pass_shards_partition_the_single_process_batches():
    one = list(SinglePassBatchSampler(200, 4, seed=1, anchor_batch_size=12, anchor_period=3))
    shards = [list(SinglePassBatchSampler(200, 4, seed=1, anchor_batch_size=12, anchor_period=3, rank=r,
                                          world_size=2)) for r in (0, 1)]
    assert [sorted(a + b) for a, b in zip(*shards)] == [sorted(batch) for batch in one]


@pytest.mark.parametrize("kwargs, match", [
    (dict(anchor_period=4), "`anchor_period`=4 needs an `anchor_batch_size`"),
    (dict(anchor_batch_size=20), "Expected `anchor_period` >= 2 with an `anchor_batch_size`"),
    (dict(anchor_batch_size=0, anchor_period=4), "`anchor_batch_size` to be a positive int"),
    (dict(anchor_batch_size=20, anchor_period=0), "`anchor_period` to be a positive int"),
])
def test_bad_anchor_options_are_named_in_one_line(kwargs, match):
    with pytest.raises(PrivacyConfigError, match=match) as info:
        SinglePassBatchSampler(100, 5, **kwargs)
    assert "\n" not in str(info.value)


def test_single_pass_resumes_where_it_stopped():
    first = SinglePassBatchSampler(300, 30, seed=3)
    iterator = iter(first)
    seen = [next(iterator) for _ in range(4)]
    resumed = SinglePassBatchSampler(300, 30, seed=3)
    resumed.load_state_dict(first.state_dict())
    rest = list(resumed)
    assert sorted(i for b in seen + rest for i in b) == list(range(300))


def test_shuffle_warns_and_yields_fixed_size_batches():
    with pytest.warns(UserWarning, match="assumes Poisson"):
        sampler = ShuffleBatchSampler(100, 10, seed=0)
    batches = list(sampler)
    assert len(batches) == 10 and all(len(b) == 10 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(100))


def test_placement_is_checked_against_the_trainer():
    sampler = PoissonBatchSampler(100, 0.1)
    sampler.check_placement(0, 1)
    with pytest.raises(PrivacyConfigError, match="rank 0 of world_size 1"):
        sampler.check_placement(1, 2)


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


def replay(generator: np.random.Generator, num_samples: int, sample_rate: float, steps: int) -> list[list[int]]:
    """The audit's attack on a leaked stream: wind it back over ``steps`` Poisson batches and draw them again."""
    bits = generator.bit_generator
    bits.advance(2**128 - steps * num_samples)  # one 64-bit output per uniform
    rewound = np.random.Generator(bits)
    return [np.flatnonzero(rewound.random(num_samples) < sample_rate).tolist() for _ in range(steps)]


def test_a_pickled_or_copied_poisson_sampler_holds_no_stream_to_replay():
    sampler = PoissonBatchSampler(200, 0.1, steps_per_epoch=4)
    seen = list(sampler)
    live = copy.copy(sampler.generator)  # the attack works on the stream a fit holds in memory
    assert replay(live, 200, 0.1, 4) == seen
    assert b"PCG64" not in pickle.dumps(sampler)
    for clone in (pickle.loads(pickle.dumps(sampler)), copy.deepcopy(sampler)):
        assert clone.generator is None
        with pytest.raises(PrivacyConfigError, match="no secret stream .*train_dataloader"):
            next(iter(clone))
    assert len(list(sampler)) == 4  # the original keeps its stream


def test_a_copied_shuffle_sampler_refuses_and_a_forgotten_stream_refuses():
    sampler = ShuffleBatchSampler(100, 10)
    with pytest.raises(PrivacyConfigError, match="no secret stream"):
        next(iter(pickle.loads(pickle.dumps(sampler))))
    sampler.forget_stream()
    with pytest.raises(PrivacyConfigError, match="no secret stream"):
        next(iter(sampler))


def test_a_copied_test_seeded_sampler_restarts_from_its_public_seed():
    sampler = PoissonBatchSampler(200, 0.1, steps_per_epoch=4, seed=5)
    first = list(sampler)
    list(sampler)
    clone = pickle.loads(pickle.dumps(sampler))
    assert clone.generator is None and list(clone) == first


def test_copied_samplers_without_a_secret_iterate_as_before():
    single, full = SinglePassBatchSampler(100, 10, seed=3), FullBatchSampler(7)
    assert list(pickle.loads(pickle.dumps(single))) == list(single)
    assert list(pickle.loads(pickle.dumps(full))) == list(full)

import math

import pytest
import torch

from lit_zodp.privacy import NoiseSource, PrivacyConfigError, noisy_mean


def test_empirical_noise_std_matches_sigma_clip_over_batch():
    """std of (0 + N(0, (sigma C)^2)) / B is sigma C / B; tolerance from the chi-square law."""
    sigma, clip, batch, n = 1.7, 3.0, 64.0, 40_000
    source = NoiseSource(seed=0)
    scalars = [noisy_mean(torch.zeros(()), expected_batch_size=batch, noise_multiplier=sigma, clip=clip,
                          noise=source) for _ in range(2000)]
    vectors = noisy_mean(torch.zeros(n), expected_batch_size=batch, noise_multiplier=sigma, clip=clip,
                         noise=source)
    values = torch.cat([torch.stack(scalars), vectors]).double()
    expected = sigma * clip / batch
    # the sample std has relative standard error ~ 1/sqrt(2 N); allow 5 of them
    tolerance = 5 / math.sqrt(2 * values.numel())
    assert values.std().item() == pytest.approx(expected, rel=tolerance)
    assert abs(values.mean().item()) < 5 * expected / math.sqrt(values.numel())


def test_seeded_noise_reproducible_and_entropy_seeds_differ():
    a = NoiseSource(seed=3).gaussian((5,), 1.0)
    b = NoiseSource(seed=3).gaussian((5,), 1.0)
    assert torch.equal(a, b)
    assert NoiseSource().seed != NoiseSource().seed
    assert not NoiseSource().seeded_by_user


def test_noise_state_round_trip_continues_stream():
    source = NoiseSource(seed=1)
    source.gaussian((3,), 1.0)
    state = source.state_dict()
    expected = source.gaussian((4,), 1.0)
    restored = NoiseSource(seed=99)
    restored.load_state_dict(state)
    assert torch.equal(restored.gaussian((4,), 1.0), expected)


def test_sigma_zero_adds_nothing_and_infinite_clip_with_noise_raises():
    s = torch.tensor(6.0)
    assert noisy_mean(s, expected_batch_size=3, noise_multiplier=0.0, clip=math.inf, noise=None) == 2.0
    with pytest.raises(PrivacyConfigError, match="finite `clip`"):
        noisy_mean(s, expected_batch_size=3, noise_multiplier=1.0, clip=math.inf, noise=NoiseSource(0))

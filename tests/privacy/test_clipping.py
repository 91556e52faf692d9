import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_zodp.privacy import clip_scalars, clip_vectors, clipped_fraction, clipped_sum
from lit_zodp.privacy.clipping import check_clip
from lit_zodp.errors import PrivacyConfigError

floats = st.floats(-1e6, 1e6, allow_nan=False)


@settings(max_examples=50, deadline=None)
@given(st.lists(floats, min_size=1, max_size=64), st.floats(1e-3, 1e3))
def test_scalar_clip_bounded_sign_preserving_identity_below(values, clip):
    v = torch.tensor(values, dtype=torch.float64)
    c = clip_scalars(v, clip)
    assert (c.abs() <= clip).all()
    assert (torch.sign(c) == torch.sign(v)).all()
    small = v.abs() <= clip
    assert torch.equal(c[small], v[small])


@settings(max_examples=50, deadline=None)
@given(st.lists(floats, min_size=2, max_size=64), floats, st.floats(1e-3, 1e3))
def test_one_example_moves_the_clipped_sum_by_at_most_clip(values, replacement, clip):
    """Add/remove-one sensitivity of sum_i clip(s_i) is C (and replace-one is 2C)."""
    v = torch.tensor(values, dtype=torch.float64)
    full = clip_scalars(v, clip).sum()
    removed = clip_scalars(v[1:], clip).sum()
    replaced = clip_scalars(torch.cat([torch.tensor([replacement], dtype=torch.float64), v[1:]]), clip).sum()
    assert abs(full - removed) <= clip * (1 + 1e-12)
    assert abs(full - replaced) <= 2 * clip * (1 + 1e-12)


def test_vector_clip_norms_and_zero_rows():
    torch.manual_seed(0)
    x = torch.randn(32, 3, 5) * torch.logspace(-3, 3, 32).view(-1, 1, 1)
    x[0] = 0
    c = clip_vectors(x, 2.0)
    norms = c.flatten(1).norm(dim=1)
    assert (norms <= 2.0 * (1 + 1e-6)).all()
    assert not torch.isnan(c).any()
    small = x.flatten(1).norm(dim=1) <= 2.0
    assert torch.allclose(c[small], x[small])
    big = ~small
    assert torch.allclose(norms[big], torch.full_like(norms[big], 2.0))
    # direction is kept
    cos = torch.nn.functional.cosine_similarity(c[big].flatten(1), x[big].flatten(1))
    assert torch.allclose(cos, torch.ones_like(cos), atol=1e-6)


def test_infinite_clip_is_identity_and_fraction():
    v = torch.tensor([-5.0, 0.5, 3.0])
    assert torch.equal(clip_scalars(v, math.inf), v)
    assert float(clipped_fraction(v, 1.0)) == pytest.approx(2 / 3)
    assert float(clipped_fraction(torch.zeros(0), 1.0)) == 0.0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), "1"])
def test_bad_clip_raises(bad):
    with pytest.raises(PrivacyConfigError, match="clip"):
        check_clip(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_infinities_clip_to_the_limit_nan_counts_zero_and_finite_values_are_clamped(dtype):
    """With a finite clip, +-inf is clipped to +-C (the limit of ``v min(1, C / |v|)``) and NaN counts 0; without
    one, NaN and +-inf count 0 (nothing bounds them). Finite values, -0.0 included, are clamped or kept bitwise,
    and :func:`clipped_sum` is the sum of exactly these values."""
    v = torch.tensor([math.nan, math.inf, -math.inf, 2.0, -0.5, -0.0, -3.0], dtype=dtype)
    clipped = clip_scalars(v, 1.0)
    assert clipped.dtype == dtype and torch.equal(clipped, torch.tensor([0, 1.0, -1.0, 1.0, -0.5, -0.0, -1.0], dtype=dtype))
    unclipped = clip_scalars(v, math.inf)
    assert torch.equal(unclipped, torch.tensor([0, 0, 0, 2.0, -0.5, -0.0, -3.0], dtype=dtype))
    assert torch.signbit(unclipped[5]) and float(clipped.sum()) == -0.5
    assert torch.equal(clipped_sum(v, 1.0), clipped.sum()) and torch.equal(clipped_sum(v, math.inf), unclipped.sum())
    assert torch.equal(v[3], torch.tensor(2.0, dtype=dtype))  # the input is not modified


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=64),
       st.floats(1e-3, 1e3), st.sampled_from([torch.float32, torch.float64]))
def test_the_clipped_sum_is_the_sum_of_the_clipped_values_and_moves_by_at_most_clip(values, clip, dtype):
    """One op fewer, the same number: ``clipped_sum`` equals ``clip_scalars(v).sum()`` bitwise (``nansum`` and ``sum``
    reduce in the same order), and removing any one value, NaN and +-inf included, moves it by at most C."""
    v = torch.tensor(values, dtype=dtype)
    total = clipped_sum(v, clip)
    assert torch.equal(total, clip_scalars(v, clip).sum()) and torch.isfinite(total)
    for i in range(len(v)):
        removed = clipped_sum(torch.cat([v[:i], v[i + 1:]]), clip)
        assert abs(float(total) - float(removed)) <= clip * (1 + 1e-5)

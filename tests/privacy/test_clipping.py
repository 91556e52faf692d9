import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_zodp.privacy import clip_scalars, clip_vectors, clipped_fraction
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
def test_non_finite_scalars_contribute_zero_and_finite_ones_are_clamped(dtype):
    """NaN and +-inf per-example scalars count as 0 (a crafted record gets no unbounded influence), with a
    finite clip and without one; finite values, -0.0 included, are clamped or kept bitwise."""
    v = torch.tensor([math.nan, math.inf, -math.inf, 2.0, -0.5, -0.0, -3.0], dtype=dtype)
    clipped = clip_scalars(v, 1.0)
    assert clipped.dtype == dtype and torch.equal(clipped, torch.tensor([0, 0, 0, 1.0, -0.5, -0.0, -1.0], dtype=dtype))
    unclipped = clip_scalars(v, math.inf)
    assert torch.equal(unclipped, torch.tensor([0, 0, 0, 2.0, -0.5, -0.0, -3.0], dtype=dtype))
    assert torch.signbit(unclipped[5]) and float(clipped.sum()) == -0.5

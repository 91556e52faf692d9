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
    assert torch.equal(clipped_sum(v, 1.0), clipped.sum(dtype=torch.float64))
    assert torch.equal(clipped_sum(v, math.inf), unclipped.sum(dtype=torch.float64))
    assert torch.equal(v[3], torch.tensor(2.0, dtype=dtype))  # the input is not modified


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=64),
       st.floats(1e-3, 1e3), st.sampled_from([torch.float32, torch.float64]))
def test_the_clipped_sum_is_the_sum_of_the_clipped_values_and_moves_by_at_most_clip(values, clip, dtype):
    """One op fewer, the same number: ``clipped_sum`` equals ``clip_scalars(v).sum()`` in float64 bitwise (``nansum``
    and ``sum`` reduce in the same order), and removing any one value, NaN and +-inf included, moves it by at most C."""
    v = torch.tensor(values, dtype=dtype)
    total = clipped_sum(v, clip)
    assert torch.equal(total, clip_scalars(v, clip).sum(dtype=torch.float64)) and torch.isfinite(total)
    for i in range(len(v)):
        removed = clipped_sum(torch.cat([v[:i], v[i + 1:]]), clip)
        assert abs(float(total) - float(removed)) <= clip * (1 + 1e-12)


@pytest.mark.parametrize("clip", [1.0, 0.1, math.inf])
def test_removing_one_of_4096_float32_values_of_one_sign_moves_the_clipped_sum_by_at_most_c(clip):
    """Audit 12, F2: summed in float32, 4,096 loss differences leaning one way (a model far from its optimum)
    reach partial sums near 3,000 C, where float32 rounds to 2.4e-4 C: removing one example moved the sum by
    up to 1.0005 C. In float64 (what :func:`clipped_sum` returns, and the release noises) by 1 + 1e-12."""
    generator = torch.Generator().manual_seed(0)
    scale = 1.0 if math.isinf(clip) else clip
    v = ((torch.rand(4096, generator=generator) * 3 - 1.5 + 0.9) * scale).float()
    total = clipped_sum(v, clip)
    assert total.dtype == torch.float64 and abs(float(total)) > 2000 * scale
    for i in torch.randint(0, len(v), (64,), generator=generator).tolist():
        removed = clipped_sum(torch.cat([v[:i], v[i + 1:]]), clip)
        assert abs(float(total - removed)) <= min(clip, abs(float(v[i]))) + 1e-9 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("clip", [0.001, 0.1, 1 / 3, 1e5])
def test_a_clip_the_dtype_cannot_hold_clamps_below_it_never_above(clip, dtype):
    """Clamping a float32 tensor at a Python ``C`` rounds ``C`` to nearest: 0.001 became 0.001 + 4.7e-11 (found
    by the hypothesis test above once the sums were exact). The bound is the dtype's largest value at most ``C``."""
    big = torch.tensor([1e4, -1e4], dtype=dtype)
    clipped = clip_scalars(big, clip)
    assert float(clipped[0]) <= clip and float(clipped[1]) >= -clip
    assert float(clipped[0]) >= clip * (1 - 2 * torch.finfo(dtype).eps) or float(big[0]) < clip
    assert abs(float(clipped_sum(big[:1], clip))) <= clip

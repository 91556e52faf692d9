"""Flat clipping, non-finite examples, empty batches, micro-batching and leftover state."""

import math

import pytest
import torch
from torch import nn

from lit_zodp.per_example import ClippedSum, PerExampleGradientEngine
from tests.per_example.helpers import (
    assert_rel_close,
    ce,
    flat_clipped_sum,
    mlp,
    opacus_per_example,
    reference,
    tiny_bert,
    tiny_vit,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
MODES = ["hooks", "ghost", "bookkeeping", "vmap"]


def _mlp_batch(n=6, seed=0):
    torch.manual_seed(seed)
    return torch.randn(n, 6) * torch.linspace(0.1, 5, n).unsqueeze(1), torch.randint(0, 3, (n,))


def _assert_sums(result, expected_sums, names, rtol=1e-6):
    for name, got in zip(names, result.grads):
        assert_rel_close(got, expected_sums[name], rtol, name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip", [0.05, 1.0, math.inf])
def test_mlp_clipped_sum_equals_reference_and_opacus(mode, clip):
    model, (x, y) = mlp(), _mlp_batch()
    engine = PerExampleGradientEngine(model, mode=mode)
    result = engine.clipped_sum(lambda: ce(model(x), y), clip)
    expected = reference(model, lambda xi, yi: ce(model(xi), yi).sum(), x, y)
    sums, norms = flat_clipped_sum(expected, engine.names, clip)
    _assert_sums(result, sums, engine.names)
    assert_rel_close(result.norms, norms)
    assert result.norms.dtype == torch.float32 and result.batch_size == len(x)
    theirs, their_norms = flat_clipped_sum(opacus_per_example(model, lambda m: ce(m(x), y)), engine.names, clip)
    _assert_sums(result, theirs, engine.names)


@pytest.mark.parametrize("mode", MODES)
def test_vit_clipped_sum_equals_reference_and_clipped_norms_are_bounded(mode):
    model = tiny_vit()
    torch.manual_seed(0)
    x, y, clip = torch.randn(3, 3, 16, 16), torch.tensor([0, 2, 1]), 0.5
    engine = PerExampleGradientEngine(model, mode=mode)
    result = engine.clipped_sum(lambda: ce(model(x), y), clip)
    expected = reference(model, lambda xi, yi: ce(model(xi), yi).sum(), x, y)
    sums, norms = flat_clipped_sum(expected, engine.names, clip)
    _assert_sums(result, sums, engine.names)
    assert (norms > clip).all()  # every example is clipped
    for i in range(len(x)):  # each example's clipped contribution has norm <= C
        one = engine.clipped_sum(lambda i=i: ce(model(x[i:i + 1]), y[i:i + 1]), clip)
        assert torch.cat([g.flatten() for g in one.grads]).norm() <= clip * (1 + 1e-9)


@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
def test_bert_clipped_sum_equals_opacus(mode):
    model = tiny_bert()
    torch.manual_seed(1)
    ids, y, clip = torch.randint(1, 50, (4, 5)), torch.tensor([0, 1, 1, 0]), 0.1
    engine = PerExampleGradientEngine(model, mode=mode)
    result = engine.clipped_sum(lambda: ce(model(input_ids=ids).logits, y), clip)
    positions = torch.arange(5).expand(4, 5)
    theirs = opacus_per_example(model, lambda m: ce(m(input_ids=ids, position_ids=positions).logits, y))
    sums, _ = flat_clipped_sum(theirs, engine.names, clip)
    _assert_sums(result, sums, engine.names)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_example_contributes_zero_and_others_are_unaffected(mode, bad):
    """A crafted record (nan/inf features -> non-finite loss and gradient) gets factor 0."""
    model, (x, y) = mlp(), _mlp_batch()
    poisoned = x.clone()
    poisoned[2, 0] = bad
    engine = PerExampleGradientEngine(model, mode=mode)
    result = engine.clipped_sum(lambda: ce(model(poisoned), y), 0.5)
    keep = torch.tensor([i != 2 for i in range(len(x))])
    clean = engine.clipped_sum(lambda: ce(model(x[keep]), y[keep]), 0.5)
    for got, want in zip(result.grads, clean.grads):
        assert torch.isfinite(got).all()
        assert_rel_close(got, want, 1e-12)
    assert not torch.isfinite(result.norms[2])
    assert_rel_close(result.norms[keep], clean.norms)


def test_non_finite_example_in_a_vit_with_fallback_parameters():
    """The vmap fallback (cls_token, pos_embed) is per example, so nan cannot leak across rows."""
    model = tiny_vit()
    torch.manual_seed(0)
    x, y = torch.randn(3, 3, 16, 16), torch.tensor([0, 2, 1])
    poisoned = x.clone()
    poisoned[1, 0, 0, 0] = math.nan
    for mode in ("hooks", "ghost", "bookkeeping"):
        engine = PerExampleGradientEngine(model, mode=mode)
        result = engine.clipped_sum(lambda: ce(model(poisoned), y), 1.0)
        clean = engine.clipped_sum(lambda: ce(model(x[[0, 2]]), y[[0, 2]]), 1.0)
        for got, want in zip(result.grads, clean.grads):
            assert_rel_close(got, want, 1e-10)


@pytest.mark.parametrize("mode", MODES)
def test_empty_batch_gives_zero_sums_without_backward(mode):
    model, (x, y) = mlp(), _mlp_batch()
    engine = PerExampleGradientEngine(model, mode=mode)
    result = engine.clipped_sum(lambda: ce(model(x[:0]), y[:0]), 1.0)
    assert result.batch_size == 0 and result.norms.shape == (0,)
    for g, p in zip(result.grads, engine.params):
        assert g.shape == p.shape and g.dtype == p.dtype and not g.any()


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_accumulate_to_one_call(mode):
    model, (x, y) = mlp(), _mlp_batch(7)
    engine = PerExampleGradientEngine(model, mode=mode)
    whole = engine.clipped_sum(lambda: ce(model(x), y), 0.3)
    parts = [lambda: ce(model(x[:3]), y[:3]), lambda: ce(model(x[3:3]), y[3:3]), lambda: ce(model(x[3:]), y[3:])]
    micro = engine.clipped_sum_microbatched(parts, 0.3)
    assert micro.batch_size == 7
    torch.testing.assert_close(micro.norms, whole.norms)
    for a, b in zip(micro.grads, whole.grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert engine.clipped_sum_microbatched([], 0.3).batch_size == 0


def test_clipped_sum_add_checks_lengths():
    from lit_zodp.errors import PrivacyConfigError

    one = ClippedSum([torch.ones(2)], torch.ones(1), 1)
    with pytest.raises(PrivacyConfigError, match="1 parameters"):
        one.add_(ClippedSum([torch.ones(2), torch.ones(1)], torch.ones(1), 1))


@pytest.mark.parametrize("mode", MODES)
def test_no_grad_or_activations_left_behind(mode):
    model, (x, y) = mlp(), _mlp_batch()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    engine = PerExampleGradientEngine(model, mode=mode)
    engine.clipped_sum(lambda: ce(model(x), y), 1.0)
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    # outside the engine the model runs as before
    torch.testing.assert_close(model(x), nn.Sequential(*model)(x))


def test_frozen_parameters_are_not_in_the_engine():
    model = mlp()
    model[0].weight.requires_grad_(False)
    engine = PerExampleGradientEngine(model)
    assert engine.names == ["0.bias", "2.weight", "2.bias"]
    x, y = _mlp_batch()
    result = engine.clipped_sum(lambda: ce(model(x), y), math.inf)
    expected = reference(model, lambda xi, yi: ce(model(xi), yi).sum(), x, y)
    _assert_sums(result, {n: g.sum(0) for n, g in expected.items()}, engine.names)


def test_no_recorded_calls_survive_the_call():
    """Activations and output gradients live in the per-call tape only."""
    import gc

    from lit_zodp.per_example.tape import LayerCall, ModuleCall, Tape

    model, (x, y) = mlp(), _mlp_batch()
    for mode in MODES:
        PerExampleGradientEngine(model, mode=mode).clipped_sum(lambda: ce(model(x), y), 1.0)
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) in (LayerCall, ModuleCall, Tape)]


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_autocast_is_close_to_float32(mode):
    """Mixed dtypes (fp32 inputs, bf16 output gradients) are promoted; the coverage check uses
    autocast's precision, so nothing falls back to recomputation in "hooks"/"ghost" modes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3)).float()
    ids, y = torch.randint(0, 20, (5, 7)), torch.randint(0, 3, (5,))
    engine = PerExampleGradientEngine(model, mode=mode)
    exact = engine.clipped_sum(lambda: ce(model(ids).float().mean(1), y), 0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = engine.clipped_sum(lambda: ce(model(ids).float().mean(1), y), 0.5)
    assert len(engine.last_recomputed) == (len(engine.names) if mode == "vmap" else 0)
    for a, b in zip(mixed.grads, exact.grads):
        assert a.dtype == torch.float32
        assert_rel_close(a, b, 3e-2)


class _ScaledLogits(nn.Module):
    """Logits times a learnable 0-dim temperature (CLIP's ``logit_scale``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear, self.scale = nn.Linear(6, 3), nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.linear(x) * self.scale


@pytest.mark.parametrize("mode", MODES)
def test_a_zero_dim_parameter_is_clipped_with_the_others(mode):
    """Audit 8: a 0-dim trainable parameter crashed every mode (``flatten(1)`` of its ``[B]`` rows)."""
    from tests.per_example.helpers import loop_reference

    model, (x, y) = _ScaledLogits().double(), _mlp_batch()
    x = x.double()
    result = PerExampleGradientEngine(model, mode=mode).clipped_sum(lambda: ce(model(x), y), 0.5)
    expected = loop_reference(model, lambda xi, yi: ce(model(xi), yi).sum(), x, y)
    names = [n for n, _ in model.named_parameters()]
    sums, norms = flat_clipped_sum(expected, names, 0.5)
    _assert_sums(result, sums, names)
    assert_rel_close(result.norms, norms)
    assert result.grads[names.index("scale")].shape == ()


class _MeanPooled(nn.Module):
    """A layer on the materialised-norm branch (``2 T^2 >= d_in d_out``), its positions mean-pooled."""

    def __init__(self, layer, dim=4):
        super().__init__()
        self.layer, self.head = layer, nn.Linear(dim, 3)

    def forward(self, x):
        out = self.layer(x)
        return self.head(torch.tanh(out.mean(1) if out.dim() == 3 else out.mean(-1)))


@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
@pytest.mark.parametrize("make, shape", [(lambda: nn.Linear(4, 4), (4, 4)), (lambda: nn.Linear(4, 4, bias=False), (4, 4)),
                                         (lambda: nn.Conv1d(4, 4, 1), (4, 4)), (lambda: nn.Embedding(5, 4), None)],
                         ids=["linear", "linear_no_bias", "conv1d", "embedding"])
def test_an_example_whose_positions_cancel_moves_the_clipped_sum_by_at_most_c(mode, make, shape):
    """Audit 13: in "ghost" and "bookkeeping" the sum is one reduction over every example's rows, while the norm of
    a layer on the materialised branch came from the example's own rows. A record with x_1 = M u, x_2 = -M u
    measured about 0 alone (clip factor 1) yet absorbed the others' partial sums: 3.1 C at B = 64 (M = 1e12),
    7.3 C at B = 256, 3.85 C through a Conv1d. Its norm is now guarded by M's scale."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float32)  # float32 rounding is the attack's lever (the fixture restores float64)
    batch, positions, big = 64, 4, 1e12
    layer = make()
    model = _MeanPooled(layer)
    engine = PerExampleGradientEngine(model, mode=mode, recheck_probability=0.0)
    if shape is None:  # an embedding: repeated tokens whose gradients cancel through a huge head input
        model.layer.weight.data[0] = big
        model.layer.weight.data[1] = -big
        x, crafted = torch.randint(2, 5, (batch, positions)), torch.tensor([[0, 1, 0, 1]])
    else:
        x, u = torch.randn(batch, *shape), torch.randn(shape[-1])
        crafted = torch.zeros(1, *shape)
        crafted[0, 0], crafted[0, 1] = big * u, -big * u
        if isinstance(layer, nn.Conv1d):
            crafted = torch.zeros(1, *shape)
            crafted[0, :, 0], crafted[0, :, 1] = big * u, -big * u
    y = torch.randint(0, 3, (batch,))
    x_with, y_with = torch.cat([x[:32], crafted, x[32:]]), torch.cat([y[:32], torch.tensor([0]), y[32:]])
    honest = torch.cat([x, x[:1]]), torch.cat([y, y[:1]])
    engine.clipped_sum(lambda: ce(model(honest[0]), honest[1]), 1.0)  # the structure's first batch: checked
    engine.clipped_sum(lambda: ce(model(x), y), 1.0)
    with_it = engine.clipped_sum(lambda: ce(model(x_with), y_with), 1.0)
    without = engine.clipped_sum(lambda: ce(model(x), y), 1.0)
    moved = torch.cat([(a.double() - b.double()).reshape(-1) for a, b in zip(with_it.grads, without.grads)]).norm()
    assert moved <= 1.0 + 1e-5, moved.item()  # (float32 rounding of a clipped share: up to ~1.4e-7 over C, as in hooks)


def _straddling_positions(batch: int, positions: int, dim: int, crafted_scale: float) -> list:
    """Where a record whose two rows cancel moves a float32 ``g^T a`` over all ``B T`` rows the most: the batch
    indices where the BLAS splits its rows across accumulators (MKL restarts them per block of rows), found on
    the GEMM alone as the engine forms it, so the test follows whatever blocking this machine's BLAS uses."""
    generator = torch.Generator().manual_seed(5)
    a = torch.nn.functional.normalize(torch.randn(1, positions, dim, generator=generator), dim=-1)
    a = a.expand(batch, positions, dim)
    g = torch.nn.functional.normalize(torch.randn(dim, generator=generator), dim=0).div(positions)
    g = g.expand(batch, positions, dim)
    u = torch.nn.functional.normalize(torch.randn(dim, generator=generator), dim=0) * crafted_scale ** 0.5
    a_c = torch.zeros(1, positions, dim)
    a_c[0, 0], a_c[0, -1] = u, -u
    g_c = (g[:1] / g[:1].norm(dim=-1, keepdim=True) * crafted_scale ** 0.5).contiguous()

    def gemm(rows_a, rows_g):
        return (rows_g.flatten(0, 1).T @ rows_a.flatten(0, 1)).double()

    base = gemm(a, g)
    moved = [((gemm(torch.cat([a[:i], a_c, a[i:]]), torch.cat([g[:i], g_c, g[i:]])) - base).norm().item(), i)
             for i in range(0, batch + 1, 1)]
    return [i for _, i in sorted(moved, reverse=True)[:2]]


@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
def test_a_record_whose_rows_cancel_across_the_blas_accumulators_moves_the_sum_by_at_most_c(mode):
    """Audit 14: audit 13's guard let a record's rows reach ``f_i S_i = C / ((T + 2) u)`` (2.4e6 C at T = 5),
    assuming that only its own T rows accumulate meanwhile. MKL's sgemm restarts its accumulators per block of
    rows (and sums use vector lanes): with ``+M u`` and ``-M u`` on both sides of a block boundary, one
    accumulator stayed near 2.4e6 C while the other examples' rows were added to it, rounding each: the record,
    whose gradient is exactly 0, moved the released sum by 1.43-1.45 C (B = 512, T = 5, the other records
    identical). The norm bound is now at least ``S_i / R`` (R = 256): 2.6e-4 C."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float32)  # float32 rounding is the attack's lever (the fixture restores float64)
    batch, positions, dim = 512, 5, 64
    model = _MeanPooled(nn.Linear(dim, dim), dim)
    engine = PerExampleGradientEngine(model, mode=mode, recheck_probability=0.0)
    x, y = (torch.randn(1, positions, dim) * 10).expand(batch, positions, dim).clone(), torch.zeros(batch).long()
    u = torch.randn(dim)
    crafted = torch.zeros(1, positions, dim)
    crafted[0, 0], crafted[0, -1] = 1e12 * u, -1e12 * u  # its weight gradient is exactly 0

    def released(inputs, targets):
        return engine.clipped_sum(lambda: ce(model(inputs), targets), 1.0).grads

    released(torch.cat([x, x[:1]]), torch.cat([y, y[:1]]))  # the structure's first batch: checked
    without = released(x, y)
    for i in _straddling_positions(batch, positions, dim, 1 / ((positions + 2) * 2.0 ** -24 * 2)):
        with_it = released(torch.cat([x[:i], crafted, x[i:]]), torch.cat([y[:i], y[:1], y[i:]]))
        moved = torch.cat([(a.double() - b.double()).reshape(-1) for a, b in zip(with_it, without)]).norm()
        assert moved <= 1.0, (i, moved.item())


@pytest.mark.parametrize("make", [lambda: nn.LayerNorm(4), lambda: nn.GroupNorm(2, 4), lambda: nn.RMSNorm(4)],
                         ids=["layer_norm", "group_norm", "rms_norm"])
def test_normalisation_norms_are_guarded_by_the_scale_of_their_terms(make):
    """Audit 13's guard for the normalisation layers (which had no norm rule): two positions whose terms
    g_t * x_hat_t cancel measure 0, but their sums are formed apart from these rows (the bookkeeping sum from
    rescaled rows, the ghost sum from autograd's backward), so the norm keeps at least (T + 2) u S_i."""
    from lit_zodp.per_example.samplers import sampler_for

    torch.set_default_dtype(torch.float32)
    layer = make()
    a = torch.randn(1, 4, 2) if isinstance(layer, nn.GroupNorm) else torch.randn(1, 2, 4)
    g = torch.zeros_like(a)
    if isinstance(layer, nn.GroupNorm):  # [B, C, L]: positions are the last dim
        a[..., 1] = a[..., 0]
        g[..., 0], g[..., 1] = 1e6, -1e6
        terms = (g * torch.nn.functional.group_norm(a, 2)).transpose(1, 2)
    else:
        a[:, 1] = a[:, 0]
        g[:, 0], g[:, 1] = 1e6, -1e6
        terms = g * (torch.nn.functional.layer_norm(a, (4,)) if isinstance(layer, nn.LayerNorm)
                     else a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + torch.finfo(a.dtype).eps))
    norms = sampler_for(layer).norms_sq(layer, a, g)
    scale = terms[0].double().norm(dim=-1).sum()
    assert norms["weight"].sqrt().item() >= 4 * 2.0 ** -24 * scale.item() > 0  # (T + 2) u S_i at T = 2
    if "bias" in norms:
        assert norms["bias"].sqrt().item() >= 4 * 2.0 ** -24 * 2e6 * 2


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bookkeeping", "vmap"])
def test_a_clipped_share_never_exceeds_c_by_rounding(mode):
    """Audit 14, H1: the clip factor ``C / ||g||`` rounded to float32, the products ``f g`` and a float32 norm
    each move a share by about an ulp: ``||f_i g_i||`` reached ``(1 + 1.7e-7) C`` in "hooks" and ``(1 + 1.1e-7) C``
    in "bookkeeping". Factors now clip at ``C (1 - 2^-20)``."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float32)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    engine = PerExampleGradientEngine(model, mode=mode, recheck_probability=0.0)
    engine.clipped_sum(lambda: ce(model(torch.randn(4, 16)), torch.randint(0, 3, (4,))), 1.0)  # checked structure
    excess = []
    for _ in range(400):
        x, y, clip = torch.randn(1, 16) * 5, torch.randint(0, 3, (1,)), float(torch.rand(()) * 0.01 + 1e-3)
        share = engine.clipped_sum(lambda: ce(model(x), y), clip).grads
        excess.append(torch.cat([g.double().reshape(-1) for g in share]).norm().item() / clip - 1)
    assert max(excess) <= 0 and min(excess) > -1e-5


@pytest.mark.parametrize("case", ["random", "cancelling", "aligned", "tiny", "huge", "long"])
def test_the_float32_summed_rows_bound_covers_the_float64_one_and_stays_close_to_it(case):
    """A bias's (and a normalisation layer's) guarded norm is formed in float32 with float32's error bounds
    (:func:`summed_norm_sq`): it must bound ``||sum_t g_t|| + rounded S_i`` computed exactly (float64 rows of the
    same float32 values) for any rows, cancelling ones included, and add little for ordinary ones."""
    from lit_zodp.per_example.ghost import CANCELLATION_LIMIT, summed_norm_sq
    from lit_zodp.per_example.rounding import sum_rounding

    generator = torch.Generator().manual_seed(hash(case) % 1000)
    batch, positions, width = 16, (4096 if case == "long" else 196), 192
    g = torch.randn(batch, positions, width, generator=generator, dtype=torch.float32)
    if case == "cancelling":  # pairs of positions cancel up to a small remainder, at several magnitudes
        g[:, 1::2] = -g[:, 0::2] + 1e-6 * torch.randn(batch, positions // 2, width, generator=generator)
        g *= torch.logspace(-25, 15, batch).view(-1, 1, 1)
    elif case == "aligned":
        g = g[:, :1].expand(batch, positions, width).contiguous()
    elif case == "tiny":
        g *= 1e-30
    elif case == "huge":
        g *= 1e15
    rows = g.double()
    rounded = sum_rounding(torch.float32, "cpu")
    scale = rows.norm(dim=-1).sum(1)
    exact = rows.sum(1).norm(dim=-1) + (rounded.product + (positions + 2) * rounded.accumulation) * scale
    exact = torch.maximum(exact, scale / CANCELLATION_LIMIT)
    bound = summed_norm_sq(g).sqrt()
    assert bound.dtype == torch.float64 and (bound >= exact).all()
    if case in ("random", "aligned", "long"):  # the price of float32: about a second (T + 2) u S_i, no more
        assert (bound <= exact * (1 + 1e-3) + 2 * positions * 2.0 ** -24 * scale).all()


@pytest.mark.parametrize("mode", ["hooks", "vmap"])
def test_a_long_materialised_gradient_whose_small_squares_a_float32_norm_drops_is_clipped_by_its_true_norm(mode):
    """Review 15, F1: a float32 norm of a long row adds its squares into a few lane accumulators, dropping each
    square below half an ulp of the one before: a 4096 x 2048 gradient of one 1 and 261,632 elements of ~2^-12.5
    measured 1.0 for a true 1.0154, and the share released was 1.0154 C. Norms now add float32 blocks of 64 in
    float64, scaled up by the blocks' error bound."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float32)
    outputs, inputs = 4096, 2048
    model = nn.Linear(inputs, outputs, bias=False)
    eps = math.sqrt(2.0 ** -25) * (1 - 2 ** -12)  # eps^2 just under half an ulp of 1
    x_c, w_c = torch.zeros(1, 2, inputs), torch.zeros(1, 2, outputs)
    x_c[0, 0, 0], w_c[0, 0, 0] = 1.0, 1.0
    x_c[0, 1, 8::8], w_c[0, 1, :] = eps, 1.0
    x_h, w_h = torch.randn(1, 2, inputs) * 0.01, torch.randn(1, 2, outputs) * 0.01

    def loss(x, w):
        return (model(x) * w).sum((1, 2))

    engine = PerExampleGradientEngine(model, mode=mode, recheck_probability=0.0)
    clip = 0.5
    engine.clipped_sum(lambda: loss(torch.cat([x_h, x_h]), torch.cat([w_h, w_h])), clip)  # the checked structure
    with_it = engine.clipped_sum(lambda: loss(torch.cat([x_c, x_h]), torch.cat([w_c, w_h])), clip)
    without = engine.clipped_sum(lambda: loss(x_h, w_h), clip)
    moved = torch.cat([(a.double() - b.double()).reshape(-1) for a, b in zip(with_it.grads, without.grads)]).norm()
    exact = torch.einsum("bto,bti->boi", w_c.double(), x_c.double()).norm()
    assert with_it.norms[0].item() >= exact.item() * (1 - 1e-6) and moved.item() <= clip

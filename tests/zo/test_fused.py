"""The fused perturbation engine and its Philox law (lit_zodp.zo.philox, lit_zodp.zo.fused).

Triton kernels run on CPU only under ``TRITON_INTERPRET=1``, which Triton reads when it is imported.
So that the rest of the suite keeps a normal Triton, the interpreted runs happen once, in a
subprocess running this file as a script (``python tests/zo/test_fused.py OUT``); the tests compare
what it saved with the torch reference computed here.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from lit_zodp.zo import philox
from lit_zodp.zo.fused import FusedPerturbation, global_offsets
from tests._triton import run_interpreted

try:
    import triton
    import triton.language as tl

    from lit_zodp.zo.fused import _minus_two_log_near_one, _pair_to_normal, _rand4x, _round_as, _store_as
except ImportError:  # pragma: no cover
    triton = None

SEEDS = [0, 1, 42, 2**31 - 1, 2**31 + 3, 2**32 + 5, 2**63 - 1, 2**63 + 7, 2**64 - 1]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(37, 11), (5,), (0,), (3, 3, 3), (2049,)]
BLOCK = 1024  # small tiles: several per tensor, full and partial ones


def probe_offsets() -> torch.Tensor:
    """Element offsets around 0, the 2^32 boundary (Philox's second counter word) and far beyond."""
    return torch.cat([torch.arange(0, 2048), torch.arange(2**32 - 6, 2**32 + 6), torch.arange(2**34, 2**34 + 8),
                      torch.tensor([2**40 + 3, 2**62 + 5])]).to(torch.int64)


def make_params(dtype, shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).mul_(0.1).to(dtype) for s in shapes]


#: Bound on the sum of |scales| of any pass of `scenario` (pending 1e-2 plus lr * c <= 0.7 * 0.75).
SCENARIO_SCALE = 0.6
#: Bound on |z_a - z_b| between two implementations of the law: CUDA's lg2/cos/sin.approx and sqrt.approx
#: (<= 5.7e-6, fused._pair_to_normal), or numpy's float32 functions (<= 4 ulps of z, |z| <= 5.7, so < 2e-6).
Z_TOLERANCE = 1e-5


def scenario(params, lr=None, **engine_kwargs):
    """A fixed sequence of passes (MeZO probe, fused update with per-parameter lr/wd, a 2-direction
    update with a pending probe, a plain restore); returns the parameters after each pass."""
    engine = FusedPerturbation(params, **engine_kwargs)
    lrs = lr if lr is not None else [0.1 * (i + 1) for i in range(len(params))]
    snaps = []

    def snap():
        snaps.append([p.clone() for p in params])

    engine.perturb_(derive(0), 1e-2)
    snap()
    engine.perturb_(derive(0), -2e-2)
    snap()
    engine.restore_and_update_({derive(0): 0.75}, lr=lrs, weight_decay=0.01)
    snap()
    engine.perturb_(2**63 + 7, 5e-3)
    engine.restore_and_update_({2**63 + 7: torch.tensor(-0.5), 3: 1.25}, lr=0.05, weight_decay=0.0)
    snap()
    engine.perturb_(11, 1e-3)
    engine.restore_()
    snap()
    engine.restore_and_update_({}, lr=0.1, weight_decay=0.5)  # decay alone: a launch with no direction
    snap()
    return snaps


def derive(step: int) -> int:
    from lit_zodp.zo import derive_seed
    return derive_seed(5, step)


SPLIT_SHAPES = [(64,), (1000,), (24,)]  # one 1088-element vector, split at multiples of 4
FAR_OFFSETS = [0, 2**32 - 8, 2**34 + 4]  # tensors placed across Philox's counter words


def interpreted_runs() -> dict:
    """Everything the interpreted kernels compute (run in the TRITON_INTERPRET=1 subprocess)."""
    out = {"words": {}, "randn": {}, "randn4x": {}, "uniforms": {}, "scenarios": {}}
    offsets = probe_offsets()
    n = offsets.numel()
    for seed in SEEDS:
        words = torch.zeros(4, n, dtype=torch.int64)
        normals = torch.zeros(5, n)
        _probe_kernel[(triton.cdiv(n, 1024),)](words, normals, seed, offsets, n, BLOCK=1024)
        out["words"][seed], out["randn"][seed], out["randn4x"][seed] = words, normals[0], normals[1:]
        out["uniforms"][seed] = uniforms_of_both(seed, offsets)
    for dtype in DTYPES:
        out["scenarios"][str(dtype)] = scenario(make_params(dtype), backend="triton", block=BLOCK)
    whole = [torch.randn(1088, generator=torch.Generator().manual_seed(3))]
    pieces = [t.clone() for t in whole[0].split([s[0] for s in SPLIT_SHAPES])]
    out["split_whole"] = scenario(whole, lr=0.1, backend="triton", block=BLOCK)
    out["split_pieces"] = scenario(pieces, lr=0.1, backend="triton", block=BLOCK)
    out["far"] = scenario(make_params(torch.float32, [(13,), (300,), (7, 9)]), backend="triton", block=BLOCK,
                          offsets=FAR_OFFSETS)
    out["other_tile"] = scenario(make_params(torch.bfloat16), backend="triton", block=256, num_warps=2)
    out["bf16_rounded"], out["bf16_stored"] = bf16_roundings(bf16_rounding_cases(), hw_round=False)
    v = series_grid()
    out["series"] = torch.empty_like(v)
    _series_kernel[(triton.cdiv(v.numel(), 1024),)](v, out["series"], v.numel(), BLOCK=1024)
    return out


def uniforms_of_both(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """``tl.rand4x`` (rows 0-3) and the fused kernel's own Philox ``_rand4x`` (rows 4-7) at ``offsets``."""
    n = offsets.numel()
    out = torch.empty(8, n, device=offsets.device)
    _uniforms_kernel[(triton.cdiv(n, 1024),)](out, seed, offsets, n, BLOCK=1024)
    return out


def bf16_roundings(x: torch.Tensor, hw_round: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's bf16 rounding of ``x``: kept in float32 (``_round_as``) and stored as bf16 (``_store_as``)."""
    rounded, stored = torch.empty_like(x), torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    _bf16_rounding_kernel[(triton.cdiv(x.numel(), 1024),)](x, rounded, stored, x.numel(), HW_ROUND=hw_round,
                                                            BLOCK=1024)
    return rounded, stored


def series_grid() -> torch.Tensor:
    """``v = 1 - u1`` where the fast log takes its series: every float32 step near 0 and a fine grid up
    to the switch (the kernel's ``u1`` are multiples of 2^-24 there)."""
    from lit_zodp.zo.fused import LOG_SERIES_BELOW
    return torch.cat([torch.arange(1, 4097), torch.arange(4097, int(LOG_SERIES_BELOW * 2**24), 61)]).float() / 2**24


if triton is not None:

    @triton.jit
    def _probe_kernel(words, normals, seed, offsets_ptr, n, BLOCK: tl.constexpr):
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = index < n
        offsets = tl.load(offsets_ptr + index, mask=mask)
        w0, w1, w2, w3 = tl.randint4x(seed, offsets)
        tl.store(words + index, w0.to(tl.int64), mask=mask)
        tl.store(words + n + index, w1.to(tl.int64), mask=mask)
        tl.store(words + 2 * n + index, w2.to(tl.int64), mask=mask)
        tl.store(words + 3 * n + index, w3.to(tl.int64), mask=mask)
        tl.store(normals + index, tl.randn(seed, offsets), mask=mask)
        n1, n2, n3, n4 = tl.randn4x(seed, offsets)
        tl.store(normals + n + index, n1, mask=mask)
        tl.store(normals + 2 * n + index, n2, mask=mask)
        tl.store(normals + 3 * n + index, n3, mask=mask)
        tl.store(normals + 4 * n + index, n4, mask=mask)

    @triton.jit
    def _uniforms_kernel(out, seed, offsets_ptr, n, BLOCK: tl.constexpr):
        """Rows 0-3 of ``out``: the four uniforms of ``tl.rand4x``; rows 4-7: the fused kernel's ``_rand4x``."""
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = index < n
        offsets = tl.load(offsets_ptr + index, mask=mask)
        a1, a2, a3, a4 = tl.rand4x(seed, offsets)
        b1, b2, b3, b4 = _rand4x(seed, offsets)
        tl.store(out + index, a1, mask=mask)
        tl.store(out + n + index, a2, mask=mask)
        tl.store(out + 2 * n + index, a3, mask=mask)
        tl.store(out + 3 * n + index, a4, mask=mask)
        tl.store(out + 4 * n + index, b1, mask=mask)
        tl.store(out + 5 * n + index, b2, mask=mask)
        tl.store(out + 6 * n + index, b3, mask=mask)
        tl.store(out + 7 * n + index, b4, mask=mask)

    @triton.jit
    def _series_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = index < n
        tl.store(out_ptr + index, _minus_two_log_near_one(tl.load(v_ptr + index, mask=mask)), mask=mask)

    @triton.jit
    def _bf16_rounding_kernel(x_ptr, rounded_ptr, stored_ptr, n, HW_ROUND: tl.constexpr, BLOCK: tl.constexpr):
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = index < n
        x = tl.load(x_ptr + index, mask=mask)
        tl.store(rounded_ptr + index, _round_as(x, tl.bfloat16, HW_ROUND), mask=mask)
        tl.store(stored_ptr + index, _store_as(x, tl.bfloat16, HW_ROUND), mask=mask)

    @triton.jit
    def _box_muller_kernel(u1_ptr, u2_ptr, out_ptr, n, FAST_MATH: tl.constexpr, BLOCK: tl.constexpr):
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = index < n
        c, s = _pair_to_normal(tl.load(u1_ptr + index, mask=mask, other=0.5),
                               tl.load(u2_ptr + index, mask=mask, other=0.5), FAST_MATH)
        tl.store(out_ptr + index, c, mask=mask)
        tl.store(out_ptr + n + index, s, mask=mask)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted(__file__, tmp_path_factory)


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of ``x``'s dtype at ``|x|`` (float64, for tolerances)."""
    a = x.abs()
    return (torch.nextafter(a, torch.full_like(a, math.inf)) - a).double()


def assert_within(actual, expected, ulps: float, extra: float = 0.0):
    """``|actual - expected| <= ulps * ulp(max(|actual|, |expected|)) + extra`` elementwise."""
    big = torch.maximum(actual.abs(), expected.abs())
    gap = (actual.double() - expected.double()).abs()
    bound = ulps * ulp(big) + extra
    assert bool((gap <= bound).all()), f"max gap {gap.max().item():.3g}, worst excess {(gap - bound).max().item():.3g}"


# ------------------------------------------------------------------------------------ Philox
def test_philox_known_answers():
    """Random123's known-answer vectors for Philox4x32-10 (Salmon et al. 2011)."""
    cases = [([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
             ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
             ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
              [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1])]
    for counter, key, expected in cases:
        words = philox.philox4x32(*[torch.tensor([c]) for c in counter], *key)
        assert [int(w) for w in words] == expected


def test_seed_key_splits_64_bits():
    assert philox.seed_key(0x0123456789ABCDEF) == (0x89ABCDEF, 0x01234567)
    assert philox.seed_key(-1) == philox.seed_key(2**64 - 1) == (0xFFFFFFFF, 0xFFFFFFFF)
    assert philox.seed_as_int64(2**63 + 7) == -(2**63) + 7
    offsets = torch.arange(64)
    assert torch.equal(philox.normal(-1, offsets), philox.normal(2**64 - 1, offsets))
    assert not torch.equal(philox.normal(2**32, offsets), philox.normal(0, offsets))  # the high word counts


def test_integer_stream_matches_triton_bitwise(interpreted):
    offsets = probe_offsets()
    for seed in SEEDS:
        assert torch.equal(interpreted["words"][seed], torch.stack(philox.randint4x(seed, offsets))), seed


def test_fused_philox_is_tritons_bitwise(interpreted):
    """The fused kernel's Philox (each round's two multiplies as widening 32x32 -> 64-bit products, one
    instruction each) gives ``tl.rand4x``'s bits: same law, fewer instructions."""
    for seed in SEEDS:
        both = interpreted["uniforms"][seed]
        assert torch.equal(both[:4], both[4:]), seed


def test_normals_match_triton_interpreter_bitwise(interpreted):
    """With numpy's float32 log/cos/sin (what the interpreter calls) the normals are bitwise Triton's."""
    offsets = probe_offsets()
    for seed in SEEDS:
        assert torch.equal(interpreted["randn"][seed], philox.randn(seed, offsets, "numpy")), seed
        assert torch.equal(interpreted["randn4x"][seed], torch.stack(philox.randn4x(seed, offsets, "numpy")))


def test_correctly_rounded_normals_within_four_ulps_of_triton(interpreted):
    """Default math against numpy's float32 log/cos/sin: at most 4 ulps of z (also the maximum over
    4e5 draws); ulps are counted at the larger magnitude, so half a binade below a power of two
    counts double."""
    offsets = probe_offsets()
    for seed in SEEDS:
        assert_within(philox.randn(seed, offsets), interpreted["randn"][seed], ulps=4)


def test_high_counter_word_is_used():
    low = philox.normal(9, torch.arange(0, 64))
    high = philox.normal(9, torch.arange(2**34, 2**34 + 64))
    assert not torch.equal(low, high)
    words = philox.randint4x(9, torch.tensor([2**32 + 3]))
    assert [int(w) for w in words] == [int(w) for w in philox.philox4x32(
        torch.tensor([3]), torch.tensor([1]), torch.tensor([0]), torch.tensor([0]), 9, 0)]


def test_law_is_a_pure_function_of_seed_and_element():
    """z(seed, g) = randn4x(seed, g // 4)[g % 4], in any order and over any range."""
    g = torch.randperm(4000, generator=torch.Generator().manual_seed(0)).to(torch.int64) + 2**32 - 2000
    lanes = torch.stack(philox.randn4x(7, g >> 2), dim=1)
    expected = lanes[torch.arange(g.numel()), g & 3]
    assert torch.equal(philox.normal(7, g), expected)
    assert torch.equal(philox.normal_range(7, 2**32 - 3, 50), philox.normal(7, torch.arange(2**32 - 3, 2**32 + 47)))


def test_moments_of_one_million_draws():
    """Mean, variance, fourth moment and neighbour correlations of 10^6 draws within 5 standard
    errors (sd of the mean 1e-3, of the variance sqrt(2/n) = 1.4e-3, of the fourth moment
    sqrt(96/n) = 9.8e-3, of a correlation 1e-3). Seeds are fixed, so the test is deterministic; a
    correct N(0, 1) law fails it with probability < 1e-5 per check. Box-Muller's floor u1 >= 1e-7
    truncates |z| at 5.68, which moves a mass of 1.3e-8: invisible at this size."""
    n = 1_000_000
    z = philox.normal(derive(1), torch.arange(2**32 - n // 2, 2**32 + n // 2)).double()
    assert abs(z.mean().item()) < 5e-3
    assert abs(z.var().item() - 1.0) < 5 * math.sqrt(2 / n)
    assert abs(z.pow(4).mean().item() - 3.0) < 5 * math.sqrt(96 / n)
    for lag in (1, 2, 3, 4):  # lanes of one Philox call, and the next call
        corr = (z[:-lag] * z[lag:]).mean().item()
        assert abs(corr) < 5e-3, lag
    assert z.abs().max().item() <= math.sqrt(-2 * math.log(1e-7)) + 1e-5


# ------------------------------------------------------------------------------------ kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_equals_reference_bitwise(interpreted, dtype):
    kernel = interpreted["scenarios"][str(dtype)]
    reference = scenario(make_params(dtype), backend="reference", math="numpy")
    for step, (k, r) in enumerate(zip(kernel, reference)):
        for i, (a, b) in enumerate(zip(k, r)):
            assert a.dtype == dtype and torch.equal(a, b), (step, i)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_close_to_correctly_rounded_reference(interpreted, dtype):
    """The tolerance the CUDA test uses, checked here where the z differ by <= 4 ulps."""
    kernel = interpreted["scenarios"][str(dtype)]
    reference = scenario(make_params(dtype), backend="reference")
    for k, r in zip(kernel, reference):
        for a, b in zip(k, r):
            assert_within(a, b, ulps=2, extra=SCENARIO_SCALE * Z_TOLERANCE)


def test_direction_does_not_depend_on_the_split(interpreted):
    """Same global offsets -> same numbers: a vector split into three tensors moves like the whole."""
    assert global_offsets([torch.empty(s) for s in SPLIT_SHAPES]) == [0, 64, 1064]
    for whole, pieces in zip(interpreted["split_whole"], interpreted["split_pieces"]):
        assert torch.equal(whole[0], torch.cat(pieces))


def test_direction_does_not_depend_on_the_tile(interpreted):
    """Another tile (elements per program, warps) computes the same bits: a default tile can change."""
    for other, default in zip(interpreted["other_tile"], interpreted["scenarios"][str(torch.bfloat16)]):
        assert all(torch.equal(a, b) for a, b in zip(other, default))


def test_integer_bf16_rounding_is_torchs(interpreted):
    """The interpreted kernel's bf16 rounding (integer arithmetic; the GPU's ``cvt.rn`` is checked against it
    on a GPU) gives torch's bits on every number, ties to even, and keeps a NaN a NaN."""
    x = bf16_rounding_cases()
    number = ~x.isnan()
    expected = x.to(torch.bfloat16)
    assert torch.equal(interpreted["bf16_stored"].view(torch.int16)[number], expected.view(torch.int16)[number])
    assert torch.equal(interpreted["bf16_rounded"][number], expected.float()[number])
    assert bool(interpreted["bf16_stored"][~number].isnan().all()) and int((~number).sum()) > 100


def test_log_series_near_one_is_accurate(interpreted):
    """The fast log's series ``-2 ln(1 - v)`` where the hardware log2's absolute error would move a small
    ``r``: within 4 ulps of the float64 value on every float32 ``v`` the kernel can meet below 2^-12 and a
    grid up to the switch (the 4-term truncation is below 2e-8 relative)."""
    v = series_grid()
    exact = -2.0 * torch.log1p(-v.double())
    assert_within(interpreted["series"], exact.float(), ulps=4)
    assert bool((interpreted["series"] > 0).all())


def test_kernel_beyond_two_to_the_32(interpreted):
    reference = scenario(make_params(torch.float32, [(13,), (300,), (7, 9)]), backend="reference", math="numpy",
                         offsets=FAR_OFFSETS)
    for k, r in zip(interpreted["far"], reference):
        assert all(torch.equal(a, b) for a, b in zip(k, r))


# ------------------------------------------------------------------------------------ semantics (reference)
def test_update_is_restore_then_decay_then_step():
    params = make_params(torch.float32, seed=1)
    before = [p.double() for p in params]
    engine = FusedPerturbation(params, backend="reference")
    s1, s2 = derive(3), derive(4)
    z1, z2 = [[z.double() for z in engine.direction(s)] for s in (s1, s2)]
    engine.perturb_(s1, 1e-3)
    engine.perturb_(s1, -2e-3)
    lrs = [0.01 * (i + 1) for i in range(len(params))]
    engine.restore_and_update_({s1: 2.0, s2: -3.0}, lr=lrs, weight_decay=0.1)
    assert engine.pending == {}
    for i, p in enumerate(params):
        kept, step = (1 - lrs[i] * 0.1) * before[i], lrs[i] * (2.0 * z1[i] - 3.0 * z2[i])
        size = (kept.abs() + lrs[i] * (2.0 * z1[i].abs() + 3.0 * z2[i].abs())).float()
        gap = (p.double() - (kept - step)).abs()
        assert bool((gap <= 4 * ulp(size)).all())  # a few roundings of terms of this size


def test_tensor_coefficients_equal_float_coefficients():
    a, b = make_params(torch.float32, seed=2), make_params(torch.float32, seed=2)
    FusedPerturbation(a, backend="reference").restore_and_update_({5: 0.3}, lr=0.1)
    FusedPerturbation(b, backend="reference").restore_and_update_({5: torch.tensor(0.3)}, lr=0.1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
def test_term_tables_are_one_buffer_with_aligned_views(k):
    """A pass's seeds and scalars travel in one host-to-device copy: two views of one buffer, each
    16-byte aligned (Triton specialises pointer arguments on it: an unaligned table would compile another
    kernel), holding the seeds bitwise and the scalars as float32, device coefficients copied in."""
    from lit_zodp.zo.fused import _Terms, _term_tables

    seeds = [2**64 - 1 - i for i in range(k)]
    coefficients = [torch.tensor(0.25 * i, dtype=torch.float64) if i % 2 else 1.5 + i for i in range(k)]
    terms = _Terms(seeds, [1e-3 * i for i in range(k)], [-1e-3] * k, coefficients)
    seed_table, scalars = _term_tables(terms, torch.device("cpu"))
    assert seed_table.dtype == torch.int64 and scalars.dtype == torch.float32 and scalars.numel() == 3 * k
    assert k == 0 or (seed_table.data_ptr() % 16 == 0 and scalars.data_ptr() % 16 == 0)
    assert k == 0 or seed_table.untyped_storage().data_ptr() == scalars.untyped_storage().data_ptr()
    assert seed_table.tolist() == [philox.seed_as_int64(s) for s in seeds]
    expected = torch.tensor(terms.pending + terms.scales + [float(c) for c in coefficients], dtype=torch.float32)
    assert torch.equal(scalars, expected)


def test_pending_cancels_and_empty_passes_are_no_ops():
    params = make_params(torch.float32)
    before = [p.clone() for p in params]
    engine = FusedPerturbation(params, backend="reference")
    engine.perturb_(1, 1e-3)
    engine.perturb_(1, -2e-3)
    engine.perturb_(1, 1e-3)
    assert engine.pending == {}
    engine.restore_()
    engine.restore_and_update_({}, lr=0.5)
    assert max(((p - b).abs().max().item() for p, b in zip(params, before) if p.numel())) <= 1e-6


def recoverable(before: torch.Tensor, perturbed: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Where ``theta -> theta + a`` keeps every bit and the restore cannot round across a binade edge:
    ``theta`` and ``theta + a`` share sign and binade, ``theta`` is not a power of two (below one
    the grid is twice finer), and ``|a| < |theta| / 8`` (the engine's odd last bit of ``a`` then lies
    below the tie position, so no tie can lose the bit)."""
    m0, e0 = torch.frexp(before.float())
    m1, e1 = torch.frexp(perturbed.float())
    return (e0 == e1) & (m0 * m1 > 0) & (m0.abs() != 0.5) & (shift.abs() < before.float().abs() / 8)


def test_weight_decay_alone_shrinks():
    params = make_params(torch.float32)
    before = [p.clone() for p in params]
    FusedPerturbation(params, backend="reference").restore_and_update_({}, lr=0.1, weight_decay=0.5)
    for p, b in zip(params, before):
        assert_within(p, b * torch.tensor(0.95), ulps=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_perturb_restore_is_exact_where_no_bit_is_lost(dtype):
    """``+s`` then restore, and MeZO's ``+s, -2s, +s``: bitwise wherever no bit was lost, and within
    one ulp of ``max(|theta|, |theta + s z|)`` everywhere (the restore rounds to the parameter grid
    before anything else is added, so the update pass sees the unperturbed value). 16-bit parameters
    add float32's own rounding of ``theta + a``, which lands on a midpoint for ~2^-13 of elements."""
    lost = 0.0 if dtype == torch.float32 else 1e-4
    (theta,) = make_params(dtype, shapes=[(50000,)], seed=4)
    before = theta.clone()
    engine = FusedPerturbation([theta], backend="reference")
    shift = engine.direction(21)[0] * 1e-3
    engine.perturb_(21, 1e-3)
    plus = theta.clone()
    engine.restore_()
    keep = recoverable(before, plus, shift)
    assert keep.double().mean().item() > 0.9 and (theta == before).double().mean().item() > 0.97
    assert (theta[keep] != before[keep]).double().mean().item() <= lost
    gap = (theta.double() - before.double()).abs()
    assert bool((gap <= ulp(torch.maximum(plus.abs(), before.abs()))).all())

    theta.copy_(before)
    shift = engine.direction(22)[0] * 1e-3
    engine.perturb_(22, 1e-3)
    plus = theta.clone()
    engine.perturb_(22, -2e-3)
    minus = theta.clone()
    engine.restore_()
    keep = recoverable(before, plus, shift) & recoverable(before, minus, -shift)
    assert keep.double().mean().item() > 0.85 and (theta == before).double().mean().item() > 0.95
    assert (theta[keep] != before[keep]).double().mean().item() <= lost
    big = torch.maximum(torch.maximum(plus.abs(), minus.abs()), before.abs())
    assert bool(((theta.double() - before.double()).abs() <= 2 * ulp(big)).all())


def test_offsets_are_checked():
    params = [torch.zeros(5), torch.zeros(4)]
    assert global_offsets(params) == [0, 8]
    with pytest.raises(ValueError, match="multiples"):
        FusedPerturbation(params, offsets=[0, 6], backend="reference")
    with pytest.raises(ValueError, match="overlap"):
        FusedPerturbation(params, offsets=[0, 4], backend="reference")
    with pytest.raises(ValueError, match="not one dense buffer"):  # (a dense one of any layout is taken: review 34)
        FusedPerturbation([torch.zeros(4, 8)[:, ::2]], backend="reference")
    with pytest.raises(ValueError, match="dtype"):
        FusedPerturbation([torch.zeros(4, dtype=torch.float64)], backend="reference")
    for block, warps, option in [(1000, 4, "block"), (1024, 3, "num_warps"), (1024, 0, "num_warps")]:
        with pytest.raises(ValueError, match=f"`{option}` a power of two"):
            FusedPerturbation(params, backend="reference", block=block, num_warps=warps)


def test_direction_matches_global_offsets():
    params = make_params(torch.float16)
    engine = FusedPerturbation(params, backend="reference")
    for p, o, z in zip(params, engine.offsets, engine.direction(99)):
        assert torch.equal(z.view(-1), philox.normal(99, o + torch.arange(p.numel())))


# ------------------------------------------------------------------------------------ CUDA
def kernel_instructions():
    """``benchmarks/kernel_instructions.py``: the pass kernel compiled for sm_90 without a GPU, and its SASS."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import kernel_instructions as module
    finally:
        sys.path.pop(0)
    return module


def skip_without_cuda_compiler(error: Exception):
    pytest.skip(f"no NVIDIA backend, ptxas or nvdisasm in this triton: {error}")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("block, warps", [(2048, 4), (1024, 8), (512, 4)])
def test_kernel_compiles_for_sm90_without_a_gpu(dtype, block, warps, tmp_path, monkeypatch):
    """Triton's CUDA frontend and ptxas accept the kernel (what the interpreter cannot check). At each tile
    bench_zo_gpu.py times: 128-bit loads and stores where a thread holds 8 bf16 (64-bit at 4); the
    hardware's ``lg2/cos/sin.approx`` and bf16 ``cvt.rn``; ``z`` stays in registers (no shared-memory round
    trip, no barrier); no local memory (spills, or the large-argument branch of a software sine)."""
    tool = kernel_instructions()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    try:
        kernel, _ = tool.compile_pass_kernel(dtype, block, warps, fast_math=True)
    except (RuntimeError, FileNotFoundError, ImportError) as error:
        skip_without_cuda_compiler(error)
    ptx = kernel.asm["ptx"]
    vector = "v4" if dtype == "fp32" or block // (32 * warps) >= 8 else "v2"
    assert f"ld.global.{vector}" in ptx and f"st.global.{vector}" in ptx
    assert "sin.approx" in ptx and "cos.approx" in ptx and "lg2.approx" in ptx
    assert dtype != "bf16" or "cvt.rn.bf16" in ptx  # the hardware's rounding, not integer arithmetic
    assert "mul.wide.u32" in ptx and "mul.hi.u32" not in ptx  # Philox: one widening multiply, not hi and lo
    assert "bar.sync" not in ptx and ".shared" not in ptx
    assert ".local" not in ptx and kernel.metadata.shared == 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_hardware_math_shortens_the_direction_loop(dtype, tmp_path, monkeypatch):
    """The pass is bound by arithmetic in bf16: the hardware ``lg2/cos/sin.approx`` must cut the instructions
    per element of the loop over directions (sm_90 SASS, ``benchmarks/kernel_instructions.py``), leave no
    large-argument branch in it, and take a special-function instruction for each of ``log2``, ``sqrt``,
    ``cos`` and ``sin`` of every pair of elements (libdevice's ``logf`` is a polynomial)."""
    tool = kernel_instructions()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    try:
        fast = tool.measure(dtype, 1024, 4, fast_math=True)
        software = tool.measure(dtype, 1024, 4, fast_math=False)
    except (RuntimeError, FileNotFoundError, ImportError) as error:
        skip_without_cuda_compiler(error)
    assert fast["loop"] > 0 and fast["per_element"] == fast["loop"] / fast["per_thread"]  # nothing skipped
    assert fast["mufu"] >= 2 * fast["per_thread"] and fast["stack"] == 0 and fast["shared"] == 0
    assert fast["per_element"] < 0.75 * software["per_element"], (fast["per_element"], software["per_element"])


@pytest.mark.gpu
@pytest.mark.parametrize("fast_math", [True, False], ids=["fast_math", "software_math"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_kernel_matches_reference(dtype, fast_math):
    """The compiled kernel against the torch reference. CUDA's log/cos/sin/sqrt are not correctly
    rounded and multiply-adds may fuse: within 2 ulps of the parameter plus ``Z_TOLERANCE`` times the
    sum of the pass's scales."""
    pytest.importorskip("triton")
    kernel = scenario([p.cuda() for p in make_params(dtype)], backend="triton", fast_math=fast_math)
    reference = scenario(make_params(dtype), backend="reference")
    for k, r in zip(kernel, reference):
        for a, b in zip(k, r):
            assert_within(a.cpu(), b, ulps=2, extra=SCENARIO_SCALE * Z_TOLERANCE)


def box_muller_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform pairs where Box-Muller's float32 arithmetic is hardest: ``u1`` at every one of the 4096
    values nearest 1 (``r`` -> 0), on both sides of the log's switch, geometric down to the floor 1e-7
    (``r`` = 5.68) and on a grid; each with ``u2`` on a grid of [0, 1) and at the quadrant edges."""
    from lit_zodp.zo.fused import LOG_SERIES_BELOW
    switch = 1.0 - LOG_SERIES_BELOW
    u1 = torch.cat([1.0 - torch.arange(1, 4097) / 2**24, switch + torch.arange(-2048, 2049) / 2**24,
                    torch.logspace(-7, -0.01, 3000), torch.linspace(0.0, 1.0 - 2**-24, 3001)]).float()
    u2 = torch.cat([torch.linspace(0.0, 1.0 - 2**-24, 61), torch.tensor([0.25, 0.5, 0.75, 0.5 - 2**-25])]).float()
    return u1.repeat_interleave(u2.numel()), u2.repeat(u1.numel())


def box_muller_float64(u1: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
    """The law's normals with exact functions: ``r`` of the floored ``u1``, the reference's float32 angle."""
    r = torch.sqrt(-2.0 * torch.log(torch.clamp(u1, min=1e-7).double()))
    th = (torch.tensor(philox.TWO_PI, dtype=torch.float32) * u2).double()
    return torch.cat([r * torch.cos(th), r * torch.sin(th)])


@pytest.mark.gpu
@pytest.mark.parametrize("fast_math", [True, False], ids=["fast_math", "software_math"])
def test_cuda_box_muller_within_its_documented_bound(fast_math):
    """:func:`_pair_to_normal` on the GPU against exact functions of the same uniforms, on a grid dense
    where ``lg2.approx``'s absolute error would show (``u1`` -> 1) and at the floor: the hardware functions
    within the docstring's 5.7e-6 (summed from CUDA's documented errors); libdevice's within 4.5e-6 (``r``
    within 4 ulps: log 1 ulp of ``r^2``, ``sqrt.approx`` 3, rounding; cosine or sine 2 ulps; the product's
    rounding: 4.3e-6 at ``r = 5.68``; ``sqrt.approx`` dominates both)."""
    pytest.importorskip("triton")
    u1, u2 = box_muller_grid()
    out = torch.empty(2 * u1.numel(), device="cuda")
    _box_muller_kernel[(triton.cdiv(u1.numel(), 1024),)](u1.cuda(), u2.cuda(), out, u1.numel(),
                                                          FAST_MATH=fast_math, BLOCK=1024)
    gap = (out.cpu().double() - box_muller_float64(u1, u2)).abs().max().item()
    assert gap <= (5.7e-6 if fast_math else 4.5e-6), gap


def bf16_rounding_cases() -> torch.Tensor:
    """float32 values whose bf16 rounding is delicate: exact ties (even and odd bf16 below), one bit
    either side of a tie, carries into the exponent and to infinity, subnormals, signed zeros and
    infinities, and random bits."""
    ties = torch.randint(0, 1 << 31, (4096,), generator=torch.Generator().manual_seed(0)) & ~0xFFFF | 0x8000
    bits = torch.cat([ties, ties + 1, ties - 1, ties | 0x7FFF, torch.arange(0, 1 << 17, 7),  # subnormals too
                      torch.tensor([0x7F7F8000, 0x7F7FFFFF, 0x7F7F7FFF, 0x3FFF8000, 0x3F808000, 0x0000_8000]),
                      torch.randint(0, 1 << 31, (1 << 16,), generator=torch.Generator().manual_seed(1))])
    values = torch.cat([bits, bits | (1 << 31)]).to(torch.int32).view(torch.float32)
    return torch.cat([values, torch.tensor([0.0, -0.0, math.inf, -math.inf])])


@pytest.mark.gpu
def test_cuda_fused_philox_is_tritons_bitwise():
    """Compiled, the fused kernel's widening-multiply Philox gives ``tl.rand4x``'s bits too."""
    pytest.importorskip("triton")
    offsets = probe_offsets().cuda()
    for seed in SEEDS:
        both = uniforms_of_both(seed, offsets)
        assert torch.equal(both[:4], both[4:]), seed


@pytest.mark.gpu
def test_cuda_hardware_bf16_rounding_equals_integer_rounding():
    """The compiled kernel rounds to bf16 with ``cvt.rn`` (one instruction), the interpreted one with
    integer arithmetic (what the reference and the bitwise tests check): the same bits as each other and
    as torch, ties to even, on every number; a NaN stays a NaN."""
    pytest.importorskip("triton")
    x = bf16_rounding_cases().cuda()
    results = {}
    for hw_round in (True, False):
        rounded, stored = bf16_roundings(x, hw_round)
        results[hw_round] = (rounded.view(torch.int32).cpu(), stored.view(torch.int16).cpu())
    number = ~x.isnan().cpu()
    expected = x.cpu().to(torch.bfloat16)  # torch's rounding too
    for rounded, stored in results.values():
        assert torch.equal(rounded[number], results[True][0][number])
        assert torch.equal(stored[number], expected.view(torch.int16)[number])
        assert bool(stored.view(torch.bfloat16)[~number].isnan().all())  # NaN payloads differ, NaN stays NaN


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_tiles_compute_the_same_bits(dtype):
    """The tiles bench_zo_gpu.py times (--tiles) beside the default: the same numbers, so that a faster
    tile can become the default without changing any run's directions."""
    pytest.importorskip("triton")
    default = scenario([p.cuda() for p in make_params(dtype)], backend="triton")
    for block, warps in [(1024, 8), (1024, 4), (512, 4)]:
        other = scenario([p.cuda() for p in make_params(dtype)], backend="triton", block=block, num_warps=warps)
        for a, b in zip(other, default):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (block, warps)


@pytest.mark.gpu
def test_cuda_perturb_restore_and_large_model_layout():
    pytest.importorskip("triton")
    params = [p.cuda() for p in make_params(torch.bfloat16, shapes=[(4096, 1027), (3,), (1 << 20,)])]
    before = [p.clone() for p in params]
    engine = FusedPerturbation(params, backend="triton", offsets=[0, 2**32 + 4, 2**34])
    engine.perturb_(derive(9), 1e-3)
    engine.perturb_(derive(9), -2e-3)
    engine.restore_()
    for p, b in zip(params, before):
        assert (p == b).double().mean().item() > 0.97
    torch.cuda.synchronize()


if __name__ == "__main__":  # the TRITON_INTERPRET=1 subprocess of the `interpreted` fixture
    torch.save(interpreted_runs(), sys.argv[1])

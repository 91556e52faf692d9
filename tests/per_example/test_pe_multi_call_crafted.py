"""Red-team review 63: a ``Linear`` or ``Embedding`` called several times (an RNN's hidden layer) is bounded in
"ghost" and "bookkeeping" from its calls' rows by the one-call rule (``PerExampleGradientEngine._bound_from_rows``).
The rule models the materialised per-example gradient's rounding as relative (``gamma_n``, converted operands within
``2^-7`` or ``2^-10``); a float32 ``bmm`` with bfloat16 operands (oneDNN on CPUs with AMX/AVX512-BF16, under
``fp32_precision = "bf16"`` or ``set_float32_matmul_precision("medium")``) flushes a subnormal operand to zero, an
absolute error the rule does not see. A record whose huge output gradient meets a subnormal input (``2^127 x 2^-127``)
cancelling another position released 30.9 C. Each example's bound is now at least the float64 norm of the
materialised rows it releases."""

import math

import pytest
import torch
from torch import nn

from lit_zodp.per_example import rounding, samplers
from lit_zodp.per_example.engine import PerExampleGradientEngine

#: The tests' rows are float32 (the per-example tests' default dtype is float64).
F32 = {"dtype": torch.float32}


class Repeated(nn.Module):
    """One ``Linear`` called once per ``k``: ``loss_i = sum_k v_{i,k} . lin(x_{i,k})``, so call ``k``'s rows are
    ``(x_k, v_k)`` (``x`` ``[B, K, T, d]``; ``v`` ``[B, K, T, d]``)."""

    def __init__(self, width, bias=False):
        super().__init__()
        self.lin = nn.Linear(width, width, bias=bias, dtype=torch.float32)

    def forward(self, xs, vs):
        return sum((self.lin(xs[:, k]) * vs[:, k]).flatten(1).sum(1) for k in range(xs.shape[1]))


def released_over_clip(model, benign, crafted, mode, divisor=16.0):
    """The structure checked on a benign batch of two (a fit's first step), then the batch ``[record, zero rows]``
    unchecked (as every later step of that structure): the record's released ``||share|| / C``, ``C`` its bound over
    ``divisor``."""
    engine = PerExampleGradientEngine(model, mode=mode, recheck_probability=0.0)
    engine.clipped_sum(benign, 1.0)
    clip = float(engine.clipped_sum(crafted, math.inf).norms[0]) / divisor
    released = engine.clipped_sum(crafted, clip).grads
    return float(torch.cat([g.double().reshape(-1) for g in released]).norm()) / clip


def flushing_record(calls, width=64, positions=2):
    """Call 0's first two positions: ``x = 1 + 2^-10`` with ``v = 1``, and ``x = 2^-127`` (a float32 subnormal) with
    ``v = -2^127``: ``G = 2^-10`` per element, ``S = 2`` per element (its other positions zero). The other calls add
    small terms."""
    xs, vs = torch.zeros(1, calls, positions, width, **F32), torch.zeros(1, calls, positions, width, **F32)
    xs[0, 0, 0], vs[0, 0, 0] = 1.0 + 2.0 ** -10, 1.0
    xs[0, 0, 1], vs[0, 0, 1] = 2.0 ** -127, -(2.0 ** 127)
    xs[0, 1:, 0], vs[0, 1:, 0] = 1e-3, 1e-3
    return xs, vs


def _bf16_operands(x):
    """float32 to bfloat16 operands as AVX512-BF16 converts them: denormals as zero, then to nearest."""
    if x.dtype != torch.float32:
        return x
    return torch.where(x.abs() < 2.0 ** -126, torch.zeros((), dtype=x.dtype), x).to(torch.bfloat16).float()


def _share(mode, calls, positions=2, device="cpu"):
    torch.manual_seed(0)
    xs, vs = flushing_record(calls, positions=positions)
    model = Repeated(xs.shape[-1]).to(device)
    g = torch.Generator().manual_seed(0)
    bx, bv = torch.randn(2, *xs.shape[1:], generator=g, **F32), torch.randn(2, *vs.shape[1:], generator=g, **F32)
    cx, cv = torch.cat([xs, torch.zeros_like(xs)]), torch.cat([vs, torch.zeros_like(vs)])
    bx, bv, cx, cv = (t.to(device) for t in (bx, bv, cx, cv))
    return released_over_clip(model, lambda: model(bx, bv), lambda: model(cx, cv), mode)


@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
@pytest.mark.parametrize("calls", [2, 8])
def test_a_flushed_subnormal_operand_in_a_repeated_layer_keeps_the_share_within_c(monkeypatch, mode, calls):
    """Emulated: the per-example ``bmm`` with bfloat16 operands, denormals flushed, and the setting saying "bf16".
    Before: 30.9 C released (the rule's bound 2.07, the materialised rows' norm 64)."""
    bmm = torch.bmm
    monkeypatch.setattr(samplers, "outer_grads",
                        lambda a, g: bmm(_bf16_operands(g).transpose(1, 2), _bf16_operands(a)))
    monkeypatch.setattr(rounding, "float32_matmul_setting", lambda device_type: "bf16")
    assert _share(mode, calls) <= 1.0


def _cpu_bf16_flushes():
    previous = torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        xs, vs = flushing_record(1)
        return float(torch.bmm(vs[:, 0].transpose(1, 2), xs[:, 0])[0, 0, 0]) != 2.0 ** -10
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = previous


@pytest.mark.skipif(not _cpu_bf16_flushes(), reason="this CPU's float32 bmm does not convert to bfloat16")
@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
def test_the_same_record_on_this_cpus_bf16_matmuls_keeps_the_share_within_c(mode):
    """The real oneDNN path (AMX here): 30.9 C before."""
    previous = torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        assert _share(mode, 2) <= 1.0
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = previous


#: Just over half an ulp of 1: each float32 addition to a running sum in [1, 2) rounds up by 2^-24.
ROUNDS_UP = 2.0 ** -24 * (1 + 2.0 ** -10)


@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_ladder_of_calls_each_rounding_the_running_sum_up_stays_within_c(mode, bias):
    """The strongest IEEE attack tried on the rule (review 63): one position per call, the calls' float32 sum
    (``_add_dense``, in call order) rounding up at every call, ``n u S`` in all, against the rule's
    ``(n + 2) u S``. Measured ``1 + 3.1e-7`` above the materialised norm at 2048 calls; here 512."""
    calls = 512
    xs, vs = torch.full((1, calls, 1, 4), ROUNDS_UP, **F32), torch.ones(1, calls, 1, 4, **F32)
    xs[0, 0] = 1.0
    if bias:
        xs, vs = vs.clone(), xs.clone()
    torch.manual_seed(0)
    model = Repeated(4, bias=bias)
    g = torch.Generator().manual_seed(0)
    bx, bv = torch.randn(2, calls, 1, 4, generator=g, **F32), torch.randn(2, calls, 1, 4, generator=g, **F32)
    cx, cv = torch.cat([xs, torch.zeros_like(xs)]), torch.cat([vs, torch.zeros_like(vs)])
    assert released_over_clip(model, lambda: model(bx, bv), lambda: model(cx, cv), mode) <= 1.0


def test_a_flushed_subnormal_operand_in_a_single_call_bookkeeping_sum_keeps_the_share_within_c(monkeypatch):
    """Found alongside: a layer called once keeps its gradient implicit in "bookkeeping", and its clipped sum is one
    float32 matmul over every example's rows (:func:`~.samplers.outer_summed`), whose bfloat16 operands (oneDNN,
    emulated here; on this machine's AMX from 64 rows and 64 features) dropped the subnormal operand's term: 30.9 C
    released (one call of 32 positions; "ghost" refuses the step: its second pass's row check). The sum is now formed
    in float64 where a row holds a subnormal (``engine._flush_flags``)."""
    matmul = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: matmul(_bf16_operands(a), _bf16_operands(b)))
    monkeypatch.setattr(rounding, "float32_matmul_setting", lambda device_type: "bf16")
    assert _share("bookkeeping", 1) <= 1.0


@pytest.mark.skipif(not _cpu_bf16_flushes(), reason="this CPU's float32 bmm does not convert to bfloat16")
def test_a_single_call_bookkeeping_sum_on_this_cpus_bf16_matmuls_keeps_the_share_within_c():
    """The real oneDNN path for the single-call sum (one call of 32 positions: the matmul over 64 rows of 64 features
    takes AMX): 30.9 C before, 0.03 C after."""
    previous = torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        assert _share("bookkeeping", 1, positions=32) <= 1.0
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = previous


def test_the_float64_sums_are_taken_only_where_a_scaled_operand_may_be_subnormal(monkeypatch):
    """``_flush_flags``: nothing under "ieee"; under "bf16", a part whose input holds a subnormal, or whose output
    gradient the clip factor scales below the smallest normal (``1e-30 x 1e-10``), and no other."""
    from lit_zodp.per_example import engine as engine_module
    from lit_zodp.per_example.samplers import sampler_for

    layer = nn.Linear(3, 2, dtype=torch.float32)

    def part(a, g):
        return engine_module._Part(layer, sampler_for(layer), a, g, {"weight": 0})

    normal = part(torch.ones(2, 4, 3, **F32), torch.full((2, 4, 2), 1e-30, **F32))
    subnormal_input = part(torch.full((2, 4, 3), 2.0 ** -127, **F32), torch.ones(2, 4, 2, **F32))
    factors = torch.tensor([1.0, 1e-10], dtype=torch.float64)
    parts = [normal, subnormal_input]
    assert engine_module._flush_flags(parts, factors) == [False, False]  # the default setting here: "ieee"
    monkeypatch.setattr(rounding, "float32_matmul_setting", lambda device_type: "bf16")
    assert engine_module._flush_flags(parts, None) == [False, True]
    assert engine_module._flush_flags(parts, factors) == [True, True]
    assert engine_module._flush_flags(parts, torch.tensor([1.0, 1e-3], dtype=torch.float64)) == [False, True]
    no_factor = torch.tensor([0.0, 1e-3], dtype=torch.float64)  # (factor 0: exact zeros, a non-finite example's)
    assert engine_module._flush_flags(parts, no_factor) == [False, True]

"""The alignment check compares rule layers through what their rules credit (stop 65, :mod:`.alignment`).

A rule layer's calls are compared through ``v_k^T G_i u_k``, the per-example gradients its rule forms projected on
secret random directions, summed over every call crediting the parameter, with the tolerance relative to the norm of
that sum. Tests: each rule's projections are those of its materialised per-example gradients; two crafted records
that pass a row-by-row comparison (a dead position, calls that cancel) release at most C; an LSTM's early steps,
whose rows are float32 subnormals at 300 tokens, keep the layer rules with the loop reference's sums.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lit_zodp.backbones import LSTMClassifier
from lit_zodp.errors import PrivacyConfigError
from lit_zodp.per_example import PerExampleGradientEngine, samplers
from lit_zodp.per_example import engine as engine_module
from lit_zodp.per_example.samplers import projected_rows, sampler_for
from tests.per_example.helpers import assert_rel_close, flat_clipped_sum, loop_reference
from tests.per_example.test_pe_alignment_float_range_attacks import RECORD, _sensitivity, dead_position_batch

MODES = ["hooks", "ghost", "bookkeeping"]
K = 5


def _directions(param, dtype):
    """Fixed Gaussian directions per parameter shape (the check draws them secretly: :class:`.alignment._Credited`)."""
    g = torch.Generator().manual_seed(param.numel())
    first = param.shape[0] if param.dim() >= 2 else param.numel()
    v = torch.randn(first, K, generator=g, dtype=torch.float64).to(dtype)
    u = torch.randn(param.numel() // first, K, generator=g, dtype=torch.float64).to(dtype) if param.dim() >= 2 else None
    return v, u


def _by_materialising(layer, a, g):
    """``v_k^T G_i u_k`` from the rule's ``grads``, in float64 without scaling: the reference."""
    out = {}
    for name, grads in sampler_for(layer).grads(layer, a, g).items():
        v, u = _directions(getattr(layer, name), torch.float64)
        rows = grads.double().reshape(len(grads), v.shape[0], -1)
        out[name] = rows[..., 0] @ v if u is None else torch.einsum("bij,ik,jk->bk", rows, v, u)
    return out


def _layer_case(case):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if case == "linear":
        layer = nn.Linear(6, 4).double()
        a = torch.randn(3, 7, 6, generator=g, dtype=torch.float64)
    elif case == "linear_no_bias_folded":
        layer = nn.Linear(6, 4, bias=False).double()
        a = torch.randn(3, 2, 5, 6, generator=g, dtype=torch.float64)
    elif case == "embedding_padding":
        layer = nn.Embedding(11, 4, padding_idx=0).double()
        a = torch.randint(0, 11, (3, 9), generator=g)
        a[:, -3:] = 0
        a[0, 0] = a[0, 1] = 5  # a repeated token: its rows add up in the example's gradient
    elif case == "layer_norm":
        layer = nn.LayerNorm(6).double()
        a = torch.randn(3, 7, 6, generator=g, dtype=torch.float64)
    else:
        layer = nn.Conv2d(2, 3, 3, padding=1).double()
        a = torch.randn(3, 2, 5, 5, generator=g, dtype=torch.float64)
    out = layer(a)
    return layer, a, torch.randn(out.shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("case", ["linear", "linear_no_bias_folded", "embedding_padding", "layer_norm", "conv"])
def test_each_rules_projections_are_those_of_its_per_example_gradients(monkeypatch, case):
    """Linear and Embedding project from their rows (no ``[B, out, in]``, no ``[B, V, D]``), LayerNorm and Conv2d by
    materialising a few rows at a time (here one: the chunking is exercised): every way equals the float64 reference
    from the rule's own ``grads``, the padding row and a repeated token included."""
    layer, a, g = _layer_case(case)
    monkeypatch.setattr(samplers, "MATERIALISED_ELEMENTS", 1)
    got = sampler_for(layer).project(layer, a, g, _directions)
    want = _by_materialising(layer, a, g)
    assert set(got) == set(want) == {n for n, p in layer.named_parameters() if p.requires_grad}
    for name in want:
        assert got[name].dtype == torch.float64 and got[name].shape == (3, K)
        assert_rel_close(got[name], want[name], rtol=1e-10, name=name)


@pytest.mark.parametrize("scale", [1e-30, 1e25])
def test_float32_rows_far_from_one_are_projected_without_under_or_overflow(scale):
    """Float32 rows at ``1e-30`` (products of ``1e-60``: 0 in float32) or ``1e25`` (``inf``) project as the float64
    reference does: rows are projected in float64 (:func:`.samplers.wide_positions`, :func:`.samplers.scaled_rows`)."""
    layer, a, g = _layer_case("linear")
    layer = layer.float()
    got = sampler_for(layer).project(layer, (a * scale).float(), (g * scale).float(), _directions)["weight"]
    want = _by_materialising(layer.double(), (a.float() * scale).double(), (g.float() * scale).double())["weight"]
    assert_rel_close(got, want, rtol=1e-5, name="weight")
    grads = torch.randn(2, 4, 3, dtype=torch.float32) * scale
    v, u = _directions(torch.empty(4, 3), torch.float64)
    assert_rel_close(projected_rows(grads, v, u), torch.einsum("bij,ik,jk->bk", grads.double(), v.double(), u.double()),
                     rtol=1e-5, name="rows")


def _row_by_row(monkeypatch):
    """The comparison before stop 65: every call's output rows, each against its whole row's norm."""
    original = engine_module.misaligned_calls
    monkeypatch.setattr(engine_module, "misaligned_calls",
                        lambda tape, losses, candidates, **kwargs: original(tape, losses, candidates))


def _no_gradient_halves(monkeypatch):
    """The gradient halves patched off, to measure the alignment check alone (as review 78 did)."""
    monkeypatch.setattr(engine_module, "refuse_gradient_mixing", lambda *args, **kwargs: None)


def test_the_dead_position_record_needed_the_new_comparison(monkeypatch):
    """Control for review 78's finding 4 (``test_a_dead_position_does_not_widen_its_rows_tolerance``, every mode):
    compared row by row, the record's step is credited and releases more than 2 C on one removal."""
    _no_gradient_halves(monkeypatch)
    _row_by_row(monkeypatch)
    model, x, y = dead_position_batch()
    assert _sensitivity(model, x, y, "hooks", 1e-3) > 2


class CancellingCalls(nn.Module):
    """A zero-initialised bias-free layer called on ``x`` and on ``-x``, its two outputs added (0 whatever ``x``: its
    calls' parts of an example's gradient cancel), the first one's output mixed across the batch BY MISTAKE by
    ``1e-5`` (within every row's tolerance, ``2 sqrt(eps)``), then a head. The layer's per-example gradient is then
    ``1e-5 x_r g_{r+1}^T``: the next example's part alone. In float32."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(4, 8, bias=False), nn.Linear(8, 2)
        nn.init.zeros_(self.lin.weight)

    def forward(self, x):  # [B, 4]
        first = self.lin(x)
        return self.head(first + 1e-5 * first.roll(1, 0) + self.lin(-x))


def _cancelling_batch():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, generator=g, dtype=torch.float32)
    x[RECORD] = 1e6 * torch.tensor([1.0, -1.0, 1.0, 1.0])
    return CancellingCalls().float(), x, torch.tensor([0, 1, 0, 1, 0, 1])  # (the victim's and the next one's differ)


@pytest.mark.parametrize("mode", MODES)
def test_calls_whose_parts_cancel_do_not_credit_a_neighbours_part(monkeypatch, mode):
    """Each of the layer's calls agrees row by row (the mix is ``1e-5`` of a row), so compared call by call the
    record, features ``1e6``, is credited ``10 g_v``: its batch-mate's gradient (the control below: removing the victim
    turns the record's clipped gradient into the next example's, of the other label). Compared through
    what is credited, the layer's two calls are one sum per example, which is the neighbour's part alone: ``lin``
    goes to the fallback and the step is refused, or releases at most C."""
    _no_gradient_halves(monkeypatch)
    model, x, y = _cancelling_batch()
    try:
        assert _sensitivity(model, x, y, mode, 1e-3) <= 1 + 1e-6
    except PrivacyConfigError:
        pass  # refused: safe


def test_the_cancelling_calls_needed_the_new_comparison(monkeypatch):
    _no_gradient_halves(monkeypatch)
    _row_by_row(monkeypatch)
    model, x, y = _cancelling_batch()
    assert _sensitivity(model, x, y, "hooks", 1e-3) > 1.5


def _long_reviews(tokens, batch=4):
    torch.manual_seed(0)
    model = LSTMClassifier(vocab_size=40, embedding_dim=6, hidden_size=5, num_layers=2).float()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 40, (batch, tokens), generator=g)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    mask[2, tokens // 2:] = 0
    return model, ids * mask, mask, torch.randint(0, 2, (batch,), generator=g)


@pytest.mark.parametrize("mode", MODES)
def test_an_lstms_subnormal_early_steps_keep_the_layer_rules(mode):
    """At 300 tokens the early steps' output gradients of the hidden-to-gates layers are float32 subnormals, which
    fail a row-by-row comparison by their own rounding: both hidden weights went to the torch.func fallback (PAZO's
    IMDB model at 290 tokens, stop 64). Summed over the layer's 300 calls they are a negligible part of what is
    credited: the rules are kept, and the clipped sum is the one-example-at-a-time reference's."""
    model, ids, mask, y = _long_reviews(300)
    engine = PerExampleGradientEngine(model, mode=mode)
    result = engine.clipped_sum(_review_losses(model, ids, mask, y), 0.5)
    assert engine.last_recomputed == {}
    want = loop_reference(model, lambda i, m, t: F.cross_entropy(model({"input_ids": i, "attention_mask": m}), t),
                          ids, mask, y)
    sums, norms = flat_clipped_sum(want, engine.names, 0.5)
    assert_rel_close(result.norms.double(), norms.double(), rtol=1e-4, name="norms")
    for name, got in zip(engine.names, result.grads):
        assert_rel_close(got.double(), sums[name].double(), rtol=1e-4, name=name)


def _review_losses(model, ids, mask, y):
    return lambda: F.cross_entropy(model({"input_ids": ids, "attention_mask": mask}), y, reduction="none")


def test_the_lstms_early_steps_fail_row_by_row(monkeypatch):
    """Control: compared row by row, the same batch sends both hidden weights to the fallback."""
    _row_by_row(monkeypatch)
    model, ids, mask, y = _long_reviews(300)
    engine = PerExampleGradientEngine(model, mode="bookkeeping")
    engine.clipped_sum(_review_losses(model, ids, mask, y), 0.5)
    assert set(engine.last_recomputed) == {"layers.0.hidden.weight", "layers.1.hidden.weight"}


class KeyBias(nn.Module):
    """One attention head whose key projection has a bias: the softmax is blind to it (it adds ``q . b`` to every
    score of a query), so each example's exact gradient of ``k.bias`` is 0 and the computed one is rounding noise."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.out = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(8, 2)

    def forward(self, x):  # [B, T, 6]
        scores = self.q(x) @ self.k(x).transpose(1, 2) / 8 ** 0.5
        return self.out((scores.softmax(-1) @ self.v(x)).mean(1))


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_whose_exact_gradient_is_zero_is_compared_with_its_layer(mode):
    """``k.bias``'s per-example gradients are rounding noise, which is not ``w_r`` times itself in the weighted pass:
    compared alone (41aae33), it failed at every one of the 16 rows, past the rechecks' cap, and sent the key layer to
    the fallback. Compared with ``k.weight``, as one layer's gradient, its noise is within tolerance: the rules are
    kept, and the clipped sum is the loop reference's."""
    torch.manual_seed(0)
    model = KeyBias().float()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 5, 6, generator=g, dtype=torch.float32), torch.randint(0, 2, (16,), generator=g)
    engine = PerExampleGradientEngine(model, mode=mode)
    result = engine.clipped_sum(lambda: F.cross_entropy(model(x), y, reduction="none"), 0.1)
    assert engine.last_recomputed == {}
    want = loop_reference(model, lambda xi, yi: F.cross_entropy(model(xi), yi), x, y)
    sums, _ = flat_clipped_sum(want, engine.names, 0.1)
    got = torch.cat([g.double().flatten() for g in result.grads])  # (k.bias's sum is noise: compared in the whole)
    assert_rel_close(got, torch.cat([sums[name].double().flatten() for name in engine.names]), rtol=1e-5, name="sum")


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_projected_weights_directions_project_what_is_credited(side):
    """DP-GRAPE credits ``P^T G_i`` (left) or ``G_i P`` (right): the check's directions for such a weight are mapped
    through ``P`` (``v = P v'``, ``u = P u'``), so its projections of the unprojected rows are ``v'^T R_i u'`` of the
    projected gradients ``R_i`` (the float64 reference from the rule's materialised gradients)."""
    from lit_zodp.per_example.alignment import _Credited
    from lit_zodp.per_example.tape import Tape
    from lit_zodp.per_example.transforms import Projection

    layer, a, g = _layer_case("linear")
    matrix = torch.randn(4 if side == "left" else 6, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    projection = Projection(matrix, side)
    credited = _Credited(Tape(layer, [], []), [], seed=3, projections={id(layer.weight): projection})
    credited._index[id(layer.weight)] = 0  # (a parameter of a candidate call gets its index in __init__)
    v, u = credited.directions(layer.weight, torch.float64)
    got = sampler_for(layer).project(layer, a, g, lambda param, dtype: (v, u))["weight"]
    projected = projection.of_gradients(sampler_for(layer).grads(layer, a, g)["weight"])  # [B, r, in] or [B, out, r]
    generator = torch.Generator(device="cpu")
    generator.manual_seed(3)
    rows, columns = projected.shape[1:]
    v_small = torch.randn(rows, 16, generator=generator, dtype=torch.float64)
    u_small = torch.randn(columns, 16, generator=generator, dtype=torch.float64)
    assert_rel_close(got, torch.einsum("bij,ik,jk->bk", projected, v_small, u_small), rtol=1e-10, name=side)


@pytest.mark.parametrize("mode", MODES)
def test_a_dead_position_under_a_projection_of_its_own_layer_is_refused(monkeypatch, mode):
    """Review 78's dead-position record with DP-GRAPE projecting ``lin.weight`` itself (left, ``r = 2``): compared
    through the projection it is credited, the record's step is refused (every mode); row by row (the control) it
    released more than 2 C."""
    from lit_zodp.per_example.transforms import Projection, Projections

    def sensitivity():
        model, x, y = dead_position_batch()
        matrix = torch.randn(8, 2, generator=torch.Generator().manual_seed(6), dtype=torch.float32)
        return _sensitivity(model, x, y, mode, 1e-3, transform=lambda: Projections({"lin.weight": Projection(matrix)}))

    _no_gradient_halves(monkeypatch)
    with pytest.raises(PrivacyConfigError):
        sensitivity()
    _row_by_row(monkeypatch)
    assert sensitivity() > 1.5

"""The transform slot: projections formed from projected rows (DP-GRAPE Alg. 1 lines 4-6; GEP)
equal the projection of the reference per-example gradients in every mode, never form
``B x out x in``, and generic rewrites (DOPE-SGD-style recentring) act on materialised gradients."""

import pytest
import torch
from torch import nn

from lit_zodp.errors import PrivacyConfigError
from lit_zodp.per_example import PerExampleGradientEngine
from lit_zodp.per_example.transforms import GradientTransform, Projection, Projections
from tests.per_example.helpers import LargestTensor, assert_rel_close, ce, flat_clipped_sum, reference


class _SeqNet(nn.Module):
    """Tokens ``[B, T, d]`` through two Linear layers (T positions per example), mean-pooled."""

    def __init__(self, d_in=12, d_hidden=16, classes=3):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, d_hidden), nn.Linear(d_hidden, classes)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))).mean(1)


def _setup(seed=0, batch=5, positions=4):
    torch.manual_seed(seed)
    model = _SeqNet().double()
    x, y = torch.randn(batch, positions, 12, dtype=torch.float64), torch.randint(0, 3, (batch,))
    return model, x, y


def _projections(left_rank=3, right_rank=5):
    torch.manual_seed(7)
    return {"fc1.weight": Projection(torch.randn(16, left_rank, dtype=torch.float64) / left_rank ** 0.5, "left"),
            "fc2.weight": Projection(torch.randn(16, right_rank, dtype=torch.float64), "right")}


def _projected_reference(model, x, y, projections):
    expected = reference(model, lambda xi, yi: ce(model(xi), yi).sum(), x, y)
    return {name: projections[name].of_gradients(g) if name in projections else g for name, g in expected.items()}


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bookkeeping", "vmap"])
def test_projection_equals_projected_reference_in_every_mode(mode):
    model, x, y = _setup()
    projections, clip = _projections(), 0.3
    engine = PerExampleGradientEngine(model, mode=mode, transform=Projections(projections))
    result = engine.clipped_sum(lambda: ce(model(x), y), clip)
    expected = _projected_reference(model, x, y, projections)
    sums, norms = flat_clipped_sum(expected, engine.names, clip)
    shapes = dict(zip(engine.names, (g.shape for g in result.grads)))
    assert shapes["fc1.weight"] == (3, 12) and shapes["fc2.weight"] == (3, 5) and shapes["fc1.bias"] == (16,)
    for name, got in zip(engine.names, result.grads):
        assert_rel_close(got, sums[name], name=name)
    assert_rel_close(result.norms, norms)
    assert (result.norms < 1e9).all() and not engine.last_recomputed.get("fc1.weight")


def test_projected_per_example_gradients_equal_the_reference():
    model, x, y = _setup(seed=1)
    projections = _projections()
    engine = PerExampleGradientEngine(model, transform=Projections(projections))
    got = dict(zip(engine.names, engine.per_example_gradients(lambda: ce(model(x), y))))
    for name, expected in _projected_reference(model, x, y, projections).items():
        assert_rel_close(got[name], expected, name=name)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bookkeeping"])
def test_projection_never_forms_batch_times_out_times_in(mode):
    """A wide Linear (256 x 256) at B = 8, T = 2: no tensor the engine forms is larger than the
    weight itself (its batch gradient), while without the projection "hooks" forms ``B x out x in``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.Tanh(), nn.Linear(256, 2)).double()
    x, y = torch.randn(8, 2, 256, dtype=torch.float64), torch.randint(0, 2, (8,))
    model[0].weight.requires_grad_(True)

    def loss_fn():
        return ce(model(x).mean(1), y)

    projection = Projections({"0.weight": Projection(torch.randn(256, 4, dtype=torch.float64), "right")})
    engine = PerExampleGradientEngine(model, mode=mode, transform=projection)
    with LargestTensor() as probe:
        engine.clipped_sum(loss_fn, 1.0)
    assert probe.largest <= 256 * 256, probe.largest
    if mode == "hooks":
        with LargestTensor() as probe:
            PerExampleGradientEngine(model, mode=mode).clipped_sum(loss_fn, 1.0)
        assert probe.largest >= 8 * 256 * 256


def test_projection_of_a_layer_without_rows_is_applied_to_its_materialised_gradient():
    """An Embedding weight ``[V, D]`` has no outer-product rows: it is projected after forming."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 6), nn.Flatten(), nn.Linear(18, 2)).double()
    x, y = torch.randint(0, 10, (4, 3)), torch.randint(0, 2, (4,))
    projections = {"0.weight": Projection(torch.randn(6, 2, dtype=torch.float64), "right")}
    engine = PerExampleGradientEngine(model, transform=Projections(projections))
    result = engine.clipped_sum(lambda: ce(model(x), y), 0.5)
    expected = reference(model, lambda xi, yi: ce(model(xi), yi).sum(), x, y)
    expected["0.weight"] = projections["0.weight"].of_gradients(expected["0.weight"])
    sums, _ = flat_clipped_sum(expected, engine.names, 0.5)
    for name, got in zip(engine.names, result.grads):
        assert_rel_close(got, sums[name], name=name)


def test_projection_changes_between_batches():
    """``projection`` is asked once per batch, so an algorithm can resample its subspace (DP-GRAPE's F)."""
    model, x, y = _setup(seed=2)

    class Resampled(GradientTransform):
        def __init__(self):
            self.calls = 0

        def projection(self, name, param):
            if name != "fc1.weight":
                return None
            self.calls += 1
            return Projection(torch.full((16, 1), float(self.calls), dtype=torch.float64))

    transform = Resampled()
    engine = PerExampleGradientEngine(model, transform=transform)
    first = engine.clipped_sum(lambda: ce(model(x), y), float("inf")).grads[0]
    second = engine.clipped_sum(lambda: ce(model(x), y), float("inf")).grads[0]
    torch.testing.assert_close(second, 2 * first)


def test_bad_projections_name_the_parameter():
    model, x, y = _setup()
    wrong_rows = Projections({"fc1.weight": Projection(torch.randn(5, 2, dtype=torch.float64))})
    with pytest.raises(PrivacyConfigError, match=r"`fc1\.weight` \(16, 12\) needs a matrix with 16 rows"):
        PerExampleGradientEngine(model, transform=wrong_rows).clipped_sum(lambda: ce(model(x), y), 1.0)
    vector = Projections({"fc1.bias": Projection(torch.randn(16, 2, dtype=torch.float64))})
    with pytest.raises(PrivacyConfigError, match=r"2-D parameter, but `fc1\.bias`"):
        PerExampleGradientEngine(model, transform=vector).clipped_sum(lambda: ce(model(x), y), 1.0)
    with pytest.raises(PrivacyConfigError, match="side"):
        Projection(torch.randn(3, 2), "middle")


class _Recentre(GradientTransform):
    """DOPE-SGD-style recentring ``g_i - c`` of materialised per-example gradients."""

    def __init__(self, centres):
        self.centres = centres

    def apply(self, name, param, grads):
        return grads - self.centres[name]


def test_generic_rewrite_in_hooks_and_vmap_and_refused_in_ghost():
    model, x, y = _setup(seed=3)
    expected = reference(model, lambda xi, yi: ce(model(xi), yi).sum(), x, y)
    centres = {name: g.mean(0) for name, g in expected.items()}
    recentred = {name: g - centres[name] for name, g in expected.items()}
    for mode in ("hooks", "vmap"):
        engine = PerExampleGradientEngine(model, mode=mode, transform=_Recentre(centres))
        result = engine.clipped_sum(lambda: ce(model(x), y), 0.2)
        sums, norms = flat_clipped_sum(recentred, engine.names, 0.2)
        for name, got in zip(engine.names, result.grads):
            assert_rel_close(got, sums[name], name=f"{mode}:{name}")
    with pytest.raises(PrivacyConfigError, match="mode='hooks' or 'vmap'"):
        PerExampleGradientEngine(model, mode="ghost", transform=_Recentre(centres))


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_projection_of_float32_gradients_stays_float32_under_bf16_autocast(side):
    """DP-GaLore projects its released gradient, and projected Adam lifts its step, inside the training step, where
    ``bf16-mixed`` autocast made both products bfloat16 (the autocast audit of 2026-11-30)."""
    g = torch.Generator().manual_seed(0)
    matrix = torch.linalg.qr(torch.randn(8 if side == "left" else 6, 3, generator=g, dtype=torch.float32)).Q
    projection, gradient = Projection(matrix, side), torch.randn(8, 6, generator=g, dtype=torch.float32)
    expected = projection.of_gradients(gradient)
    lifted = projection.back(expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(projection.of_gradients(gradient), expected)
        assert torch.equal(projection.back(expected), lifted)

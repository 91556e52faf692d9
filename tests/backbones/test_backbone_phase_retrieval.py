"""PhaseRetrievalLoss (robust phase retrieval, E2 of the reading notes): losses, Lipschitzness, the planted signal,
the per-example rule, the evaluation metrics, the one-line errors and short private fits."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.func import functional_call, grad, vmap

from datamodules import PhaseRetrievalDataModule
from lit_zodp.algorithms import DPSGD, DPZero, MeZO
from lit_zodp.backbones import PhaseRetrievalLoss
from lit_zodp.backbones.phase_retrieval import ball_points, min_norm_in_hull, planted_signal, unit_rows
from lit_zodp.errors import ConfigError
from lit_zodp.per_example import PerExampleGradientEngine
from tests.conftest import quiet_trainer


def rows(n, d, seed=0, signal_seed=0, noise=0.0):
    """``[a_i, b_i]`` with unit ``a_i`` and ``b_i = |<a_i, x*>|`` (plus ``noise * N(0, 1)``)."""
    generator = torch.Generator().manual_seed(seed)
    a = unit_rows(n, d, generator)
    b = (a @ planted_signal(d, signal_seed)).abs() + noise * torch.randn(n, generator=generator, dtype=torch.float64)
    return torch.cat([a, b[:, None]], dim=1)


def moved(model, seed=1):
    with torch.no_grad():
        model.x.copy_(torch.randn(model.dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return model


def zeros(n):
    return torch.zeros(n, dtype=torch.long)


def test_losses_are_the_formula_per_row():
    model = moved(PhaseRetrievalLoss(7))
    batch = rows(50, 7, noise=0.3)
    a, b, x = batch[:, :7], batch[:, 7], model.x.detach()
    expected = torch.tensor([abs(abs(float(a[i] @ x)) - float(b[i])) for i in range(50)], dtype=torch.float64)
    for grad_enabled in (False, True):
        with torch.set_grad_enabled(grad_enabled):
            losses = model.per_example_loss(batch, zeros(50))
        assert losses.shape == (50,) and losses.dtype == torch.float64
        torch.testing.assert_close(losses.detach(), expected, rtol=1e-13, atol=1e-13)
    assert model.predict(batch).shape == (50, 1)
    assert model(batch[:0]).shape == (0,)


def test_each_loss_is_1_lipschitz_on_unit_rows():
    model = PhaseRetrievalLoss(10)
    batch = rows(40, 10, noise=0.5)
    generator = torch.Generator().manual_seed(5)
    for _ in range(50):
        x, y = (torch.randn(10, generator=generator, dtype=torch.float64) for _ in range(2))
        with torch.no_grad():
            model.x.copy_(x)
            fx = model(batch)
            model.x.copy_(y)
            fy = model(batch)
        assert ((fx - fy).abs() <= (x - y).norm() + 1e-12).all()


def test_the_planted_signal_is_a_seeded_unit_vector_and_both_signs_are_minimisers():
    d = 12
    signal = planted_signal(d, 3)
    assert signal.shape == (d,) and signal.dtype == torch.float64
    assert float(signal.norm()) == pytest.approx(1.0, abs=1e-14)
    assert torch.equal(signal, planted_signal(d, 3)) and not torch.equal(signal, planted_signal(d, 4))
    model = PhaseRetrievalLoss(d, signal_seed=3)
    assert torch.equal(model.signal, signal)
    assert not torch.allclose(model.x.detach(), signal)  # (the init stream is not the signal's, equal seeds alike)
    batch = rows(30, d, signal_seed=3)
    for sign in (1.0, -1.0):
        with torch.no_grad():
            model.x.copy_(sign * signal)
            assert float(model(batch).abs().max()) < 1e-14
            assert float(model.distance()) < 1e-14
    with torch.no_grad():
        model.x.copy_(signal + 0.5 * torch.ones(d, dtype=torch.float64) / d ** 0.5)
    assert float(model.distance()) == pytest.approx(0.5, rel=1e-12)


def test_the_initial_points():
    model = PhaseRetrievalLoss(9, init_norm=2.5, init_seed=7)
    assert float(model.x.detach().norm()) == pytest.approx(2.5, rel=1e-12) and model.x.dtype == torch.float64
    assert torch.equal(model.x, PhaseRetrievalLoss(9, init_norm=2.5, init_seed=7).x)
    assert not torch.equal(model.x, PhaseRetrievalLoss(9, init_norm=2.5, init_seed=8).x)
    origin = PhaseRetrievalLoss(9, init="zeros")
    assert not origin.x.any()
    # f is even in x: at x_0 = 0 every central difference is exactly 0, and so is every subgradient
    batch, u = rows(20, 9, noise=0.1), torch.randn(9, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        origin.x.copy_(1e-3 * u)
        ahead = origin(batch)
        origin.x.copy_(-1e-3 * u)
        assert torch.equal(ahead, origin(batch))
        origin.x.zero_()
    assert not origin.gradient(batch).any()
    single = PhaseRetrievalLoss(9, dtype="float32")
    assert single.x.dtype == single.signal.dtype == torch.float32


def per_example_autograd(model, batch):
    params = {"x": model.x.detach()}

    def loss_of_row(p, row):
        return functional_call(model, p, (row[None],))[0]

    return vmap(grad(loss_of_row), in_dims=(None, 0))(params, batch)["x"]


def away_from_kinks(model, batch, margin=1e-3):
    inner = batch[:, :-1] @ model.x.detach()
    return (inner.abs() > margin) & ((inner.abs() - batch[:, -1]).abs() > margin)


def test_the_exact_subgradients_equal_autograd_away_from_the_kinks():
    model = moved(PhaseRetrievalLoss(8))
    batch = rows(60, 8, noise=0.2)
    batch = batch[away_from_kinks(model, batch)]
    a, b, x = batch[:, :8], batch[:, 8], model.x.detach()
    exact = ((a @ x).sign() * ((a @ x).abs() - b).sign())[:, None] * a
    torch.testing.assert_close(per_example_autograd(model, batch), exact, rtol=1e-12, atol=1e-14)
    model(batch).mean().backward()
    torch.testing.assert_close(model.x.grad, exact.mean(0), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(model.gradient(batch), exact.mean(0), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bookkeeping", "vmap"])
def test_per_example_rule_gives_the_clipped_sum_of_the_autograd_per_example_gradients(mode):
    model = moved(PhaseRetrievalLoss(6), seed=2)
    batch = rows(40, 6, noise=0.2)
    batch = batch[away_from_kinks(model, batch)]
    per_example = per_example_autograd(model, batch)
    batch[:5, :6] *= 3.0  # (rows of norm 3: the clip binds)
    per_example[:5] *= 3.0
    clip = 2.0
    factors = (clip / per_example.norm(dim=1)).clamp(max=1)
    engine = PerExampleGradientEngine(model, mode=mode)
    result = engine.clipped_sum(lambda: model(batch), clip)
    torch.testing.assert_close(result.grads[0], (factors[:, None] * per_example).sum(0), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(result.norms.double(), per_example.norm(dim=1), rtol=1e-6, atol=1e-8)


def test_the_registered_rules_against_autograd():
    from lit_zodp.per_example.samplers import sampler_for

    model = moved(PhaseRetrievalLoss(5), seed=3)
    batch = rows(30, 5, noise=0.2)
    batch = batch[away_from_kinks(model, batch)]
    g = torch.randn(len(batch), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected = g[:, None] * per_example_autograd(model, batch)
    sampler = sampler_for(model)
    torch.testing.assert_close(sampler.grads(model, batch, g)["x"], expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(sampler.norms(model, batch, g)["x"], expected.norm(dim=1) ** 2, rtol=1e-12,
                               atol=1e-14)
    torch.testing.assert_close(sampler.summed(model, batch, g)["x"], expected.sum(0), rtol=1e-12, atol=1e-14)


def test_test_logs_the_loss_the_distance_and_the_subgradient_norm_over_the_whole_set():
    data = PhaseRetrievalDataModule(dim=5, n_train=64, n_test=50, eval_batch_size=16, signal_seed=2)
    model = moved(PhaseRetrievalLoss(5, signal_seed=2), seed=4)
    module = MeZO(model, lr=1e-3, lam=1e-4)
    data.setup()
    test_rows = data.test_dataset.inputs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (metrics,) = quiet_trainer(max_steps=1).test(module, datamodule=data, verbose=False)
    assert set(metrics) == {"test_loss", "test_distance", "test_grad_norm", "test_goldstein"}
    x, signal = model.x.detach(), planted_signal(5, 2)
    assert metrics["test_distance"] == pytest.approx(float(min((x - signal).norm(), (x + signal).norm())), rel=1e-6)
    assert metrics["test_grad_norm"] == pytest.approx(float(model.gradient(test_rows).norm()), rel=1e-6)
    with torch.no_grad():
        assert metrics["test_loss"] == pytest.approx(float(model(test_rows).mean()), rel=1e-12)


@pytest.mark.parametrize("cls,kwargs", [(DPZero, dict(lam=1e-3)), (DPSGD, {})])
@pytest.mark.parametrize("sampling", ["poisson", "single_pass"])
def test_a_private_fit_runs_a_few_steps(cls, kwargs, sampling):
    data = PhaseRetrievalDataModule(dim=6, n_train=300, n_test=50, batch_size=20, sampling=sampling,
                                    outlier_fraction=0.1)
    model = PhaseRetrievalLoss(6)
    start = model.x.detach().clone()
    neighbours = {"neighbours": "replace_one"} if sampling == "single_pass" else {}  # (single pass: replace-one)
    module = cls(model, lr=0.1, clip=1.0, noise_multiplier=1.0, **neighbours, **kwargs)
    trainer = quiet_trainer(max_steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
        (metrics,) = trainer.test(module, datamodule=data, verbose=False)
    assert trainer.global_step == 3 and model.x.dtype == torch.float64
    assert not torch.equal(model.x.detach(), start)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


@pytest.mark.parametrize("kwargs,message", [
    (dict(dim=0), r"Expected the backbone's `dim` to be a positive int, but got 0"),
    (dict(dim=5, init="ones"), r"Expected the backbone's `init` in \['random', 'zeros'\], but got 'ones'"),
    (dict(dim=5, init_norm=0.0), r"Expected the backbone's `init_norm` to be a positive finite float, but got 0.0"),
    (dict(dim=5, signal_seed=-1), r"Expected the backbone's `signal_seed` to be an int >= 0, but got -1"),
    (dict(dim=5, init_seed=1.5), r"Expected the backbone's `init_seed` to be an int >= 0, but got 1.5"),
    (dict(dim=5, dtype="float16"), r"Expected the backbone's `dtype` in \['float64', 'float32'\], but got 'float16'"),
])
def test_bad_options_are_one_line_errors(kwargs, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        PhaseRetrievalLoss(**kwargs)


def test_a_dimension_other_than_the_datas_is_refused_at_setup():
    data = PhaseRetrievalDataModule(dim=6, n_train=100, n_test=10)
    with pytest.raises(ConfigError, match=r"^Model/data mismatch: the backbone PhaseRetrievalLoss has `dim` 5 \(rows "
                                          r"\[a, b\] of 6 values\), but the data's rows have shape \(7,\): set the "
                                          r"same `dim` on both$"):
        quiet_trainer(max_steps=1).fit(MeZO(PhaseRetrievalLoss(5), lr=1e-3), datamodule=data)


def test_a_signal_other_than_the_datas_is_refused_at_setup():
    data = PhaseRetrievalDataModule(dim=5, n_train=100, n_test=10, signal_seed=1)
    with pytest.raises(ConfigError, match=r"^Model/data mismatch: the backbone PhaseRetrievalLoss has `signal_seed` 0, "
                                          r"but the data module has `signal_seed` 1: set the same `signal_seed` on "
                                          r"both$"):
        quiet_trainer(max_steps=1).fit(MeZO(PhaseRetrievalLoss(5), lr=1e-3), datamodule=data)


# ------------------------------------------------------------------------ the Goldstein certificate
def test_the_min_norm_point_of_a_hull():
    e1, e2 = torch.eye(2, dtype=torch.float64)
    assert float(min_norm_in_hull(torch.stack([e1, -e1]))) == pytest.approx(0.0, abs=1e-12)
    assert float(min_norm_in_hull(torch.stack([e1, e2]))) == pytest.approx(2 ** -0.5, rel=1e-9)
    assert float(min_norm_in_hull(torch.stack([3 * e1]))) == pytest.approx(3.0)
    # against a dense scan of the simplex of three random vectors in R^2 (a segment or the hull's nearest point)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        vectors = torch.randn(3, 2, generator=g, dtype=torch.float64) + 2.0
        grid = torch.linspace(0, 1, 401, dtype=torch.float64)
        l1, l2 = torch.meshgrid(grid, grid, indexing="ij")
        keep = l1 + l2 <= 1
        weights = torch.stack([l1[keep], l2[keep], 1 - l1[keep] - l2[keep]], 1)
        scanned = float((weights @ vectors).norm(dim=1).min())
        assert float(min_norm_in_hull(vectors)) == pytest.approx(scanned, abs=2e-3)
        assert float(min_norm_in_hull(vectors)) <= scanned + 1e-9


def goldstein(model, data):
    metrics = model.evaluation_metrics()
    model.update_evaluation(metrics, data, torch.zeros(len(data), dtype=torch.long))
    return {name: float(metric.compute()) for name, metric in metrics.items()}


def test_the_goldstein_bound_is_small_near_the_signal_and_the_gradient_norm_far_from_it():
    """0.02 from ``x*`` (clean data) the gradient norm is 0.29 (``F`` is nonsmooth at its minimiser: no gradient
    vanishes near it), but gradients around ``x*`` cancel, so the bound at ``r = 0.1`` is below 0.01: the point is
    ``(0.1, 0.01)``-stationary. At ``r = 0`` every point is ``x`` and the bound is ``grad_norm``; far from ``x*`` (norm
    5, where ``F`` grows about linearly) it stays near ``grad_norm``. It never exceeds ``grad_norm`` (``x`` is one
    of its points)."""
    data = rows(4000, 8)
    near_signal = PhaseRetrievalLoss(8, certificate_radius=0.1)
    with torch.no_grad():
        near_signal.x.copy_(planted_signal(8, 0) + 0.02 * unit_rows(1, 8, torch.Generator().manual_seed(5))[0])
    near = goldstein(near_signal, data)
    assert near["goldstein"] < 0.01 and near["grad_norm"] > 0.2
    exact = PhaseRetrievalLoss(8, certificate_radius=0.0)
    far = PhaseRetrievalLoss(8, certificate_radius=0.1, init_norm=5.0)
    assert goldstein(exact, data)["goldstein"] == pytest.approx(goldstein(exact, data)["grad_norm"], rel=1e-9)
    values = goldstein(far, data)
    assert 0.8 * values["grad_norm"] <= values["goldstein"] <= values["grad_norm"] + 1e-12


def test_the_certificate_points_are_in_the_ball_public_and_include_x():
    points = ball_points(64, 5, 0)
    assert torch.equal(points[0], torch.zeros(5, dtype=torch.float64)) and float(points.norm(dim=1).max()) <= 1.0
    assert torch.equal(points, ball_points(64, 5, 0)) and not torch.equal(points, ball_points(64, 5, 1))
    with pytest.raises(ConfigError, match="certificate_radius"):
        PhaseRetrievalLoss(4, certificate_radius=-1.0)
    with pytest.raises(ConfigError, match="certificate_points"):
        PhaseRetrievalLoss(4, certificate_points=0)

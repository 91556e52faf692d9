import math

import pytest
import torch
from torch import nn

from lit_zodp.zo import ZOSGD, GaussianDirections, PerturbationEngine, SphereDirections, derive_seed


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(13, 7), nn.ReLU(), nn.Linear(7, 3))


@pytest.mark.parametrize("law", [GaussianDirections(), SphereDirections()])
@pytest.mark.parametrize("chunk", [5, 1 << 20])
def test_plus_minus_plus_restores_every_parameter(law, chunk):
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    engine = PerturbationEngine(list(model.parameters()), law, chunk_numel=chunk)
    for step in range(20):
        seed = derive_seed(1, step)
        engine.perturb_(seed, 1e-3)
        engine.perturb_(seed, -2e-3)
        engine.perturb_(seed, 1e-3)
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p, b, rtol=0, atol=1e-6)
    assert engine.pending == {}


@pytest.mark.parametrize("law", [GaussianDirections(), SphereDirections()])
def test_regenerated_direction_is_bitwise_equal(law):
    engine = PerturbationEngine(list(make_model().parameters()), law, chunk_numel=11)
    first = engine.direction(42)
    engine.direction(7)
    again = engine.direction(42)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, engine.direction(43)))


def test_perturbation_adds_exactly_scale_times_direction():
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    engine = PerturbationEngine(list(model.parameters()), chunk_numel=4)
    u = engine.direction(5)
    engine.perturb_(5, 0.25)
    for p, b, z in zip(model.parameters(), before, u):
        torch.testing.assert_close(p, b + 0.25 * z)


def test_sphere_direction_has_norm_sqrt_d():
    engine = PerturbationEngine(list(make_model().parameters()), SphereDirections(), chunk_numel=9)
    for seed in range(5):
        u = torch.cat([t.flatten() for t in engine.direction(seed)]).double()
        assert u.norm().item() == pytest.approx(math.sqrt(engine.dim), rel=1e-6)
        assert engine.direction_norm(seed) == pytest.approx(math.sqrt(engine.dim), rel=1e-6)


def test_directions_do_not_depend_on_chunking_or_global_rng():
    params = list(make_model().parameters())
    a = PerturbationEngine(params, chunk_numel=1 << 20).direction(3)
    torch.manual_seed(123)
    torch.randn(10)
    b = PerturbationEngine(params, chunk_numel=1 << 20).direction(3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_fused_restore_and_update_equals_restore_then_update():
    model_a, model_b = make_model(), make_model()
    opt_a = ZOSGD(model_a.parameters(), lr=0.1, weight_decay=0.5)
    opt_b = ZOSGD(model_b.parameters(), lr=0.1, weight_decay=0.5)
    for opt in (opt_a, opt_b):
        opt.engine.perturb_(9, 1e-3)
        opt.engine.perturb_(9, -2e-3)
    opt_b.engine.perturb_(9, 1e-3)       # explicit restore first
    for opt in (opt_a, opt_b):
        opt.set_coefficients({9: 3.0})
        opt.step()
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_update_is_sgd_along_u_with_decoupled_weight_decay():
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = ZOSGD(model.parameters(), lr=0.1, weight_decay=0.5)
    u = opt.engine.direction(4)
    opt.set_coefficients({4: 2.0})
    opt.step()
    for p, b, z in zip(model.parameters(), before, u):
        torch.testing.assert_close(p, (1 - 0.05) * b - 0.1 * 2.0 * z)


def test_zosgd_never_allocates_grad():
    model = make_model()
    opt = ZOSGD(model.parameters(), lr=0.1)
    opt.engine.perturb_(1, 1e-3)
    opt.set_coefficients({1: 1.0})
    opt.step()
    assert all(p.grad is None for p in model.parameters())
    assert opt.state_dict()["state"] == {}


def test_seeds_are_deterministic_and_distinct():
    assert derive_seed(1, 2, 0) == derive_seed(1, 2, 0)
    seeds = {derive_seed(1, step, k) for step in range(100) for k in range(3)}
    assert len(seeds) == 300
    assert all(0 <= s < 2**63 for s in seeds)


def test_engine_refuses_a_law_without_independent_chunks():
    class SerialLaw(GaussianDirections):
        independent_chunks = False

    with pytest.raises(ValueError, match="independent"):
        PerturbationEngine(list(make_model().parameters()), SerialLaw())

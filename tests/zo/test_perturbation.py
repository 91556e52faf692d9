import math

import numpy as np
import pytest
import torch
from torch import nn

from lit_zodp.privacy import SecretGaussianVector
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


def _step(engine, seeds, lam=1e-3, lr=0.1):
    """Per seed: +lam, -2 lam, then the fused restore-and-update with a coefficient."""
    for k, seed in enumerate(seeds):
        engine.perturb_(seed, lam)
        engine.perturb_(seed, -2 * lam)
        if k < len(seeds) - 1:
            engine.restore_()
    engine.restore_and_update_({seed: 0.5 + k for k, seed in enumerate(seeds)}, lr=lr, weight_decay=0.1)


@pytest.mark.parametrize("law", [GaussianDirections, SphereDirections])
@pytest.mark.parametrize("seeds_per_step", [1, 3])
def test_a_direction_cache_changes_no_bit_and_draws_u_once_per_step(law, seeds_per_step, monkeypatch):
    from lit_zodp.zo.perturbation import DirectionCache

    plain, cached = make_model(), make_model()
    a = PerturbationEngine(list(plain.parameters()), law(), chunk_numel=16)
    b = PerturbationEngine(list(cached.parameters()), law(), chunk_numel=16, cache=DirectionCache(200))
    for step in range(4):
        seeds = [derive_seed(9, step, k) for k in range(seeds_per_step)]
        _step(a, seeds)
        draws = []
        fill = GaussianDirections.fill_chunk_
        monkeypatch.setattr(GaussianDirections, "fill_chunk_",
                            lambda self, out, seed, index, gen: draws.append(seed) or fill(self, out, seed, index, gen))
        _step(b, seeds)
        monkeypatch.undo()
        for p, q in zip(plain.parameters(), cached.parameters()):
            assert torch.equal(p, q)
        chunks = len(b._chunks)
        # each seed is drawn once for its +lam, -2 lam and restore; the seeds before the last are
        # drawn again for the update (the cache holds the last only); without a cache it would be
        # 3 draws per seed plus 1 per earlier seed. The sphere's norm adds one pass per new seed.
        expected = chunks * (2 * seeds_per_step - 1)
        assert len(draws) >= expected and len(draws) <= expected + (chunks * seeds_per_step if law is SphereDirections else 0)


def test_engines_sharing_a_cache_never_read_each_others_direction():
    from lit_zodp.zo.perturbation import DirectionCache

    model, reference = make_model(), make_model()
    cache = DirectionCache(100)
    first, second = list(model.parameters())[:2], list(model.parameters())[2:]
    engines = [PerturbationEngine(first, chunk_numel=8, cache=cache), PerturbationEngine(second, chunk_numel=8, cache=cache)]
    plain_params = list(reference.parameters())
    plains = [PerturbationEngine(plain_params[:2], chunk_numel=8), PerturbationEngine(plain_params[2:], chunk_numel=8)]
    for step, (j, seed) in enumerate([(0, 5), (1, 5), (0, 5), (1, 6), (0, 6)]):  # same seeds on both engines
        engines[j].perturb_(seed, 1e-2)
        engines[1 - j].direction(seed)  # reading another engine's direction does not disturb the cache
        engines[j].restore_and_update_({seed: 1.0}, lr=0.1)
        plains[j].perturb_(seed, 1e-2)
        plains[j].restore_and_update_({seed: 1.0}, lr=0.1)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters())), step


def test_a_cache_smaller_than_the_engine_is_refused():
    from lit_zodp.zo.perturbation import DirectionCache

    params = list(make_model().parameters())
    with pytest.raises(ValueError, match="cache holds 10 elements"):
        PerturbationEngine(params, cache=DirectionCache(10))


class _Constant:
    """A direction law of all ones (makes the rounding of each term visible)."""

    name = "constant"
    independent_chunks = True

    def chunk_scale(self, chunks, seed):
        return 1.0

    def fill_chunk_(self, out, seed, index, generator):
        return out.fill_(1.0)

    def add_scaled_(self, total, alpha, index):  # as a noise vector: total += alpha * 1
        return total.add_(alpha)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_noise_vector_is_summed_with_the_private_term_before_one_rounding(dtype):
    """DPGD-0th: theta - lr (c u + s xi) must round once. Rounding ``theta - lr c u`` first would release a
    noise-free function of the private ``c``: here +0.6 ulp (private) then -0.4 ulp (noise) gives
    ``1 + ulp`` term by term, and ``1`` (the correctly rounded ``1 + 0.2 ulp``) in one add."""
    ulp = torch.finfo(dtype).eps  # the spacing above 1.0
    x = nn.Parameter(torch.ones(8, dtype=dtype))
    law = _Constant()
    engine = PerturbationEngine([x], law)
    engine.restore_and_update_({5: -0.6 * ulp}, lr=1.0, extra_terms=[(_Constant(), 0.4 * ulp)])
    assert torch.equal(x.detach(), torch.ones(8, dtype=dtype))
    term_by_term = torch.ones(8, dtype=dtype).add_(torch.ones(8, dtype=dtype), alpha=0.6 * ulp)
    assert torch.equal(term_by_term.add_(torch.ones(8, dtype=dtype), alpha=-0.4 * ulp),
                       torch.full((8,), 1 + ulp, dtype=dtype))  # the order this test rules out


def _secret_normals(key, index: int, numel: int) -> torch.Tensor:
    """Chunk ``index`` of a secret vector as the CPU law defines it: float64 normals of Philox(key, block index)."""
    rng = np.random.Generator(np.random.Philox(key=np.array(key, dtype=np.uint64), counter=[0, 0, 0, index]))
    return torch.from_numpy(rng.standard_normal(numel))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_noise_vector_is_a_float64_normal_added_to_the_float64_update_and_rounded_once(dtype):
    """DPGD-0th: each chunk becomes ``fl(theta + restore + private + c xi)`` with ``xi`` float64 normals
    and the sum in float64 (audit 3: float32 normals scaled and summed in float32 leave holes whose
    place depends on the private term). A noise as large as theta makes any float32 draw or extra
    rounding visible in most elements."""
    theta = torch.linspace(-1, 1, 2500).to(dtype)
    x = nn.Parameter(theta.clone())
    engine = PerturbationEngine([x], chunk_numel=1000)
    key = (0x0123456789ABCDEF, 0xFEDCBA9876543210)
    engine.perturb_(3, 1e-3)
    perturbed = x.detach().clone()
    u = engine.direction(3)[0].double()
    engine.restore_and_update_({3: 0.25}, lr=0.5, extra_terms=[(SecretGaussianVector(key), 2.0)])
    xi = torch.cat([_secret_normals(key, i, n) for i, n in enumerate([1000, 1000, 500])])
    expected = perturbed.double() - 1e-3 * u - 0.5 * 0.25 * u - 0.5 * 2.0 * xi
    assert torch.equal(x.detach(), expected.to(dtype))


def test_an_extra_term_that_is_not_a_noise_vector_is_refused():
    engine = PerturbationEngine([nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="not a noise vector"):
        engine.restore_and_update_({}, lr=1.0, extra_terms=[(GaussianDirections(), 1.0)])


@pytest.mark.parametrize("default", [torch.float16, torch.float64])
def test_the_direction_law_does_not_follow_the_default_dtype(default):
    """Review 20: under ``precision="16-true"`` (or ``"64-true"``) Lightning sets torch's default dtype within the
    step, and the chunked engine's scratch buffer took it, so ``u`` was drawn in float16 (float64), not the float32
    law the fused engine and its CPU reference draw."""
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    u = PerturbationEngine(list(model.parameters()), chunk_numel=4).direction(5)
    engine = PerturbationEngine(list(model.parameters()), chunk_numel=4)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        engine.perturb_(5, 0.25)
    finally:
        torch.set_default_dtype(saved)
    for p, b, z in zip(model.parameters(), before, u):
        torch.testing.assert_close(p, b + 0.25 * z, rtol=0, atol=0)

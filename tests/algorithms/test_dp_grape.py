"""DP-GRAPE (Mulrooney et al., Alg. 1 + 2) and naive DP-GaLore (Alg. 5): against the algorithms written naively, the
projector law, and projected Adam against torch's Adam. Review 49's engine-level references (tied weights,
micro-batches, resume, refusals, DP-GRAPE projecting nothing = DP-Adam bit for bit) are in test_dp_grape_reference.py."""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lit_zodp.algorithms import DPGaLore, DPGRAPE, GaLore, GRAPE
from lit_zodp.errors import ConfigError
from lit_zodp.per_example.transforms import Projection
from lit_zodp.privacy import FullBatchSampler, NoiseSource
from lit_zodp.projection import (ProjectedAdam, SeededProjections, gaussian_projection, projected_names,
                                 projection_side, projector_seed)
from lit_zodp.zo.philox import normal_range
from tests.conftest import blobs, collate_tensors, quiet_trainer

pytestmark = pytest.mark.filterwarnings("ignore:`(noise|sampling)_seed` is set")


def two_sided(seed=0):
    """Linear(10 -> 16): weight [16, 10], projected on the right (m = in = 10); Linear(16 -> 6): weight [6, 16],
    projected on the left (m = out = 6); the biases are not projected."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 6))
    model.num_classes = 6
    return model


def flat(model):
    return torch.cat([p.detach().flatten().double() for p in model.parameters()]).clone()


def full_batch(dataset, steps):
    return DataLoader(dataset, batch_sampler=FullBatchSampler(len(dataset), steps_per_epoch=steps),
                      collate_fn=collate_tensors)


# ------------------------------------------------------------------------------------------------ projector
def test_the_projector_is_the_philox_law_scaled_to_variance_one_over_r_and_unbiased():
    p = gaussian_projection(123, 7, 5)
    torch.testing.assert_close(p, normal_range(123, 0, 35).view(7, 5) / math.sqrt(5), rtol=0, atol=0)
    assert torch.equal(p, gaussian_projection(123, 7, 5)) and not torch.equal(p, gaussian_projection(124, 7, 5))
    draws = torch.stack([gaussian_projection(seed, 6, 4).double() for seed in range(4000)])
    assert draws.var().item() == pytest.approx(1 / 4, rel=0.03)
    expected_outer = (draws @ draws.transpose(1, 2)).mean(0)  # E[P P^T] = I_m: P P^T G is unbiased for G
    torch.testing.assert_close(expected_outer, torch.eye(6, dtype=torch.float64), rtol=0, atol=0.05)


def test_projectors_change_exactly_every_f_steps_and_differ_between_tensors():
    projections = SeededProjections(["a", "b"], rank=2, frequency=3)
    projections.run_seed = 9
    weight = torch.zeros(4, 5)
    seen = []
    for step in range(7):
        projections.at_step(step)
        seen.append(projections.projection("a", weight).matrix.clone())
        assert projections.projection("c", weight) is None
        assert not torch.equal(seen[-1], projections.projection("b", weight).matrix)
    same = [torch.equal(seen[t], seen[t - 1]) for t in range(1, 7)]
    assert same == [True, True, False, True, True, False]  # new subspaces at t = 3, 6 (t mod F == 0)
    torch.testing.assert_close(seen[3], gaussian_projection(projector_seed(9, 1, 0), 4, 2), rtol=0, atol=0)


def test_only_untied_linear_weights_wider_than_the_rank_outside_the_heads_are_projected():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(30, 8)
            self.body = nn.Linear(8, 12)
            self.thin = nn.Linear(12, 3)             # min side 3 <= rank 4
            self.head = nn.Linear(12, 12)            # a head: unprojected by name
            self.tied = nn.Linear(8, 30, bias=False)
            self.tied.weight = self.embed.weight     # tied to the embedding
            self.frozen = nn.Linear(12, 12)
            self.frozen.weight.requires_grad_(False)

    assert projected_names(Model(), rank=4) == ["body.weight"]
    assert projected_names(Model(), rank=4, unprojected=()) == ["body.weight", "head.weight"]
    assert [projection_side(s) for s in [(3, 5), (5, 5), (6, 5)]] == ["left", "left", "right"]


# ------------------------------------------------------------------------------------------------ Adam
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_projected_adam_without_a_projection_is_torchs_adamw(weight_decay):
    torch.manual_seed(0)
    ours, theirs = torch.randn(5, 3, dtype=torch.float64), None
    theirs = ours.clone().requires_grad_()
    ours = nn.Parameter(ours)
    optimizer = ProjectedAdam([ours], lr=0.01, weight_decay=weight_decay)
    reference = torch.optim.AdamW([theirs], lr=0.01, weight_decay=weight_decay)
    for _ in range(5):
        gradient = torch.randn(5, 3, dtype=torch.float64)
        optimizer.hand([gradient], [None])
        optimizer.step()
        theirs.grad = gradient
        reference.step()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("side", ["left", "right"])
def test_projected_adam_moves_the_weight_by_p_times_adams_move_in_the_projected_space(side):
    """W_t - W_0 = P (Z_t - Z_0) (left) or (Z_t - Z_0) P^T (right), Z stepped by Adam on the projected gradients R_t."""
    torch.manual_seed(1)
    weight = nn.Parameter(torch.randn(6, 9, dtype=torch.float64))
    start = weight.detach().clone()
    p = torch.randn(6 if side == "left" else 9, 2, dtype=torch.float64)
    shape = (2, 9) if side == "left" else (6, 2)
    z = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    optimizer, reference = ProjectedAdam([weight], lr=0.05), torch.optim.Adam([z], lr=0.05)
    for _ in range(4):
        r = torch.randn(shape, dtype=torch.float64)
        optimizer.hand([r], [Projection(p, side)])
        optimizer.step()
        z.grad = r
        reference.step()
    moved = p @ z.detach() if side == "left" else z.detach() @ p.T
    torch.testing.assert_close(weight.detach() - start, moved, rtol=1e-12, atol=1e-14)
    assert optimizer.state[weight]["exp_avg"].shape == shape  # the moments live in the projected space


def test_projected_adam_refuses_a_step_without_gradients_and_moments_of_another_shape():
    weight = nn.Parameter(torch.zeros(4, 4))
    optimizer = ProjectedAdam([weight])
    with pytest.raises(ConfigError, match="hand"):
        optimizer.step()
    optimizer.hand([torch.ones(2, 4)], [Projection(torch.ones(4, 2), "left")])
    optimizer.step()
    optimizer.hand([torch.ones(3, 4)], [Projection(torch.ones(4, 3), "left")])
    with pytest.raises(ConfigError, match="rank"):
        optimizer.step()


# ------------------------------------------------------------------------------------------------ the module
def per_example_projected_clipped_sum(model, x, y, clip, projections):
    """The slow reference of Alg. 1 lines 2-7: one backward per example, P^T G_i / G_i P per projected weight,
    one flat clip over every coordinate, sum."""
    params = list(model.parameters())
    total = None
    for xi, yi in zip(x, y):
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(xi[None]), yi[None]), params)
        grads = [g if pr is None else (pr.matrix.T @ g if pr.side == "left" else g @ pr.matrix)
                 for g, pr in zip(grads, projections)]
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads)).item()
        factor = min(1.0, clip / max(norm, 1e-30))
        total = [factor * g for g in grads] if total is None else [t + factor * g for t, g in zip(total, grads)]
    return total


def naive_projectors(run_seed, step, frequency, rank):
    """P of Alg. 1 line 5 for :func:`two_sided`: its two weights, indices 0 and 1, the biases unprojected."""
    period = step // frequency
    return [Projection(gaussian_projection(projector_seed(run_seed, period, 0), 10, rank), "right"), None,
            Projection(gaussian_projection(projector_seed(run_seed, period, 1), 6, rank), "left"), None]


@pytest.mark.parametrize("grad_mode", ["hooks", "ghost", "bookkeeping", "vmap"])
def test_dpgrape_matches_algorithms_1_and_2_written_naively(grad_mode):
    """Three steps with F = 2 (a new subspace at the third, Adam's moments kept): per-example gradients projected,
    one flat clip, noise N(0, sigma^2 C^2) in the projected coordinates, divided by B, Adam with projected moments."""
    dataset = blobs(n=40, classes=6)
    lr, clip, sigma, betas, eps, steps, rank, frequency = 0.01, 0.5, 0.8, (0.9, 0.999), 1e-8, 3, 3, 2
    module = DPGRAPE(two_sided(3), lr=lr, clip=clip, noise_multiplier=sigma, noise_seed=11, seed=5, rank=rank,
                     projection_frequency=frequency, grad_mode=grad_mode)
    assert module.projected == {"0.weight", "2.weight"}
    quiet_trainer(max_steps=steps).fit(module, full_batch(dataset, steps))

    reference = two_sided(3)
    noise = NoiseSource(11)
    params = list(reference.parameters())
    m = v = None
    x, y = dataset.tensors
    for t in range(1, steps + 1):
        projections = naive_projectors(5, t - 1, frequency, rank)
        summed = per_example_projected_clipped_sum(reference, x, y, clip, projections)
        assert [tuple(g.shape) for g in summed] == [(16, rank), (16,), (rank, 16), (6,)]  # R in r x n
        flat_noise = noise.gaussian((sum(g.numel() for g in summed),), sigma * clip)
        released = [(g + z.view_as(g)) / len(dataset) for g, z in zip(summed, flat_noise.split(
            [g.numel() for g in summed]))]
        m = [torch.zeros_like(r) for r in released] if m is None else m
        v = [torch.zeros_like(r) for r in released] if v is None else v
        with torch.no_grad():
            alpha = lr * math.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t)       # Alg. 2 line 1
            for p, r, mi, vi, pr in zip(params, released, m, v, projections):
                mi.mul_(betas[0]).add_(r, alpha=1 - betas[0])
                vi.mul_(betas[1]).addcmul_(r, r, value=1 - betas[1])
                step = mi / (vi.sqrt() + eps * math.sqrt(1 - betas[1] ** t))     # (torch's placement of phi)
                if pr is not None:
                    step = pr.matrix @ step if pr.side == "left" else step @ pr.matrix.T
                p.sub_(alpha * step)
    torch.testing.assert_close(flat(module.backbone), flat(reference), rtol=1e-5, atol=1e-6)


def test_the_noise_of_a_dpgrape_step_lives_in_the_projected_coordinates_with_std_sigma_c_over_b():
    """With zero per-example gradients the release is the noise alone: std sigma C / B, r x n coordinates per
    projected weight (Adam's first moment after one step is (1 - beta1) R~)."""

    class Flat(nn.Module):
        num_classes = 3

        def __init__(self):
            super().__init__()
            self.w = nn.Linear(400, 300)

        def forward(self, x):
            return torch.zeros(x.shape[0], 3) + 0.0 * self.w(torch.zeros(x.shape[0], 400)).sum()

    sigma, clip, n = 2.0, 0.5, 80
    # a test noise seed: deterministic. From the OS, the three 5-standard-error checks below failed about 1.2e-6 of
    # runs (two-sided 5 sigma on the mean, and the chi-square tails of the std's over 3200 values: 5.8e-7 each)
    module = DPGRAPE(Flat(), lr=0.1, clip=clip, noise_multiplier=sigma, seed=0, rank=8, noise_seed=4)
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(module, full_batch(blobs(n=n), 1))
    state = trainer.optimizers[0].state[module.backbone.w.weight]
    released = (state["exp_avg"] / (1 - 0.9)).double()
    assert released.shape == (8, 400)  # the left projection of [300, 400]: R = P^T G, r x n coordinates
    expected = sigma * clip / n
    assert released.std().item() == pytest.approx(expected, rel=5 / math.sqrt(2 * released.numel()))
    assert abs(released.mean().item()) < 5 * expected / math.sqrt(released.numel())
    bias = (trainer.optimizers[0].state[module.backbone.w.bias]["exp_avg"] / (1 - 0.9)).double()
    assert bias.shape == (300,) and bias.std().item() == pytest.approx(expected, rel=0.25)


def test_naive_dp_galore_matches_algorithm_5_written_naively():
    """DP-Adam's release of the full gradient G~, then P = the top-r singular vectors of G~ on the weight's smaller
    side, renewed at t mod F == 0 (post-processing), R~ = P^T G~ (or G~ P), and Adam with projected moments."""
    dataset = blobs(n=40, classes=6)
    lr, clip, sigma, betas, eps, steps, rank, frequency = 0.01, 0.5, 0.8, (0.9, 0.999), 1e-8, 3, 3, 2
    module = DPGaLore(two_sided(3), lr=lr, clip=clip, noise_multiplier=sigma, noise_seed=11, seed=5, rank=rank,
                      projection_frequency=frequency)
    quiet_trainer(max_steps=steps).fit(module, full_batch(dataset, steps))

    reference = two_sided(3)
    noise = NoiseSource(11)
    params = list(reference.parameters())
    x, y = dataset.tensors
    m = v = None
    projectors = [None] * len(params)
    for t in range(1, steps + 1):
        summed = per_example_projected_clipped_sum(reference, x, y, clip, [None] * len(params))
        flat_noise = noise.gaussian((sum(g.numel() for g in summed),), sigma * clip)
        released = [(g + z.view_as(g)) / len(dataset) for g, z in zip(summed, flat_noise.split(
            [g.numel() for g in summed]))]
        if (t - 1) % frequency == 0:
            for i, g in enumerate(released):
                if g.dim() == 2:
                    u, _, vh = torch.linalg.svd(g, full_matrices=False)
                    projectors[i] = (u[:, :rank], "left") if g.shape[0] <= g.shape[1] else (vh[:rank].T, "right")
        projected = [g if pr is None else (pr[0].T @ g if pr[1] == "left" else g @ pr[0])
                     for g, pr in zip(released, projectors)]
        m = [torch.zeros_like(r) for r in projected] if m is None else m
        v = [torch.zeros_like(r) for r in projected] if v is None else v
        with torch.no_grad():
            alpha = lr * math.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t)
            for p, r, mi, vi, pr in zip(params, projected, m, v, projectors):
                mi.mul_(betas[0]).add_(r, alpha=1 - betas[0])
                vi.mul_(betas[1]).addcmul_(r, r, value=1 - betas[1])
                step = mi / (vi.sqrt() + eps * math.sqrt(1 - betas[1] ** t))
                if pr is not None:
                    step = pr[0] @ step if pr[1] == "left" else step @ pr[0].T
                p.sub_(alpha * step)
    state = module.optimizers().optimizer.state
    assert [tuple(state[p]["exp_avg"].shape) for p in module.backbone.parameters()] == [
        (16, rank), (16,), (rank, 16), (6,)]
    torch.testing.assert_close(flat(module.backbone), flat(reference), rtol=1e-5, atol=1e-6)


def test_the_non_private_twins_train_and_keep_projected_moments():
    dataset = blobs(n=40, classes=6)
    for cls in (GRAPE, GaLore):
        module = cls(two_sided(3), lr=0.01, seed=5, rank=3)
        before = flat(module.backbone)
        trainer = quiet_trainer(max_steps=3)
        trainer.fit(module, full_batch(dataset, 3))
        assert not torch.equal(before, flat(module.backbone))
        state = trainer.optimizers[0].state
        assert [tuple(state[p]["exp_avg"].shape) for p in module.backbone.parameters()] == [
            (16, 3), (16,), (3, 16), (6,)]


def test_projected_adam_keeps_float32_moments_so_float16_weights_step_where_adams_eps_would_vanish():
    """DP-Adam refuses float16 weights at eps 1e-8 (it rounds to 0 there: m / 0 where v underflows); projected Adam
    keeps its moments, and phi, in float32, so a coordinate whose gradient is 0 stays where it is."""
    weight = nn.Parameter(torch.ones(4, 6, dtype=torch.float16))
    optimizer = ProjectedAdam([weight], lr=0.1, eps=1e-8)
    gradient = torch.zeros(2, 6)
    gradient[0, 0] = 1e-3
    optimizer.hand([gradient], [Projection(torch.eye(4, 2), "left")])
    optimizer.step()
    assert optimizer.state[weight]["exp_avg"].dtype == torch.float32 and torch.isfinite(weight).all()
    moved = (weight.float() - 1).abs() > 0
    assert moved[0, 0] and moved.sum() == 1

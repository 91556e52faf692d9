"""DP-GRAPE (Mulrooney et al. Alg. 1 + 2), GRAPE, DP-GaLore: numeric identities against slow hand-written references.

The references below are independent of the engine: per-example gradients from one autograd backward per example,
projected with ``P = N_s(0, 1/r)`` drawn from the public seed of the step's period, one flat clip over every
projected and unprojected coordinate, and Adam with projected moments written out line by line (Alg. 2 with torch's
bias correction, as the module documents).
"""

import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lit_zodp.algorithms import DPGRAPE, GRAPE, DPAdam, DPGaLore, GaLore
from lit_zodp.algorithms.first_order import GRAD_MODES
from lit_zodp.errors import ConfigError
from lit_zodp.privacy import FullBatchSampler
from lit_zodp.projection import gaussian_projection, projection_side, projector_seed
from tests.conftest import collate_tensors, poisson_loader, quiet_trainer

pytestmark = pytest.mark.filterwarnings("ignore:`(noise|sampling)_seed` is set", "ignore:.*ckpt_path.*",
                                        "ignore:.*dataloader is not resumable.*", "ignore:.*val_dataloader.*")

RANK = 4


class Net(nn.Module):
    """Both sides projected (``up`` [14, 6] right, ``down`` [9, 14] left), and an embedding, a LayerNorm, biases and
    a ``head`` left unprojected."""

    def __init__(self, seed=0, vocab=11):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, 6)
        self.up = nn.Linear(6, 14)
        self.norm = nn.LayerNorm(14)
        self.down = nn.Linear(14, 9)
        self.head = nn.Linear(9, 3)

    def forward(self, x):
        h = self.norm(torch.tanh(self.up(self.emb(x))))
        return self.head(torch.tanh(self.down(h)).mean(1))


def tokens(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, 11, (n, 5), generator=g), torch.randint(0, 3, (n,), generator=g))


def full_batch(dataset, steps):
    return DataLoader(dataset, batch_sampler=FullBatchSampler(len(dataset), steps_per_epoch=steps),
                      collate_fn=collate_tensors)


PRIVATE = dict(clip=1.0, noise_multiplier=1.0, delta=1e-5, noise_seed=5)


def build(cls=DPGRAPE, backbone=None, **overrides):
    kwargs = dict(rank=RANK, lr=0.01, seed=3) | (PRIVATE if cls.private else {})
    return cls(backbone if backbone is not None else Net(), **(kwargs | overrides))


class Recorder(Callback):
    """Each step's batch, projected clipped sum, release, and the weights before and after."""

    def __init__(self):
        self.steps = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.steps.append({"before": {n: p.detach().clone() for n, p in module.backbone.named_parameters()}})
        private_gradient, release = module.private_gradient, module.release_gradient
        record = self.steps[-1]

        def recorded_private_gradient(inputs, targets):
            record["inputs"], record["targets"] = inputs.clone(), targets.clone()
            return private_gradient(inputs, targets)

        def recorded_release(clipped):
            record["clipped"] = [g.detach().clone() for g in clipped.grads]
            record["released"] = [g.detach().clone() for g in release(clipped)]
            record["batch_size"] = clipped.batch_size
            return record["released"]

        module.private_gradient, module.release_gradient = recorded_private_gradient, recorded_release

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.steps[-1]["after"] = {n: p.detach().clone() for n, p in module.backbone.named_parameters()}
        del module.private_gradient, module.release_gradient


def fit(module, loader, steps, **trainer_kwargs):
    recorder = Recorder()
    trainer = quiet_trainer(max_steps=steps, callbacks=[recorder], **trainer_kwargs)
    trainer.fit(module, loader)
    return recorder.steps, trainer


def projector(module, name, param, step):
    """``P`` of ``name`` at the 0-based ``step``, from the public seed alone (never from the module's state)."""
    index = [n for n in module.engine.names if n in module.projected].index(name)
    side = projection_side(param.shape)
    rows = param.shape[0] if side == "left" else param.shape[1]
    seed = projector_seed(module.run_seed, step // module.projection_frequency, index)
    return gaussian_projection(seed, rows, module.rank).double(), side


def project(g, matrix, side):
    return matrix.T @ g if side == "left" else g @ matrix


def project_back(u, matrix, side):
    return matrix @ u if side == "left" else u @ matrix.T


def reference_clipped_sum(module, weights, inputs, targets, step, clip, factory=Net):
    """``sum_i clip_C(R_i)``: one backward per example on a float64 copy, projected, ONE flat norm over all."""
    model = factory().double()
    missing, unexpected = model.load_state_dict({n: w.double() for n, w in weights.items()}, strict=False)
    assert not unexpected and all(n in {"out.weight"} for n in missing)  # (a tied weight is named once)
    names = list(module.engine.names)
    params = dict(model.named_parameters())
    total = None
    for i in range(len(targets)):
        loss = F.cross_entropy(model(inputs[i:i + 1]), targets[i:i + 1])
        grads = torch.autograd.grad(loss, [params[n] for n in names])
        rows = [project(g, *projector(module, n, params[n], step)) if n in module.projected else g
                for n, g in zip(names, grads)]
        norm = torch.cat([r.flatten() for r in rows]).norm()
        scale = min(1.0, clip / norm.item())
        rows = [r * scale for r in rows]
        total = rows if total is None else [t + r for t, r in zip(total, rows)]
    return total


# ------------------------------------------------------------------------- 1. faithfulness to Alg. 1 and 2
@pytest.mark.parametrize("mode", GRAD_MODES)
def test_the_clipped_sum_is_the_flat_clip_of_the_projected_per_example_gradients_in_every_mode(mode):
    """Left (``P^T G_i``) and right (``G_i P``) projections from the public seed, unprojected embedding, LayerNorm,
    biases and head, one flat clip over all of them (a clip whose threshold sits inside the norms' range: a
    per-layer clip, a clip of the unprojected norm, or a projection after the clip would each differ)."""
    module = build(grad_mode=mode, clip=1.7)
    assert module.projected == {"up.weight", "down.weight"}
    steps, _ = fit(module, full_batch(tokens(24), 2), 2)
    for step, record in enumerate(steps):
        expected = reference_clipped_sum(module, record["before"], record["inputs"], record["targets"], step, 1.7)
        for name, got, want in zip(module.engine.names, record["clipped"], expected):
            assert got.shape == want.shape, name
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6, msg=name)
    shapes = dict(zip(module.engine.names, (g.shape for g in steps[0]["clipped"])))
    assert shapes["up.weight"] == (14, RANK) and shapes["down.weight"] == (RANK, 14)


def test_micro_batches_accumulate_the_same_projected_clipped_sum():
    """One logical batch in micro-batches of 5: the same projectors for each, the clipped sums added, noise once."""
    module = build(micro_batch_size=5, clip=1.7)
    steps, _ = fit(module, full_batch(tokens(24), 2), 2)
    for step, record in enumerate(steps):
        expected = reference_clipped_sum(module, record["before"], record["inputs"], record["targets"], step, 1.7)
        for name, got, want in zip(module.engine.names, record["clipped"], expected):
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6, msg=name)


class Tied(nn.Module):
    """An output layer tied to the embedding (a LM head): a Linear whose weight has two holders."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(11, 8)
        self.mix = nn.Linear(8, 8)
        self.out = nn.Linear(8, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mix(self.emb(x))).mean(1))


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
def test_a_weight_tied_to_an_embedding_keeps_its_full_gradient_inside_the_flat_clip(mode):
    """The tied output weight is not projected (its per-example gradient sums the embedding's and the head's uses);
    ``mix`` is; the clipped sum equals the reference's in ghost mode too."""
    module = build(backbone=Tied(), grad_mode=mode, clip=0.5)
    assert module.projected == {"mix.weight"}
    steps, _ = fit(module, full_batch(tokens(16), 1), 1)
    record = steps[0]
    expected = reference_clipped_sum(module, record["before"], record["inputs"], record["targets"], 0, 0.5,
                                     factory=Tied)
    for name, got, want in zip(module.engine.names, record["clipped"], expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6, msg=name)


def test_the_reference_sees_a_clip_that_binds_for_some_examples_only():
    """(The threshold of the test above clips part of the batch: both branches of ``min(1, C / |R_i|)`` run.)"""
    module = build(clip=1.7)
    steps, _ = fit(module, full_batch(tokens(24), 1), 1)
    record = steps[0]
    model = Net().double()
    model.load_state_dict({n: w.double() for n, w in record["before"].items()})
    params = dict(model.named_parameters())
    norms = []
    for i in range(24):
        loss = F.cross_entropy(model(record["inputs"][i:i + 1]), record["targets"][i:i + 1])
        grads = torch.autograd.grad(loss, [params[n] for n in module.engine.names])
        norms.append(torch.cat([(project(g, *projector(module, n, params[n], 0)) if n in module.projected else g)
                                .flatten() for n, g in zip(module.engine.names, grads)]).norm().item())
    assert min(norms) < 1.7 < max(norms)


def test_the_noise_lives_in_the_projected_dimension_with_std_sigma_c_over_b():
    """The release adds ``N(0, sigma^2 C^2)`` to exactly ``r sum n_l + d_unprojected`` coordinates, divided by B."""
    module = build(noise_multiplier=3.0, clip=2.0)
    steps, _ = fit(module, poisson_loader(tokens(64), 0.25, seed=1), 1)
    record = steps[0]
    dimension = sum(g.numel() for g in record["released"])
    unprojected = sum(p.numel() for n, p in module.backbone.named_parameters() if n not in module.projected)
    assert dimension == 14 * RANK + RANK * 14 + unprojected  # up: [14, r] (right: out 14 > in 6); down: [r, 14] (left)
    size = module.privacy.expected_batch_size
    assert size == 16
    noise = torch.cat([(r * size - c).flatten() for r, c in zip(record["released"], record["clipped"])]).double()
    assert abs(noise.std().item() / (3.0 * 2.0) - 1) < 0.12 and abs(noise.mean().item()) < 0.15 * 6.0


def adam_reference(module, steps, full=None):
    """Alg. 2 (torch's bias correction, as documented): the weights after each step from the releases alone, with
    ``P`` regenerated from the public seeds of each step's period. ``full``: the released gradient is full-shape
    (DP-GaLore); then it is given with its projection per step."""
    (beta1, beta2), eps, lr = module.betas, module.eps, module.lr
    weights = {n: w.double() for n, w in steps[0]["before"].items()}
    names = list(module.engine.names)
    m, v, out = {}, {}, []
    for t, record in enumerate(steps, start=1):
        for name, g in zip(names, record["released"]):
            g = g.double()
            if name in module.projected and full is not None:
                matrix, side = full[t - 1][name]
                g = project(g, matrix, side)
            m[name] = beta1 * m.get(name, 0) + (1 - beta1) * g
            v[name] = beta2 * v.get(name, 0) + (1 - beta2) * g * g
            direction = m[name] / (v[name].sqrt() / math.sqrt(1 - beta2 ** t) + eps)
            if name in module.projected:
                matrix, side = (full[t - 1][name] if full is not None
                                else projector(module, name, record["before"][name], t - 1))
                direction = project_back(direction, matrix, side)
            weights[name] = weights[name] - lr / (1 - beta1 ** t) * direction
        out.append({n: w.clone() for n, w in weights.items()})
    return out, m, v


@pytest.mark.parametrize("frequency", [1, 2, 3])
def test_the_update_is_w_minus_alpha_p_m_over_sqrt_v_with_p_renewed_exactly_every_f_steps(frequency):
    """Seven steps: every step's weights equal the hand-written Alg. 2 on the recorded releases, with ``P`` from the
    seed of period ``t // F`` (the same ``P`` as the backward's, which the clipped-sum test pins); the moments have
    the projected shape and are carried across every change of subspace (neither reset nor re-projected)."""
    module = build(projection_frequency=frequency)
    steps, _ = fit(module, poisson_loader(tokens(64), 0.25, seed=1), 7)
    expected, m, v = adam_reference(module, steps)
    for t, (record, want) in enumerate(zip(steps, expected)):
        for name, w in record["after"].items():
            torch.testing.assert_close(w.double(), want[name], rtol=1e-5, atol=1e-7, msg=f"step {t} {name}")
    state = module.optimizers().optimizer.state
    for name, param in zip(module.engine.names, module.engine.params):
        assert state[param]["step"] == 7
        assert state[param]["exp_avg"].shape == m[name].shape
        torch.testing.assert_close(state[param]["exp_avg"].double(), m[name], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(state[param]["exp_avg_sq"].double(), v[name], rtol=1e-5, atol=1e-10)
    assert state[dict(module.backbone.named_parameters())["down.weight"]]["exp_avg"].shape == (RANK, 14)


@pytest.mark.parametrize("frequency", [1, 3])
def test_the_projector_changes_exactly_at_the_steps_t_mod_f_zero(frequency):
    module = build(projection_frequency=frequency)
    fit(module, poisson_loader(tokens(64), 0.25, seed=1), 1)
    param = dict(module.backbone.named_parameters())["up.weight"]
    index = module.engine.names.index("up.weight")
    matrices = [module.projections_at(t)[index].matrix.clone() for t in range(7)]
    for t in range(1, 7):
        same = torch.equal(matrices[t], matrices[t - 1])
        assert same == (t % frequency != 0), t
        torch.testing.assert_close(matrices[t].double(), projector(module, "up.weight", param, t)[0])


def test_the_projector_is_public_the_same_whatever_the_data_and_the_noise():
    """``P`` is a function of the run seed, the period and the tensor's index alone."""
    a, b = build(noise_seed=1), build(noise_seed=2)
    fit(a, poisson_loader(tokens(64, seed=0), 0.25, seed=1), 2)
    fit(b, poisson_loader(tokens(64, seed=9), 0.5, seed=4), 2)
    for pa, pb in zip(a.projections_at(5), b.projections_at(5)):
        assert (pa is None) == (pb is None)
        if pa is not None:
            assert torch.equal(pa.matrix, pb.matrix) and pa.side == pb.side
    c = build(seed=4)
    fit(c, poisson_loader(tokens(64), 0.25, seed=1), 1)
    assert not torch.equal(c.projections_at(0)[1].matrix, a.projections_at(0)[1].matrix)


# ------------------------------------------------------------------------- 4. reductions
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_dp_grape_with_nothing_projected_is_dp_adam_bit_for_bit(weight_decay):
    """``rank`` at least every Linear's smaller side: no projection, and the fit is DP-Adam's, same seeds, bit for bit
    (ProjectedAdam's first moment was ``mul_(beta1).add_(g)`` where torch's AdamW lerps: 1e-7 apart after 5 steps)."""
    with pytest.warns(UserWarning, match="projects no tensor"):
        grape = build(rank=9, weight_decay=weight_decay)
    assert grape.projected == set()
    adam = DPAdam(Net(), lr=0.01, seed=3, weight_decay=weight_decay, **PRIVATE)
    fit(grape, poisson_loader(tokens(64), 0.25, seed=1), 5)
    fit(adam, poisson_loader(tokens(64), 0.25, seed=1), 5)
    for (name, a), b in zip(grape.backbone.named_parameters(), adam.backbone.parameters()):
        assert torch.equal(a, b), name


def test_grape_equals_a_hand_written_projected_adam_on_the_batch_mean():
    """The non-private twin: the mean gradient of the realized batch, projected by the seeded ``P``, Adam (Alg. 2)."""
    module = build(GRAPE, projection_frequency=2)
    steps, _ = fit(module, poisson_loader(tokens(64), 0.25, seed=1), 5)
    for t, record in enumerate(steps):
        model = Net().double()
        model.load_state_dict({n: w.double() for n, w in record["before"].items()})
        params = dict(model.named_parameters())
        loss = F.cross_entropy(model(record["inputs"]), record["targets"])
        grads = torch.autograd.grad(loss, [params[n] for n in module.engine.names])
        for name, got, g in zip(module.engine.names, record["released"], grads):
            want = project(g, *projector(module, name, params[name], t)) if name in module.projected else g
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-8, msg=f"step {t} {name}")
    expected, _, _ = adam_reference(module, steps)
    for name, w in steps[-1]["after"].items():
        torch.testing.assert_close(w.double(), expected[-1][name], rtol=1e-5, atol=1e-7, msg=name)


def test_dp_galore_projects_the_noisy_release_on_its_top_singular_vectors_every_f_steps():
    """Alg. 5: ``P`` is ``U[:, :r]`` (left) or ``V[:, :r]`` (right) of the SVD of the step's RELEASED (noisy)
    gradient at ``t mod F == 0`` and kept between; Adam on ``P^T G~``; the weights follow the reference."""
    module = build(DPGaLore, projection_frequency=2)
    steps, _ = fit(module, poisson_loader(tokens(64), 0.25, seed=1), 5)
    full, current = [], {}
    for t, record in enumerate(steps):
        for name, g in zip(module.engine.names, record["released"]):
            if name in module.projected and t % 2 == 0:
                side = projection_side(g.shape)
                u, _, vh = torch.linalg.svd(g.float(), full_matrices=False)  # (the module's float32 SVD: same signs)
                current[name] = ((u[:, :RANK] if side == "left" else vh[:RANK].T).double(), side)
        full.append(dict(current))
    expected, _, _ = adam_reference(module, steps, full=full)
    for t, record in enumerate(steps):
        for name, w in record["after"].items():
            # (singular vectors are defined up to sign; Adam's direction P (M / sqrt V) is sign-invariant per column
            # only while the sign does not change, which the kept projector guarantees within a period)
            torch.testing.assert_close(w.double(), expected[t][name], rtol=1e-4, atol=1e-6, msg=f"step {t} {name}")


# ------------------------------------------------------------------------- 2. resume
def _checkpoint(module, loader, steps, path):
    trainer = quiet_trainer(max_steps=steps)
    trainer.fit(module, loader)
    trainer.save_checkpoint(path)
    return path


@pytest.mark.parametrize("cls", [GRAPE, GaLore])
def test_a_fit_of_n_steps_equals_k_steps_and_a_resume_of_the_rest(cls, tmp_path):
    """The resumed fit continues the same projectors (GRAPE: from the run seed and the step; GaLore: the SVD
    projector kept in the optimizer state, renewed at step 4 only) and the same projected moments."""
    whole = build(cls, projection_frequency=4)
    fit(whole, full_batch(tokens(32), 7), 7)
    path = _checkpoint(build(cls, projection_frequency=4), full_batch(tokens(32), 3), 3, tmp_path / "k.ckpt")
    resumed = build(cls, projection_frequency=4)
    trainer = quiet_trainer(max_steps=7)
    trainer.fit(resumed, full_batch(tokens(32), 7), ckpt_path=str(path))
    assert trainer.global_step == 7
    for (name, a), b in zip(whole.backbone.named_parameters(), resumed.backbone.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("change", [dict(rank=3), dict(projection_frequency=7), dict(unprojected=["head", "up"])])
@pytest.mark.parametrize("cls", [DPGRAPE, DPGaLore])
def test_a_resume_with_other_projection_settings_is_refused_in_one_line_before_any_step(cls, change, tmp_path):
    """Before, another ``rank`` (or ``unprojected``) failed inside ProjectedAdam after the step's release was counted
    and the embedding had moved; another ``projection_frequency`` resumed silently on other projectors."""
    path = _checkpoint(build(cls, projection_frequency=5), poisson_loader(tokens(), 0.25, seed=1), 3,
                       tmp_path / "k.ckpt")
    resumed = build(cls, **({"projection_frequency": 5} | change))
    before = [p.detach().clone() for p in resumed.parameters()]
    trainer = quiet_trainer(max_steps=6)
    with pytest.raises(ConfigError) as refused:
        trainer.fit(resumed, poisson_loader(tokens(), 0.25, seed=1), ckpt_path=str(path))
    message = str(refused.value)
    assert "\n" not in message and f"`{next(iter(change))}`" in message
    assert resumed.privacy.ledger.total_count == 0 and trainer.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, resumed.parameters()))


def test_a_resume_with_the_same_settings_continues(tmp_path):
    path = _checkpoint(build(projection_frequency=5), poisson_loader(tokens(), 0.25, seed=1), 3, tmp_path / "k.ckpt")
    resumed = build(projection_frequency=5)
    trainer = quiet_trainer(max_steps=5)
    trainer.fit(resumed, poisson_loader(tokens(), 0.25, seed=1), ckpt_path=str(path))
    assert trainer.global_step == 5


# ------------------------------------------------------------------------- 3. bad configuration
@pytest.mark.parametrize("cls", [DPGRAPE, GRAPE, DPGaLore, GaLore])
@pytest.mark.parametrize("bad", [dict(rank=0), dict(rank=-2), dict(projection_frequency=0),
                                 dict(unprojected="head")])
def test_bad_projection_settings_are_refused_in_one_line(cls, bad):
    with pytest.raises(ConfigError) as refused:
        build(cls, **bad)
    assert "\n" not in str(refused.value) and f"`{next(iter(bad))}`" in str(refused.value)


@pytest.mark.parametrize("cls", [DPGRAPE, DPGaLore])
def test_an_unprojected_name_matching_no_layer_is_refused_rather_than_ignored(cls):
    """``unprojected=["haed"]`` (a typo for ``head``) left ``head`` under the defaults' rule silently."""
    with pytest.raises(ConfigError, match="'haed'"):
        build(cls, unprojected=["haed"])
    assert build(cls, unprojected=["lm_head", "classifier", "head", "down"]).projected == {"up.weight"}


@pytest.mark.parametrize("backbone", [lambda: Net(), lambda: nn.Sequential(nn.Embedding(11, 3), nn.Flatten(),
                                                                           nn.Tanh(), nn.Flatten(), )])
def test_a_rank_that_projects_nothing_warns(backbone):
    with pytest.warns(UserWarning, match="projects no tensor"):
        module = build(backbone=backbone(), rank=64)
    assert module.projected == set()


def test_a_private_step_never_projects_a_sum_clipped_in_full():
    """If the engine handed back full per-example-clipped sums for a projected weight (its transform replaced), the
    module projected the clipped SUM: ``|P^T G|`` then exceeds ``C`` (up to ``sigma_max(P) C``) and the noise covers
    less than one example. Refused before the release instead."""
    module = build()
    module.engine.transform = None
    trainer = quiet_trainer(max_steps=2)
    with pytest.raises(ConfigError, match="came back unprojected"):
        trainer.fit(module, poisson_loader(tokens(), 0.5, seed=1))
    assert module.privacy.ledger.total_count == 0
    matrix = gaussian_projection(projector_seed(3, 0, 1), 9, RANK).double()
    assert torch.linalg.matrix_norm(matrix, ord=2) > 1.5  # (how far above C such a projected clipped sum can reach)


def test_a_projector_cached_on_another_device_is_drawn_again_on_the_parameters():
    """A module fitted again on another device within the same period of F steps found its cached projectors on
    the first device (its engine then failed at ``g @ P``); the same matrix is drawn again on the new device."""
    from lit_zodp.per_example.transforms import Projection
    from lit_zodp.projection import SeededProjections

    param = torch.zeros(9, 14)
    projections = SeededProjections(["w"], RANK, 10)
    projections.run_seed = 3
    projections.at_step(4)
    first = projections.projection("w", param).matrix.clone()
    projections._matrices["w"] = Projection(torch.empty(9, RANK, device="meta"), "left")  # (as if on another device)
    projections.at_step(7)
    again = projections.projection("w", param)
    assert again.matrix.device == param.device and torch.equal(again.matrix, first)


def test_a_resume_without_a_configured_seed_continues_the_checkpoints_projectors(tmp_path):
    """No ``seed``: the run seed drawn at the first fit is the checkpoint's public state, and the resumed fit draws
    the same ``P`` from it (a fresh draw would change the subspace under the projected moments)."""
    first = build(seed=None)
    path = _checkpoint(first, poisson_loader(tokens(), 0.25, seed=1), 3, tmp_path / "k.ckpt")
    resumed = build(seed=None)
    torch.manual_seed(12345)  # (another process's torch seed)
    trainer = quiet_trainer(max_steps=4)
    trainer.fit(resumed, poisson_loader(tokens(), 0.25, seed=1), ckpt_path=str(path))
    assert resumed.run_seed == first.run_seed
    for a, b in zip(first.projections_at(3), resumed.projections_at(3)):
        assert (a is None and b is None) or torch.equal(a.matrix, b.matrix)

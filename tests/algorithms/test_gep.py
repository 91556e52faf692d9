"""GEP (Yu et al. 2021), the PAZO paper's fourth FO+PUB baseline: the authors' groups and bases, the power method, one
step against a naive implementation (per-example gradients by autograd), each part's sensitivity, the twin, the
accounting, an audit of the two releases, and the configuration errors."""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_zodp.algorithms import GEP, SGD, DPSGD, NonPrivateGEP
from lit_zodp.algorithms.gep import (ANCHOR_STREAM, EMBEDDING, RESIDUAL, anchor_subspace, bases_per_group,
                                     parameter_groups)
from lit_zodp.errors import LitZodpWarning, PrivacyConfigError
from lit_zodp.per_example import PerExampleGradientEngine
from lit_zodp.privacy import FullBatchSampler, PrivacyComponent
from lit_zodp.privacy.audit import accounted_mu, gaussian_mu, gaussian_spread
from lit_zodp.zo.seeds import derive_seed
from tests.algorithms.test_pazo import PRIVATE_SET, PUBLIC_SET, gradient_at, loaders, one_step, rows
from tests.conftest import blobs, collate_tensors, mlp, poisson_loader, quiet_trainer

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers.*", "ignore:`noise_seed` is set")

OPTIONS = dict(num_bases=6, num_groups=2)  # 227 MLP parameters: 2 + 3 bases, both parts non-zero


def flat(tensors):
    return torch.cat([t.flatten() for t in tensors])


# ------------------------------------------------------------------------------------------ groups, bases, subspace
def test_groups_and_bases_follow_the_authors_code():
    """``group_params``: equal consecutive parts, the remainder to the last; bases ``floor(K sqrt(n_g) / sum sqrt)``."""
    assert parameter_groups(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert parameter_groups(2, 3) == [(0, 2)]  # two empty groups dropped
    assert bases_per_group(30, [100, 100, 102]) == [9, 9, 10]  # floor(9.97), floor(9.97), floor(10.07)
    assert bases_per_group(1000, [100, 400]) == [100, 400]  # floor(333.3), floor(666.7): capped at the groups' sizes
    assert bases_per_group(10, [4]) == [4]


def test_the_power_method_spans_the_anchor_gradients_top_subspace():
    """Orthonormal columns; many iterations converge to the top singular subspace; one iteration with as many bases
    as anchors holds every anchor gradient exactly (G = G V V^T)."""
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(12, 12, generator=g))
    v, _ = torch.linalg.qr(torch.randn(40, 12, generator=g))
    anchors = u @ torch.diag(torch.logspace(1, -1, 12)) @ v.T  # singular values 10 .. 0.1, well separated
    groups = [(0, 40)]
    top = anchor_subspace(anchors, groups, [3], 40, seed=5).bases[0]
    torch.testing.assert_close(top.T @ top, torch.eye(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(top @ top.T, v[:, :3] @ v[:, :3].T, atol=1e-4, rtol=0)
    full = anchor_subspace(anchors, groups, [12], 1, seed=5).bases[0]
    torch.testing.assert_close(anchors @ full @ full.T, anchors, atol=1e-3, rtol=0)  # (float32; |G| = 10)
    assert not torch.equal(anchor_subspace(anchors, groups, [3], 1, seed=6).bases[0],
                           anchor_subspace(anchors, groups, [3], 1, seed=5).bases[0])  # the start is the seed's


def test_bases_past_the_anchor_gradients_span_move_only_as_much_as_the_anchors():
    """More bases than the anchor gradients span (TINY's default 1000 bases, 6 anchors), a repeated anchor gradient
    among them (rank 5): QR's columns past the rank were its round-off, so a last-bit change of the anchors (the DDP
    all-reduce summing in another order) turned them, and the noise ``V z`` with them, by O(1) (the DDP test's 0.19
    after 16 steps). They are the seeded start projected off the anchors' span now: they move by ~ the change."""
    g = torch.Generator().manual_seed(0)
    anchors = torch.randn(6, 40, generator=g)
    anchors[5] = anchors[4]
    nudged = anchors * (1 + 2e-7 * torch.randn(anchors.shape, generator=g))  # (a float32 last bit or two)
    for count in (40, 20):
        basis = anchor_subspace(anchors, [(0, 40)], [count], 1, seed=5).bases[0]
        moved = anchor_subspace(nudged, [(0, 40)], [count], 1, seed=5).bases[0]
        torch.testing.assert_close(basis.T @ basis, torch.eye(count), atol=1e-5, rtol=0)
        torch.testing.assert_close(anchors @ basis @ basis.T, anchors, atol=1e-4, rtol=0)  # the span holds them
        assert (basis - moved).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------ the step, naively
def naive_gep_step(module, before, c0, c1, public_rows=12, dtype=torch.float32):
    """Alg. 1 at sigma = 0 from autograd: per-example gradients of the private set, anchor gradients of the public
    batch, the power method from the module's seed, embedding and residual clipped apart, divided by B."""
    backbone = module.backbone
    x, y = rows(PRIVATE_SET)
    px, py = rows(PUBLIC_SET, public_rows)
    x, px = x.to(dtype), px.to(dtype)
    anchors = torch.stack([flat(gradient_at(backbone, before, px[i:i + 1], py[i:i + 1])) for i in range(len(py))])
    seed = derive_seed(module.run_seed, ANCHOR_STREAM, 0)
    subspace = anchor_subspace(anchors, module.groups, module.bases_counts, module.power_iterations, seed)
    embedding_sum = torch.zeros(subspace.dimension, dtype=dtype)
    residual_sum = torch.zeros(len(anchors[0]), dtype=dtype)
    clipped = [0, 0]
    for i in range(len(y)):
        g = flat(gradient_at(backbone, before, x[i:i + 1], y[i:i + 1]))[None]
        w = subspace.embed(g)[0]
        r = g[0] - subspace.reconstruct(w)
        clipped[0] += bool(w.norm() > c0)
        clipped[1] += bool(r.norm() > c1)
        embedding_sum += w * min(1.0, c0 / float(w.norm()))
        residual_sum += r * min(1.0, c1 / float(r.norm()))
    return (subspace.reconstruct(embedding_sum) + residual_sum) / len(y), clipped


def test_a_gep_step_is_algorithm_1():
    """sigma = 0, both clips binding for some examples: x_{t+1} = x_t - lr (V sum clip_C0(w_i) + sum clip_C1(r_i)) / B."""
    lr, c0, c1 = 0.3, 0.9, 2.0  # about the medians of |w_i| and |r_i|
    module = GEP(mlp(seed=1), lr=lr, clip=c1, embedding_clip=c0, noise_multiplier=0.0, seed=3, **OPTIONS)
    before, after = one_step(module)
    step, clipped = naive_gep_step(module, before, c0, c1)
    assert all(0 < n < len(PRIVATE_SET) for n in clipped), clipped  # each clip binds for some examples, not all
    torch.testing.assert_close(flat(after), flat(before) - lr * step, rtol=1e-5, atol=1e-6)


def test_the_twin_is_sgd_on_the_private_batch():
    """clip = embedding_clip = inf: V sum w_i + sum r_i = sum g_i, so the step is SGD's (to rounding)."""
    twin, sgd = NonPrivateGEP(mlp(seed=1), lr=0.3, seed=3, **OPTIONS), SGD(mlp(seed=1), lr=0.3, seed=3)
    _, after = one_step(twin)
    one_step(sgd)
    torch.testing.assert_close(flat(after), flat(sgd.backbone.parameters()), rtol=1e-5, atol=1e-6)


def test_micro_batches_release_the_sums_of_one_pass():
    lr, c0, c1 = 0.3, 0.9, 2.0  # about the medians of |w_i| and |r_i|
    whole, split = (GEP(mlp(seed=1), lr=lr, clip=c1, embedding_clip=c0, noise_multiplier=0.0, seed=3,
                        micro_batch_size=size, **OPTIONS) for size in (None, 7))
    _, a = one_step(whole)
    _, b = one_step(split)
    torch.testing.assert_close(flat(a), flat(b), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------ privacy
def test_each_part_moves_by_at_most_its_clip_when_one_example_is_removed():
    """Add/remove one: the clipped sums of a batch and of the batch without example j differ by at most C0 in the
    embedding and C1 in the residual, exactly what the two releases are calibrated to; a huge record too."""
    torch.manual_seed(0)
    backbone = mlp(seed=1)
    engine = PerExampleGradientEngine(backbone, mode="hooks")
    x, y = rows(PRIVATE_SET, 16)
    x = x.clone()
    x[3] *= 1e4  # a crafted record: its gradient is far past both clips
    anchors = torch.randn(12, sum(p.numel() for p in backbone.parameters()))
    groups = parameter_groups(anchors.shape[1], 2)
    subspace = anchor_subspace(anchors, groups, bases_per_group(6, [b - a for a, b in groups]), 1, seed=1)

    def split(grads):
        flat_rows = torch.cat([g.reshape(len(g), -1) for g in grads], 1)
        grads.clear()
        w = subspace.embed(flat_rows)
        return [w, subspace.subtract_reconstruction_(flat_rows, w)]

    def sums(keep):
        loss = lambda: nn.functional.cross_entropy(backbone(x[keep]), y[keep], reduction="none")  # noqa: E731
        return engine.clipped_parts(loss, split, (0.3, 0.02)).sums

    everyone = sums(torch.ones(16, dtype=torch.bool))
    for j in range(16):
        keep = torch.ones(16, dtype=torch.bool)
        keep[j] = False
        without = sums(keep)
        assert float((everyone[0] - without[0]).norm()) <= 0.3 * (1 + 1e-6)
        assert float((everyone[1] - without[1]).norm()) <= 0.02 * (1 + 1e-6)
    keep = torch.ones(16, dtype=torch.bool)
    keep[3] = False
    assert float((everyone[0] - sums(keep)[0]).norm()) == pytest.approx(0.3, rel=1e-5)  # the crafted record: at C0


def test_the_step_is_one_gaussian_of_multiplier_sigma():
    """The two releases (noise sqrt(2) sigma C0 and sqrt(2) sigma C1) compose into multiplier sigma: GEP spends what
    DP-SGD spends at the same sigma and sampling, and calibrates the same sigma for a target epsilon."""
    def spent(cls, **extra):
        module = cls(mlp(seed=1), lr=0.05, seed=3, clip=0.5, delta=1e-5, accountant="rdp", **extra)
        if cls is GEP:
            module.use_public_data([rows(PUBLIC_SET)])
        quiet_trainer(max_steps=5).fit(module, poisson_loader(blobs(), 0.25, seed=1))
        return module.privacy

    gep, dpsgd = spent(GEP, noise_multiplier=1.1, **OPTIONS), spent(DPSGD, noise_multiplier=1.1)
    assert gep.epsilon() == pytest.approx(dpsgd.epsilon(), rel=1e-9)
    plan = {release.name: release for release in gep.step_plan}
    assert gep._noise_std(plan[EMBEDDING]) == pytest.approx(math.sqrt(2) * 1.1 * 5.0)
    assert gep._noise_std(plan[RESIDUAL]) == pytest.approx(math.sqrt(2) * 1.1 * 0.5)
    calibrated = spent(GEP, target_epsilon=3.0, **OPTIONS), spent(DPSGD, target_epsilon=3.0)
    assert calibrated[0].noise_multiplier == pytest.approx(calibrated[1].noise_multiplier, rel=1e-6)


def release_scores(canary, steps=150, sigma=1.0, c0=0.02, c1=0.01):
    """One score per step from the two releases, as an attacker who knows every row but the canary reads them: all
    other rows are zero inputs to a bias-free Linear (their gradients 0), the canary's clipped parts point along
    ``a`` and ``r``; score = (B w~ . a / |a| / (sqrt(2) C0) + B r~ . r / |r| / (sqrt(2) C1)) / sqrt(2), in units
    where the canary's shift is 1 and the noise std is sigma. The weights return to the start after each step (every
    step one trial of the same mechanism: the same subspace in both worlds)."""
    from lightning.pytorch.callbacks import Callback

    torch.manual_seed(0)
    backbone = nn.Linear(10, 3, bias=False)
    x = torch.zeros(8, 10)
    y = torch.zeros(8, dtype=torch.long)
    if canary:
        x[0] = torch.linspace(-1, 1, 10) * 3
    module = GEP(backbone, lr=0.1, seed=3, clip=c1, embedding_clip=c0, noise_multiplier=sigma, delta=1e-5,
                 noise_seed=0, num_bases=4, num_groups=2)
    module.use_public_data([blobs(n=12, features=10, classes=3, seed=7).tensors])
    start = {n: p.detach().clone() for n, p in backbone.named_parameters()}

    class Restart(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            with torch.no_grad():
                for n, p in backbone.named_parameters():
                    p.copy_(start[n])

    loader = DataLoader(TensorDataset(x, y), batch_sampler=FullBatchSampler(8, steps_per_epoch=steps),
                        collate_fn=collate_tensors)
    return recorded_fit(module, loader, steps, [Restart()]), module


def recorded_fit(module, loader, steps, callbacks=()):
    """Fit ``module`` and return every ``(name, clipped sum, released)`` of its releases, in order."""
    released = []
    original = PrivacyComponent.release

    def recording(self, clipped_sum, name, **kwargs):
        out = original(self, clipped_sum, name, **kwargs)
        released.append((name, clipped_sum.detach().clone(), out.detach().clone()))
        return out

    PrivacyComponent.release = recording
    try:
        quiet_trainer(max_steps=steps, callbacks=list(callbacks)).fit(module, loader)
    finally:
        PrivacyComponent.release = original
    return released


def scores_of(released, directions, size=8.0, c0=0.02, c1=0.01):
    scores = []
    for t in range(0, len(released), 2):
        (e_name, _, e_out), (r_name, _, r_out) = released[t], released[t + 1]
        assert (e_name, r_name) == (EMBEDDING, RESIDUAL)
        a, r = directions[t // 2]
        scores.append((size * float(e_out @ a) / (math.sqrt(2) * c0) + size * float(r_out @ r) / (math.sqrt(2) * c1))
                      / math.sqrt(2))
    return scores


def test_the_two_releases_show_one_row_exactly_as_much_as_accounted():
    """The canary's parts both clip (|a| = C0, |r| = C1), so with it each step's score is N(1, sigma^2), without it
    N(0, sigma^2): the measured mu must be the ledger's 1 / sigma and the spread sigma (99.9% intervals). Fails if
    either release's noise, either clip, the division by B or the accounted sigma were wrong."""
    inside, module = release_scores(True)
    outside, _ = release_scores(False)
    directions = []
    for t in range(0, len(inside), 2):
        a, r = inside[t][1], inside[t + 1][1]  # the canary world's clipped sums: the canary's clipped parts
        assert float(a.norm()) == pytest.approx(0.02, rel=1e-5) and float(r.norm()) == pytest.approx(0.01, rel=1e-5)
        directions.append((a / a.norm(), r / r.norm()))
    with_canary, without = scores_of(inside, directions), scores_of(outside, directions)
    claimed = accounted_mu(module.privacy.ledger.counts) / math.sqrt(150)
    assert claimed == pytest.approx(1.0)
    measured = gaussian_mu(with_canary, without, confidence=0.999)
    spread = gaussian_spread(without, confidence=0.999)
    assert measured.low <= claimed <= measured.high and spread.low <= 1 / claimed <= spread.high, (measured, spread)


# ------------------------------------------------------------------------------------------ configuration
def test_configuration_errors_are_one_line_each():
    with pytest.raises(PrivacyConfigError, match="GEP embeds materialised per-example gradients"):
        GEP(mlp(), grad_mode="ghost", clip=1.0, noise_multiplier=1.0)
    for bad in (dict(embedding_clip=0.0), dict(num_bases=0), dict(num_groups=0), dict(power_iterations=0)):
        with pytest.raises(PrivacyConfigError, match=f"`{next(iter(bad))}`"):
            GEP(mlp(), clip=1.0, noise_multiplier=1.0, **bad)
    with pytest.raises(PrivacyConfigError, match="finite `embedding_clip` for a private run"):
        GEP(mlp(), clip=1.0, noise_multiplier=1.0, embedding_clip=math.inf)
    GEP(mlp(), clip=math.inf, noise_multiplier=0.0, embedding_clip=math.inf)  # the noiseless ablation


def test_more_bases_than_the_anchor_gradients_span_are_warned_of_once():
    module = GEP(mlp(seed=1), lr=0.1, clip=0.5, noise_multiplier=0.0, seed=3, num_bases=40, num_groups=2)
    with pytest.warns(LitZodpWarning, match=r"more bases than the 12 anchor gradients .* set num_bases <= 24") as seen:
        quiet_trainer(max_steps=2).fit(module, loaders())
    assert sum("anchor gradients" in str(w.message) for w in seen) == 1


def test_a_non_finite_public_batch_is_refused_before_the_release():
    """A NaN anchor gradient made the basis NaN, zeroed every private row and wrote NaN into every weight, silently."""
    from lit_zodp.errors import ConfigError

    x, y = rows(PUBLIC_SET)
    x = x.clone()
    x[2, 0] = float("nan")
    module = GEP(mlp(seed=1), lr=0.1, clip=0.5, noise_multiplier=1.0, seed=3, **OPTIONS).use_public_data([(x, y)])
    with pytest.raises(ConfigError, match="anchor gradients at step 0 are not finite"):
        quiet_trainer(max_steps=2).fit(module, poisson_loader(blobs(), 0.25, seed=1))
    assert module.privacy.ledger.total_count == 0


def test_a_float64_model_steps_in_float64():
    """Float64 weights give float64 anchor gradients, bases and parts (float32 bases failed the embedding's matmul)."""
    lr, c0, c1 = 0.3, 0.9, 2.0
    module = GEP(mlp(seed=1), lr=lr, clip=c1, embedding_clip=c0, noise_multiplier=0.0, seed=3, **OPTIONS)
    quiet_trainer(max_steps=1, precision="64-true").fit(module, loaders())  # (the module and batches in float64)
    after = [p.detach().clone() for p in module.backbone.parameters()]
    assert after[0].dtype == torch.float64
    before = [p.detach().double() for p in mlp(seed=1).parameters()]
    step, _ = naive_gep_step(module, before, c0, c1, dtype=torch.float64)
    # (the engine's clip keeps a 2^-20 margin, the naive one none: clipped rows differ by ~1e-6 of their share)
    torch.testing.assert_close(flat(after), flat(before) - lr * step, rtol=1e-5, atol=1e-7)


def test_under_bf16_autocast_the_bases_and_the_step_stay_float32(monkeypatch):
    """bf16-mixed (found on an H200): the power method's products came out in bfloat16, which CUDA's QR refuses
    (CPU autocast casts QR's input to float32, so the refusal is emulated here). The bases and the step are float32
    again: the step is the naive one's."""
    qr = torch.linalg.qr

    def cuda_qr(matrix, *args, **kwargs):
        if matrix.dtype == torch.bfloat16:
            raise NotImplementedError("\"geqrf_cuda\" not implemented for 'BFloat16'")
        return qr(matrix, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "qr", cuda_qr)
    lr, c0, c1 = 0.3, 0.9, 2.0
    module = GEP(mlp(seed=1), lr=lr, clip=c1, embedding_clip=c0, noise_multiplier=0.0, seed=3, **OPTIONS)
    before = [p.detach().clone() for p in module.backbone.parameters()]
    quiet_trainer(max_steps=1, precision="bf16-mixed").fit(module, loaders())
    assert all(basis.dtype == torch.float32 for basis in module.subspace.bases)
    after = [p.detach().clone() for p in module.backbone.parameters()]
    step, _ = naive_gep_step(module, before, c0, c1)
    # (the forwards ran in bfloat16 autocast, the naive step's in float32: relative differences of bfloat16's 2^-8)
    torch.testing.assert_close(flat(after), flat(before) - lr * step, rtol=3e-2, atol=3e-3)

"""Red-team review 62 (GEP): attacks on the anchor subspace, the two clipped parts and their noise.

Each test would fail if the privacy claim of :mod:`lit_zodp.algorithms.gep` were false: the subspace is a function of
public data (whatever private batch came before), each part moves by at most its clip (crafted records, padding rows,
bf16), both releases get the plan's noise (doubled for replace-one), and a clip changed within a fit stays within it."""

import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_zodp.algorithms import GEP, NonPrivateGEP
from lit_zodp.algorithms.gep import EMBEDDING, RESIDUAL, anchor_subspace, bases_per_group, flatten_rows, \
    parameter_groups
from lit_zodp.per_example import PerExampleGradientEngine
from lit_zodp.privacy import FullBatchSampler, PrivacyComponent
from tests.algorithms.test_gep import OPTIONS, recorded_fit
from tests.algorithms.test_pazo import PRIVATE_SET, PUBLIC_SET, rows
from tests.conftest import blobs, collate_tensors, mlp, poisson_loader, quiet_trainer

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers.*", "ignore:`noise_seed` is set",
                                        "ignore:GEP.*more bases")



def full_batches(x, y, steps):
    return DataLoader(TensorDataset(x, y), batch_sampler=FullBatchSampler(len(y), steps_per_epoch=steps),
                      collate_fn=collate_tensors)


# ------------------------------------------------------------------------------------------ the clips and the plan
def test_an_embedding_clip_raised_within_a_fit_is_capped_at_the_planned_noise():
    """The noise is the plan's, fixed at the fit's start (sqrt(2) sigma C0); a callback (a scheduler, a tuner) raising
    ``embedding_clip`` after it must not let an example's embedding past the planned C0 (review 59's hole in O2NC's
    ``difference_clip``, here for GEP's second clip)."""
    c0, c1 = 0.02, 0.01
    torch.manual_seed(0)
    x, y = torch.zeros(4, 10), torch.zeros(4, dtype=torch.long)
    x[0] = torch.linspace(-1, 1, 10) * 3  # the only example with a gradient: far past both clips
    module = GEP(nn.Linear(10, 3, bias=False), lr=0.1, seed=3, clip=c1, embedding_clip=c0, noise_multiplier=1.0,
                 delta=1e-5, num_bases=4, num_groups=2)
    module.use_public_data([blobs(n=12, features=10, classes=3, seed=7).tensors])

    class Raise(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            pl_module.embedding_clip = 100 * c0

    released = recorded_fit(module, full_batches(x, y, 3), 3, [Raise()])
    embeddings = [float(s.norm()) for name, s, _ in released if name == EMBEDDING]
    assert len(embeddings) == 3
    assert all(norm <= c0 * (1 + 1e-6) for norm in embeddings), embeddings  # (100 C0 clipped it at |w| > C0)
    residuals = [float(s.norm()) for name, s, _ in released if name == RESIDUAL]
    assert all(norm <= c1 * (1 + 1e-6) for norm in residuals), residuals


@pytest.mark.parametrize("neighbours", ["add_remove", "replace_one"])
def test_both_releases_get_their_noise_doubled_for_replace_one(neighbours):
    """Replace-one neighbours move each clipped sum by 2 C0 and 2 C1: both releases' std doubles, not one."""
    module = GEP(mlp(seed=1), lr=0.05, seed=3, clip=0.5, embedding_clip=2.0, noise_multiplier=1.1, delta=1e-5,
                 neighbours=neighbours, **OPTIONS)
    module.use_public_data([rows(PUBLIC_SET)])
    quiet_trainer(max_steps=1).fit(module, poisson_loader(blobs(), 0.25, seed=1))
    plan = {release.name: release for release in module.privacy.step_plan}
    factor = 2.0 if neighbours == "replace_one" else 1.0
    assert module.privacy._noise_std(plan[EMBEDDING]) == pytest.approx(factor * math.sqrt(2) * 1.1 * 2.0)
    assert module.privacy._noise_std(plan[RESIDUAL]) == pytest.approx(factor * math.sqrt(2) * 1.1 * 0.5)


# ------------------------------------------------------------------------------------------ crafted records
def gep_split(subspace):
    def split(grads):
        flat = flatten_rows(grads)
        w = subspace.embed(flat)
        return [w, subspace.subtract_reconstruction_(flat, w)]
    return split


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("record", ["in_subspace", "orthogonal", "huge", "nan", "inf", "tiny"])
def test_a_crafted_record_moves_each_part_by_at_most_its_clip(record, dtype):
    """A record whose gradient lies in V (residual ~ 0), is orthogonal to it (embedding ~ 0), is huge, tiny, or has a
    non-finite loss, in float32, bfloat16 and float16 weights: removing it moves the embedding sum by at most C0 and
    the residual sum by at most C1 (the clip margin covers the parts' rounding); a non-finite one by nothing."""
    torch.manual_seed(0)
    backbone = nn.Linear(10, 3, bias=False).to(dtype)
    engine = PerExampleGradientEngine(backbone, mode="hooks")
    x, y = rows(PRIVATE_SET, 16)
    x = x.clone().to(dtype)
    c0, c1 = 0.3, 0.05
    gen = torch.Generator().manual_seed(1)
    anchors = torch.randn(4, 30, generator=gen)
    groups = parameter_groups(30, 2)
    if record in ("in_subspace", "orthogonal"):  # the record's gradient (p - e_y) x^T, in or orthogonal to each V_g
        x[3] = torch.linspace(1, 2, 10).to(dtype) * 5
        logits = x[3:4].float() @ backbone.weight.float().T
        grad = ((torch.softmax(logits, 1) - nn.functional.one_hot(y[3:4], 3)).T @ x[3:4].float()).reshape(-1)
        if record == "in_subspace":  # far the top direction of each group's anchors
            anchors = torch.cat([100 * grad[None], anchors[:3]])
        else:
            for a, b in groups:
                block = grad[a:b]
                anchors[:, a:b] -= (anchors[:, a:b] @ block)[:, None] * block / block.dot(block)
    elif record == "huge":
        x[3] = x[3] * 1e4 if dtype == torch.float32 else x[3] * 100
    elif record == "tiny":
        x[3] = x[3] * 1e-6
    elif record == "nan":
        x[3, 0] = math.nan
    else:
        x[3, 0] = math.inf
    subspace = anchor_subspace(anchors, groups, bases_per_group(4, [b - a for a, b in groups]), 3, seed=1)
    split = gep_split(subspace)

    def sums(keep):
        loss = lambda: nn.functional.cross_entropy(backbone(x[keep]).float(), y[keep], reduction="none")  # noqa
        return engine.clipped_parts(loss, split, (c0, c1)).sums

    everyone = sums(torch.ones(16, dtype=torch.bool))
    keep = torch.ones(16, dtype=torch.bool)
    keep[3] = False
    without = sums(keep)
    moved = [float((a - b).norm()) for a, b in zip(everyone, without)]
    assert all(torch.isfinite(s).all() for s in everyone)
    assert moved[0] <= c0 * (1 + 1e-6) and moved[1] <= c1 * (1 + 1e-6), moved
    if record in ("nan", "inf"):
        assert max(moved) <= 1e-5 * c1  # (rounding: the other rows' gradients from a batch of 15 or 16)
    if record == "in_subspace" and dtype == torch.float32:
        assert moved[1] < 0.1 * c1 < moved[0]  # the record's gradient is (nearly) all embedding
    if record == "orthogonal" and dtype == torch.float32:
        assert moved[0] < 0.1 * c0 < moved[1]  # ... and here all residual


def test_padding_rows_count_in_neither_part():
    """``fixed_forward_rows``' padding rows (index >= examples) add nothing to either sum, whatever they hold."""
    torch.manual_seed(0)
    backbone = mlp(seed=1)
    engine = PerExampleGradientEngine(backbone, mode="hooks")
    x, y = rows(PRIVATE_SET, 8)
    anchors = torch.randn(6, sum(p.numel() for p in backbone.parameters()))
    groups = parameter_groups(anchors.shape[1], 2)
    subspace = anchor_subspace(anchors, groups, bases_per_group(6, [b - a for a, b in groups]), 1, seed=1)
    split = gep_split(subspace)

    def sums(padded_x, examples):
        loss = lambda: nn.functional.cross_entropy(backbone(padded_x), torch.cat([y, y])[:len(padded_x)],  # noqa
                                                   reduction="none")
        return engine.clipped_parts(loss, split, (0.3, 0.05), examples)

    a = sums(torch.cat([x, torch.zeros(8, 10)]), 8)
    b = sums(torch.cat([x, 1e3 * torch.randn(8, 10)]), 8)
    assert a.batch_size == b.batch_size == 8 and a.norms.shape == (8, 2)
    for s, t in zip(a.sums, b.sums):
        torch.testing.assert_close(s, t, rtol=0, atol=1e-7)


# ------------------------------------------------------------------------------------------ the anchor subspace
class Subspaces(Callback):
    """Each step's anchor subspace, as the module kept it; then the weights go back to the start (every step at the
    same weights, so its subspace depends only on the public batch, the seed and the step)."""

    def __init__(self, backbone):
        self.bases = []
        self.start = [p.detach().clone() for p in backbone.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.bases.append([b.clone() for b in pl_module.subspace.bases])
        with torch.no_grad():
            for p, start in zip(pl_module.backbone.parameters(), self.start):
                p.copy_(start)


def test_the_anchor_subspace_does_not_depend_on_the_private_batches():
    """The weights restored after each step: every step's V must be bitwise the same whatever the private batches were
    (other rows, sizes, a NaN-loss row, an empty Poisson batch): nothing the private pass leaves in the engine (checked
    structures, projections, caches) or in torch's streams may reach the public anchor pass."""
    def subspaces(x, y, loader=None):
        module = GEP(mlp(seed=1), lr=0.1, seed=3, clip=0.5, embedding_clip=1.0, noise_multiplier=1.0, delta=1e-5,
                     **OPTIONS)
        module.use_public_data(DataLoader(PUBLIC_SET, batch_size=6, shuffle=False, collate_fn=collate_tensors))
        seen = Subspaces(module.backbone)
        quiet_trainer(max_steps=4, callbacks=[seen]).fit(module, loader or full_batches(x, y, 4))
        return seen.bases

    x, y = rows(PRIVATE_SET)
    first = subspaces(x, y)
    other_x = x[:5].clone()
    other_x[2, 0] = math.nan
    for second in (subspaces(other_x, y[:5]), subspaces(None, None, poisson_loader(blobs(n=8), 0.05, seed=2))):
        assert len(second) == len(first) == 4
        for a, b in zip(first, second):
            assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not all(torch.equal(u, v) for u, v in zip(first[0], first[1]))  # (steps draw their own start)


def test_the_kept_subspace_is_not_in_a_checkpoint():
    """``self.subspace`` (a function of public data and released weights) stays off the checkpoint's state_dict; the
    checkpoint holds no tensor equal to it or to the step's clipped sums."""
    module = GEP(mlp(seed=1), lr=0.1, seed=3, clip=0.5, embedding_clip=1.0, noise_multiplier=1.0, delta=1e-5,
                 **OPTIONS)
    module.use_public_data([rows(PUBLIC_SET)])
    x, y = rows(PRIVATE_SET)
    trainer = quiet_trainer(max_steps=2)
    released = []
    original = PrivacyComponent.release

    def recording(self, clipped_sum, name, **kwargs):
        released.append(clipped_sum.detach().clone())
        return original(self, clipped_sum, name, **kwargs)

    PrivacyComponent.release = recording
    try:
        trainer.fit(module, full_batches(x, y, 2))
    finally:
        PrivacyComponent.release = original
    assert set(module.state_dict()) == {f"backbone.{n}" for n, _ in module.backbone.named_parameters()}
    checkpoint = trainer._checkpoint_connector.dump_checkpoint()  # (the dict a ModelCheckpoint writes)
    tensors = []

    def walk(value):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(checkpoint)
    secret = [b for b in module.subspace.bases] + released
    for t in tensors:
        for s in secret:
            assert not (t.shape == s.shape and torch.allclose(t.double(), s.double())), t.shape


def dropout_mlp(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 3))


@pytest.mark.parametrize("cls", [GEP, NonPrivateGEP])
def test_every_rank_finds_the_same_subspace_with_dropout(cls):
    """Under DDP each rank runs the anchor pass itself on the same public batch (checked) at the same weights: with a
    dropout backbone the masks must be the same on every rank too, or each rank embeds in its own V_r, the all-reduced
    embedding adds coordinates of different bases, and the ranks' weights part. Two runs of the pass at one point
    stand for two ranks; torch's seeded streams stay where they were (the pass draws nothing from them)."""
    module = cls(dropout_mlp(), lr=0.1, seed=3, clip=0.5, embedding_clip=1.0, **OPTIONS,
                 **(dict(noise_multiplier=1.0, delta=1e-5) if cls is GEP else {}))
    module.use_public_data([rows(PUBLIC_SET)])
    x, y = rows(PRIVATE_SET)
    quiet_trainer(max_steps=1).fit(module, full_batches(x, y, 1))
    module.train()
    before = torch.random.get_rng_state()
    first = module.find_subspace(rows(PUBLIC_SET)).bases
    second = module.find_subspace(rows(PUBLIC_SET)).bases
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(u, v) for u, v in zip(first, second))
    with torch.no_grad():
        module.backbone[2].p = 0.0  # (the masks matter: without dropout the subspace is another)
    assert not all(torch.equal(u, v) for u, v in zip(first, module.find_subspace(rows(PUBLIC_SET)).bases))

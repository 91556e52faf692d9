"""MeZO-BCD (Park et al.) against its pseudo-code written naively: Alg. 1-3 (SGD, the four orders), Alg. 4
(adaptive selection), Alg. 5 (Adam over intervals of nu steps), and the private variant (ours: DPZero's
clipped, noised scalar).

The reference holds no engine: it takes the public direction ``u ~ N(0, I_|B_j|)`` of each step as a tensor
(the module's law, read back from its seed), perturbs a copy of the parameters by ``+-mu u`` on the block
only, forms ``projected_grad = (l+ - l-) / (2 mu)`` from per-example losses, and applies the paper's update
line by line; the block index comes from Alg. 3's formulas (the random order's permutations are the public
stream's ``Shuffle([N])``), Alg. 4's EMA and softmax are computed here. Equal iterates over several block
switches pin the whole step: block choice, locality, the estimator's scale, the update and Adam's local
bias correction. The runs are in float64 (``precision="64-true"``), where the module and the reference agree to
rounding (1e-15 to 1e-12), so no tolerance hides a small deviation; one float32 run covers the default path.
"""

import copy
import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.nn import functional as F

from lit_zodp.algorithms import DPMeZOBCD, MeZOBCD
from lit_zodp.privacy import NoiseSource, clip_scalars
from lit_zodp.zo import derive_seed
from lit_zodp.zo.blocks import random_permutation, sample_block
from tests.algorithms.test_mezo_bcd import deep_mlp
from tests.conftest import blobs, poisson_loader, quiet_trainer

pytestmark = pytest.mark.filterwarnings("ignore:`(noise|sampling)_seed` is set", "ignore:.*val_dataloader.*")

LR, LAM, RATE = 0.05, 1e-2, 0.25


def alg3_index(order: str, t: int, n: int, run_seed: int) -> int:
    """UpdateBlockIdx(order, t, N) of Alg. 3, as printed (1-based)."""
    if order == "ascending":
        return ((t - 1) % n) + 1
    if order == "descending":
        return n - ((t - 1) % n)
    if order == "flip_flop":
        return n - abs(((t - 1) % (2 * n - 2)) - (n - 1))
    pi = random_permutation(run_seed, t // n, n)  # pi <- Shuffle([N]) when t mod N = 0 (pi_0 drawn at the start)
    return int(pi[t % n])


class Record(Callback):
    def __init__(self):
        self.batches, self.blocks = [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches.append(batch)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.blocks.append(module.active_block)


class ReferenceBCD:
    """Alg. 1 / 4 / 5 of Park et al. on explicit tensors; ``clip``/``sigma``: the private variant's release."""

    def __init__(self, module, *, lr=LR, order="random", optimizer="sgd", nu=1, adaptive=None, clip=math.inf,
                 sigma=0.0, noise_seed=None, expected_batch=None, betas=(0.9, 0.999), eps=1e-8,
                 dtype=torch.float64):
        self.module, self.model, self.lr, self.dtype = module, deep_mlp().to(dtype), lr, dtype
        self.order, self.optimizer, self.nu, self.adaptive = order, optimizer, nu, adaptive
        self.clip, self.sigma, self.B = clip, sigma, expected_batch
        self.noise = NoiseSource(noise_seed) if sigma else None
        self.betas, self.eps = betas, eps
        blocks = module.blocks()
        position = {id(p): i for i, p in enumerate(module.backbone.parameters())}
        self.blocks = [[position[id(p)] for p in block.params] for block in blocks]
        self.scores = [0.0] * len(blocks)                                   # Alg. 4: zbar_0 = 0
        self.m = self.v = None
        self.j = None

    def direction(self, j: int, seed: int) -> list:
        """u ~ N(0, I_|B_j|) of the seed, block j's tensors in the model's order (the public law)."""
        engine = self.module.engine
        engine.activate(j - 1)
        by_id = {id(p): u.double() for p, u in zip(engine.block_params(), engine.block_direction(seed))}
        params = list(self.module.backbone.parameters())
        return [by_id[id(params[i])] for i in self.blocks[j - 1]]

    def losses(self, block, values, x, y):
        model = copy.deepcopy(self.model)
        params = list(model.parameters())
        with torch.no_grad():
            for i, value in zip(block, values):
                params[i].copy_(value)
            return F.cross_entropy(model(x.to(self.dtype)), y, reduction="none").double()

    def select(self, t: int) -> int:
        n = len(self.blocks)
        interval = (t - 1) // self.nu + 1                                    # Alg. 5: t_b
        if (t - 1) % self.nu:
            return self.j
        self.m = self.v = None                                               # Alg. 5: m_0 = v_0 = 0
        if self.adaptive is None:
            return alg3_index(self.order, interval, n, self.module.run_seed)
        warmup, tau, _, _ = self.adaptive
        if interval <= warmup:
            return alg3_index("ascending", interval, n, self.module.run_seed)
        z = torch.tensor(self.scores, dtype=torch.float64) / tau
        p = torch.exp(z - z.max())
        return sample_block((p / p.sum()).tolist(), self.module.run_seed, interval)  # j ~ Categorical(p)

    def step(self, t: int, x, y) -> int:
        self.j = j = self.select(t)
        block = self.blocks[j - 1]
        params = list(self.model.parameters())
        theta = [params[i].detach().double().clone() for i in block]
        u = self.direction(j, derive_seed(self.module.run_seed, t - 1, 0))
        plus = self.losses(block, [w + LAM * z for w, z in zip(theta, u)], x, y)
        minus = self.losses(block, [w - LAM * z for w, z in zip(theta, u)], x, y)
        differences = (plus - minus) / (2 * LAM)                             # projected_grad per example
        if self.sigma:                                                       # ours: DPZero's release
            noise = self.noise.gaussian((1,), self.sigma * self.clip, dtype=torch.float64)[0]
            pg = (clip_scalars(differences, self.clip).sum() + noise) / self.B
        elif len(differences):
            pg = clip_scalars(differences, self.clip).mean()
        else:
            pg = torch.zeros((), dtype=torch.float64)
        pg = float(pg)
        if self.adaptive is not None:                                        # Alg. 4: EMA of the active block
            _, _, alpha, signed = self.adaptive
            score = pg if signed else abs(pg)
            self.scores[j - 1] = alpha * score + (1 - alpha) * self.scores[j - 1]
        with torch.no_grad():
            if self.optimizer == "sgd":                                      # Alg. 1: theta_i -= eta pg u
                new = [w - self.lr * pg * z for w, z in zip(theta, u)]
            else:                                                            # Alg. 5: Adam, local t
                local = (t - 1) % self.nu + 1
                b1, b2 = self.betas
                g = [pg * z for z in u]
                if self.m is None:
                    self.m, self.v = [torch.zeros_like(z) for z in g], [torch.zeros_like(z) for z in g]
                self.m = [b1 * m + (1 - b1) * gi for m, gi in zip(self.m, g)]
                self.v = [b2 * v + (1 - b2) * gi * gi for v, gi in zip(self.v, g)]
                new = [w - self.lr * (m / (1 - b1 ** local)) / ((v / (1 - b2 ** local)).sqrt() + self.eps)
                       for w, m, v in zip(theta, self.m, self.v)]
            for i, value in zip(block, new):
                params[i].copy_(value)
        return j


def fit_and_replay(module, steps, precision="64-true", **reference_kwargs):
    record = Record()
    trainer = quiet_trainer(max_steps=steps, callbacks=[record], precision=precision)
    trainer.fit(module, poisson_loader(blobs(), RATE, seed=1))
    dtype = torch.float64 if precision == "64-true" else torch.float32
    reference = ReferenceBCD(module, dtype=dtype, **reference_kwargs)
    chosen = [reference.step(t, x, y) for t, (x, y) in enumerate(record.batches, start=1)]
    return record, reference, chosen


def assert_same_iterates(module, reference, atol=1e-12):
    start = deep_mlp()
    for p, q, p0 in zip(module.backbone.parameters(), reference.model.parameters(), start.parameters()):
        torch.testing.assert_close(p.double(), q.double(), rtol=0, atol=atol)
    moved = max((p.double() - p0.double()).abs().max().item()
                for p, p0 in zip(module.backbone.parameters(), start.parameters()))
    assert moved > 100 * atol  # (the comparison is not of two untrained models)


@pytest.mark.parametrize("order", ["ascending", "descending", "flip_flop", "random"])
def test_alg1_sgd_iterates_equal_the_pseudo_code(order):
    """12 steps over N = 5 blocks: every order's block sequence, and theta_Bj -= eta pg u on the block only."""
    module = MeZOBCD(deep_mlp(), lr=LR, lam=LAM, seed=3, order=order, perturbation="chunked")
    record, reference, chosen = fit_and_replay(module, 12, order=order)
    assert chosen == record.blocks
    assert_same_iterates(module, reference)


def test_alg1_in_float32_equals_the_pseudo_code_up_to_float32_losses():
    """The default precision: the same iterates within what float32 losses allow (relative ~1e-5 of a step)."""
    module = MeZOBCD(deep_mlp(), lr=LR, lam=LAM, seed=3, order="random", perturbation="chunked")
    record, reference, chosen = fit_and_replay(module, 12, precision="32-true", order="random")
    assert chosen == record.blocks
    assert_same_iterates(module, reference, atol=1e-6)


def test_alg5_adam_iterates_equal_the_pseudo_code_across_intervals():
    """nu = 3, four intervals: the moments restart at each interval with the local t in the bias correction."""
    lr = 0.01
    module = MeZOBCD(deep_mlp(), lr=lr, lam=LAM, seed=3, block_optimizer="adam", steps_per_block=3,
                     perturbation="chunked")
    record, reference, chosen = fit_and_replay(module, 12, lr=lr, optimizer="adam", nu=3)
    assert chosen == record.blocks and len(set(chosen)) > 1
    assert_same_iterates(module, reference)


@pytest.mark.parametrize("score", ["abs", "signed"])
def test_alg4_adaptive_iterates_equal_the_pseudo_code(score):
    """T_warm = 5 steps in ascending order, then j ~ softmax(zbar / tau) with zbar the EMA of (|)pg(|)."""
    module = MeZOBCD(deep_mlp(), lr=LR, lam=LAM, seed=3, selection="adaptive", warmup_steps=5, temperature=0.5,
                     ema_decay=0.3, adaptive_score=score, perturbation="chunked")
    record, reference, chosen = fit_and_replay(module, 16, adaptive=(5, 0.5, 0.3, score == "signed"))
    assert chosen == record.blocks and chosen[:5] == [1, 2, 3, 4, 5]
    assert module.block_scores == pytest.approx(reference.scores, rel=1e-12)
    assert_same_iterates(module, reference)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_private_variant_equals_alg1_and_alg5_on_dpzeros_released_scalar(optimizer):
    """pg~ = (sum_i clip_C(d_i) + N(0, (sigma C)^2)) / B, B the expected batch size, in place of projected_grad."""
    clip, sigma, lr = 0.7, 0.9, (LR if optimizer == "sgd" else 0.01)
    module = DPMeZOBCD(deep_mlp(), lr=lr, lam=LAM, seed=3, clip=clip, noise_multiplier=sigma, delta=1e-5,
                       noise_seed=4, block_optimizer=optimizer, steps_per_block=3 if optimizer == "adam" else None,
                       perturbation="chunked")
    record, reference, chosen = fit_and_replay(
        module, 12, lr=lr, optimizer=optimizer, nu=3 if optimizer == "adam" else 1, clip=clip, sigma=sigma,
        noise_seed=4, expected_batch=RATE * len(blobs()))
    assert chosen == record.blocks
    assert_same_iterates(module, reference, atol=1e-10)
    assert module.privacy.ledger.total_count == 12

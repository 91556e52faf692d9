"""DOPE-SGD and DPMD (the PAZO paper's FO+PUB baselines): one step against a naive implementation with per-example
gradients by autograd, the recentred clip's bound, DPMD's schedule, and the configuration errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from lit_zodp.algorithms import DOPESGD, DPMD, NonPrivateDOPESGD, NonPrivateDPMD
from lit_zodp.errors import PrivacyConfigError
from tests.algorithms.test_pazo import PRIVATE_SET, PUBLIC_SET, gradient_at, losses_at, one_step, rows
from tests.conftest import mlp

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers.*")


def per_example_gradients(backbone, params, x, y):
    return [gradient_at(backbone, params, x[i:i + 1], y[i:i + 1]) for i in range(len(y))]


def flat(tensors):
    return torch.cat([t.flatten() for t in tensors])


def test_dope_sgd_clips_each_example_around_the_public_gradient():
    """sigma = 0: x_{t+1} = x_t - lr ((1/B) sum_i clip_C(g_i - g_pub) + g_pub), flat clip over all parameters."""
    lr, clip = 0.3, 2.2
    module = DOPESGD(mlp(seed=1), lr=lr, clip=clip, noise_multiplier=0.0, seed=3)
    before, after = one_step(module)
    center = gradient_at(module.backbone, before, *rows(PUBLIC_SET))
    total = torch.zeros_like(flat(center))
    clipped = 0
    for g in per_example_gradients(module.backbone, before, *rows(PRIVATE_SET)):
        shift = flat(g) - flat(center)
        clipped += bool(shift.norm() > clip)
        total += shift * min(1.0, clip / float(shift.norm()))
    assert 0 < clipped < len(PRIVATE_SET)  # the clip binds for some examples, not all
    step = total / len(PRIVATE_SET) + flat(center)
    torch.testing.assert_close(flat(after), flat(before) - lr * step, rtol=1e-5, atol=1e-6)


def test_the_non_private_dope_sgd_is_sgd_on_the_private_batch():
    """clip = inf: (sum_i (g_i - g_pub)) / n + g_pub = the private batch's mean gradient."""
    module = NonPrivateDOPESGD(mlp(seed=1), lr=0.3, seed=3)
    before, after = one_step(module)
    mean = gradient_at(module.backbone, before, *rows(PRIVATE_SET))
    torch.testing.assert_close(flat(after), flat(before) - 0.3 * flat(mean), rtol=1e-5, atol=1e-6)


def test_dpmd_mixes_the_release_and_the_public_gradient_with_a_cosine_weight():
    """Two steps of T = 3 at sigma = 0: a_0 = 1 (DP-SGD's step), a_1 = cos(pi / 6)."""
    lr, clip = 0.3, 0.5
    module = DPMD(mlp(seed=1), lr=lr, clip=clip, noise_multiplier=0.0, total_steps=3, seed=3)
    assert [module.private_weight(t) for t in (0, 1, 3, 5)] == pytest.approx([1.0, math.cos(math.pi / 6), 0.0, 0.0])
    from tests.algorithms.test_pazo import loaders
    from tests.conftest import quiet_trainer

    x = [p.detach().clone() for p in module.backbone.parameters()]
    quiet_trainer(max_steps=2).fit(module, loaders())
    for t in range(2):
        a = math.cos(math.pi * t / 6)
        clipped = [flat(g) * min(1.0, clip / float(flat(g).norm()))
                   for g in per_example_gradients(module.backbone, x, *rows(PRIVATE_SET))]
        step = a * sum(clipped) / len(PRIVATE_SET) + (1 - a) * flat(gradient_at(module.backbone, x, *rows(PUBLIC_SET)))
        new = flat(x) - lr * step
        x = [v.view_as(p) for v, p in zip(new.split([p.numel() for p in x]), x)]
    torch.testing.assert_close(flat(module.backbone.parameters()), flat(x), rtol=1e-5, atol=1e-6)


def test_dope_sgd_refuses_norm_only_gradient_modes():
    with pytest.raises(PrivacyConfigError, match="DOPE-SGD recentres materialised per-example gradients"):
        DOPESGD(mlp(), grad_mode="ghost", clip=1.0, noise_multiplier=1.0)
    with pytest.raises(PrivacyConfigError, match="`total_steps`"):
        NonPrivateDPMD(mlp(), total_steps=0)


def test_the_canary_audit_refuses_dpmd_while_its_weights_mix_in_the_public_gradient():
    """A DPMD step moves the weights by a_t times the release plus (1 - a_t) times g_pub, which the audit does not
    read: refused (the contract suite audits DPMD with a_t = 1 throughout)."""
    from lit_zodp.callbacks.audit import CanaryAudit
    from lit_zodp.errors import ConfigError
    from tests.algorithms.test_pazo import loaders
    from tests.conftest import quiet_trainer

    module = DPMD(mlp(seed=1), lr=0.1, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    audit = CanaryAudit(*[t[:1] for t in rows(PRIVATE_SET)])
    with pytest.raises(ConfigError, match="DPMD's weights show a_t times its release"):
        quiet_trainer(max_steps=2, callbacks=[audit]).fit(module, loaders())


def test_the_public_gradient_draws_one_dropout_on_every_rank_and_leaves_the_seeded_streams():
    """Review 62: the public gradient's dropout came from secret states, so under DDP each rank stepped along its own
    public gradient and the replicas parted. It is keyed by the run seed, the step and the call (public randomness
    on public data): two ranks agree, the next call in a step (the warm start's batches) draws other masks, and
    torch's seeded streams are where they were."""
    def rank():
        torch.manual_seed(0)
        backbone = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Dropout(0.5), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 3))
        return DOPESGD(backbone, lr=0.1, clip=1.0, noise_multiplier=1.0, seed=3)

    first, second = rank(), rank()
    state = torch.random.get_rng_state()
    mine, theirs = first.public_gradient(rows(PUBLIC_SET)), second.public_gradient(rows(PUBLIC_SET))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    assert not all(torch.equal(a, b) for a, b in zip(mine, first.public_gradient(rows(PUBLIC_SET))))

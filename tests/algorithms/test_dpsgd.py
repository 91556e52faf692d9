"""DP-SGD and DP-Adam: against Opacus on the same model and batch, against Alg. 3 written naively,
their noise law, micro-batching, the norm-only path and the refusal of BatchNorm."""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lit_zodp.algorithms import DPAdam, DPSGD
from lit_zodp.errors import PrivacyConfigError
from lit_zodp.privacy import FullBatchSampler, NoiseSource
from tests.conftest import blobs, collate_tensors, mlp, poisson_loader, quiet_trainer

pytestmark = pytest.mark.filterwarnings("ignore:`(noise|sampling)_seed` is set", "ignore:.*Secure RNG.*",
                                        "ignore:.*Optimal order.*", "ignore:.*non-full backward hook.*")


def flat(model):
    return torch.cat([p.detach().flatten().double() for p in model.parameters()]).clone()


def full_batch(dataset, steps):
    return DataLoader(dataset, batch_sampler=FullBatchSampler(len(dataset), steps_per_epoch=steps),
                      collate_fn=collate_tensors)


def per_example_clipped_sum(model, x, y, clip):
    """The slow reference: one backward per example, flat clip over all parameters, sum."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for xi, yi in zip(x, y):
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(xi[None]), yi[None]), list(model.parameters()))
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        factor = min(1.0, clip / max(norm.item(), 1e-30))
        total = [t + factor * g for t, g in zip(total, grads)]
    return total


def test_a_dpsgd_step_equals_opacus_dp_optimizer_on_the_same_model_and_batch():
    opacus = pytest.importorskip("opacus")
    dataset = blobs(n=48)
    ours = DPSGD(mlp(seed=4), lr=0.3, clip=0.2, noise_multiplier=0.0, seed=0)
    quiet_trainer(max_steps=1).fit(ours, full_batch(dataset, 1))

    model = mlp(seed=4)
    engine = opacus.PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.3),
        data_loader=DataLoader(dataset, batch_size=48), noise_multiplier=0.0, max_grad_norm=0.2,
        poisson_sampling=False)
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    torch.testing.assert_close(flat(ours.backbone), flat(model._module), rtol=1e-6, atol=1e-7)


def test_the_clipped_sum_equals_a_one_example_at_a_time_reference():
    dataset = blobs(n=20)
    x, y = dataset.tensors
    module = DPSGD(mlp(seed=2), lr=1.0, clip=0.3, noise_multiplier=0.0, seed=0)
    clipped = module.private_gradient(x, y)
    reference = per_example_clipped_sum(mlp(seed=2), x, y, 0.3)
    for got, want in zip(clipped.grads, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_dpadam_matches_algorithm_3_written_naively():
    """G~ = (sum_i clip(G_i) + N(0, C^2 sigma^2 I)) / B, then bias-corrected Adam (DP-GRAPE Alg. 2-3)."""
    dataset = blobs(n=40)
    lr, clip, sigma, betas, eps, steps = 0.01, 0.5, 0.8, (0.9, 0.999), 1e-8, 3
    module = DPAdam(mlp(seed=3), lr=lr, clip=clip, noise_multiplier=sigma, noise_seed=11, seed=0)
    quiet_trainer(max_steps=steps).fit(module, full_batch(dataset, steps))

    reference = mlp(seed=3)
    noise = NoiseSource(11)
    params = list(reference.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    x, y = dataset.tensors
    for t in range(1, steps + 1):
        summed = per_example_clipped_sum(reference, x, y, clip)
        flat_noise = noise.gaussian((sum(p.numel() for p in params),), sigma * clip)
        noises = flat_noise.split([p.numel() for p in params])
        with torch.no_grad():
            alpha = lr * math.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t)
            for p, g, z, mi, vi in zip(params, summed, noises, m, v):
                released = (g + z.view_as(g)) / len(dataset)
                mi.mul_(betas[0]).add_(released, alpha=1 - betas[0])
                vi.mul_(betas[1]).addcmul_(released, released, value=1 - betas[1])
                p.sub_(alpha * mi / (vi.sqrt() + eps * math.sqrt(1 - betas[1] ** t)))
    torch.testing.assert_close(flat(module.backbone), flat(reference), rtol=1e-5, atol=1e-6)


class Flat(nn.Module):
    """Logits that do not depend on the parameters: every per-example gradient is exactly 0."""

    num_classes = 3

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(1000, 1)

    def forward(self, x):
        return torch.zeros(x.shape[0], 3) + 0.0 * self.w(torch.zeros(x.shape[0], 1000)).sum()


def test_the_noise_of_a_dpsgd_step_has_std_lr_sigma_clip_over_b():
    sigma, clip, lr, q = 2.0, 0.5, 0.1, 0.1
    dataset = blobs(n=80)
    # a test noise seed: deterministic. From the OS, the two 5-standard-error checks below failed about 1.2e-6 of runs
    # (the chi-square tails of the std of 1001 values, 6.1e-7, and two-sided 5 sigma on their mean, 5.7e-7)
    module = DPSGD(Flat(), lr=lr, clip=clip, noise_multiplier=sigma, seed=0, noise_seed=4)
    before = flat(module.backbone)
    quiet_trainer(max_steps=1).fit(module, poisson_loader(dataset, q))
    step = (flat(module.backbone) - before).numpy()
    expected = lr * sigma * clip / (q * 80)
    assert step.std() == pytest.approx(expected, rel=5 / math.sqrt(2 * step.size))
    assert abs(step.mean()) < 5 * expected / math.sqrt(step.size)


def test_epsilon_matches_opacus_prv_accountant_within_one_percent():
    opacus = pytest.importorskip("opacus")
    module = DPSGD(mlp(), lr=0.1, clip=1.0, noise_multiplier=1.1, delta=1e-5, seed=0)
    quiet_trainer(max_steps=40).fit(module, poisson_loader(blobs(), 0.1))
    accountant = opacus.accountants.PRVAccountant()
    accountant.history = [(1.1, 0.1, 40)]
    bounds = module.privacy.ledger.epsilon(1e-5)
    assert bounds.estimate == pytest.approx(accountant.get_epsilon(1e-5), rel=0.01)
    assert module.privacy.epsilon() == bounds.upper >= bounds.estimate  # what we report: the upper bound


@pytest.mark.parametrize("kwargs", [dict(micro_batch_size=7), dict(grad_mode="ghost"), dict(grad_mode="bookkeeping")])
def test_micro_batches_and_the_norm_only_path_give_the_same_step(kwargs):
    dataset = blobs(n=40)

    def run(**extra):
        module = DPSGD(mlp(seed=5), lr=0.2, clip=0.3, noise_multiplier=1.0, noise_seed=3, seed=0, **extra)
        quiet_trainer(max_steps=3).fit(module, full_batch(dataset, 3))
        return flat(module.backbone)

    torch.testing.assert_close(run(**kwargs), run(), rtol=1e-5, atol=1e-6)


def test_batchnorm_is_refused_with_the_layer_name_and_a_suggestion():
    model = nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    with pytest.raises(PrivacyConfigError, match=r"(?s)1.*GroupNorm"):
        DPSGD(model, lr=0.1, clip=1.0, noise_multiplier=1.0)


@pytest.mark.parametrize("kwargs,match", [(dict(grad_mode="other"), "grad_mode"),
                                          (dict(micro_batch_size=0), "micro_batch_size"),
                                          (dict(momentum=-1.0), "momentum")])
def test_bad_first_order_settings_are_refused(kwargs, match):
    with pytest.raises(PrivacyConfigError, match=match):
        DPSGD(mlp(), lr=0.1, clip=1.0, noise_multiplier=1.0, **kwargs)


def test_the_non_private_twin_takes_the_batch_gradient_without_per_example_gradients():
    """``SGD`` (clip = inf, no noise): ``sum_i grad loss_i`` from one ordinary backward, micro-batch
    by micro-batch, equal to the engine's unclipped sum; a clip on the twin still goes through the engine."""
    from lit_zodp.algorithms import SGD

    x, y = blobs(n=30).tensors
    module = SGD(mlp(seed=2), lr=1.0, micro_batch_size=7)
    module.engine.clipped_sum_microbatched = None  # must not be reached
    summed = module.private_gradient(x, y)
    expected = torch.autograd.grad(nn.functional.cross_entropy(module.backbone(x), y, reduction="sum"),
                                   list(module.backbone.parameters()))
    assert summed.batch_size == 30
    for got, want in zip(summed.grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    clipped = SGD(mlp(seed=2), lr=1.0, clip=0.3).private_gradient(x, y)
    for got, want in zip(clipped.grads, per_example_clipped_sum(mlp(seed=2), x, y, 0.3)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_the_non_private_twin_trains_a_gpt2_candidate_scorer():
    """K = 2 candidate rows per example through GPT-2 (whose shared position ids broke the per-example
    recording, second audit N1): the non-private step needs no per-example attribution."""
    from lit_zodp.algorithms import SGD
    from lit_zodp.backbones import HFCandidateScorer

    torch.manual_seed(0)
    config = dict(model_type="gpt2", vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    module = SGD(HFCandidateScorer(config=config, num_classes=2), lr=0.1)
    ids = torch.randint(3, 40, (4, 2, 6))
    candidates = torch.zeros(4, 2, 6, dtype=torch.long)
    candidates[:, :, 5] = 1
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "candidate_mask": candidates}
    targets = torch.tensor([0, 1, 1, 0])
    summed = module.private_gradient(inputs, targets)
    loss = module.backbone.per_example_loss(inputs, targets).sum()
    expected = torch.autograd.grad(loss, module.engine.params, allow_unused=True)
    for got, want in zip(summed.grads, expected):
        torch.testing.assert_close(got, torch.zeros_like(got) if want is None else want, rtol=1e-5, atol=1e-6)


def test_under_bf16_mixed_precision_the_engine_runs_inside_the_autocast_and_sees_it(monkeypatch):
    """Lightning's ``precision="bf16-mixed"`` calls the engine under autocast, the case of
    tests/per_example/test_pe_rounding.py (bfloat16 sums gave 2 C at B = 1024 before the engine
    turned autocast off for its own work), in "ghost" mode too (its bfloat16 second backward is
    checked against the first pass's norms)."""
    from lit_zodp.per_example import engine as engine_module

    seen, clipped_sum = [], engine_module.PerExampleGradientEngine.clipped_sum

    def spy(self, loss_fn, clip, examples=None, **kwargs):
        result = clipped_sum(self, loss_fn, clip, examples, **kwargs)
        seen.append((torch.is_autocast_enabled("cpu"), {g.dtype for g in result.grads}))
        return result

    monkeypatch.setattr(engine_module.PerExampleGradientEngine, "clipped_sum", spy)
    module = DPSGD(mlp(seed=4), lr=0.3, clip=0.2, noise_multiplier=1.0, grad_mode="ghost")
    quiet_trainer(max_steps=2, precision="bf16-mixed").fit(module, full_batch(blobs(n=48), 2))
    assert seen == [(True, {torch.float32})] * 2


def test_a_decoder_classifier_on_right_padded_inputs_embeds_is_refused_before_a_step():
    """Given ``inputs_embeds``, GPT-2's classifier reads its logit at the last column, padding in a row shorter
    than its batch (transformers cannot find pad ids in embeddings): the row's loss moved with its batch's
    longest row (audit 5, 0.05-0.11 in a logit). First-order fits did not check padding before 2026-11-25."""
    from lit_zodp.backbones import HFSequenceClassifier
    from lit_zodp.privacy import PoissonBatchSampler

    torch.manual_seed(0)
    backbone = HFSequenceClassifier(config=dict(model_type="gpt2", vocab_size=64, n_embd=32, n_layer=2, n_head=2,
                                                n_positions=32, pad_token_id=0, eos_token_id=1), num_classes=2)
    g = torch.Generator().manual_seed(0)
    embeds = [torch.randn(int(k), 32, generator=g) for k in torch.randint(2, 11, (64,), generator=g)]

    def collate(indices):
        width = max([len(embeds[i]) for i in indices], default=1)
        x, mask = torch.zeros(len(indices), width, 32), torch.zeros(len(indices), width, dtype=torch.long)
        for r, i in enumerate(indices):
            x[r, :len(embeds[i])], mask[r, :len(embeds[i])] = embeds[i], 1
        return {"inputs_embeds": x, "attention_mask": mask}, torch.tensor([i % 2 for i in indices])

    loader = DataLoader(list(range(64)), batch_sampler=PoissonBatchSampler(64, 0.3, seed=0), collate_fn=collate)
    module = DPSGD(backbone, lr=0.05, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    with pytest.raises(PrivacyConfigError, match="inputs_embeds reads the last column"):
        quiet_trainer(max_steps=2).fit(module, loader)
    assert module.privacy.ledger.total_count == 0


def test_one_draw_per_step_rechecks_the_losses_and_the_engines_calls(monkeypatch):
    """A first-order module draws each step's re-check once (``recheck_probability``, OS randomness):
    the halves check on its losses and the engine's check of its module's calls run at the same steps;
    two independent draws re-checked about twice as many steps. Here the draws alternate: True, False, ..."""
    from lit_zodp.algorithms import base
    from lit_zodp.per_example import engine as engine_module

    draws, runs = iter([True, False] * 10), {"losses": [], "calls": []}

    def counted(kind, function):
        def run(self, *args, **kwargs):
            runs[kind].append(module.trainer.global_step)
            return function(self, *args, **kwargs)
        return run

    monkeypatch.setattr(base.AlgorithmModule, "_refuse_batch_mixing",
                        counted("losses", base.AlgorithmModule._refuse_batch_mixing))
    monkeypatch.setattr(engine_module.PerExampleGradientEngine, "_refuse_forward_mixing",
                        counted("calls", engine_module.PerExampleGradientEngine._refuse_forward_mixing))
    torch.manual_seed(0)
    module = DPSGD(mlp(seed=1), lr=0.1, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    monkeypatch.setattr(module.recheck_clock, "due", lambda: next(draws))
    quiet_trainer(max_steps=6).fit(module, full_batch(blobs(64), 6))  # every batch can compare
    assert module.engine.recheck_clock.probability == 0.0  # the engine draws nothing of its own
    assert module.engine.recheck_clock._left == float("inf")
    assert runs["losses"] == runs["calls"] == [0, 2, 4]  # the first batch, then the drawn steps


def test_adam_with_an_eps_that_float16_rounds_to_zero_is_refused_before_a_step():
    """Review 20: DPAdam under ``precision="16-true"`` kept Adam's state in float16, where eps = 1e-8 is 0, and its
    weights were inf after the first step. An eps float16 holds trains."""
    module = DPAdam(mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    with pytest.raises(PrivacyConfigError, match=r"`eps`=1e-08 rounds to 0 in the parameters' dtype torch.float16"):
        quiet_trainer(max_steps=3, precision="16-true").fit(module, poisson_loader(blobs(), 0.25))
    assert module.privacy.ledger.total_count == 0
    module = DPAdam(mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5, eps=1e-4)
    quiet_trainer(max_steps=3, precision="16-true").fit(module, poisson_loader(blobs(), 0.25))
    assert module.privacy.steps == 3 and all(torch.isfinite(p).all() for p in module.parameters())


def test_parameters_reparametrised_between_steps_are_refused_in_one_line():
    """Review 20: ``ModelPruning`` re-registers a pruned layer's ``weight`` as ``weight_orig`` at an epoch's end; the
    per-example engine, built for the fit's parameters, then failed with ``AttributeError: 'NoneType' object has no
    attribute 'grads'``. Refused in one line before the next step's forward (nothing released for it)."""
    from lightning.pytorch.callbacks import ModelPruning

    module = DPSGD(mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    trainer = quiet_trainer(max_steps=6, max_epochs=3, callbacks=[ModelPruning("l1_unstructured", amount=0.5)])
    with pytest.raises(PrivacyConfigError, match=r"parameters changed between private steps \(`0.weight_orig`") as info:
        trainer.fit(module, poisson_loader(blobs(), 0.25, steps_per_epoch=2))
    assert "\n" not in str(info.value) and module.privacy.steps == module.privacy.ledger.total_count == 2

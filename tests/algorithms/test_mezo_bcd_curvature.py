"""MeZO-BCD's ``block_lr="curvature"`` (ours): the ZO trace probe against exact Hessians, the median
rule, the rates it puts in the optimizer, checkpoints, and the private variant's public-only probe."""

import math
from itertools import islice

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F

from datamodules import SyntheticClassificationDataModule
from lit_zodp.algorithms import DPMeZOBCD, MeZOBCD
from lit_zodp.errors import ConfigError, PrivacyConfigError
from lit_zodp.zo import PerturbationEngine, make_direction_law, second_differences
from lit_zodp.zo.blocks import median_rate_factors
from lit_zodp.zo.fused import FusedPerturbation
from tests.algorithms.test_mezo_bcd import deep_mlp, params_of
from tests.conftest import blobs, poisson_loader, quiet_trainer

pytestmark = pytest.mark.filterwarnings("ignore:`(noise|sampling)_seed` is set", "ignore:.*val_dataloader.*")


def quadratic(d=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(d, d, generator=g, dtype=torch.float64)
    a = m @ m.T / d + torch.diag(torch.linspace(0.1, 3.0, d, dtype=torch.float64))
    b = torch.randn(d, generator=g, dtype=torch.float64)
    return a, b


# ------------------------------------------------------------------------------ the estimator
def test_second_differences_are_u_A_u_on_a_quadratic_and_average_to_its_trace():
    a, b = quadratic()
    x = nn.Parameter(torch.randn(a.shape[0], dtype=torch.float64))
    start = x.detach().clone()
    engine = PerturbationEngine([x], make_direction_law("gaussian"))

    def f():
        return 0.5 * x @ a @ x + b @ x

    values, exact = [], []
    with torch.no_grad():
        for seed in range(3000):
            value = second_differences(engine, seed, 1e-3, f, f())
            engine.restore_()
            u = engine.direction(seed)[0].double()
            values.append(float(value))
            exact.append(float(u @ a @ u))
    torch.testing.assert_close(torch.tensor(values), torch.tensor(exact), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.detach(), start, rtol=0, atol=1e-12)
    mean, se = torch.tensor(values).mean(), math.sqrt(2 * float((a * a).sum()) / len(values))  # Var u'Au = 2||A||_F^2
    assert abs(float(mean) - float(a.trace())) < 4 * se
    assert abs(float(mean) - float(a.trace()) / 2) > 10 * se  # a 1/(2 lam^2) scaling would be caught


def test_second_differences_with_the_fused_engine_are_u_A_u_in_float32():
    a, b = quadratic(d=16, seed=1)
    x = nn.Parameter(torch.randn(a.shape[0]))
    engine = FusedPerturbation([x], backend="reference")

    def f():
        xd = x.double()
        return (0.5 * xd @ a @ xd + b @ xd).float()

    with torch.no_grad():
        for seed in range(20):
            value = second_differences(engine, seed, 1e-2, f, f())
            engine.restore_()
            u = engine.direction(seed)[0].double()
            # float32 parameters: x + lam u rounds at ~6e-8 |x|, so the difference is exact to ~1e-2
            assert abs(float(value) - float(u @ a @ u)) < 0.02 * float(u @ a @ u)


def test_the_median_rule_scales_only_blocks_above_the_median():
    assert median_rate_factors([4.0, 1.0, 2.0, 8.0, 3.0]) == [0.75, 1.0, 1.0, 0.375, 1.0]
    assert median_rate_factors([4.0, 1.0, 2.0, 8.0]) == [0.5, 1.0, 1.0, 0.25]        # lower median: 2
    assert median_rate_factors([-1.0, 2.0, 5.0]) == [1.0, 1.0, 0.4]                   # negative: keeps lr
    assert median_rate_factors([0.0, -1.0, 3.0]) == [1.0, 1.0, 1.0]                   # no positive median
    sizes = [b.numel for b in MeZOBCD(deep_mlp(embed_width=64)).blocks()]
    median = sorted(sizes)[(len(sizes) - 1) // 2]
    assert median_rate_factors(sizes) == [min(1.0, median / s) for s in sizes]        # "size" is the same rule


def exact_block_traces(module, batches):
    """Mean over ``batches`` of ``tr(H_jj)`` of the batch mean loss, by autograd in float64."""
    model = module.backbone.double()
    names = {id(p): n for n, p in model.named_parameters()}
    traces = []
    for block in module.blocks():
        total = 0.0
        for inputs, targets in batches:
            flat = torch.cat([p.detach().reshape(-1) for p in block.params])
            shapes = [(names[id(p)], p.shape, p.numel()) for p in block.params]

            def loss(v, inputs=inputs, targets=targets, shapes=shapes):
                params, start = {}, 0
                for name, shape, n in shapes:
                    params[name] = v[start:start + n].view(shape)
                    start += n
                logits = torch.func.functional_call(model, params, (inputs.double(),))
                return F.cross_entropy(logits, targets)

            total += float(torch.autograd.functional.hessian(loss, flat).diagonal().sum())
        traces.append(total / len(batches))
    module.backbone.float()
    return traces


def test_the_block_estimates_equal_the_exact_block_hessian_traces():
    module = MeZOBCD(deep_mlp(), lr=1e-2, seed=3, block_lr="curvature", curvature_probes=150)
    batches = list(islice(poisson_loader(blobs(), 0.25, seed=1), 3))
    before = params_of(module)
    traces, errors = module.estimate_block_curvature(batches)
    exact = exact_block_traces(module, batches)
    assert len(traces) == len(errors) == module.num_blocks == 5
    for name, t, e, x in zip(module.block_names, traces, errors, exact):
        assert 0 < e < 0.5 * max(abs(x), 1.0), name
        assert abs(t - x) < 4 * e, (name, t, e, x)
    for p, q in zip(params_of(module), before):
        # every probe restored: 450 restores per block, each within an ulp (a missed one: ~1e-3)
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ in a fit
def fixed_traces(monkeypatch, traces):
    calls = []

    def estimate(self, batches):
        seen = list(batches)
        calls.append(seen)
        return list(traces), [0.0] * len(traces)

    monkeypatch.setattr(MeZOBCD, "estimate_block_curvature", estimate)
    return calls


def test_a_fit_trains_with_the_estimated_rates_exactly_as_with_those_factors_given(monkeypatch):
    traces = [2.0, 1.0, 3.0, 12.0, 4.0]                        # median 3: factors 1, 1, 1, 0.25, 0.75
    factors = median_rate_factors(traces)
    loader = poisson_loader(blobs(), 0.25, seed=1)
    given = MeZOBCD(deep_mlp(), lr=0.05, seed=3, order="ascending", block_lr=factors)
    quiet_trainer(max_steps=10).fit(given, loader)

    calls = fixed_traces(monkeypatch, traces)
    curvature = MeZOBCD(deep_mlp(), lr=0.05, seed=3, order="ascending", block_lr="curvature", curvature_batches=4)
    quiet_trainer(max_steps=10).fit(curvature, poisson_loader(blobs(), 0.25, seed=1))
    assert len(calls) == 1 and len(calls[0]) == 4 and all(len(y) > 0 for _, y in calls[0])
    assert curvature.curvature_factors == factors == [1.0, 1.0, 1.0, 0.25, 0.75]
    rate = {id(p): g["lr"] for g in curvature.zo_optimizer.param_groups for p in g["params"]}
    for block, factor in zip(curvature.blocks(), factors):
        assert all(rate[id(p)] == pytest.approx(0.05 * factor) for p in block.params)
    for p, q in zip(params_of(curvature), params_of(given)):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_the_probe_reads_the_training_data_and_logs_its_estimates(caplog):
    module = MeZOBCD(deep_mlp(), lr=1e-2, seed=3, block_lr="curvature", curvature_batches=3, curvature_probes=2)
    with caplog.at_level("INFO"):
        quiet_trainer(max_steps=1).fit(module, poisson_loader(blobs(), 0.25, seed=1))
    assert module.curvature_factors == median_rate_factors(module.block_curvature["trace"])
    assert all(e > 0 for e in module.block_curvature["se"])   # 3 batches x 2 probes per block
    assert "block_lr='curvature'" in caplog.text and "head: tr(H)" in caplog.text


def test_a_resumed_run_keeps_its_rates_and_does_not_probe_again(tmp_path, monkeypatch):
    calls = fixed_traces(monkeypatch, [2.0, 1.0, 3.0, 12.0, 4.0])
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = MeZOBCD(deep_mlp(), lr=0.05, seed=3, block_lr="curvature")
    quiet_trainer(max_steps=3, enable_checkpointing=True, callbacks=[checkpoint]).fit(
        first, poisson_loader(blobs(), 0.25, seed=1))
    assert len(calls) == 1

    monkeypatch.setattr(MeZOBCD, "estimate_block_curvature", lambda self, b: pytest.fail("probed again"))
    resumed = MeZOBCD(deep_mlp(), lr=0.05, seed=3, block_lr="curvature")
    quiet_trainer(max_steps=5).fit(resumed, poisson_loader(blobs(), 0.25, seed=1), ckpt_path=tmp_path / "last.ckpt")
    assert resumed.global_step == 5 and resumed.curvature_factors == first.curvature_factors
    rate = {id(p): g["lr"] for g in resumed.zo_optimizer.param_groups for p in g["params"]}
    assert [rate[id(b.params[0])] for b in resumed.blocks()] == pytest.approx([0.05 * f for f in first.curvature_factors])
    loaded = MeZOBCD.load_from_checkpoint(tmp_path / "last.ckpt", backbone=deep_mlp())
    assert loaded.curvature_factors == first.curvature_factors


def test_resuming_a_run_of_another_block_lr_with_curvature_is_refused(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    quiet_trainer(max_steps=2, enable_checkpointing=True, callbacks=[checkpoint]).fit(
        MeZOBCD(deep_mlp(), lr=0.05, seed=3), poisson_loader(blobs(), 0.25, seed=1))
    with pytest.raises(ConfigError, match="checkpoint holds no estimated block rates"):
        quiet_trainer(max_steps=4).fit(MeZOBCD(deep_mlp(), lr=0.05, seed=3, block_lr="curvature"),
                                       poisson_loader(blobs(), 0.25, seed=1), ckpt_path=tmp_path / "last.ckpt")


@pytest.mark.parametrize("kwargs,match", [
    ({"block_lr": "curvatur"}, r"`block_lr` in \['uniform', 'size', 'curvature'\]"),
    ({"block_lr": "curvature", "curvature_batches": 0}, "curvature_batches"),
    ({"block_lr": "curvature", "curvature_probes": 1.5}, "curvature_probes"),
])
def test_bad_curvature_options_are_refused_in_one_line(kwargs, match):
    with pytest.raises(PrivacyConfigError, match=match):
        MeZOBCD(deep_mlp(), **kwargs)


def test_the_rates_are_not_available_before_they_are_estimated():
    with pytest.raises(RuntimeError, match="estimated when a fit starts"):
        MeZOBCD(deep_mlp(), block_lr="curvature").block_lr_factors()


# ------------------------------------------------------------------------------ the private variant
def private_module(**kwargs):
    backbone = deep_mlp()
    backbone.embed = nn.Linear(16, 8)
    backbone.head = nn.Linear(8, 2)
    return DPMeZOBCD(backbone, lr=1e-2, seed=3, clip=1.0, noise_multiplier=1.0, num_classes=2,
                     block_lr="curvature", curvature_batches=3, **kwargs)


def test_the_private_variant_probes_public_data_only(monkeypatch):
    data = SyntheticClassificationDataModule(batch_size=32, n_samples=512, public_fraction=0.25, sampling_seed=1)
    seen = []
    estimate = DPMeZOBCD.estimate_block_curvature

    def recording(self, batches):
        batches = list(batches)
        seen.extend(batches)
        return estimate(self, batches)

    monkeypatch.setattr(DPMeZOBCD, "estimate_block_curvature", recording)
    module = private_module()
    quiet_trainer(max_steps=2).fit(module, datamodule=data)
    public = {tuple(x.tolist()) for x, _ in data.public_dataset}
    private = {tuple(x.tolist()) for x, _ in data.private_dataset}
    rows = [tuple(row.tolist()) for inputs, _ in seen for row in inputs]
    assert len(seen) == 3 and rows and all(row in public for row in rows)
    assert not any(row in private for row in rows)
    assert module.curvature_factors is not None and module.privacy.ledger.total_count == 2


def test_the_private_variant_without_public_data_is_refused_before_the_first_step():
    data = SyntheticClassificationDataModule(batch_size=32, n_samples=512, sampling_seed=1)
    with pytest.raises(PrivacyConfigError, match="estimates the rates on PUBLIC data"):
        quiet_trainer(max_steps=2).fit(private_module(), datamodule=data)

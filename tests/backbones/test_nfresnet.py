"""NFResNet18 (Brock et al. 2021's NF-ResNet recipe on ResNet-18): layout and parameter count, no normalisation
layer, signal propagation at init against the analytic ``beta^2``, Scaled Weight Standardization, exact per-example
gradients in every engine mode without the vmap fallback, DP-SGD and PAZO-M steps through a Trainer, refusals."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lit_zodp.backbones import NFResNet18, count_parameters
from lit_zodp.backbones.nfresnet import RELU_GAIN, ScaledStdConv2d, expected_variances
from lit_zodp.errors import ConfigError
from lit_zodp.per_example import PerExampleGradientEngine, samplers
from lit_zodp.per_example.checks import batchnorm_layers, refuse_batchnorm
from lit_zodp.per_example.conv import _conv_grads
from lit_zodp.per_example.std_conv import standardized_conv_grads, standardized_conv_norms, standardized_conv_summed
from lit_zodp.privacy.clipping import SHARE_MARGIN
from tests.per_example.test_pe_rounding import _tf32

NORMALISATION = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.modules.instancenorm._InstanceNorm,
                 nn.LocalResponseNorm)


def small(**kwargs):
    """Width 1/16 (4-8-16-32 channels), the cifar stem: fast enough for exact per-example checks."""
    return NFResNet18(**{"num_classes": 3, "in_chans": 2, "width": 0.0625, "stem": "cifar", **kwargs})


def test_resnet18_layout_and_parameter_count():
    """ResNet-18's 11,181,642 parameters at 10 classes (each BatchNorm's weight and bias become a conv's bias and
    gain); ImageNet stem: 224 -> 7x7 feature maps."""
    model = NFResNet18()
    assert count_parameters(model) == 11_181_642
    assert len(model.blocks) == 8 and [b.transition for b in model.blocks] == [False, False] + [True, False] * 3
    assert model.features(torch.zeros(1, 3, 224, 224)).shape == (1, 512, 7, 7)
    assert small().features(torch.zeros(1, 2, 32, 32)).shape == (1, 32, 4, 4)


def test_no_normalisation_layer_and_the_batchnorm_refusal_does_not_fire(contract, independent):
    model = small()
    assert not [m for m in model.modules() if isinstance(m, NORMALISATION)]
    assert batchnorm_layers(model) == []
    refuse_batchnorm(model)  # no PrivacyConfigError
    torch.manual_seed(0)
    x, y = torch.randn(4, 2, 16, 16), torch.randint(0, 3, (4,))
    contract(model, x, y)
    independent(model.train(), x, y)


def test_expected_variances_follow_the_recipe():
    """1 after the stem, + alpha^2 per block, reset to 1 + alpha^2 after each stage's first block."""
    a2 = 0.04
    expected = [1, 1 + a2, 1 + 2 * a2] + [1 + a2, 1 + 2 * a2] * 3
    assert expected_variances((2, 2, 2, 2), 0.2) == pytest.approx(expected)
    assert [b.beta ** 2 for b in NFResNet18().blocks] == pytest.approx(expected[:-1])


def test_signal_propagation_matches_the_analytic_variance():
    """Brock et al.'s signal propagation plots: the average channel variance of the residual stream at each block's
    input (and after the last) is ``beta^2``; the branches' variance-preserving SWS convolutions make it so at init.
    Tolerance 15%: a width-1/2 net on 32 random 32x32 inputs is within 5% in the first three stages and 11% in the
    last, whose 4x4 maps make the 3x3 convolutions read zero padding at 31% of their taps (on 16x16 inputs, 2x2 maps:
    31% below the prediction)."""
    torch.manual_seed(0)
    model = NFResNet18(width=0.5, stem="cifar", zero_init_last=False).eval()
    stream = []
    hooks = [b.register_forward_pre_hook(lambda m, args: stream.append(args[0])) for b in model.blocks]
    with torch.no_grad():
        stream.append(model.features(torch.randn(32, 3, 32, 32)))
    for hook in hooks:
        hook.remove()
    measured = torch.tensor([h.var(dim=(0, 2, 3)).mean().item() for h in stream])
    predicted = torch.tensor(expected_variances((2, 2, 2, 2), 0.2))
    assert ((measured / predicted - 1).abs() < 0.15).all(), (measured, predicted)
    squared_means = torch.tensor([h.mean(dim=(0, 2, 3)).pow(2).mean().item() for h in stream])
    assert (squared_means < 0.2 * predicted).all()  # SWS keeps the channel means from growing


def test_zero_init_last_starts_every_block_as_the_identity():
    model = small()
    assert all(not b.conv2.gain.detach().any() for b in model.blocks)
    block = model.blocks[1]
    h = torch.randn(2, 4, 8, 8)
    torch.testing.assert_close(block(h), h)


def test_standardized_weights_have_zero_mean_and_the_scaled_variance():
    """Each output channel of ``W_hat``: mean 0, biased variance ``(g gamma)^2 / N * v / (v + eps)``."""
    torch.manual_seed(0)
    conv = ScaledStdConv2d(5, 7, 3)
    with torch.no_grad():
        conv.gain.uniform_(0.5, 2.0)
    w_hat = conv.standardized_weight().double().flatten(1)
    raw_var = conv.weight.double().flatten(1).var(1, unbiased=False)
    expected = (conv.gain.double() * RELU_GAIN) ** 2 / 45 * raw_var / (raw_var + conv.eps)
    torch.testing.assert_close(w_hat.mean(1), torch.zeros(7, dtype=torch.float64), atol=1e-8, rtol=0)
    torch.testing.assert_close(w_hat.var(1, unbiased=False), expected, rtol=1e-5, atol=0)
    x = torch.randn(2, 5, 6, 6)
    torch.testing.assert_close(conv(x), F.conv2d(x, w_hat.float().view_as(conv.weight), conv.bias))


def _problem(batch=5, stem="cifar", side=8):
    """A float64 small net with non-zero gains and biases (so every parameter gets a gradient) and its batch."""
    torch.manual_seed(0)
    model = small(zero_init_last=False, stem=stem).double()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("gain", "bias")):
                param.add_(0.1 * torch.randn_like(param))
    x, y = torch.randn(batch, 2, side, side, dtype=torch.float64), torch.randint(0, 3, (batch,))
    return model, x, y


def _loop(model, x, y):
    """The slow reference: one autograd backward per example."""
    named = list(model.named_parameters())
    rows = [torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), [p for _, p in named])
            for i in range(len(x))]
    return {name: torch.stack([row[k] for row in rows]) for k, (name, _) in enumerate(named)}


def _assert_close(got, want, rtol=1e-9):
    assert (got - want).norm() <= rtol * want.norm() + 1e-15, ((got - want).norm(), want.norm())


@pytest.mark.parametrize("mode, stem, side", [("hooks", "cifar", 8), ("vmap", "cifar", 8), ("hooks", "imagenet", 16)])
def test_per_example_gradients_equal_a_loop_of_autograd(mode, stem, side):
    model, x, y = _problem(stem=stem, side=side)
    expected = _loop(model, x, y)
    engine = PerExampleGradientEngine(model, mode=mode)
    got = dict(zip(engine.names, engine.per_example_gradients(lambda: F.cross_entropy(model(x), y, reduction="none"))))
    for name in expected:
        _assert_close(got[name], expected[name])
    assert engine.last_recomputed == ({} if mode == "hooks" else {name: "" for name in expected})


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bookkeeping", "vmap"])
def test_clipped_sums_and_norms_equal_the_loop_in_every_mode(mode):
    """The flat clip (Abadi et al. 2016) of the loop's gradients, at a clip that binds for some examples; the layer
    rule serves every parameter (no vmap fallback) outside mode "vmap"."""
    model, x, y = _problem()
    expected = _loop(model, x, y)
    norms = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
    clip = float(norms.median())
    factors = (clip * (1 - SHARE_MARGIN) / norms).clamp(max=1)
    engine = PerExampleGradientEngine(model, mode=mode)
    clipped = engine.clipped_sum(lambda: F.cross_entropy(model(x), y, reduction="none"), clip)
    torch.testing.assert_close(clipped.norms.double(), norms, rtol=1e-6, atol=0)  # (the guards' margins)
    for name, got in zip(engine.names, clipped.grads):
        _assert_close(got, torch.einsum("b,b...->...", factors, expected[name]), rtol=1e-6)
    assert (engine.last_recomputed == {}) == (mode != "vmap")


def test_the_norm_rule_bounds_the_float64_norms_and_the_sum_rule_sums_the_rows():
    """On float32 rows of one layer: the guarded norms (closed form, module doc of ``std_conv``) lie at or above the
    exact norms of the float64 pulled-back gradients, within the guards' margins (1e-3
    here); the sum rule equals the rows' float64 sum."""
    torch.manual_seed(0)
    conv = ScaledStdConv2d(3, 5, 3, 2, 1)
    with torch.no_grad():
        conv.gain.uniform_(0.5, 2.0)
    a, g = torch.randn(6, 3, 9, 9), torch.randn(6, 5, 5, 5)
    exact = {name: rows.double()
             for name, rows in standardized_conv_grads(conv.double(), a.double(), g.double()).items()}
    conv.float()
    bounds = standardized_conv_norms(conv, a, g)
    for name in ("weight", "gain", "bias"):
        norm_sq = exact[name].flatten(1).pow(2).sum(1)
        assert (bounds[name] >= norm_sq).all() and (bounds[name] <= norm_sq * (1 + 1e-3)).all(), name
    for name, total in standardized_conv_summed(conv, a, g).items():
        _assert_close(total.double(), exact[name].sum(0), rtol=1e-6)


def test_a_naive_conv_rule_is_caught_by_the_coverage_check(monkeypatch):
    """The plain conv rule on a standardised conv gives the gradient of ``W_hat``, not of ``W``: the engine's
    numeric coverage check finds it and recomputes those parameters, which then equal the loop."""
    naive = samplers.Sampler(lambda layer, a, g: {**standardized_conv_grads(layer, a, g), **_conv_grads(layer, a, g)})
    monkeypatch.setitem(samplers._SAMPLERS, ScaledStdConv2d, naive)
    model, x, y = _problem()
    expected = _loop(model, x, y)
    engine = PerExampleGradientEngine(model, mode="hooks")
    got = dict(zip(engine.names, engine.per_example_gradients(lambda: F.cross_entropy(model(x), y, reduction="none"))))
    assert any(name.endswith(".weight") and name != "head.weight" for name in engine.last_recomputed)
    for name in expected:
        _assert_close(got[name], expected[name])


@pytest.mark.filterwarnings("ignore:`(noise|sampling)_seed` is set", "ignore:.*Optimal order.*")
@pytest.mark.parametrize("algorithm", ["DPSGD", "DPZero", "PAZOM"])
def test_one_private_step_through_a_trainer(algorithm):
    """Digits resized to 16x16, one channel: one step moves the parameters, the validation loss after it is finite."""
    from datamodules import DigitsDataModule
    from lit_zodp import algorithms
    from tests.conftest import quiet_trainer

    torch.manual_seed(0)
    backbone = NFResNet18(num_classes=10, in_chans=1, width=0.0625, stem="cifar")
    module = getattr(algorithms, algorithm)(backbone, lr=0.05, clip=1.0, noise_multiplier=1.0, seed=0, noise_seed=1)
    datamodule = DigitsDataModule(batch_size=16, image_size=16, public_fraction=0.05,
                                  public_in_step=algorithm == "PAZOM", sampling_seed=0)
    before = [p.detach().clone() for p in backbone.parameters()]
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 1
    assert any(not torch.equal(b, p) for b, p in zip(before, backbone.parameters()))
    (metrics,) = quiet_trainer(limit_val_batches=2).validate(module, datamodule=datamodule, verbose=False)
    assert math.isfinite(metrics["val_loss"]) and 0 < metrics["val_loss"] < 10


@pytest.mark.parametrize("kwargs, message", [
    ({"stem": "cifar10"}, r"Expected `stem` in \['imagenet', 'cifar'\], but got 'cifar10'"),
    ({"width": 0}, "Expected `width` to be a positive float, but got 0"),
    ({"alpha": -0.2}, "Expected `alpha` to be a positive float, but got -0.2"),
    ({"num_classes": 0}, "Expected `num_classes` to be a positive int, but got 0"),
    ({"in_chans": 2.0}, "Expected `in_chans` to be a positive int, but got 2.0"),
])
def test_bad_options_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ConfigError, match=message) as error:
        NFResNet18(**kwargs)
    assert "\n" not in str(error.value)


def test_data_mismatch_names_the_option():
    model = NFResNet18(in_chans=3)
    assert model.data_mismatch(text=False, example_shape=(3, 32, 32)) is None
    assert "set `in_chans: 1`" in model.data_mismatch(text=False, example_shape=(1, 32, 32))
    assert "tokenized text" in model.data_mismatch(text=True, example_shape=None)


class _TF32Conv2d(torch.autograd.Function):
    """``F.conv2d`` as cuDNN runs it under TF32: every product's operands rounded to a 10-bit mantissa, in the
    forward and in both backward convolutions (input and weight gradients)."""

    @staticmethod
    def forward(x, weight, bias, stride, padding, dilation, groups):
        return _conv2d(_tf32(x), _tf32(weight), bias, stride, padding, dilation, groups)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, *ctx.args = inputs
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, g):
        (x, weight), (stride, padding, dilation, groups) = ctx.saved_tensors, ctx.args
        dx = torch.nn.grad.conv2d_input(x.shape, _tf32(weight), _tf32(g), stride, padding, dilation, groups)
        dw = torch.nn.grad.conv2d_weight(_tf32(x), weight.shape, _tf32(g), stride, padding, dilation, groups)
        return dx, dw, g.sum((0, 2, 3)) if ctx.has_bias else None, None, None, None, None


_conv2d = F.conv2d


@pytest.fixture
def emulated_tf32_convs(monkeypatch):
    """cuDNN's TF32 convolutions (torch's default on CUDA), and the setting saying so."""
    from lit_zodp.per_example import rounding

    monkeypatch.setattr(F, "conv2d", lambda x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1:
                        _TF32Conv2d.apply(x, weight, bias, stride, padding, dilation, groups))
    monkeypatch.setattr(rounding, "float32_conv_setting", lambda device_type: "tf32")


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bookkeeping"])
def test_with_tf32_convolutions_the_checks_keep_the_fast_path(emulated_tf32_convs, mode):
    """The H200 run (2026-11-30) sent ``blocks.7.conv1`` to the exact fallback under cuDNN's TF32; emulated here, the
    checks' IEEE tolerances sent 27-36 of the 62 parameters there (and the fallback cannot vmap this emulation). The
    tolerances of a model with convolutions now take TF32's product error (``rounding.working_eps``): no parameter
    is recomputed, and the clipped sum is the float64 loop's within TF32's rounding."""
    model, x, y = _problem()
    expected = _loop(model, x, y)
    norms = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
    clip = float(norms.median())
    factors = (clip * (1 - SHARE_MARGIN) / norms).clamp(max=1)
    model, x = model.float(), x.float()
    engine = PerExampleGradientEngine(model, mode=mode)
    clipped = engine.clipped_sum(lambda: F.cross_entropy(model(x), y, reduction="none"), clip)
    assert engine.last_recomputed == {}
    torch.testing.assert_close(clipped.norms.double(), norms, rtol=1e-2, atol=0)
    for name, got in zip(engine.names, clipped.grads):
        _assert_close(got.double(), torch.einsum("b,b...->...", factors, expected[name]), rtol=1e-2)


@pytest.fixture(params=[False, True], ids=["ieee_convs", "tf32_convs"])
def cudnn_tf32(request):
    """cuDNN's float32 convolutions in IEEE float32 or in TF32 (torch's default)."""
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = request.param
    yield request.param
    torch.backends.cudnn.allow_tf32 = previous


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["hooks", "ghost", "bookkeeping"])
def test_clipped_sums_on_cuda_equal_the_cpu_loop(mode, cudnn_tf32):
    """The layer rule on CUDA (float32; with TF32 convolutions, hence 1e-2) against the CPU float64 loop, with no
    parameter recomputed by vmap, with IEEE and with TF32 convolutions. With cuDNN's TF32 (torch's default) the H200
    run of 2026-11-30 sent ``blocks.7.conv1`` to the exact fallback in "ghost" and "bookkeeping": the checks'
    tolerances followed the float32 matmul setting, not cuDNN's (now both: emulated on the CPU above)."""
    model, x, y = _problem()
    expected = _loop(model, x, y)
    norms = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
    clip = float(norms.median())
    factors = (clip * (1 - SHARE_MARGIN) / norms).clamp(max=1)
    model, x, y = model.float().cuda(), x.float().cuda(), y.cuda()
    engine = PerExampleGradientEngine(model, mode=mode)
    clipped = engine.clipped_sum(lambda: F.cross_entropy(model(x), y, reduction="none"), clip)
    assert engine.last_recomputed == {}
    torch.testing.assert_close(clipped.norms.double().cpu(), norms, rtol=1e-2, atol=0)
    for name, got in zip(engine.names, clipped.grads):
        _assert_close(got.double().cpu(), torch.einsum("b,b...->...", factors, expected[name]), rtol=1e-2)

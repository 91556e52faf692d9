"""Each layer rule ("hooks" mode) equals the torch.func vmap reference; other layers use the fallback."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lit_zodp.per_example import PerExampleGradientEngine, register_sampler, sampler_for
from lit_zodp.per_example import samplers
from tests.per_example.helpers import assert_grads_match, engine_per_example, reference



def check_layer(layer, x, *, modes=("hooks", "vmap"), recomputed=None):
    """Per-example gradients of ``sum(out * w)`` (a fixed random readout) against the reference."""
    torch.manual_seed(1)
    with torch.no_grad():
        w = torch.randn_like(layer(x[:1]))[0]

    def loss_of_one(xi):
        return (layer(xi) * w).sum()

    def loss_fn():
        return (layer(x) * w).flatten(1).sum(1)

    expected = reference(layer, loss_of_one, x)
    for mode in modes:
        assert_grads_match(engine_per_example(layer, loss_fn, mode, recomputed), expected)
    return expected


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 4), (5, 3, 4), (5, 2, 3, 4)])
def test_linear_2d_and_sequence_inputs(shape, bias):
    torch.manual_seed(0)
    check_layer(nn.Linear(4, 3, bias=bias), torch.randn(*shape))


def test_frozen_weight_trainable_bias():
    layer = nn.Linear(4, 3)
    layer.weight.requires_grad_(False)
    grads = check_layer(layer, torch.randn(5, 2, 4))
    assert set(grads) == {"bias"}


def test_embedding_with_padding_idx_has_zero_padding_rows():
    torch.manual_seed(0)
    layer = nn.Embedding(7, 3, padding_idx=0)
    idx = torch.randint(0, 7, (5, 6))
    idx[:, :2] = 0
    grads = check_layer(layer, idx)
    ours = engine_per_example(layer, lambda: layer(idx).flatten(1).sum(1))["weight"]
    assert torch.count_nonzero(ours[:, 0]) == 0
    assert grads["weight"].abs().sum() > 0


def test_embedding_shared_position_ids_are_per_example():
    """``emb(arange(T)[None])`` broadcast over the batch (BERT/GPT-2 position ids)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"tok": nn.Embedding(9, 4), "pos": nn.Embedding(6, 4)})
    idx = torch.randint(0, 9, (3, 5))
    weights = torch.randn(3, 5, 4)

    def forward(ids):
        return model["tok"](ids) + model["pos"](torch.arange(ids.shape[1])[None])

    root = _Wrap(forward, model)
    expected = reference(root, lambda i, w: (root(i) * w).sum(), idx, weights)
    assert_grads_match(engine_per_example(root, lambda: (root(idx) * weights).sum((1, 2))), expected)


def test_one_dimensional_positions_with_t_equal_b_are_not_mistaken_for_the_batch():
    """nanoGPT's ``wpe(arange(T))`` is ``[T, D]``; with ``T == B`` its rows look like examples.
    1-D embedding inputs are never taken as batched: the whole-module recomputation handles them."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"tok": nn.Embedding(9, 4), "pos": nn.Embedding(4, 4)})
    idx, weights = torch.randint(0, 9, (4, 4)), torch.randn(4, 4, 4)

    def forward(ids):
        return model["tok"](ids) + model["pos"](torch.arange(ids.shape[1]))

    root = _Wrap(forward, model)
    expected = reference(root, lambda i, w: (root(i) * w).sum(), idx, weights)
    got = engine_per_example(root, lambda: (root(idx) * weights).sum((1, 2)), recomputed={"inner.pos.weight": ""})
    assert_grads_match(got, expected)


class _Wrap(nn.Module):
    """A root module around a forward function (its parameters live in ``inner``)."""

    def __init__(self, fn, inner):
        super().__init__()
        self.fn, self.inner = fn, inner

    def forward(self, *args):
        return self.fn(*args)


@pytest.mark.parametrize("shape", [(4, 6), (4, 3, 6), (4, 3, 2, 6)])
def test_layer_norm_over_last_dim(shape):
    torch.manual_seed(0)
    layer = nn.LayerNorm(6)
    with torch.no_grad():
        layer.weight.normal_(), layer.bias.normal_()
    check_layer(layer, torch.randn(*shape))


def test_layer_norm_over_two_dims_and_without_bias():
    torch.manual_seed(0)
    check_layer(nn.LayerNorm((3, 4)), torch.randn(4, 2, 3, 4))
    check_layer(nn.LayerNorm(4, bias=False), torch.randn(4, 3, 4))


def test_group_norm_and_rms_norm():
    torch.manual_seed(0)
    check_layer(nn.GroupNorm(2, 6), torch.randn(4, 6, 3, 2))
    check_layer(nn.GroupNorm(3, 6), torch.randn(4, 6))
    check_layer(nn.RMSNorm(5), torch.randn(4, 3, 5))


def test_timm_norms_use_the_rules():
    """timm's LayerNorm/RmsNorm override ``forward`` with the same maths and are registered."""
    from timm.layers import LayerNorm, RmsNorm

    torch.manual_seed(0)
    check_layer(LayerNorm(5).double(), torch.randn(4, 3, 5))
    check_layer(RmsNorm(5).double(), torch.randn(4, 3, 5))


def test_conv1d():
    torch.manual_seed(0)
    check_layer(nn.Conv1d(3, 4, 3, stride=2, padding=1, dilation=2), torch.randn(4, 3, 11))


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("kwargs", [
    dict(kernel_size=3),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=(2, 3), stride=(2, 1), padding=(1, 2), dilation=(2, 1)),
    dict(kernel_size=3, padding="same", dilation=2),
    dict(kernel_size=4, padding="same"),
    dict(kernel_size=3, padding=1, padding_mode="reflect"),
    dict(kernel_size=3, padding=2, padding_mode="circular", bias=False),
    dict(kernel_size=3, groups=2),
])
def test_conv2d_stride_padding_dilation_groups(kwargs):
    torch.manual_seed(0)
    check_layer(nn.Conv2d(4, 6, **kwargs), torch.randn(3, 4, 7, 8))


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 3), st.integers(1, 2), st.integers(0, 2), st.integers(1, 2), st.sampled_from([1, 2]),
       st.integers(6, 9))
def test_conv2d_config_sweep(kernel, stride, padding, dilation, groups, width):
    torch.manual_seed(0)
    channels = 2 * groups
    layer = nn.Conv2d(channels, channels, kernel, stride=stride, padding=padding, dilation=dilation, groups=groups)
    check_layer(layer, torch.randn(3, 2 * groups, 5, width), modes=("hooks",))


def test_layers_without_rule_use_the_vmap_fallback():
    """Conv3d, a Linear subclass with its own forward, and a custom module have no rule."""
    torch.manual_seed(0)

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.gamma = nn.Parameter(torch.randn(3))

        def forward(self, x):
            return x * torch.sigmoid(self.gamma)

    assert sampler_for(nn.Conv3d(1, 1, 1)) is None and sampler_for(Scaled(2, 2)) is None
    check_layer(nn.Conv3d(2, 3, 2, padding=1), torch.randn(3, 2, 3, 4, 3), recomputed={"weight": "", "bias": ""})
    check_layer(nn.Sequential(Scaled(4, 3), Gate(), nn.Linear(3, 2)), torch.randn(5, 2, 4),
                recomputed={"0.weight": "0", "0.bias": "0", "1.gamma": "1"})


def test_subclass_inheriting_forward_uses_the_rule():
    assert sampler_for(nn.modules.linear.NonDynamicallyQuantizableLinear(2, 2)) is not None
    assert sampler_for(nn.Embedding(3, 2, max_norm=1.0)) is None  # rewrites the weight in forward


def test_multihead_attention_params_used_outside_their_module():
    """``nn.MultiheadAttention`` uses ``out_proj.weight`` without calling ``out_proj``: the
    coverage check sends it to the whole-module recomputation."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(6, 2, batch_first=True)
    x = torch.randn(3, 4, 6)
    w = torch.randn(4, 6)
    expected = reference(attn, lambda xi: (attn(xi, xi, xi)[0] * w).sum(), x)
    got = engine_per_example(attn, lambda: (attn(x, x, x)[0] * w).sum((1, 2)),
                             recomputed=dict.fromkeys(["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"], ""))
    assert_grads_match(got, expected)


def test_register_sampler_for_a_custom_layer(monkeypatch):
    monkeypatch.setattr(samplers, "_SAMPLERS", dict(samplers._SAMPLERS))

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gamma = nn.Parameter(torch.randn(4))

        def forward(self, x):
            return x * self.gamma

    calls = []

    @register_sampler(Scale)
    def scale_grads(layer, a, g):
        calls.append(1)
        return {"gamma": (a * g).reshape(a.shape[0], -1, 4).sum(1)}

    torch.manual_seed(0)
    check_layer(Scale(), torch.randn(5, 3, 4), modes=("hooks",))
    assert calls


def test_register_sampler_rejects_non_modules():
    from lit_zodp.errors import PrivacyConfigError

    with pytest.raises(PrivacyConfigError, match="nn.Module subclasses"):
        register_sampler(int)
    with pytest.raises(PrivacyConfigError, match="at least one"):
        register_sampler()


def test_linear_mixed_ghost_rule_long_sequence():
    """2 T^2 >= in * out: ghost mode materialises the weight norm; both ways agree with hooks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 20)).double()
    x = torch.randn(4, 30, 3)

    def loss_fn():
        return F.logsigmoid(model(x)).sum((1, 2))

    hooks = PerExampleGradientEngine(model).clipped_sum(loss_fn, 1.0)
    for mode in ("ghost", "bookkeeping"):
        ghost = PerExampleGradientEngine(model, mode=mode).clipped_sum(loss_fn, 1.0)
        torch.testing.assert_close(ghost.norms, hooks.norms)
        for a, b in zip(ghost.grads, hooks.grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)

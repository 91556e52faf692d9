"""Models as users bring them, dropped into the modules (review 34): outputs that are not logits, layouts the
zeroth-order engine did not expect, and uses of a shared embedding call that the per-example engine's expansion broke.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from lit_zodp.algorithms import DPSGD, DPMeZOBCD, DPZero
from lit_zodp.backbones import per_example_loss, predict
from lit_zodp.errors import ConfigError
from lit_zodp.per_example import PerExampleGradientEngine
from lit_zodp.zo import PerturbationEngine
from lit_zodp.zo.fused import FusedPerturbation
from tests.conftest import blobs, mlp, poisson_loader, quiet_trainer
from tests.per_example.helpers import assert_rel_close, flat_clipped_sum, loop_reference

PRIVACY = dict(clip=1.0, noise_multiplier=1.0, delta=1e-5, seed=0)


class DictOutput(nn.Module):
    """A plain module returning what a Hugging Face or peft model returns: a mapping holding ``logits``."""

    def __init__(self, kind="dict"):
        super().__init__()
        self.net, self.kind = mlp(seed=1), kind

    def forward(self, x):
        logits = self.net(x)
        if self.kind == "model_output":
            from transformers.modeling_outputs import SequenceClassifierOutput
            return SequenceClassifierOutput(logits=logits)
        return (logits,) if self.kind == "tuple" else {"logits": logits, "hidden": x}


@pytest.mark.parametrize("kind", ["dict", "model_output"])
def test_a_module_returning_a_mapping_with_logits_is_trained_on_them(kind):
    if kind == "model_output":
        pytest.importorskip("transformers")
    model, (x, y) = DictOutput(kind), blobs(n=8)[:]
    expected = F.cross_entropy(model.net(x), y, reduction="none")
    torch.testing.assert_close(per_example_loss(model, x, y), expected, rtol=0, atol=0)
    torch.testing.assert_close(predict(model, x), model.net(x), rtol=0, atol=0)
    for cls in (DPZero, DPSGD):
        before = [p.detach().clone() for p in model.parameters()]
        quiet_trainer(max_steps=2).fit(cls(model, lr=0.05, **PRIVACY), poisson_loader(blobs(), 0.25))
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_module_returning_anything_else_is_refused_in_one_line():
    (x, y) = blobs(n=4)[:]
    with pytest.raises(ConfigError, match=r"^The backbone DictOutput returned a tuple, but .* must return its logits") \
            as error:
        per_example_loss(DictOutput("tuple"), x, y)
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------------------------ memory formats
def conv_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 2))


@pytest.mark.parametrize("engine", [PerturbationEngine, lambda ps: FusedPerturbation(ps, backend="reference")])
def test_a_channels_last_weight_is_perturbed_along_its_direction_and_keeps_its_layout(engine):
    torch.manual_seed(0)
    start = torch.randn(4, 3, 3, 3)
    weight = nn.Parameter(start.clone().to(memory_format=torch.channels_last))
    zo = engine([weight])
    zo.perturb_(7, 0.5)
    u = zo.direction(7)[0]
    assert weight.is_contiguous(memory_format=torch.channels_last) and u.shape == weight.shape
    torch.testing.assert_close(weight.detach(), start + 0.5 * u, rtol=0, atol=1e-6)
    zo.restore_()
    torch.testing.assert_close(weight.detach(), start, rtol=0, atol=1e-6)


def test_a_weight_that_is_not_one_dense_buffer_is_refused_in_one_line():
    weight = nn.Parameter(torch.randn(4, 6)[:, ::2])
    with pytest.raises(ValueError, match=r"^A parameter of shape \(4, 3\) .* is not one dense buffer"):
        PerturbationEngine([weight])


@pytest.mark.parametrize("cls", [DPZero, DPMeZOBCD])
def test_a_channels_last_model_trains_in_zeroth_order_modules(cls):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 3, 8, 8, generator=g)
    data = TensorDataset(x, (x.mean((1, 2, 3)) > 0).long())
    model = conv_net().to(memory_format=torch.channels_last)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    quiet_trainer(max_steps=2).fit(cls(model, lr=0.05, **PRIVACY), poisson_loader(data, 0.5))
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


# ------------------------------------------------------------------------- a shared embedding call
class RepeatedPrompt(nn.Module):
    """peft's prompt tuning: virtual tokens embedded once as ``[1, T]`` and ``repeat``-ed to the batch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.prompt, self.body, self.head = nn.Embedding(3, 10), nn.Linear(10, 10), nn.Linear(10, 3)

    def forward(self, x):
        prompts = self.prompt(torch.arange(3).unsqueeze(0)).repeat(len(x), 1, 1)     # [B, 3, 10]
        states = torch.tanh(self.body(torch.cat([prompts, x.unsqueeze(1)], 1)))      # [B, 4, 10]
        return self.head(states.mean(1))


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bookkeeping"])
def test_a_repeated_shared_embedding_call_gives_the_loop_references_clipped_sum(mode):
    """The engine expanded the ``[1, T]`` call to ``[B, T]``, so ``repeat(B, 1, 1)`` made ``B^2`` rows and every batch
    of two or more examples failed in ``torch.cat``; it now runs such a forward unexpanded (the embedding through the
    torch.func fallback)."""
    model = RepeatedPrompt().double()
    x, y = blobs(n=6)[:]
    x = x.double()
    loss_fn = lambda: F.cross_entropy(model(x), y, reduction="none")  # noqa: E731
    engine = PerExampleGradientEngine(model, mode=mode)
    out = engine.clipped_sum(loss_fn, clip=1.25)
    reference = loop_reference(model, lambda xi, yi: F.cross_entropy(model(xi), yi).sum(), x, y)
    sums, norms = flat_clipped_sum(reference, engine.names, 1.25)
    assert 0 < int((norms > 1.25).sum()) < len(norms)
    for name, got in zip(engine.names, out.grads):
        assert_rel_close(got, sums[name], 1e-6, name)
    assert engine.last_recomputed and all(name.startswith("prompt") for name in engine.last_recomputed)

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

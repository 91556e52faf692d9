"""Eval mode at every zeroth-order step (:class:`lit_zodp.zo.eval_mode.EvalMode`): every layer, at the cost of
reading their flags where none is set."""

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lit_zodp.algorithms import DPZero, MeZO
from lit_zodp.zo.eval_mode import EvalMode
from tests.conftest import blobs, poisson_loader, quiet_trainer


class CountingTrain(nn.Sequential):
    """A Sequential that counts its ``train(mode)`` calls (``eval()`` is ``train(False)``)."""

    calls = 0

    def train(self, mode=True):
        self.calls += 1
        return super().train(mode)


def nested():
    return CountingTrain(nn.Linear(4, 8), nn.Sequential(nn.Dropout(0.5), nn.Linear(8, 3)))


def flags(module):
    return [layer.training for layer in module.modules()]


def test_every_layer_goes_to_eval_after_the_trainers_train_mode():
    module, keeper = nested().train(), EvalMode()
    keeper.ensure(module)
    assert not any(flags(module))


def test_a_nested_layer_alone_in_train_mode_is_found():
    module, keeper = nested().eval(), EvalMode()
    keeper.ensure(module)
    module[1][0].train()  # the root stays in eval mode
    keeper.ensure(module)
    assert not any(flags(module))


@pytest.mark.parametrize("how", ["setattr", "append", "add_module"])
def test_a_layer_added_between_steps_is_seen(how):
    module, keeper = nested().eval(), EvalMode()
    keeper.ensure(module)
    added = nn.Dropout(0.5)  # (in train mode, as every new layer)
    if how == "setattr":
        module[1].extra = added
    elif how == "append":
        module[1].append(added)
    else:
        module.add_module("extra", added)
    keeper.ensure(module)
    assert not added.training and not any(flags(module))


def test_nothing_is_set_where_every_layer_is_in_eval_mode():
    module, keeper = nested().eval(), EvalMode()
    calls = module.calls
    for _ in range(3):
        keeper.ensure(module)
    assert module.calls == calls


def test_another_module_gets_its_own_layers():
    first, second, keeper = nested().eval(), nested().eval(), EvalMode()
    keeper.ensure(first)
    second[1][0].train()
    keeper.ensure(second)
    assert not any(flags(second))


class LayerModes(Callback):
    """The nested dropout's mode at each forward of the training steps, and validation in between (Lightning puts
    the model back in train mode after it)."""

    def __init__(self, layer):
        self.modes = []
        layer.register_forward_pre_hook(lambda m, args: self.modes.append(m.training))


@pytest.mark.parametrize("cls,kwargs", [(MeZO, {}), (DPZero, dict(clip=1.0, noise_multiplier=1.0))])
def test_every_layer_of_a_zeroth_order_step_is_in_eval_mode_across_epochs_and_validation(cls, kwargs):
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(10, 16), nn.Sequential(nn.Dropout(0.5), nn.Tanh()), nn.Linear(16, 3))
    module = cls(backbone, lr=0.01, seed=0, **kwargs)
    modes = LayerModes(backbone[1][0])
    validation = []
    module.validation_step = lambda batch, batch_idx: validation.append(backbone[1][0].training)
    trainer = quiet_trainer(max_epochs=3, limit_train_batches=2, limit_val_batches=1, callbacks=[modes])
    trainer.fit(module, train_dataloaders=poisson_loader(blobs(64), 0.25),
                val_dataloaders=torch.utils.data.DataLoader(blobs(16, seed=5), batch_size=8))  # (held out)
    assert len(validation) == 3 and len(modes.modes) >= 12 and not any(modes.modes)

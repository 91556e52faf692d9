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


def tiny_levit():
    """A model with timm LeViT's attention, whose eval mode caches its attention biases until its next ``train()``."""
    from timm.models.levit import Attention

    class TinyLeViT(nn.Module):
        num_classes = 3

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.inp = nn.Linear(10, 16 * 8)
            self.attn = Attention(dim=8, key_dim=4, num_heads=2, attn_ratio=2, resolution=4)
            self.head = nn.Linear(8, 3)
            with torch.no_grad():
                self.attn.attention_biases.normal_()

        def forward(self, x):
            return self.head(self.attn(self.inp(x).view(-1, 16, 8)).mean(1))

    return TinyLeViT()


def uncached(layer, device):
    return layer.attention_biases[:, layer.attention_bias_idxs]


def test_a_layers_eval_mode_cache_of_its_parameters_is_emptied_before_each_forward():
    """Review 23: timm's LeViT (also EfficientFormer, TinyViT, EfficientViT-MSRA) keeps its attention biases in an
    eval-mode cache until its next ``train()``; a zeroth-order step forwards in eval mode, so the ``x - lam u`` forward
    read the biases of ``x + lam u`` and every later step those of the fit's first forward: their perturbations and
    updates never reached the loss. The differences now equal those of the same layer without a cache."""
    cached, reference = MeZO(tiny_levit(), lam=1e-2), MeZO(tiny_levit(), lam=1e-2)
    reference.backbone.attn.get_attention_biases = uncached.__get__(reference.backbone.attn)
    x, y = torch.randn(6, 10), torch.randint(0, 3, (6,))
    for module in (cached, reference):
        module.configure_optimizers()
    with torch.no_grad():
        for seed in (1, 2, 3):
            torch.testing.assert_close(cached.directional_differences(seed, x, y),
                                       reference.directional_differences(seed, x, y), rtol=0, atol=0)
            for module in (cached, reference):  # the point moves (a step's update would)
                module.restore()
                for parameter in module.backbone.parameters():
                    parameter.add_(0.25)


def test_a_validation_forward_after_a_step_reads_the_updated_attention_biases():
    """The last private forward of a step (at ``x - lam u``) fills LeViT's cache, and the update then moves the
    weights. Review 53 asked whether a validation forward reads the cached biases of that perturbed point: it does
    not, because timm's ``train(mode)`` empties the cache for either mode and Lightning's validation loop calls
    ``eval()``. Each validation forward equals the uncached layer's at the current weights (a guard against a timm
    or Lightning change)."""
    differences = []

    class Checked(MeZO):
        def validation_step(self, batch, batch_idx):
            reference = tiny_levit()
            reference.load_state_dict(self.backbone.state_dict())
            reference.attn.get_attention_biases = uncached.__get__(reference.attn)
            reference.eval()
            differences.append(float((self.backbone(batch[0]) - reference(batch[0])).abs().max()))
            return super().validation_step(batch, batch_idx)

    module = Checked(tiny_levit(), lr=0.5, lam=1e-2, seed=3)
    trainer = quiet_trainer(max_steps=4, val_check_interval=2, check_val_every_n_epoch=None)
    trainer.fit(module, train_dataloaders=poisson_loader(blobs(64), 0.5, steps_per_epoch=8),
                val_dataloaders=torch.utils.data.DataLoader(blobs(16, seed=5), batch_size=8))
    assert len(differences) == 4 and max(differences) == 0.0

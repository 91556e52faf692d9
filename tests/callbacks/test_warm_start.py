"""PublicWarmStart: SGD on the public split before the first private step (PAZO App. C.1), once per run."""

import copy

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from datamodules import DigitsDataModule
from lit_zodp.algorithms import DPSGD, DPZero
from lit_zodp.backbones import TinyMLP
from lit_zodp.callbacks import PublicWarmStart
from lit_zodp.errors import ConfigError
from tests.conftest import blobs, mlp, poisson_loader, quiet_trainer


def digits(**kwargs):
    return DigitsDataModule(batch_size=32, public_fraction=0.1, data_seed=3, **kwargs)


def tiny_mlp():
    torch.manual_seed(0)
    return TinyMLP(in_features=64, num_classes=10, hidden=16)


class WeightsAtFirstStep(Callback):
    """The backbone's weights when the first private step starts (after every on_train_start)."""

    def __init__(self):
        self.weights = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.weights is None:
            self.weights = [p.detach().clone() for p in module.backbone.parameters()]


def reference_warm_start(backbone, datamodule, *, epochs, lr, momentum, batch_size):
    """The warm start written out: torch SGD on the mean cross-entropy of the public loader's batches."""
    datamodule.setup("fit")
    optimizer = torch.optim.SGD(backbone.parameters(), lr=lr, momentum=momentum)
    loader = datamodule.public_dataloader(batch_size, shuffle=True)  # (one loader: reshuffled at each pass)
    for _ in range(epochs):
        for inputs, targets in loader:
            optimizer.zero_grad()
            F.cross_entropy(backbone(inputs), targets).backward()
            optimizer.step()
    return [p.detach() for p in backbone.parameters()]


@pytest.mark.parametrize("algorithm", [DPZero, DPSGD])
def test_the_first_private_step_starts_from_sgd_on_the_public_split(algorithm):
    backbone = tiny_mlp()
    expected = reference_warm_start(copy.deepcopy(backbone), digits(), epochs=2, lr=0.1, momentum=0.9,
                                    batch_size=16)
    warm, seen = PublicWarmStart(epochs=2, lr=0.1, momentum=0.9, batch_size=16), WeightsAtFirstStep()
    module = algorithm(backbone, lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    quiet_trainer(max_steps=1, callbacks=[warm, seen]).fit(module, datamodule=digits())
    assert len(seen.weights) == len(expected)
    for got, want in zip(seen.weights, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert warm.done and len(warm.epoch_losses) == 2 and warm.epoch_losses[1] < warm.epoch_losses[0]
    assert all(p.grad is None for p in module.backbone.parameters())  # nothing left for the private step to read


def test_it_reads_public_rows_only():
    datamodule = digits()
    module = DPZero(tiny_mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    read = []
    original = module.public_gradient

    def recording(batch, params=None):
        read.append(batch[0].reshape(len(batch[0]), -1))
        return original(batch, params)

    module.public_gradient = recording
    quiet_trainer(max_steps=1, callbacks=[PublicWarmStart(epochs=1)]).fit(module, datamodule=datamodule)
    rows = torch.cat(read)
    public = torch.stack([datamodule.public_dataset[i][0].reshape(-1) for i in range(len(datamodule.public_dataset))])
    private = torch.stack([datamodule.private_dataset[i][0].reshape(-1) for i in range(len(datamodule.private_dataset))])
    assert len(rows) == len(public)  # one epoch: each public row once
    assert all((public == row).all(1).any() for row in rows)
    assert not any((private == row).all(1).any() for row in rows if not (public == row).all(1).any())


def test_a_resumed_fit_does_not_warm_start_again(tmp_path):
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)
    module = DPZero(tiny_mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    quiet_trainer(max_steps=2, callbacks=[PublicWarmStart(epochs=1), checkpoints],
                  enable_checkpointing=True).fit(module, datamodule=digits())
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["callbacks"]["PublicWarmStart"] == {"done": True}
    weights = {k[len("backbone."):]: v for k, v in saved["state_dict"].items() if k.startswith("backbone.")}

    resumed_warm, seen = PublicWarmStart(epochs=1), WeightsAtFirstStep()
    resumed = DPZero(tiny_mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    quiet_trainer(max_steps=3, callbacks=[resumed_warm, seen]).fit(resumed, datamodule=digits(),
                                                                    ckpt_path=tmp_path / "last.ckpt")
    assert resumed_warm.epoch_losses == []
    for (name, _), got in zip(resumed.backbone.named_parameters(), seen.weights):
        torch.testing.assert_close(got, weights[name], rtol=0, atol=0)


def test_a_second_fit_with_the_same_callback_does_not_warm_start_again():
    warm = PublicWarmStart(epochs=1)
    module = DPZero(tiny_mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    quiet_trainer(max_steps=1, callbacks=[warm]).fit(module, datamodule=digits())
    seen = WeightsAtFirstStep()
    before = [p.detach().clone() for p in module.backbone.parameters()]
    quiet_trainer(max_steps=1, callbacks=[warm, seen]).fit(module, datamodule=digits())
    assert len(warm.epoch_losses) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, seen.weights))


@pytest.mark.parametrize("kwargs, message", [
    (dict(epochs=0), "epochs"), (dict(lr=0.0), "lr"), (dict(momentum=-0.1), "momentum"),
    (dict(weight_decay=-1.0), "weight_decay"), (dict(batch_size=0), "batch_size")])
def test_bad_options_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        PublicWarmStart(**kwargs)


def test_without_a_public_split_or_a_data_module_it_says_what_to_do():
    module = DPZero(tiny_mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    with pytest.raises(ConfigError, match="public_fraction"):
        quiet_trainer(max_steps=1, callbacks=[PublicWarmStart()]).fit(
            module, datamodule=DigitsDataModule(batch_size=32))
    plain = DPZero(mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    with pytest.raises(ConfigError, match="datamodule="):
        quiet_trainer(max_steps=1, callbacks=[PublicWarmStart()]).fit(plain, poisson_loader(blobs(), 0.5))

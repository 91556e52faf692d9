"""A public warm start: plain SGD on the data module's public split before the first private step.

PAZO (Gong & Li, NeurIPS 2025), App. C.1: on CIFAR-10 the authors "warm-start on the public data by training on it for
a small number of epochs" (after Amid et al.'s public-data-assisted mirror descent), and their code starts every method
of the CIFAR-10 and Tiny-ImageNet tables from that public-warm-started model. It reads public data only, which is
data-independent of the private set by declaration: it costs no privacy and releases nothing.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lit_zodp.backbones.base import per_example_loss
from lit_zodp.errors import ConfigError, check_non_negative, check_positive, check_positive_int, raise_if_any


class PublicWarmStart(Callback):
    """Trains the module's backbone on the public split with SGD before its first private step, once.

    Each public batch's gradient is the module's :meth:`~lit_zodp.algorithms.AlgorithmModule.public_gradient` (backprop
    on the public batch alone, as PAZO's and DOPE-SGD's public gradients are formed), applied by ``torch.optim.SGD``
    over the backbone's trainable parameters. The batches are the data module's :meth:`public_dataloader` (shuffled
    from ``data_seed``, the same on every DDP rank, augmented where the data module's ``public_augment`` is set); under
    DDP, rank 0's weights are then broadcast, so the ranks start the private fit from identical weights whatever the
    device's non-deterministic kernels did.

    It runs at the start of a fit at global step 0 that it has not warm-started yet: its state (``done``) is saved in
    checkpoints, so a resumed fit, or a second fit with the same callback, never trains on the public data again (the
    checkpointed weights hold the warm start). Progress is printed once per epoch (the mean public loss).

    Where the paper is silent (App. C.1 says only "a small number of epochs"), the defaults are this package's choice:
    10 epochs of SGD, lr 0.05, momentum 0.9, no weight decay, the data module's public batch size.

    Args:
        epochs: passes over the public split.
        lr: SGD's learning rate.
        momentum: SGD's momentum.
        weight_decay: SGD's weight decay.
        batch_size: public batch size; ``None``: the data module's ``public_batch_size``, else its ``batch_size``.
    """

    def __init__(self, epochs: int = 10, lr: float = 0.05, momentum: float = 0.9, weight_decay: float = 0.0,
                 batch_size: Optional[int] = None) -> None:
        raise_if_any([check_positive_int("epochs", epochs), check_positive("lr", lr),
                      check_non_negative("momentum", momentum), check_non_negative("weight_decay", weight_decay),
                      None if batch_size is None else check_positive_int("batch_size", batch_size)])
        self.epochs, self.lr, self.momentum, self.weight_decay = epochs, lr, momentum, weight_decay
        self.batch_size = batch_size
        self.done = False
        #: the mean public loss of each epoch of the warm start
        self.epoch_losses: list[float] = []

    @property
    def state_key(self) -> str:
        return "PublicWarmStart"

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.done = bool(state_dict.get("done", False))

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.done or trainer.global_step > 0:
            self.done = True
            return
        loader = self._public_loader(trainer, pl_module)
        params = [p for p in pl_module.backbone.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        for epoch in range(self.epochs):
            loss = self._train_epoch(trainer, pl_module, loader, params, optimizer)
            self.epoch_losses.append(loss)
            rank_zero_info(f"PublicWarmStart: epoch {epoch + 1}/{self.epochs}, mean public loss {loss:.4f}")
        _broadcast_from_rank_zero(trainer, params)
        self.done = True

    def _train_epoch(self, trainer, pl_module, loader, params: list[Tensor], optimizer) -> float:
        total, rows = 0.0, 0
        for batch in loader:
            batch = move_data_to_device(trainer.precision_plugin.convert_input(batch), pl_module.device)
            loss, grads = _public_loss_and_gradient(pl_module, batch, params)
            for param, grad in zip(params, grads):
                param.grad = grad.to(param.dtype)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            count = len(batch[1])
            total, rows = total + loss * count, rows + count
        return total / max(rows, 1)

    def _public_loader(self, trainer, pl_module):
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "public_dataloader"):
            raise ConfigError("PublicWarmStart trains on the public split of a lit_zodp data module: fit with "
                              "`datamodule=` a PublicPrivateDataModule (one with public_fraction > 0 or a public "
                              "source)")
        if not hasattr(pl_module, "public_gradient") or not hasattr(pl_module, "backbone"):
            raise ConfigError(f"PublicWarmStart trains a lit_zodp algorithm module's backbone, but got "
                              f"{type(pl_module).__name__}")
        loader = datamodule.public_dataloader(self.batch_size, shuffle=True)
        if loader is None:
            raise ConfigError("PublicWarmStart: the data module has no public split: set `public_fraction` > 0 (or "
                              "give it a public source)")
        return loader


def _public_loss_and_gradient(pl_module, batch, params: list[Tensor]) -> tuple[float, list[Tensor]]:
    """The public batch's mean loss (for the progress line) and its gradient (:meth:`public_gradient`)."""
    grads = pl_module.public_gradient(batch, params)
    with torch.no_grad():
        loss = float(per_example_loss(pl_module.backbone, *batch).float().mean())
    return loss, grads


def _broadcast_from_rank_zero(trainer, params: list[Tensor]) -> None:
    if trainer.world_size <= 1 or not torch.distributed.is_initialized():
        return
    with torch.no_grad():
        for param in params:
            torch.distributed.broadcast(param.data, src=0)


__all__ = ["PublicWarmStart"]

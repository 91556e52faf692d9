"""Stop every rank of a DDP fit when the process that launched them fails.

``--trainer.strategy ddp --trainer.devices N`` runs rank 0 in the command's own process, which
starts the other ranks (Lightning's subprocess launcher). When a started rank fails, Lightning's
process observer stops them all within its 5-second poll. When rank 0 fails (a privacy refusal: a
check on its own batch, its budget, its data), Lightning raises and exits, but the ranks it started
stay in their next collective: with gloo they fail on the closed connection, and with NCCL they wait
out the process group's timeout (30 minutes in Lightning) on their GPUs. This callback sends those
ranks Lightning's own kill signal, as Lightning does after a keyboard interrupt. It only reaches the
processes of its own node: rank 0 of another node, and ranks under ``torchrun`` or SLURM, are left to
the launcher that started them.
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal


def launched_ranks(trainer: "pl.Trainer") -> list:
    """The processes this one started as ranks of the fit and that still run (empty on a started rank)."""
    launcher = trainer.strategy.launcher
    if not isinstance(launcher, _SubprocessScriptLauncher):
        return []
    return [proc for proc in launcher.procs if proc.poll() is None]


def stop_started_ranks(trainer: "pl.Trainer", exception: BaseException) -> None:
    """On an error in the process that launched the other ranks, stop them (module docstring)."""
    running = launched_ranks(trainer)
    if not running:
        return
    sys.stderr.write(f"lit-zodp: rank {trainer.global_rank} failed ({type(exception).__name__}); stopping the "
                     f"{len(running)} rank(s) it started\n")
    trainer.strategy.launcher.kill(_get_sigkill_signal())


class StopRanksOnError(Callback):
    """On an error in the process that launched the other ranks, stop them (module docstring). A private
    module's :class:`~lit_zodp.callbacks.PrivacySpendCallback` does it too, so its fit needs no second callback."""

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        stop_started_ranks(trainer, exception)


def rank_label() -> str:
    """``"rank k: "`` in a distributed run of more than one process, else ``""``."""
    if not _distributed_is_initialized():
        return ""
    import torch.distributed as dist

    return f"rank {dist.get_rank()}: " if dist.get_world_size() > 1 else ""


__all__ = ["StopRanksOnError", "launched_ranks", "rank_label", "stop_started_ranks"]

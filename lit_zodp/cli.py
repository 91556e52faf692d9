"""The ``lightning`` / ``lit-zodp`` command: a plain LightningCLI with class_path configs.

``lightning fit --config configs/quickstart.yaml`` works for any LightningModule and
LightningDataModule. Two additions for private training: Lightning's distributed sampler is off
by default (the DataModule Poisson-samples each rank's shard itself), and after ``fit`` the test
set is evaluated and a one-line result is printed (``--test_after_fit false`` skips it).
"""

from __future__ import annotations

import math
import os
import time
from typing import Optional

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class LitZODPCLI(LightningCLI):
    """LightningCLI with a test pass and a result line after ``fit``."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--test_after_fit", type=bool, default=True,
                            help="After fit, evaluate the test set and print a one-line result.")

    def before_fit(self) -> None:
        self._fit_started = time.perf_counter()

    def after_fit(self) -> None:
        wall = time.perf_counter() - getattr(self, "_fit_started", time.perf_counter())
        test_metrics = {}
        if self.config[self.subcommand].get("test_after_fit") and _has_test_data(self.datamodule):
            results = self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)
            test_metrics = results[0] if results else {}
        rank_zero_info(result_line(self.model, self.datamodule, self.trainer, test_metrics, wall))


    def before_test(self) -> None:
        self._test_started = time.perf_counter()

    def after_test(self) -> None:
        """After ``lightning test`` (e.g. zero-shot accuracy of an untrained prompt model)."""
        wall = time.perf_counter() - getattr(self, "_test_started", time.perf_counter())
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()}
        rank_zero_info(result_line(self.model, self.datamodule, self.trainer, metrics, wall))


def _has_test_data(datamodule: Optional[LightningDataModule]) -> bool:
    if datamodule is None:
        return False
    hook = getattr(type(datamodule), "test_dataloader", None)
    return hook is not None and hook is not LightningDataModule.test_dataloader


def result_line(model, datamodule, trainer, test_metrics: dict, wall_seconds: float) -> str:
    """``RESULT task=... algorithm=... epsilon=... delta=... accuracy=... steps=... wall_s=...``."""
    epsilon = spent_epsilon(model)
    accuracy = test_metrics.get("test_acc")
    fields = {
        "task": type(datamodule).__name__ if datamodule is not None else "-",
        "algorithm": type(model).__name__,
        "epsilon": f"{epsilon:.3f}" if getattr(model, "private", False) else "non-private",
        "delta": f"{model.delta:.3g}" if getattr(model, "delta", None) else "-",
        "accuracy": f"{accuracy:.4f}" if accuracy is not None else "-",
        "steps": trainer.global_step,
        "wall_s": f"{wall_seconds:.1f}",
    }
    return "RESULT " + " ".join(f"{k}={v}" for k, v in fields.items())


def build_cli(args=None) -> LitZODPCLI:
    """Parse ``args`` (``None``: ``sys.argv``) and run the subcommand; returns the CLI (tests use it)."""
    return LitZODPCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"use_distributed_sampler": False},
        save_config_kwargs={"overwrite": True},
        args=args,
    )


def spent_epsilon(model) -> float:
    """Epsilon spent so far: inf without noise, 0 before any private step, else the ledger's bound."""
    if not getattr(model, "private", False) or model.noise_multiplier == 0:
        return math.inf
    if model.ledger.total_count == 0:
        return 0.0
    return model.ledger.epsilon(model.delta).upper


def cli_main(args=None) -> None:
    """Entry point of the ``lightning`` and ``lit-zodp`` console scripts."""
    build_cli(args)


if __name__ == "__main__":
    cli_main()

"""The ``lightning`` / ``lit-zodp`` command: a plain LightningCLI with class_path configs.

``lightning fit --config configs/quickstart.yaml`` works for any LightningModule and
LightningDataModule. Two additions for private training: Lightning's distributed sampler is off
by default (the DataModule Poisson-samples each rank's shard itself), and after ``fit`` the test
set is evaluated and a one-line result is printed (``--test_after_fit false`` skips it;
``--test_ckpt best`` tests the best checkpoint of a monitored ModelCheckpoint instead of the last
iterate, as the papers' reference code does with ``load_best_model_at_end``).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Literal, Optional

# before lightning, which imports huggingface_hub (it reads HF_HUB_OFFLINE once, at import)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lightning.fabric.utilities.exceptions import MisconfigurationException  # noqa: E402
from lightning.pytorch import LightningDataModule, LightningModule  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402
from lightning.pytorch.utilities import rank_zero_info  # noqa: E402

from lit_zodp.errors import ConfigError, PrivacyConfigError  # noqa: E402
from lit_zodp.privacy.component import epsilon_text  # noqa: E402


#: ``ckpt_path`` values Lightning resolves itself rather than reading a file.
_SPECIAL_CKPT_PATHS = ("last", "best", "hpc", "registry")


class LitZODPCLI(LightningCLI):
    """LightningCLI with a test pass and a result line after ``fit``."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--test_after_fit", type=bool, default=True,
                            help="After fit, evaluate the test set and print a one-line result.")
        parser.add_argument("--test_ckpt", type=Literal["last", "best"], default="last",
                            help="Which model the test after fit evaluates: 'last' (the final iterate) or 'best' "
                                 "(the best checkpoint of a ModelCheckpoint with a `monitor`, e.g. val_acc).")

    def _parse_ckpt_path(self) -> None:
        """Resuming: LightningCLI replaces the model arguments by the checkpoint's saved hyperparameters.

        A privacy budget given on the command line must still bind: keep the smaller of the
        command line's and the checkpoint's ``target_epsilon`` and ``max_epsilon``. (The checkpoint's
        privacy state keeps its own budget binding too, whatever these arguments say.)
        """
        path = self.config[self.config.subcommand].get("ckpt_path")
        if path is not None and path not in _SPECIAL_CKPT_PATHS and not os.path.exists(path):
            raise ConfigError(f"`ckpt_path`: no checkpoint at {path!r}")  # before: a traceback after data setup
        given = _budget_arguments(self.config)
        super()._parse_ckpt_path()
        restored = _budget_arguments(self.config)
        for key, value in given.items():
            if value is not None:
                smaller = value if restored.get(key) is None else min(value, restored[key])
                self.config[self.config.subcommand].model.init_args[key] = smaller

    def before_fit(self) -> None:
        self._fit_started = time.perf_counter()

    def after_fit(self) -> None:
        wall = time.perf_counter() - getattr(self, "_fit_started", time.perf_counter())
        test_metrics = {}
        if self.config[self.subcommand].get("test_after_fit") and _has_test_data(self.datamodule):
            ckpt_path = self._test_checkpoint(self.config[self.subcommand].get("test_ckpt", "last"))
            results = self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=ckpt_path, verbose=False)
            test_metrics = results[0] if results else {}
        rank_zero_info(result_line(self.model, self.datamodule, self.trainer, test_metrics, wall))


    def _test_checkpoint(self, which: str) -> Optional[str]:
        """``None`` for the last iterate; the best monitored checkpoint's path for ``'best'``."""
        if which == "last":
            return None
        if which != "best":
            raise PrivacyConfigError(f"Expected `test_ckpt` in ['last', 'best'], but got {which!r}")
        callback = self.trainer.checkpoint_callback
        if callback is None or callback.monitor is None:
            raise PrivacyConfigError("`test_ckpt: best` needs a ModelCheckpoint with a `monitor` (e.g. val_acc) "
                                     "in trainer.callbacks")
        return callback.best_model_path or None

    def before_test(self) -> None:
        self._test_started = time.perf_counter()

    def after_test(self) -> None:
        """After ``lightning test`` (e.g. zero-shot accuracy of an untrained prompt model)."""
        wall = time.perf_counter() - getattr(self, "_test_started", time.perf_counter())
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()}
        rank_zero_info(result_line(self.model, self.datamodule, self.trainer, metrics, wall))


BUDGET_ARGUMENTS = ("target_epsilon", "max_epsilon")


def _budget_arguments(config) -> dict:
    subcommand = config.get("subcommand")
    init_args = config.get(subcommand, {}).get("model", {}).get("init_args", {}) if subcommand else {}
    return {key: init_args.get(key) for key in BUDGET_ARGUMENTS if key in init_args}


def _has_test_data(datamodule: Optional[LightningDataModule]) -> bool:
    if datamodule is None:
        return False
    hook = getattr(type(datamodule), "test_dataloader", None)
    return hook is not None and hook is not LightningDataModule.test_dataloader


def result_line(model, datamodule, trainer, test_metrics: dict, wall_seconds: float) -> str:
    """``RESULT task=... algorithm=... epsilon=... delta=... accuracy=... steps=... wall_s=...``."""
    privacy = getattr(model, "privacy", None)
    accuracy = test_metrics.get("test_acc")
    fields = {
        "task": type(datamodule).__name__ if datamodule is not None else "-",
        "algorithm": type(model).__name__,
        "epsilon": epsilon_text(privacy.epsilon(), ".3f") if getattr(privacy, "private", False) else "non-private",
        "delta": f"{privacy.delta:.3g}" if getattr(privacy, "delta", None) else "-",
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
        auto_configure_optimizers=False,  # an `optimizer:` override would bypass the privacy ledger
        save_config_kwargs={"overwrite": True},
        args=args,
    )


def cli_main(args=None) -> None:
    """Entry point of the ``lightning`` and ``lit-zodp`` console scripts.

    A configuration error (:class:`~lit_zodp.errors.ConfigError`: bad privacy setting, impossible
    budget, model/data mismatch, a model or tokenizer that cannot be loaded, a prompt backbone without
    label words) ends in one readable line on stderr and exit code 2, not a traceback or a dump of the
    namespace (jsonargparse wraps errors raised while instantiating classes; the cause is found in the
    chain).
    """
    try:
        build_cli(args)
    except Exception as err:
        cause = configuration_error(err)
        if cause is None:
            raise
        sys.stderr.write(f"lit-zodp: error: {' '.join(str(cause).split())}\n")
        raise SystemExit(2) from None


def configuration_error(err: BaseException) -> Optional[Exception]:
    """The :class:`ConfigError` (:class:`PrivacyConfigError` included) or Lightning ``MisconfigurationException``
    (``--trainer.max_steps -5``, a GPU accelerator without one) behind ``err`` (itself or in its
    cause/context chain), if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (ConfigError, MisconfigurationException)):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


if __name__ == "__main__":
    cli_main()

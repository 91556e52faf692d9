"""The ``lightning`` / ``lit-zodp`` command: a plain LightningCLI with class_path configs.

``lightning fit --config configs/quickstart.yaml`` works for any LightningModule and
LightningDataModule. Two additions for private training: Lightning's distributed sampler is off
by default (the DataModule Poisson-samples each rank's shard itself), and after ``fit`` the test
set is evaluated and a one-line result is printed (``--test_after_fit false`` skips it;
``--test_ckpt best`` tests the best checkpoint of a monitored ModelCheckpoint instead of the last
iterate, as the papers' reference code does with ``load_best_model_at_end``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from typing import Literal, Optional

# before lightning, which imports huggingface_hub (it reads HF_HUB_OFFLINE once, at import)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lightning.fabric.utilities.exceptions import MisconfigurationException  # noqa: E402
from lightning.pytorch import LightningDataModule, LightningModule  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn  # noqa: E402

from lit_zodp.callbacks.ranks import rank_label  # noqa: E402
from lit_zodp.cli_errors import OneLineErrorParser, imported  # noqa: E402
from lit_zodp.errors import ConfigError, LitZodpWarning, PrivacyConfigError, raise_if_any  # noqa: E402
from lit_zodp.privacy.component import budget_order_error, epsilon_text  # noqa: E402


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
        """Resuming continues ONE run: LightningCLI rebuilds the model from the checkpoint's saved
        hyperparameters, which its privacy ledger depends on. So:

        * a configured model class other than the checkpoint's is refused (a private run must not
          continue as a non-private one, nor the reverse);
        * each configured model option the checkpoint replaces is named in one warning line;
        * a privacy budget given must still bind: ``target_epsilon`` and ``max_epsilon`` keep the smaller
          of the configured and the checkpoint's value (listed as replaced only when the checkpoint's
          smaller one was kept). The checkpoint's privacy state keeps its own budget binding too.

        Without a checkpoint, a ``fit`` whose ``max_epsilon`` is below its ``target_epsilon`` is refused
        here, before any data is loaded (:func:`~lit_zodp.privacy.component.budget_order_error`).
        """
        subcommand = self.config.subcommand
        path = self.config[subcommand].get("ckpt_path")
        if path is not None and path not in _SPECIAL_CKPT_PATHS and not os.path.exists(path):
            raise ConfigError(f"`ckpt_path`: no checkpoint at {path!r}")  # before: a traceback after data setup
        configured = _model_arguments(self.config)
        if path is None:
            if subcommand == "fit":
                raise_if_any([budget_order_error(configured.get("target_epsilon"), configured.get("max_epsilon"))])
            return
        if os.path.isfile(path):
            checkpoint = _read_checkpoint(path)
            _refuse_another_class(configured.get("class_path"), _checkpoint_class(checkpoint), path)
            self._merge_checkpoint_options(checkpoint, configured.get("class_path"))
        restored = _model_arguments(self.config)
        configured = _target_as_budget_of_a_fixed_sigma(configured, restored, path)
        for key in BUDGET_ARGUMENTS:
            if configured.get(key) is not None and key in restored:
                kept = configured[key] if restored[key] is None else min(configured[key], restored[key])
                self.config[subcommand].model.init_args[key] = kept
        if "noise_seed" in restored:  # (a checkpoint from before hparams left it out: the configured seed, or none)
            self.config[subcommand].model.init_args["noise_seed"] = configured.get("noise_seed")
        _warn_replaced(configured, _model_arguments(self.config), path, subcommand)

    def _merge_checkpoint_options(self, checkpoint: dict, configured_class: Optional[str]) -> None:
        """LightningCLI's merge of the checkpoint's saved model options into the configuration. A checkpoint written
        by a Trainer of one's own has no ``_class_path`` among them, and LightningCLI parsed its options as
        ``LightningModule``'s and failed in two lines (``Option 'clip' is not accepted by
        lightning.LightningModule``, ``Parsing of ckpt_path hyperparameters failed!``); they are the configured
        class's (its class was checked against the one the checkpoint records)."""
        options = dict(checkpoint.get("hyper_parameters") or {})
        options.pop("_instantiator", None)
        if not options:
            return
        class_path = options.pop("_class_path", None) or configured_class
        model = {"class_path": class_path, "dict_kwargs": options} if class_path else options
        try:
            self.config = self.parser.parse_object({self.config.subcommand: {"model": model}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise

    def before_fit(self) -> None:
        """A private fit under a launcher that returns only the weights is refused here, in this process (one line),
        before its children start (the module refuses it too, in each child, for a Trainer of one's own)."""
        if getattr(self.model, "private", False):
            from lit_zodp.algorithms.base import refuse_launchers_that_return_only_the_weights

            refuse_launchers_that_return_only_the_weights(self.trainer)
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
        path = self.config[self.subcommand].get("ckpt_path")
        trained = _read_checkpoint(path).get("global_step") if path and os.path.isfile(path) else None
        rank_zero_info(result_line(self.model, self.datamodule, self.trainer, metrics, wall, steps=trained))


BUDGET_ARGUMENTS = ("target_epsilon", "max_epsilon")


def _target_as_budget_of_a_fixed_sigma(configured: dict, restored: dict, path: str) -> dict:
    """A ``target_epsilon`` configured for a resume of a run with a fixed ``noise_multiplier`` cannot calibrate
    the checkpoint's sigma: it binds as ``max_epsilon`` instead (the smaller, with a configured one), and one line
    says so. (Before, it joined the checkpoint's sigma and the run was refused: 'Give exactly one of ...'.)"""
    target = configured.get("target_epsilon")
    if target is None or restored.get("noise_multiplier") is None or restored.get("target_epsilon") is not None:
        return configured
    budget = target if configured.get("max_epsilon") is None else min(target, configured["max_epsilon"])
    rank_zero_warn(f"Resuming {path}: its run has a fixed noise_multiplier={_shown(restored['noise_multiplier'])}, "
                   f"which a target cannot calibrate: the configured target_epsilon={_shown(target)} binds as "
                   f"max_epsilon={_shown(budget)}", category=LitZodpWarning, stacklevel=5)
    return {**configured, "target_epsilon": None, "max_epsilon": budget}


def _model_arguments(config) -> dict:
    """The model's ``class_path`` and ``init_args`` in ``config``, as plain values."""
    model = config[config.subcommand].get("model") or {}
    init_args = model.get("init_args") or {}
    init_args = init_args.as_dict() if hasattr(init_args, "as_dict") else dict(init_args)
    return {"class_path": model.get("class_path"), **init_args}


def _checkpoint_class(checkpoint: dict) -> Optional[str]:
    """The model class a checkpoint saved (LightningCLI's ``_class_path`` hyperparameter, or the algorithm our modules
    record, for a checkpoint written in Python); ``None`` when it saved none."""
    return ((checkpoint.get("hyper_parameters") or {}).get("_class_path")
            or (checkpoint.get("public_state") or {}).get("algorithm"))


def _read_checkpoint(path: str) -> dict:
    """A checkpoint's dictionary, its tensors memory-mapped, not read (``weights_only``, as Lightning loads it).
    A file that is no checkpoint is refused in one line (before: torch's 24-line traceback after data setup)."""
    import torch

    for mmap in (True, False):  # a checkpoint of the old, non-zip format cannot be memory-mapped
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            break
        except Exception as err:  # noqa: BLE001 (any reason: the message names it)
            error = err
    else:
        lines = str(error).strip().splitlines()
        reason = ("not a file torch.save wrote" if isinstance(error, (KeyError, EOFError, ValueError)) or not lines
                  else f"{type(error).__name__}: {lines[0]}")  # (a stray file: a bare KeyError '101')
        raise ConfigError(f"`ckpt_path`: {path!r} cannot be read as a checkpoint ({reason})")
    if not isinstance(checkpoint, dict):
        raise ConfigError(f"`ckpt_path`: {path!r} holds a {type(checkpoint).__name__}, not a Lightning checkpoint")
    return checkpoint


def _refuse_another_class(configured: Optional[str], saved: Optional[str], path: str) -> None:
    """A resume continues the checkpoint's run: the configured model class must be the checkpoint's."""
    if configured is None or saved is None or configured == saved:
        return
    if imported(configured) is not None and imported(configured) is imported(saved):
        return  # one class under two import paths
    raise ConfigError(
        f"`model.class_path`: the checkpoint {path!r} was trained by {saved}, but the configuration names "
        f"{configured}; a resume continues the checkpoint's run (privacy included): configure {saved}, or "
        "start a new run without ckpt_path")


def _warn_replaced(configured: dict, kept: dict, path: str, subcommand: str = "fit") -> None:
    """One warning line naming each configured model option whose value the checkpoint's replaced."""
    replaced = [f"{key}: configured {_shown(configured.get(key))}, checkpoint {_shown(value)} (kept)"
                for key, value in kept.items() if key in configured and not _same(configured[key], value)]
    if replaced:
        how = ("a resume continues its run with the checkpoint's model options" if subcommand == "fit"
               else f"`{subcommand}` uses the checkpoint's model options")
        rank_zero_warn(f"{'Resuming' if subcommand == 'fit' else 'Loading'} {path}: {how}, not the configured ones: "
                       f"{'; '.join(replaced)}", category=LitZodpWarning, stacklevel=5)


def _same(a, b) -> bool:
    """Equal values, numbers up to type (``1 == 1.0``; a bool equals only itself)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if all(isinstance(v, (int, float)) for v in (a, b)):
        return float(a) == float(b)
    return a == b


def _shown(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def _has_test_data(datamodule: Optional[LightningDataModule]) -> bool:
    if datamodule is None:
        return False
    hook = getattr(type(datamodule), "test_dataloader", None)
    return hook is not None and hook is not LightningDataModule.test_dataloader


def result_line(model, datamodule, trainer, test_metrics: dict, wall_seconds: float,
                steps: Optional[int] = None) -> str:
    """``RESULT task=... algorithm=... epsilon=... delta=... accuracy=... steps=... wall_s=...``.

    ``steps``: the model's training steps (default: the Trainer's; ``lightning test`` passes its checkpoint's).

    ``epsilon`` is ``non-private`` for a non-private module, ``inf`` at sigma = 0, and carries the suffix
    ``(poisson-assumed)`` for ``sampling: shuffle`` (grep ``poisson-assumed``): never a bare number that
    is not a guarantee.
    """
    privacy = getattr(model, "privacy", None)
    accuracy = test_metrics.get("test_acc")
    fields = {
        "task": _task_name(datamodule),
        "algorithm": type(model).__name__,
        "epsilon": _epsilon_field(privacy),
        "delta": f"{privacy.delta:.3g}" if getattr(privacy, "delta", None) else "-",
        "accuracy": f"{accuracy:.4f}" if accuracy is not None else "-",
        # a backbone's own test metrics besides its loss (the synthetic quadratic's ||grad F||, DPZero Fig. 1)
        **{name: f"{test_metrics[f'test_{name}']:.4g}" for name in (getattr(model, "test_metrics", None) or {})
           if name != "loss" and f"test_{name}" in test_metrics},
        "steps": trainer.global_step if steps is None else steps,
        "wall_s": f"{wall_seconds:.1f}",
    }
    return "RESULT " + " ".join(f"{k}={v}" for k, v in fields.items())


def _task_name(datamodule) -> str:
    """The data module's ``task_name`` (the paper task of a text module: ``SST-2``, ``SQuAD``), else its class."""
    if datamodule is None:
        return "-"
    return str(getattr(datamodule, "task_name", None) or type(datamodule).__name__)


def _epsilon_field(privacy) -> str:
    """``1.234``; ``1.234(poisson-assumed)`` for ``sampling: shuffle`` (accounted as Poisson: no guarantee);
    ``1.234(test-seeded)`` where ``noise_seed`` makes the noise reproducible."""
    if not getattr(privacy, "private", False):
        return "non-private"
    text = epsilon_text(privacy.epsilon(), ".3f")
    text = f"{text}(poisson-assumed)" if getattr(privacy, "poisson_assumed", False) else text
    return f"{text}(test-seeded)" if getattr(privacy, "test_seeded", False) else text


def build_cli(args=None) -> LitZODPCLI:
    """Parse ``args`` (``None``: ``sys.argv``) and run the subcommand; returns the CLI (tests use it)."""
    return LitZODPCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_class=OneLineErrorParser,
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

    In a DDP fit the line names the rank; a rank stopped because another one failed (its collective
    lost the peer) says so in one line instead of a traceback, and exits with code 1.
    """
    _quiet_lightning_internals()
    try:
        build_cli(args)
    except Exception as err:
        cause = configuration_error(err)
        if cause is not None:
            sys.stderr.write(f"lit-zodp: error: {rank_label()}{' '.join(str(cause).split())}\n")
            _exit(2)
        if rank_label() and lost_peer(err):
            sys.stderr.write(f"lit-zodp: error: {rank_label()}stopped because another rank failed (its error is "
                             f"above): {str(err).splitlines()[0][:200]}\n")
            _exit(1)
        raise


def _quiet_lightning_internals() -> None:
    """Hide warnings that Lightning's own code raises and a user cannot act on (the command line only; a
    user's own Trainer keeps them): torch (2.14 here) deprecates ``LeafSpec()``, which Lightning's pytree helper
    still builds (once per fit and per test)."""
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            module=r"lightning\.pytorch\.utilities\._pytree")


def _exit(code: int) -> None:
    """Exit with ``code``. In a distributed run, without the interpreter's teardown (Lightning's
    ``trainer._teardown`` has run, loggers are finalised): once a peer has gone, gloo's threads could
    abort it ("terminate called without an active exception", exit -6 instead of the code; 1 of 3
    clean-clone CI runs of the rank-0 refusal test)."""
    if rank_label():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code) from None


#: What gloo and the TCP store say when another rank's process has gone.
LOST_PEER = ("closed by peer", "reset by peer", "remote worker", "Broken pipe")


def lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is a collective's failure on a lost peer: a ``torch.distributed.DistNetworkError``
    or a ``RuntimeError`` naming one of :data:`LOST_PEER` (gloo raises a plain ``RuntimeError``). NCCL
    reports no lost peer (it waits); :class:`~lit_zodp.callbacks.StopRanksOnError` and Lightning's
    process observer stop those ranks."""
    import torch.distributed as dist

    return isinstance(err, dist.DistNetworkError) or (isinstance(err, RuntimeError)
                                                      and any(s in str(err) for s in LOST_PEER))


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

"""The shared LightningModule of the zeroth-order algorithms.

It owns what every paper's training step needs and nothing paper-specific: the backbone and its
per-example losses (always under ``no_grad`` and in eval mode), torchmetrics accuracy for val/test,
the privacy configuration (``target_epsilon`` or ``noise_multiplier``, ``delta``, ``clip``), sigma
calibrated at fit start from the planned steps and the DataModule's sample rate, the privacy ledger,
the three random streams (public directions, secret noise, Poisson sampling in the DataModule), the
DDP reduction of clipped sums, and the ZO optimizer that makes Lightning count steps.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.cli import LRSchedulerCallable
import torch
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lit_zodp.backbones.base import batch_size_of, num_classes_of, per_example_loss, predict
from lit_zodp.privacy import (
    NoiseSource,
    PrivacyConfigError,
    PrivacyLedger,
    SubsampledGaussian,
    calibrate_noise_multiplier,
)
from lit_zodp.privacy.errors import (
    check_delta,
    check_non_negative,
    check_positive,
    check_positive_int,
    raise_if_any,
)
from lit_zodp.privacy.mechanisms import Mechanism
from lit_zodp.zo import ZOSGD, derive_seed, make_direction_law


class ZerothOrderModule(pl.LightningModule):
    """Base of every ZO algorithm: manual optimization with a seeded :class:`ZOSGD`.

    Args:
        backbone: a module mapping inputs to logits (see ``lit_zodp.backbones``).
        lr: step size ``alpha``.
        weight_decay: decoupled weight decay, applied to tensors of 2+ dimensions only (weights,
            not biases or norms).
        lam: smoothing parameter ``lambda`` of the two-point estimator.
        num_directions: directions ``u`` per step (the estimate averages them).
        directions: ``"gaussian"`` (the papers' experiments) or ``"sphere"`` (radius ``sqrt(d)``,
            DPZero's theory).
        seed: run seed of the public perturbation directions; ``None`` takes ``torch.initial_seed()``
            (so ``seed_everything`` fixes it). Under DDP rank 0's value is used everywhere.
        num_classes: classes for accuracy; ``None`` reads it from the backbone or DataModule.
        lr_scheduler: a callable ``optimizer -> LRScheduler`` (a ``class_path`` in YAML), stepped
            once per training step.
    """

    private: bool = False

    def __init__(
        self,
        backbone: nn.Module,
        *,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        lam: float = 1e-3,
        num_directions: int = 1,
        directions: str = "gaussian",
        seed: Optional[int] = None,
        num_classes: Optional[int] = None,
        lr_scheduler: Optional[LRSchedulerCallable] = None,
    ) -> None:
        super().__init__()
        raise_if_any([
            check_non_negative("lr", lr),
            check_non_negative("weight_decay", weight_decay),
            check_positive("lam", lam),
            check_positive_int("num_directions", num_directions),
            None if directions in ("gaussian", "sphere")
            else f"Expected `directions` in ['gaussian', 'sphere'], but got {directions!r}",
        ])
        self.save_hyperparameters(ignore=["backbone", "lr_scheduler"])
        self.lr_scheduler_factory = lr_scheduler
        self.automatic_optimization = False
        self.backbone = backbone
        self.lr = lr
        self.weight_decay = weight_decay
        self.lam = lam
        self.num_directions = num_directions
        self.directions = directions
        self.run_seed = seed
        self.num_classes = num_classes or num_classes_of(backbone)
        self.val_accuracy: Optional[MulticlassAccuracy] = None
        self.test_accuracy: Optional[MulticlassAccuracy] = None
        if self.num_classes:
            self._build_metrics(self.num_classes)

    # ----------------------------------------------------------------- setup
    def _build_metrics(self, num_classes: int) -> None:
        self.val_accuracy = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_accuracy = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def setup(self, stage: str) -> None:
        data_classes = getattr(self.trainer.datamodule, "num_classes", None) if self._trainer else None
        if data_classes and self.num_classes and data_classes != self.num_classes:
            raise PrivacyConfigError(
                f"Model/data mismatch: the backbone predicts {self.num_classes} classes but the "
                f"DataModule has {data_classes}")
        if self.num_classes is None and data_classes:
            self.num_classes = data_classes
            self._build_metrics(data_classes)
        if self.run_seed is None:
            self.run_seed = torch.initial_seed() & ((1 << 62) - 1)
        self.run_seed = int(self.trainer.strategy.broadcast(self.run_seed, src=0))

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.backbone.parameters() if p.requires_grad]

    def configure_optimizers(self):
        decay = [p for p in self.trainable_parameters() if p.ndim >= 2]
        no_decay = [p for p in self.trainable_parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": self.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        optimizer = ZOSGD(groups, lr=self.lr, law=make_direction_law(self.directions))
        if self.lr_scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.lr_scheduler_factory(optimizer)}

    @property
    def zo_optimizer(self) -> ZOSGD:
        optimizer = self.optimizers()
        return getattr(optimizer, "optimizer", optimizer)

    # ----------------------------------------------------------- forward passes
    def forward(self, inputs) -> Tensor:
        return predict(self.backbone, inputs)

    @torch.no_grad()
    def per_example_losses(self, inputs, targets) -> Tensor:
        """``f(x; xi_i)`` for each example, in eval mode and without autograd; ``[0]`` if empty."""
        if batch_size_of(inputs) == 0:
            return torch.zeros(0, device=targets.device)
        return per_example_loss(self.backbone, inputs, targets).float()

    def direction_seeds(self) -> list[int]:
        """Seeds of this step's directions ``u_1..u_q``: public, from (run seed, step)."""
        return [derive_seed(self.run_seed, self.global_step, k) for k in range(self.num_directions)]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Optional[int]:
        if getattr(self, "privacy_budget_exhausted", False):
            return -1  # the privacy callback found the budget spent: skip the rest of the epoch
        self.backbone.eval()  # the two-point passes must see the same function (no dropout)
        self._step_started = time.perf_counter()
        return None

    def reduce_sum(self, tensor: Tensor) -> Tensor:
        """All-reduce SUM across DDP ranks (identity on one process)."""
        if self._trainer is None or self.trainer.world_size == 1:
            return tensor
        return self.trainer.strategy.reduce(tensor, reduce_op="sum")

    def apply_update(self, coefficients: dict[int, float], **noise) -> None:
        """``x <- x - lr * sum_k c_k u_k`` through the registered optimizer (Lightning counts it)."""
        self.zo_optimizer.set_coefficients(coefficients, **noise)
        self.step_optimizer()

    def step_optimizer(self) -> None:
        """Step the ZO optimizer (Lightning counts it) and the LR scheduler, if any."""
        self.optimizers().step()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()

    # ----------------------------------------------------------- evaluation
    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, self.val_accuracy, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, self.test_accuracy, "test")

    def _evaluate(self, batch, metric: Optional[MulticlassAccuracy], prefix: str) -> None:
        inputs, targets = batch
        if batch_size_of(inputs) == 0:
            return
        with torch.no_grad():
            logits = self(inputs)
            loss = nn.functional.cross_entropy(logits.float(), targets)
        size = len(targets)
        self.log(f"{prefix}_loss", loss, batch_size=size, sync_dist=True)
        if metric is not None:
            metric(logits, targets)
            self.log(f"{prefix}_acc", metric, prog_bar=True, batch_size=size)

    def log_step_time(self, batch_size: int) -> None:
        self.log("step_time", time.perf_counter() - self._step_started, batch_size=max(batch_size, 1))

    # ----------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["zo_state"] = {"run_seed": self.run_seed}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("zo_state", {})
        self.run_seed = state.get("run_seed", self.run_seed)


class PrivateZerothOrderModule(ZerothOrderModule):
    """A ZO module whose every private release is a Poisson-subsampled Gaussian of clipped values.

    Privacy args (keyword-only):
        clip: per-example clipping threshold ``C`` of each released value.
        target_epsilon: calibrate sigma at fit start so the planned run spends at most this
            (upper bound of the PRV accountant). Exclusive with ``noise_multiplier``.
        noise_multiplier: a fixed sigma (noise std ``sigma * C`` on the clipped sum). ``0`` is allowed
            for ablations and reports epsilon = inf (not private).
        delta: the target delta; ``None`` means ``1 / n_private``.
        max_epsilon: a budget: training stops before a step would exceed it.
        noise_seed: seed of the secret noise generator; ``None`` (the default, and the only
            private choice) draws it from OS entropy. Tests pass one.
        eps_error: accountant precision (epsilon upper bound minus estimate).
        log_private_stats: log the clip fraction, a non-privatized diagnostic of the private batch.
    """

    private = True

    def __init__(
        self,
        backbone: nn.Module,
        *,
        clip: float = 1.0,
        target_epsilon: Optional[float] = None,
        noise_multiplier: Optional[float] = None,
        delta: Optional[float] = None,
        max_epsilon: Optional[float] = None,
        noise_seed: Optional[int] = None,
        eps_error: float = 0.05,
        log_private_stats: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, **kwargs)
        raise_if_any(_privacy_config_errors(clip, target_epsilon, noise_multiplier, delta, max_epsilon))
        self.clip = float(clip)
        self.target_epsilon = target_epsilon
        self.noise_multiplier = noise_multiplier
        self.delta = delta
        self.max_epsilon = max_epsilon
        self.eps_error = eps_error
        self.log_private_stats = log_private_stats
        self.noise = NoiseSource(noise_seed)
        self.ledger = PrivacyLedger(eps_error=eps_error)
        self.sample_rate: Optional[float] = None
        self.expected_batch_size: Optional[float] = None
        self.n_private: Optional[int] = None
        self.planned_steps: Optional[int] = None

    # ------------------------------------------------------------------ plan
    def configure_callbacks(self):
        """The privacy callback, unless the Trainer already has one (a user-configured instance)."""
        from lit_zodp.callbacks import PrivacySpendCallback

        if self._trainer is not None and any(isinstance(c, PrivacySpendCallback) for c in self.trainer.callbacks):
            return []
        return [PrivacySpendCallback()]

    def on_train_start(self) -> None:
        """Plan the run once the private loader exists: n, q, delta, steps, then sigma."""
        self._read_sampling()
        self.planned_steps = _planned_steps(self.trainer)
        if self.delta is None:
            self.delta = 1.0 / self.n_private
        raise_if_any([check_delta(self.delta)])
        if self.noise_multiplier is None:
            self.noise_multiplier = self._calibrate()
        if self.trainer.world_size > 1:
            _require_no_distributed_sampler(self.trainer)
            self.noise.load_state_dict(self.trainer.strategy.broadcast(self.noise.state_dict(), src=0))

    def _read_sampling(self) -> None:
        """``n_private`` and ``q`` from the DataModule (or the Poisson batch sampler)."""
        source = self.trainer.datamodule
        if source is None or getattr(source, "sample_rate", None) is None:
            source = getattr(self.trainer.train_dataloader, "batch_sampler", None)
        n = getattr(source, "n_private", None) or getattr(source, "num_samples", None)
        q = getattr(source, "sample_rate", None)
        if not n or not q:
            raise PrivacyConfigError(
                "A private module needs the size of the private set and its Poisson sample rate: use a "
                "`PublicPrivateDataModule` (datamodules/) or a DataLoader whose batch_sampler is a "
                "`lit_zodp.privacy.PoissonBatchSampler`.")
        raise_if_any([None if 0 < q <= 1 else f"Expected the sample rate in (0, 1], but got {q}"])
        self.n_private, self.sample_rate = int(n), float(q)
        self.expected_batch_size = self.sample_rate * self.n_private

    def _calibrate(self) -> float:
        """Smallest sigma whose PRV epsilon upper bound over the planned steps is <= target."""
        effective = calibrate_noise_multiplier(
            target_epsilon=self.target_epsilon, delta=self.delta, sample_rate=self.sample_rate,
            steps=self.planned_steps, eps_error=self.eps_error)
        return effective * self.noise_multiplier_scale()

    def noise_multiplier_scale(self) -> float:
        """sigma / (accounted multiplier): ``sqrt(q)`` when q clipped scalars share one batch.

        The q per-direction scalars are each clipped to ``C``, so one example moves the q-vector of
        sums by at most ``sqrt(q) C``; noise ``sigma C`` per coordinate is then a single subsampled
        Gaussian mechanism with multiplier ``sigma / sqrt(q)``.
        """
        return math.sqrt(self.num_directions)

    @property
    def is_private(self) -> bool:
        """False for a noiseless ablation (sigma = 0): its epsilon is infinite."""
        return bool(self.noise_multiplier)

    def step_mechanisms(self) -> list[tuple[Mechanism, int]]:
        """What one training step releases, for the ledger and the budget check."""
        if not self.is_private:
            return []
        return [(SubsampledGaussian(self.noise_multiplier / self.noise_multiplier_scale(),
                                    self.sample_rate), 1)]

    def record_step(self) -> None:
        for mechanism, count in self.step_mechanisms():
            self.ledger.record(mechanism, count)

    # ---------------------------------------------------------- the mechanism
    def privatize(self, clipped_sums: Tensor) -> Tensor:
        """``(sum over all ranks of clipped values + N(0, (sigma C)^2 I)) / B``, B the EXPECTED size.

        Every rank adds the same draw after the all-reduce (the secret noise seed is shared by
        broadcast at fit start), so the update is identical on every rank and to one process.
        """
        total = self.reduce_sum(clipped_sums)
        if self.noise_multiplier > 0:
            total = total + self.noise.gaussian(total.shape, self.noise_multiplier * self.clip,
                                                device=total.device, dtype=total.dtype)
        return total / self.expected_batch_size

    # ----------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["zo_state"].update(noise=self.noise.state_dict(), noise_multiplier=self.noise_multiplier,
                                      delta=self.delta)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("zo_state", {})
        if "noise" in state:
            self.noise.load_state_dict(state["noise"])
        self.noise_multiplier = state.get("noise_multiplier", self.noise_multiplier)
        self.delta = state.get("delta", self.delta)


def _privacy_config_errors(clip, target_epsilon, noise_multiplier, delta, max_epsilon) -> list:
    errors = [check_positive("clip", clip, allow_inf=True)]
    if math.isinf(clip) and (target_epsilon is not None or noise_multiplier):
        errors.append("Expected a finite `clip` for a private run (noise std is sigma * clip), but got inf")
    if (target_epsilon is None) == (noise_multiplier is None):
        errors.append("Give exactly one of `target_epsilon` and `noise_multiplier` "
                      f"(got target_epsilon={target_epsilon}, noise_multiplier={noise_multiplier})")
    if target_epsilon is not None:
        errors.append(check_positive("target_epsilon", target_epsilon))
    if noise_multiplier is not None:
        errors.append(check_non_negative("noise_multiplier", noise_multiplier))
    if delta is not None:
        errors.append(check_delta(delta))
    if max_epsilon is not None:
        errors.append(check_positive("max_epsilon", max_epsilon))
    return errors


def _planned_steps(trainer: "pl.Trainer") -> int:
    steps = trainer.estimated_stepping_batches
    if not math.isfinite(steps) or steps <= 0:
        raise PrivacyConfigError(
            "Calibrating sigma needs a finite number of steps: set `max_steps` or `max_epochs`.")
    return int(steps)


def _require_no_distributed_sampler(trainer: "pl.Trainer") -> None:
    connector = getattr(trainer, "_accelerator_connector", None)
    if getattr(connector, "use_distributed_sampler", False):
        raise PrivacyConfigError(
            "DDP with a private module needs `Trainer(use_distributed_sampler=False)`: the DataModule "
            "Poisson-samples each rank's shard itself (the `lightning`/`lit-zodp` CLI sets this).")


__all__ = ["PrivateZerothOrderModule", "ZerothOrderModule"]

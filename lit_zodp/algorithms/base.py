"""The one LightningModule base every algorithm shares, private or not, zeroth- or first-order.

It owns what is common and nothing paper-specific: the backbone and its per-example losses,
torchmetrics accuracy for val/test, the public run seed, the privacy component (composition: a
:class:`~lit_zodp.privacy.PrivacyComponent` or its non-private twin), the DDP reduction, step
timing, the budget stop and the checkpointed state. An algorithm declares its ``step_plan()``
(what one step releases) and writes ``training_step`` with the verbs of its paper.

Concrete subclasses register themselves in :data:`ALGORITHMS`; the privacy contract test suite
runs over every registered private module.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
from collections.abc import Mapping
from typing import Any, Callable, ClassVar, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LRSchedulerCallable
from lightning.pytorch.core.hooks import DataHooks
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lit_zodp.backbones.base import (Backbone, are_class_indices, batch_size_of, label_classes, num_classes_of,
                                     per_example_loss, predict, shared_option_mismatch)
from lit_zodp.cli_errors import imported
from lit_zodp.errors import (ConfigError, LitZodpWarning, PrivacyConfigError, check_positive, check_positive_int,
                             raise_if_any)
from lit_zodp.per_example.checks import (RECHECK_PROBABILITY, BufferState, ParameterWrites, RecheckProbability,
                                         RegistrationWatch,
                                         beyond_tolerance, buffer_state, check_recheck_probability, eval_mode,
                                         refuse_batch_mixing, refuse_buffer_writes, renormalising_embeddings,
                                         rows_agree, rows_differ, step_mode_recompute, warn_unchecked_training_mode)
from lit_zodp.per_example.ghost import at_least_float32
from lit_zodp.privacy import (NonPrivate, PoissonBatchSampler, PrivacyComponent, PrivateBatchSampler,
                              SinglePassBatchSampler, SpendLog, StepPlan)
from lit_zodp.privacy.fixed_shape import (FixedShapeForwards, any_row_ends_early, cut_columns, rows_ending_early,
                                         take_rows, used_lengths)
from lit_zodp.privacy.sampling import SamplingDescription, is_private_data, mark_private_data
from lit_zodp.schedules import horizon_note
from lit_zodp.zo.eval_mode import clear_eval_mode_caches

#: Every concrete algorithm, by class name (filled by ``AlgorithmModule.__init_subclass__``).
ALGORITHMS: dict[str, type["AlgorithmModule"]] = {}


def _moved_as_it_is(holder: Any) -> bool:
    """Whether ``holder`` (a module, a DataModule or ``None``) keeps Lightning's own ``transfer_batch_to_device``
    and ``on_after_batch_transfer``: its device batch is then its host batch moved, value for value."""
    return holder is None or all(getattr(getattr(holder, name), "__func__", None) is getattr(DataHooks, name)
                                 for name in ("transfer_batch_to_device", "on_after_batch_transfer"))


class AlgorithmModule(pl.LightningModule):
    """Base of every algorithm: manual optimization, a backbone and a privacy component.

    Args:
        backbone: a module mapping inputs to logits (see ``lit_zodp.backbones``).
        lr: step size ``alpha`` (> 0).
        seed: run seed of the PUBLIC randomness (directions, block order); ``None`` takes
            ``torch.initial_seed()`` (so ``seed_everything`` fixes it). Under DDP rank 0's is used.
        num_classes: classes for accuracy; ``None`` reads it from the backbone or DataModule.
        lr_scheduler: a callable ``optimizer -> LRScheduler`` (a ``class_path`` in YAML), stepped
            once per training step.

    Privacy args (keyword-only, private algorithms; see :class:`~lit_zodp.privacy.PrivacyComponent`):
        clip, target_epsilon, noise_multiplier, delta, max_epsilon, noise_seed (TEST ONLY), eps_error,
        neighbours (``add_remove`` or the papers' ``replace_one``), accountant (``prv`` or ``rdp``);
        log_private_stats: log ``clip_fraction`` and ``step_time`` of each logged step. In a private
            module both are exact, unaccounted statistics of the private batch (which examples were
            clipped; the time tracks the realized batch size): a log reader sees an example's
            membership, so they are off by default there (``None``: on only for non-private modules),
            and turning them on warns that the logs are outside the guarantee.
        fixed_forward_rows: forward every private batch as chunks of exactly this many rows of one
            row shape (the last chunk padded with copies of its first row, whose values are dropped):
            batched GPU kernels pick their reduction order by shape, so otherwise an example's value
            moves by rounding with its batch-mates and the sensitivity ``C`` holds only up to that
            rounding (:mod:`lit_zodp.privacy.fixed_shape`). Text data must pad every row to
            ``max_length`` (``pad_to_max_length: true``). ``None``: one forward of the batch as sampled.
        fixed_forward_lengths: with ``fixed_forward_rows``, sequence-length buckets for text (e.g.
            ``[16, 32, 64]``): each row is forwarded cut to the shortest bucket holding its last
            attended token, with rows of its bucket only (the bucket depends on the row alone).
            ``None``: every row at the data's full length.
        recheck_probability: after the first batch, the probability per step (OS randomness) that a
            private module runs the halves check on its losses again (a first-order module's engine
            re-checks its calls at the same steps). The check costs about one forward without grad.
            ``0``: the first batch only.
    """

    #: False for the non-private twin of an algorithm (MeZO for DPZero).
    private: ClassVar[bool] = True
    #: The per-example independence checks a private fit runs on its first batches (audit 5): ``halves`` (a
    #: forward mixing rows in its values) and ``padding`` (a model reading padded columns).
    independence_checks: ClassVar[tuple[str, ...]] = ("halves", "padding")
    #: The algorithm a private one equals at sigma = 0 and clip = inf (checked by the contract suite).
    non_private_twin: ClassVar[Optional[str]] = None
    #: Registered for the contract suite unless abstract.
    abstract: ClassVar[bool] = True
    #: Whether the module trains on an anchored single pass (``anchor_batch_size``: Kornowski et al.'s Alg. 3 sizes).
    takes_anchored_pass: bool = False
    #: A private step's losses check every class target on the device (review 21); otherwise only where a bad one
    #: cannot raise (an accelerator) and the host has not vetted the batch (:meth:`example_losses`).
    labels_checked_in_every_forward: ClassVar[bool] = False
    recheck_probability = RecheckProbability()
    #: True while :meth:`public_gradient` forwards and backpropagates a public batch (PAZO's): hooks tell it apart.
    public_forward = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("abstract", False):
            cls.abstract = False
            ALGORITHMS[cls.__name__] = cls

    def __setattr__(self, name: str, value: Any) -> None:
        """``nn.Module.__setattr__``, in a third of its time for a value that is neither a tensor nor a module,
        named after no parameter, buffer or layer: torch would store it as a plain attribute too, after three
        ``isinstance`` checks, two through Python metaclasses (1.3 us against 0.45, AMD EPYC). Lightning sets
        ``_current_fx_name`` at each hook it calls, 24 times a step (issue 8: a step's host time)."""
        slots = self.__dict__
        if (not isinstance(value, (Tensor, nn.Module)) and "_buffers" in slots and name not in slots["_parameters"]
                and name not in slots["_modules"] and name not in slots["_buffers"]):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __init__(
        self,
        backbone: nn.Module,
        *,
        lr: float = 1e-6,
        seed: Optional[int] = None,
        num_classes: Optional[int] = None,
        lr_scheduler: Optional[LRSchedulerCallable] = None,
        clip: float = 1.0,
        target_epsilon: Optional[float] = None,
        noise_multiplier: Optional[float] = None,
        delta: Optional[float] = None,
        max_epsilon: Optional[float] = None,
        noise_seed: Optional[int] = None,
        eps_error: float = 0.05,
        neighbours: str = "add_remove",
        accountant: str = "prv",
        log_private_stats: Optional[bool] = None,
        fixed_forward_rows: Optional[int] = None,
        fixed_forward_lengths: Optional[list[int]] = None,
        recheck_probability: float = RECHECK_PROBABILITY,
    ) -> None:
        super().__init__()
        raise_if_any([check_positive("lr", lr), None if fixed_forward_rows is None
                      else check_positive_int("fixed_forward_rows", fixed_forward_rows),
                      _check_lengths(fixed_forward_lengths, fixed_forward_rows),
                      check_recheck_probability(recheck_probability),
                      renormalising_embeddings(backbone) if self.private else None])
        self.save_hyperparameters(ignore=["backbone", "lr_scheduler", "noise_seed"])  # (a test seed never resumes)
        self.automatic_optimization = False
        self.backbone = backbone
        self.lr = lr
        self.run_seed = seed
        self.lr_scheduler_factory = lr_scheduler
        self.fixed_shape = (None if fixed_forward_rows is None
                            else FixedShapeForwards(fixed_forward_rows, fixed_forward_lengths))
        if self.fixed_shape is not None and isinstance(backbone, Backbone):
            backbone.row_shapes = True
        self._buffers_before: Optional[BufferState] = None
        self._parameter_writes: Optional[ParameterWrites] = None
        self._registrations: Optional[RegistrationWatch] = None  # (a private fit's, closed at its teardown)
        self._pending_checks: set[str] = set()  # per-example independence checks of a private fit
        self._host_answer: Optional[bool] = None  # the host batch's mask has a row shorter than its longest
        # (device mask, its version) of a batch the host saw no shorter row in: for that very tensor, unwritten
        self._host_note: Optional[tuple[Tensor, int]] = None
        self._eval_mode_caches: list[tuple[nn.Module, str]] = []  # (zeroth order: emptied before each forward)
        # (device targets, their version) of a batch whose class targets the host saw all in 0..C-1 (review 21)
        self._labels_note: Optional[tuple[Tensor, int]] = None
        self._labels_vetted_on_host = False  # the host batch about to be moved: every class target in range
        self._check_labels = False  # this step's losses check the class targets on the device (not vetted on the host)
        self._labels_on_device = False  # this private fit's targets reach an accelerator, where a bad one cannot raise
        self._transfer_as_is = False  # this fit's batches reach the step as the host batch moved (its hooks' own)
        self._loss_dtype: Optional[torch.dtype] = None  # the model's losses' dtype (loss_dtype), read again each fit
        self._classes_of_labels: Optional[int] = None  # this fit's C of the class targets 0..C-1
        self.recheck_probability = recheck_probability  # (makes its recheck_clock)
        self._recheck_pending = False  # a step drawn for a re-check, until a batch of it could compare
        self.log_private_stats = (not self.private) if log_private_stats is None else bool(log_private_stats)
        if self.private and self.log_private_stats:
            warnings.warn(f"{type(self).__name__}(log_private_stats=True) logs clip_fraction and step_time of "
                          "private batches without noise or accounting: the logs are outside the privacy "
                          "guarantee (debugging only)", LitZodpWarning, stacklevel=2)
        if self.private:
            self.privacy = PrivacyComponent(clip=clip, target_epsilon=target_epsilon,
                                            noise_multiplier=noise_multiplier, delta=delta,
                                            max_epsilon=max_epsilon, noise_seed=noise_seed, eps_error=eps_error,
                                            neighbours=neighbours, accountant=accountant)
        else:
            given = {"target_epsilon": target_epsilon, "noise_multiplier": noise_multiplier, "delta": delta,
                     "max_epsilon": max_epsilon, "noise_seed": noise_seed}
            raise_if_any([f"`{name}` has no effect: {type(self).__name__} is not private (use its private "
                          "version)" for name, value in given.items() if value is not None])
            self.privacy = NonPrivate(clip=clip)
        self.num_classes = num_classes or num_classes_of(backbone)
        self.val_accuracy: Optional[MulticlassAccuracy] = None
        self.test_accuracy: Optional[MulticlassAccuracy] = None
        # a backbone's own evaluation metrics (the synthetic quadratic's gradient norm) replace loss and accuracy
        own = getattr(backbone, "evaluation_metrics", None)
        own = own() if callable(own) else None
        self.val_metrics: Optional[nn.ModuleDict] = nn.ModuleDict(own) if own else None
        self.test_metrics: Optional[nn.ModuleDict] = nn.ModuleDict(backbone.evaluation_metrics()) if own else None
        if self.num_classes and self.val_metrics is None:
            self._build_metrics(self.num_classes)

    # ----------------------------------------------------------------- the algorithm's declaration
    def step_plan(self) -> StepPlan:
        """What one training step releases about its batch (calibration and the ledger derive from it)."""
        raise NotImplementedError

    @property
    def clip(self) -> float:
        return self.privacy.clip

    # ----------------------------------------------------------------------------------- setup
    def _build_metrics(self, num_classes: int) -> None:
        self.val_accuracy = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_accuracy = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def setup(self, stage: str) -> None:
        _refuse_loss_scaling(self.trainer)
        if stage == "fit":
            _refuse_a_backbone_without_trainable_parameters(self.backbone, type(self).__name__)
        if self.private:
            _refuse_tuner(self.trainer)
            if stage == "fit":
                refuse_launchers_that_return_only_the_weights(self.trainer)
                _refuse_batch_size_monitors(self.trainer)
                _refuse_length_dependent_state(self.backbone, self.trainer.datamodule)
        data_classes = getattr(self.trainer.datamodule, "num_classes", None) if self._trainer else None
        if data_classes and self.num_classes and data_classes != self.num_classes:
            raise PrivacyConfigError(
                f"Model/data mismatch: the backbone predicts {self.num_classes} classes but the "
                f"DataModule has {data_classes}")
        if self.num_classes is None and data_classes:
            self.num_classes = data_classes
            if self.val_metrics is None:
                self._build_metrics(data_classes)
        _refuse_input_mismatch(self.backbone, self.trainer.datamodule if self._trainer else None)
        _refuse_text_mismatch(self.backbone, self.trainer.datamodule if self._trainer else None)
        if self.fixed_shape is not None and getattr(self.trainer.datamodule, "pad_to_max_length", True) is False:
            raise PrivacyConfigError(
                "`fixed_forward_rows` needs rows of one length, but the data module pads each batch to its "
                "longest row: set its `pad_to_max_length: true`")
        if self.run_seed is None:
            self.run_seed = torch.initial_seed() & ((1 << 62) - 1)
        self.run_seed = int(self.trainer.strategy.broadcast(self.run_seed, src=0))

    def configure_callbacks(self):
        """:class:`~lit_zodp.callbacks.StopRanksOnError` (a DDP fit whose rank 0 fails leaves no rank
        waiting), or for a private module the privacy callback, which stops them too: unless the Trainer
        already has one (a user's instance, or this module's from an earlier fit or test: Lightning would
        announce that it overrides it)."""
        from lit_zodp.callbacks import PrivacySpendCallback, StopRanksOnError

        wanted = PrivacySpendCallback() if self.private else StopRanksOnError()
        present = self.trainer.callbacks if self._trainer is not None else []
        return [] if any(isinstance(p, type(wanted)) for p in present) else [wanted]

    def on_train_start(self) -> None:
        """Plan the privacy of this fit: sampling from the real sampler, sigma, budget, fresh noise."""
        if self.trainer.world_size > 1:
            _require_no_distributed_sampler(self.trainer)
        sampling = read_sampling(self.trainer) if self.private else None
        _refuse_anchored_pass(self)
        change = self.privacy.sampling_change(sampling) if self.private else None
        if change:
            rank_zero_warn(change, category=LitZodpWarning)
        planned_steps = _planned_steps(self.trainer) if self.private else None
        if planned_steps is not None and planned_steps >= LONG_PLAN_STEPS:
            rank_zero_info(
                f"Accounting {planned_steps:,} planned steps: the PRV accountant's calibration and budget take a while "
                "here (about 10 s and 1.6 GB at 1e6 steps, 2 min and 5.7 GB at 1e7)")
        self.privacy.plan(step_plan=self.step_plan(), sampling=sampling, planned_steps=planned_steps,
                          reduce_sum=self.reduce_sum if self.trainer.world_size > 1 else None,  # None: one process
                          broadcast=lambda value: self.trainer.strategy.broadcast(value, src=0),
                          spend_log=SpendLog() if self.private and self.trainer.is_global_zero else None,
                          split=getattr(self.trainer.datamodule, "split_id", None))
        if self.private:
            _refuse_unreachable_minimum(self.trainer, self.privacy.steps_allowed)
            _refuse_collate_failing_on_empty_batches(self.trainer)
            self._refuse_private_rows_of_several_shapes()
            self.privacy.require_attached(self.trainer.optimizers)
            _mark_private_training_data(self.trainer)
            self._buffers_before = buffer_state(self.backbone)
            self._parameter_writes = ParameterWrites(self.backbone)
            self._close_registrations()
            self._registrations = RegistrationWatch(self.backbone)
            self._pending_checks = set(self.independence_checks)
        self._host_answer, self._host_note = None, None  # (nothing noted in an earlier fit holds in this one)
        self._labels_note, self._labels_vetted_on_host = None, False
        self._labels_on_device = (self.private and not self.labels_checked_in_every_forward
                                  and self._device_checks_labels())
        self._check_labels = self.private and self.labels_checked_in_every_forward
        self._transfer_as_is = _moved_as_it_is(self) and _moved_as_it_is(self.trainer.datamodule)
        self._classes_of_labels = label_classes(self.backbone, self.num_classes)  # as per_example_loss reads it
        self._sigma_logged = False
        self._loss_dtype = None  # (the precision plugin may have cast the weights since)
        self._warn_short_schedule()

    def _warn_short_schedule(self) -> None:
        """One line where the ``lr_scheduler``'s horizon ends before the fit (:mod:`lit_zodp.schedules`): a horizon
        written in epochs, as Lightning's automatic optimization counts them, ran out silently (review 30)."""
        scheduler = self.lr_schedulers()
        for note in [horizon_note(s, remaining_steps(self.trainer)) for s in _as_list(scheduler)]:
            if note:
                rank_zero_warn(note, category=LitZodpWarning)

    def _refuse_private_rows_of_several_shapes(self) -> None:
        """Under ``fixed_forward_rows``, rows of several shapes in a private loader are refused before the first step
        (:meth:`~lit_zodp.privacy.fixed_shape.FixedShapeForwards.refuse_rows_of_several_shapes`, review 21); a data
        module that pads every row to ``max_length`` has one shape by construction."""
        if self.fixed_shape is None or getattr(self.trainer.datamodule, "pad_to_max_length", None) is True:
            return
        for loader in _train_loaders(self.trainer):
            if isinstance(getattr(loader, "batch_sampler", None), PrivateBatchSampler):
                self.fixed_shape.refuse_rows_of_several_shapes(loader)

    def on_train_epoch_start(self) -> None:
        """A private loader rebuilt for this epoch (``reload_dataloaders_every_n_epochs``) must sample as planned:
        the ledger accounts every step at the fit's rate, and releases divide by the fit's expected batch size."""
        sampling = read_sampling(self.trainer) if self.private else None
        _refuse_anchored_pass(self)
        if sampling != self.privacy.sampling:
            raise PrivacyConfigError(
                f"The private loader was rebuilt with sampling {sampling} but this fit is accounted "
                f"at {self.privacy.sampling}: keep the batch size and data fixed within a fit (no batch-size "
                "schedule or tuner re-run); change them by resuming from a checkpoint in a new fit.")

    def teardown(self, stage: str) -> None:
        self.privacy.end_fit()
        self._close_registrations()

    def _close_registrations(self) -> None:
        if self._registrations is not None:
            self._registrations.close()
            self._registrations = None

    def attach_privacy(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Every ``optimizer.step()`` commits the step plan to the ledger."""
        self.privacy.attach(optimizer)
        return optimizer

    def with_scheduler(self, optimizer: torch.optim.Optimizer):
        if self.lr_scheduler_factory is None:
            return optimizer
        scheduler = self.lr_scheduler_factory(optimizer)
        raise_if_any([_metric_scheduler_error(scheduler)])
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    # ------------------------------------------------------------------------------ verbs
    def forward(self, inputs) -> Tensor:
        return predict(self.backbone, inputs)

    @torch.no_grad()
    def private_losses(self, inputs, targets) -> Tensor:
        """``f(x; xi_i)`` per private example: no autograd, eval mode (set here too, whatever a subclass's
        hooks did: dropout or batch statistics would couple the examples); the only way a ZO step sees
        the batch."""
        if batch_size_of(inputs) == 0:
            self._enter_eval_forward()
            return torch.zeros(0, dtype=self.loss_dtype, device=targets.device)
        self._enter_private_forward(targets)
        versions = self._parameter_writes.versions() if self._parameter_writes is not None else None
        registrations = self._registrations
        losses = self._losses(inputs, targets)
        if self._buffers_before:  # a layer that writes a buffer even in eval mode (microseconds; none: nothing)
            refuse_buffer_writes(self.backbone, self._buffers_before, added=False)
        # (most steps: no check; a padding check waiting for a batch with a shorter row costs a dict lookup)
        checking = bool(self._pending_checks or self._recheck_pending) and self._checks_can_compare(inputs)
        if versions is not None:  # (between the forwards the engine writes them: each forward is checked alone)
            self._parameter_writes.refuse_since(versions, reassigned=checking)
        if checking:
            self._run_due_checks(inputs, targets, losses)
        if registrations is not None and registrations.registered:  # (the checks' forwards included)
            registrations.refuse()
        return losses

    def _enter_eval_forward(self) -> None:
        """Eval mode, and no eval-mode value cached at another point (a forward at a new point may not read the last
        point's biases)."""
        if self.backbone.training:
            self.backbone.eval()
        if self._eval_mode_caches:
            clear_eval_mode_caches(self._eval_mode_caches)

    def _enter_private_forward(self, targets) -> None:
        """What every eval-mode forward of a private batch needs first, whatever runs it (:meth:`private_losses`,
        O2NC's vmapped per-example gradients): :meth:`_enter_eval_forward`, the device-side check of class targets
        the host did not vet (review 21), and a registration watch emptied of what was made outside a private forward
        (the caller refuses what its forward registers)."""
        self._enter_eval_forward()
        if self._labels_on_device:
            self._start_private_losses(targets)
        registrations = self._registrations
        if registrations is not None and registrations.registered:
            registrations.forget()

    def _losses(self, inputs, targets) -> Tensor:
        if self.fixed_shape is None:
            return self.example_losses(inputs, targets)
        losses = None
        for rows, row_targets, positions in self.fixed_shape.chunks(inputs, targets):
            chunk = self.example_losses(rows, row_targets)
            if losses is None:  # (the chunks' dtype: a float64 model's losses stay float64)
                losses = torch.empty(len(targets), dtype=chunk.dtype, device=targets.device)
            losses[positions] = chunk[:len(positions)]
        return losses if losses is not None else torch.zeros(0, dtype=self.loss_dtype, device=targets.device)

    @property
    def loss_dtype(self) -> torch.dtype:
        """The per-example losses' dtype, of the model and never of a batch: float32, or the parameters' where wider
        (:func:`~lit_zodp.per_example.ghost.at_least_float32`: a float64 model's). An empty batch's losses have it,
        and a release is rounded to it: an empty batch's float32 zeros made a float64 model's release, and the update
        it scales, a float32 number, so the weights showed which steps sampled no row (review 33)."""
        if self._loss_dtype is None:
            dtypes = [p.dtype for p in self.backbone.parameters() if p.is_floating_point()]
            self._loss_dtype = functools.reduce(torch.promote_types, dtypes, torch.float32)
        return self._loss_dtype

    def example_losses(self, inputs, targets) -> Tensor:
        """The backbone's per-example losses (float32 or wider: half precision is widened, a float64 model's are kept
        for the central difference; a ``.float()`` here narrowed them, and on DPZero's synthetic quadratic, App. B.1
        at ``lam = 1e-4``, losses of ~500 rounded to float32 moved each difference in steps of 0.3). In a private
        step a class target the model cannot take gives a NaN loss, counted as zero, instead of failing the step that
        samples its row (review 21: :func:`~lit_zodp.backbones.base.per_example_loss`). The check costs about six
        tensor ops per forward (56 us per forward on the quickstart's CPU), so it runs only where needed: on the CPU,
        after the plain losses raised (``IndexError: Target 7 is out of bounds``); on an accelerator, where a bad
        target is a device assert, unless the host saw every target of the batch in range
        (:meth:`_vet_host_labels`)."""
        if self.private and self._check_labels:
            return self._total_losses(inputs, targets)
        try:
            return at_least_float32(per_example_loss(self.backbone, inputs, targets))
        except (IndexError, RuntimeError):
            if not self.private:
                raise
        return self._total_losses(inputs, targets)  # (the check raises again an error that was not the targets')

    def _total_losses(self, inputs, targets) -> Tensor:
        return at_least_float32(per_example_loss(self.backbone, inputs, targets, total=True, classes=self.num_classes))

    def _device_checks_labels(self) -> bool:
        """Whether this fit's class targets are checked before the device sees them: on an accelerator a target out
        of range is a device-side assert, which no step can catch."""
        return self.device.type != "cpu"

    def _start_private_losses(self, targets: Tensor) -> None:
        """At a private step's losses (the whole batch's targets), on an accelerator: whether they must check the
        class targets on the device, i.e. whether the host did not vet these very targets, unwritten since the
        transfer."""
        note = self._labels_note
        check = not (note is not None and targets is note[0] and targets._version == note[1])
        if check is not self._check_labels:  # (a store costs 0.5 us)
            self._check_labels = check

    def _vet_host_labels(self, batch: Any) -> None:
        """Whether every class target of the private part of the host batch about to be moved lies in ``0..C-1``, read
        as a Python list on the host (a few us), where the device check of :func:`per_example_loss` costs about six
        tensor ops per forward (56 us per forward on the quickstart's CPU, launches on a GPU). Not class targets
        (floats, several per row) need no check; no ``C`` known or a batch already on a device: not vetted."""
        vetted = False
        if self._labels_on_device and self._transfer_as_is:
            vetted = _labels_in_range(self._private_pair(batch)[1], self._classes_of_labels)
        if vetted is not self._labels_vetted_on_host:
            self._labels_vetted_on_host = vetted

    def _run_due_checks(self, inputs, targets, losses: Tensor) -> None:
        """The per-example independence checks of a private fit (audit 5): a forward or loss that mixes rows
        (batch statistics, batch centring, a loss divided by the batch's total) or reads padding (FNet takes
        no attention mask: 4.6e-3 in a loss) is refused in one line. Each runs on private batches until one
        lets it compare (about two extra forwards of one batch per fit); then the halves check runs again at
        steps drawn by the OS with probability ``recheck_probability``, once in the step: mixing that only
        some batches trigger (a capacity-limited mixture of experts) is sampled, not excluded. A step is drawn
        in :meth:`on_train_batch_start`; a drawn batch with fewer than two finite losses passes the re-check
        on to the next."""
        if not (self._pending_checks or self._recheck_pending):
            return
        dtype = self._parameter_dtype()
        if "padding" in self._pending_checks and self._refuse_padding_dependence(inputs, targets, losses, dtype):
            self._pending_checks.discard("padding")
        if "halves" in self._pending_checks or self._recheck_pending:
            if self._refuse_batch_mixing(inputs, targets, losses, dtype):
                self._pending_checks.discard("halves")
                self._recheck_pending = False

    def _parameter_dtype(self) -> torch.dtype:
        """The backbone's (first) parameter dtype: the rounding the independence checks tolerate."""
        return next((p.dtype for p in self.backbone.parameters()), torch.float32)

    def run_independence_checks(self, inputs, targets) -> None:
        """The independence checks (:meth:`_run_due_checks`) for modules whose step has no
        ``private_losses`` (first-order), on the losses of the batch computed as the step computes them:
        the backbone in its own (training) mode, autograd on, every Bernoulli draw (dropout) at its mean
        (:func:`~lit_zodp.per_example.checks.step_mode_recompute`). Before audit 8 they ran in eval mode
        without grad, so a loss or forward that mixed the batch only in training passed (62 C released on
        one removal). Every other draw takes its mean or a fixed stand-in too, a model's own generator's since stop 62
        (until then such a forward was checked in eval mode, with a warning); one drawn anew in every recomputation
        (``binomial``, NumPy) is checked in eval mode, with a warning. Before
        2026-11-25 first-order fits checked neither a decoder classifier given ``inputs_embeds``, which
        reads its logit at a padded column (0.05-0.11 in a logit, audit 5), nor a ``per_example_loss``
        mixing the batch after the model. Until 2026-11-28 a padding check still waiting for a batch with a
        row shorter than its longest recomputed the losses on every step (two forwards: text of full-length
        rows never resolves it; MiniLM, batch 32: 1.0 s of a 3.7 s step); :meth:`_checks_can_compare`."""
        if batch_size_of(inputs) == 0 or not self._checks_can_compare(inputs):
            return
        with step_mode_recompute():
            losses = self._losses(inputs, targets).detach()
            if not rows_agree(losses, self._losses(inputs, targets).detach(), dtype=self._parameter_dtype()):
                warn_unchecked_training_mode("the backbone and its per_example_loss")
                with torch.no_grad(), eval_mode(self.backbone):
                    self._run_due_checks(inputs, targets, self._losses(inputs, targets))
                return
            self._run_due_checks(inputs, targets, losses)

    def _refuse_batch_mixing(self, inputs, targets, losses: Tensor, dtype: torch.dtype) -> bool:
        """The losses again on two random halves, each cut to its own longest row as the data modules pad
        it (:func:`~lit_zodp.per_example.checks.refuse_batch_mixing`; a mismatch is measured again in the
        batch's own shape, padding included); whether 2+ finite ones compared."""
        def losses_of(rows: Tensor, own_padding: bool = True) -> Tensor:
            rows = rows.to(targets.device)
            taken = take_rows(inputs, rows)
            return self._losses(self._own_padding(taken) if own_padding else taken, targets[rows])

        return refuse_batch_mixing(losses_of, len(targets), dtype=dtype, device=losses.device, full=losses,
                                   in_place=lambda rows: losses_of(rows, own_padding=False))

    def _refuse_padding_dependence(self, inputs, targets, losses: Tensor, dtype: torch.dtype) -> bool:
        """Text batches padded to their longest row: the rows shorter than it, again cut to their own
        longest, must keep their losses (fewer padded columns, never more: no position table is passed).
        A model that reads padded columns ties a row's loss to its batch's longest row, whatever a split
        of the batch shows. Whether a row could be compared (or nothing is to check)."""
        shorter = self._rows_shorter_than_the_batch(inputs)
        if shorter is None:
            return True
        if len(shorter) == 0:
            return False
        again = self._losses(self._own_padding(take_rows(inputs, shorter)), targets[shorter.to(targets.device)])
        ratio = float(rows_differ(losses[shorter.to(losses.device)], again, dtype=dtype, device=losses.device).max())
        raise_if_any([None if ratio <= 1.0 else
                      f"The per-example losses change with the padding of their batch (by {beyond_tolerance(ratio)} "
                      "with fewer padded columns): the model reads padded columns (FNet "
                      "ignores the attention mask; a decoder classifier given inputs_embeds reads the last "
                      "column), so an example's loss depends on its batch's longest row; pad every row to "
                      "max_length (the data's `pad_to_max_length: true`) or use a model that masks padding"])
        return True

    def _rows_shorter_than_the_batch(self, inputs) -> Optional[Tensor]:
        """The rows the padding check compares: those shorter than the batch's longest (none: this batch cannot
        compare); ``None`` where the check does not apply (no attention mask, a fixed shape, text padded to
        ``max_length``)."""
        if self._host_saw_no_shorter_row(inputs):  # no wait for a device
            return torch.zeros(0, dtype=torch.long, device=inputs["attention_mask"].device)
        mask = self._padding_check_mask(inputs)
        return None if mask is None else torch.nonzero(rows_ending_early(mask)).flatten()

    def _host_saw_no_shorter_row(self, inputs) -> bool:
        """Whether the host's note of this batch (:meth:`_note_host_batch`, made only where the padding check applies)
        says it has no row shorter than its longest. The note holds for the very mask tensor the transfer produced,
        unwritten since (its version): a callback's or subclass's ``on_train_batch_start``, or a ``training_step``,
        that replaces or rewrites the mask after the transfer gets the device's answer (red-team review,
        2026-11-28: a mask set from the token ids in ``on_train_batch_start`` passed a model that reads padding)."""
        note = self._host_note
        return (note is not None and isinstance(inputs, Mapping)
                and inputs.get("attention_mask") is note[0] and note[0]._version == note[1])

    def _padding_check_mask(self, inputs) -> Optional[Tensor]:
        """The attention mask the padding check reads; ``None`` where the check does not apply (no attention mask, a
        fixed shape, text padded to ``max_length``)."""
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if (self.fixed_shape is not None or not isinstance(inputs, Mapping) or "attention_mask" not in inputs
                or getattr(datamodule, "pad_to_max_length", False)):
            return None
        return inputs["attention_mask"]

    def _on_before_batch_transfer(self, batch: Any, dataloader_idx: int = 0) -> Any:
        """Lightning's step before each transfer, after the ``on_before_batch_transfer`` hooks (overridden here
        rather than that public hook, which Lightning warns about whenever a DataModule is passed): the host
        batch about to be moved, for :meth:`_note_host_batch`."""
        batch = super()._on_before_batch_transfer(batch, dataloader_idx)
        self._note_host_batch(batch)
        self._vet_host_labels(batch)
        return batch

    def _apply_batch_transfer_handler(self, batch: Any, device: Optional[torch.device] = None,
                                      dataloader_idx: int = 0) -> Any:
        """Lightning's transfer (``transfer_batch_to_device``, ``on_after_batch_transfer``); the host's answer is
        bound to the mask it produced (:meth:`_host_saw_no_shorter_row`)."""
        answer = self._host_answer
        if answer is not None:  # (assigned only when it changes: a store costs 0.5 us even on the fast __setattr__)
            self._host_answer = None
        batch = super()._apply_batch_transfer_handler(batch, device, dataloader_idx)
        mask = self._private_mask(batch) if answer is False else None
        usable = isinstance(mask, Tensor) and not mask.is_inference()  # (an inference tensor keeps no version)
        if usable or self._host_note is not None:
            self._host_note = (mask, mask._version) if usable else None
        self._bind_vetted_labels(batch)
        return batch

    def _bind_vetted_labels(self, batch: Any) -> None:
        """The host's vetting (:meth:`_vet_host_labels`) holds for the targets tensor this transfer produced, as long as
        nothing writes it: a callback or ``training_step`` that replaces or rewrites them gets the device check."""
        targets = None
        if self._labels_vetted_on_host:
            self._labels_vetted_on_host = False
            targets = self._private_pair(batch)[1]
        usable = isinstance(targets, Tensor) and not targets.is_inference()
        if usable or self._labels_note is not None:
            self._labels_note = (targets, targets._version) if usable else None

    def _note_host_batch(self, batch: Any) -> None:
        """While a padding check waits for a batch with a row shorter than its longest, whether the training batch
        has one is read here, once, on the host: asked on an accelerator, every step would wait for the device
        (issue 8), until such a batch comes (text of full-length rows: never); on the CPU each forward would
        measure the rows again. Each batch's transfer replaces the answer. The step asks the device where the device
        batch may not be the host batch moved (an own ``transfer_batch_to_device`` or ``on_after_batch_transfer``,
        here or in the DataModule), where no host batch was seen (``dataloader_iter`` steps), and where the mask the
        forward gets is not the one the transfer produced, unwritten."""
        if self._host_answer is not None or self._host_note is not None:
            self._host_answer, self._host_note = None, None
        if not ("padding" in self._pending_checks and self._trainer is not None
                and self.trainer.training and _moved_as_it_is(self) and _moved_as_it_is(self.trainer.datamodule)):
            return
        mask = self._private_mask(batch)
        if isinstance(mask, Tensor) and mask.device.type == "cpu":
            self._host_answer = any_row_ends_early(mask)

    def _private_mask(self, batch: Any) -> Optional[Tensor]:
        """The attention mask of a training batch's private part that the padding check reads, if any."""
        return self._padding_check_mask(self._private_pair(batch)[0])

    def _private_pair(self, batch: Any) -> tuple[Any, Any]:
        """``(inputs, targets)`` of a training batch's private part; ``(None, None)`` for another layout."""
        private = self.split_batch(batch)[0]
        return tuple(private) if isinstance(private, (tuple, list)) and len(private) == 2 else (None, None)

    def _checks_can_compare(self, inputs) -> bool:
        """Whether a pending check can run on this batch. The halves check (and a drawn re-check) can; a padding
        check alone waits, at no cost, for a batch with a row shorter than its longest (first-order steps
        recompute the losses for a check: two forwards)."""
        if self._recheck_pending or self._pending_checks - {"padding"}:
            return True
        if "padding" not in self._pending_checks:
            return False
        if self._host_saw_no_shorter_row(inputs):  # (every full-length step: no tensor is made)
            return False
        shorter = self._rows_shorter_than_the_batch(inputs)
        return shorter is None or len(shorter) > 0

    def _own_padding(self, part):
        """``part`` cut to its longest row (text padded per batch, as the data modules pad it)."""
        if self.fixed_shape is None and isinstance(part, Mapping) and "attention_mask" in part:
            return cut_columns(part, max(int(used_lengths(part["attention_mask"]).max()), 1))
        return part

    def split_batch(self, batch) -> tuple[Any, Optional[Any]]:
        """``(private, public)``: a DataModule with ``public_in_step`` hands both; otherwise public is None."""
        if isinstance(batch, dict) and "private" in batch:
            return batch["private"], batch.get("public")
        return batch, None

    def public_gradient(self, public_batch, params: Optional[list[Tensor]] = None) -> list[Tensor]:
        """Gradient of the mean loss on a PUBLIC batch at the current parameters (no privacy cost).

        Backprop on the public batch only: no private tensor enters this graph. ``params``
        defaults to the trainable parameters; unused ones get zeros. ``public_forward`` is True during its forward
        and backward (a forward hook can tell it from a private forward). Eval-mode caches (LeViT's attention biases)
        are emptied before and after: filled by the last private forward, without a graph and at another point, they
        gave the cached parameters a zero public gradient (review 53).
        """
        inputs, targets = public_batch
        params = params if params is not None else [p for p in self.backbone.parameters() if p.requires_grad]
        with self.public_backprop():
            loss = at_least_float32(per_example_loss(self.backbone, inputs, targets)).mean()
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]

    @contextlib.contextmanager
    def public_backprop(self):
        """A forward and backward on a PUBLIC batch (:meth:`public_gradient`, GEP's anchor gradients): grad on,
        ``public_forward`` True, the eval-mode caches emptied before and after."""
        if torch.is_inference_mode_enabled():
            raise_if_any(["A public gradient (backprop on a public batch) runs inside `torch.inference_mode()`, where "
                          "no backward can run: call trainer.fit outside inference_mode"])
        self.public_forward = True  # (forward hooks tell this forward from a private one)
        clear_eval_mode_caches(self._eval_mode_caches)  # (at x_t: not the last forward's point, nor its no-grad tensor)
        try:
            with torch.enable_grad():
                yield
        finally:
            self.public_forward = False
            clear_eval_mode_caches(self._eval_mode_caches)  # (holds no graph into the next forward)

    def reduce_sum(self, tensor: Tensor) -> Tensor:
        """All-reduce SUM across DDP ranks (identity on one process)."""
        if self._trainer is None or self.trainer.world_size == 1:
            return tensor
        return self.trainer.strategy.reduce(tensor, reduce_op="sum")

    def step_optimizer(self) -> None:
        """Step the optimizer (Lightning counts it; the ledger commits) and the LR scheduler."""
        self.optimizers().step()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Optional[int]:
        if self.privacy.budget_exhausted:
            self.trainer.should_stop = True
            return -1  # one more step would spend past the budget: stop here
        if self.private and not self._recheck_pending and self.recheck_clock.due():
            self._recheck_pending = True  # the halves check runs again (set only then: Module.__setattr__ is slow)
        self._step_started = time.perf_counter()
        return None

    def log_step(self, batch_size: int, clip_fraction: Optional[Callable[[], float | Tensor]] = None,
                 **stats: float) -> None:
        """Per-step statistics (sigma once, public ``stats``; ``log_private_stats``: ``step_time``, ``clip_fraction``)
        on the steps the loggers write.

        Lightning writes ``on_step`` values every ``log_every_n_steps`` steps; a value logged between
        two writes is overwritten unread (these are not in the progress bar). ``self.log`` costs
        0.3-1 ms per call in Lightning 2.x (it walks the metric's state each time), more than a whole
        quickstart step, so the other steps skip it. ``clip_fraction`` is a function, called only
        on those steps.
        """
        if not self._loggers_write_this_step():
            return
        size = max(batch_size, 1)
        if self.privacy.is_private and not getattr(self, "_sigma_logged", False):  # constant in a fit: once
            self.log("sigma", float(self.privacy.noise_multiplier), batch_size=size)
            self._sigma_logged = True
        if clip_fraction is not None and self.log_private_stats:
            self.log("clip_fraction", clip_fraction(), batch_size=size)
        for name, value in stats.items():
            self.log(name, value, batch_size=size)
        if self.log_private_stats:
            self.log("step_time", time.perf_counter() - self._step_started, batch_size=size)

    def _loggers_write_this_step(self) -> bool:
        """Lightning's own test (``should_update_logs``: every ``log_every_n_steps``; every step under ``fast_dev_run``)."""
        trainer = self._trainer
        if trainer is None:
            return False
        connector = getattr(trainer, "_logger_connector", None)
        return bool(getattr(connector, "should_update_logs", True) or trainer.fast_dev_run)

    # ------------------------------------------------------------------------------ evaluation
    def on_validation_start(self) -> None:
        _refuse_private_evaluation(self, "validation", "val_dataloaders")

    def on_test_start(self) -> None:
        _refuse_private_evaluation(self, "test", "test_dataloaders")

    def on_predict_start(self) -> None:
        _refuse_private_evaluation(self, "predict", "predict_dataloaders")

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, self.val_accuracy, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, self.test_accuracy, "test")

    def _evaluate(self, batch, metric: Optional[MulticlassAccuracy], prefix: str) -> None:
        inputs, targets = batch
        if batch_size_of(inputs) == 0:
            return
        own = self.val_metrics if prefix == "val" else self.test_metrics
        if own is not None:  # the backbone's metrics (Backbone.evaluation_metrics), computed over the whole set
            with torch.no_grad():
                self.backbone.update_evaluation(own, inputs, targets)
            for name, value in own.items():
                self.log(f"{prefix}_{name}", value, prog_bar=name != "loss", batch_size=len(targets))
            return
        with torch.no_grad():
            logits = self(inputs)
            loss = nn.functional.cross_entropy(logits.float(), targets)
        size = len(targets)
        self.log(f"{prefix}_loss", loss, batch_size=size, sync_dist=True)
        if metric is not None:
            metric(logits, credited_targets(logits, targets, inputs))
            self.log(f"{prefix}_acc", metric, prog_bar=True, batch_size=size)

    # ----------------------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The privacy state (ledger and plan, no secret) and the public run seed."""
        checkpoint["privacy"] = self.privacy.state_dict()
        checkpoint["public_state"] = {"run_seed": self.run_seed, "algorithm": _dotted_name(type(self))}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Trainer resumes and ``load_from_checkpoint`` alike: the ledger continues."""
        resuming = self._trainer is not None and self.trainer.training
        private_steps = 0 if self.private else _private_steps_in(checkpoint)
        if private_steps and resuming:
            raise PrivacyConfigError(
                f"This checkpoint is a private run's ({private_steps} accounted steps): "
                f"{type(self).__name__} would continue it without noise or accounting; resume with the private module, "
                "or load its weights into a new non-private run yourself (the backbone's load_state_dict)")
        has_privacy_state = checkpoint.get("privacy") or "privacy" in checkpoint and not self.private
        if self.private and not has_privacy_state:
            raise PrivacyConfigError("This checkpoint has no privacy state (a non-private run's, or from elsewhere): its "
                                     "weights may have trained on the private data without noise, and a private run "
                                     "cannot resume from it without losing what was spent; start a private run from "
                                     "weights that never saw the private data.")
        if resuming:
            raise_if_any([self._another_algorithms_error(checkpoint)])
        if has_privacy_state:
            self.privacy.load_state_dict(checkpoint["privacy"])
        self.run_seed = checkpoint.get("public_state", {}).get("run_seed", self.run_seed)

    def _another_algorithms_error(self, checkpoint: dict) -> Optional[str]:
        """A Trainer resume continues the checkpoint's run: its optimizer state and its privacy ledger. Resumed by
        another algorithm, it failed inside Lightning (first-order <-> zeroth-order: "loaded state dict has a
        different number of parameter groups"; DPAdam -> DPSGD: ``KeyError: 'momentum'`` after a counted release)
        or took the other algorithm's learning rate silently. Refused in one line, as the CLI refuses a class
        change; the class under another import path, and a user's subclass of it, resume it. The class is the one
        the checkpoint records (LightningCLI's ``_class_path`` for checkpoints written before it did). The message
        offers no new run from these weights: for a private checkpoint it would not count what they spent."""
        saved = ((checkpoint.get("public_state") or {}).get("algorithm")
                 or (checkpoint.get("hyper_parameters") or {}).get("_class_path"))
        if not saved or saved == _dotted_name(type(self)):
            return None
        saved_class = imported(saved)
        if saved_class is type(self) or (isinstance(saved_class, type) and isinstance(self, saved_class)
                                         and _library_class(type(self)) is _library_class(saved_class)):
            return None  # the class under another import path, or a user's subclass of it (of the same algorithm:
            # DPMeZOBCD subclasses DPZero, and a user's subclass of it is no DPZero)
        return (f"`ckpt_path`: this checkpoint was trained by {saved}, but the module resuming it is "
                f"{_dotted_name(type(self))}; a resume continues the checkpoint's run (its optimizer state and "
                f"privacy ledger): resume with {saved.rpartition('.')[2]}")


def credited_targets(logits: Tensor, targets: Tensor, inputs: Any) -> Tensor:
    """The targets accuracy compares the predictions with: ``targets``, except where the inputs carry a
    ``gold_mask [B, K]`` (ReCoRD: several gold candidates, any of which is right; ``targets`` is the first, the
    one trained on), in which case a prediction that is a gold candidate is its own target."""
    gold = inputs.get("gold_mask") if isinstance(inputs, Mapping) else None
    if gold is None:
        return targets
    predicted = logits.argmax(-1)
    hit = gold.to(predicted.device).gather(1, predicted.unsqueeze(1)).squeeze(1).bool()
    return torch.where(hit, predicted, targets.to(predicted.device))


def _dotted_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _library_class(cls: type) -> Optional[type]:
    """The nearest of ``cls``'s classes that lit_zodp defines (the algorithm a user's subclass runs)."""
    return next((c for c in cls.__mro__ if c.__module__.startswith("lit_zodp.")), None)


def _private_steps_in(checkpoint: dict) -> int:
    """The steps a checkpoint's privacy ledger accounts (0: a non-private run's, or none taken)."""
    ledger = (checkpoint.get("privacy") or {}).get("ledger") or {}
    return sum(int(entry.get("count", 0)) for entry in ledger.get("entries", ()))


def _check_lengths(lengths: Optional[list[int]], rows: Optional[int]) -> Optional[str]:
    if lengths is None:
        return None
    if rows is None:
        return "`fixed_forward_lengths` buckets the rows of `fixed_forward_rows` chunks: set `fixed_forward_rows` too"
    if not isinstance(lengths, (list, tuple)) or not lengths or any(check_positive_int("", n) for n in lengths):
        return f"Expected `fixed_forward_lengths` to be a list of positive ints, but got {lengths!r}"
    return None


def _private_samplers(trainer: "pl.Trainer") -> list[PrivateBatchSampler]:
    """The training loaders' REAL private batch samplers (never a duck-typed attribute)."""
    samplers = [getattr(loader, "batch_sampler", None) for loader in _train_loaders(trainer)]
    return [s for s in samplers if isinstance(s, PrivateBatchSampler)]


def read_sampling(trainer: "pl.Trainer") -> SamplingDescription:
    """The sampling description of the private loader's REAL batch sampler (never a duck-typed attribute)."""
    private = _private_samplers(trainer)
    if len(private) != 1:
        raise PrivacyConfigError(
            "A private module needs one private loader whose batch_sampler is a lit_zodp.privacy "
            "PrivateBatchSampler (Poisson by default): use a `PublicPrivateDataModule` (datamodules/) or "
            "DataLoader(batch_sampler=PoissonBatchSampler(n, q, rank=..., world_size=...), collate_fn=... that "
            "collates an empty batch as zero rows). A plain "
            "shuffled loader gives no guarantee the accountant can state.")
    private[0].check_placement(int(trainer.global_rank), int(trainer.world_size))
    return private[0].description


def loader_sampling(trainer: "pl.Trainer") -> Optional[SamplingDescription]:
    """The description of the training loader's private batch sampler, if it has exactly one (a non-private module's
    loader may have none)."""
    private = _private_samplers(trainer)
    return private[0].description if len(private) == 1 else None


def _refuse_anchored_pass(module: "AlgorithmModule") -> None:
    """An anchored single pass (``anchor_batch_size``) gives its anchor steps more examples: only a module that
    divides each step by its own expected size (DPO2NC's Alg. 3) reads it right; any other would divide an anchor's
    sum by a regular step's size. (A private module's loader holds exactly one private sampler: ``read_sampling``.)"""
    if getattr(loader_sampling(module.trainer), "anchored", False) and not module.takes_anchored_pass:
        raise PrivacyConfigError(
            f"{type(module).__name__} does not train on an anchored single pass (the data's `anchor_batch_size` and "
            "`anchor_period`: Alg. 3's batch sizes B1 and B2 for DPO2NC and O2NC with oracle='single_pass'): drop "
            "them")


def _refuse_private_evaluation(module: AlgorithmModule, stage: str, loaders_attribute: str) -> None:
    """A private module's validation, test or predict loader must not read the private split: their loss and
    accuracy reach every logger, the progress bar and ``callback_metrics`` (and an ``EarlyStopping`` or
    ``ModelCheckpoint`` monitoring them) as exact means over private rows, un-noised (red-team review 18: the
    training loader passed as ``val_dataloaders`` too, or ``trainer.validate(model, dm.train_dataloader())``). Refused
    where the loader samples with a :class:`PrivateBatchSampler`, or its dataset is a private training dataset (the
    training loader's, a DataModule's ``private_dataset``, any a private fit of this process trained on) or a
    ``Subset`` or ``ConcatDataset`` part of one."""
    if not module.private or module._trainer is None:
        return
    trainer = module.trainer
    private = _private_datasets(trainer)
    for loader in _as_list(getattr(trainer, loaders_attribute, None)):
        if isinstance(getattr(loader, "batch_sampler", None), PrivateBatchSampler) or _reads_any(
                getattr(loader, "dataset", None), private):
            raise PrivacyConfigError(
                f"The {stage} loader reads the private training data: its metrics would be logged as exact, "
                "un-noised means over private examples (and drive any EarlyStopping or ModelCheckpoint monitoring "
                "them); evaluate on held-out data (a DataModule's val/test splits, or a loader of other rows)")


def _metric_scheduler_error(scheduler: Any) -> Optional[str]:
    """``ReduceLROnPlateau`` steps on a monitored metric; these modules step their scheduler once per training step,
    with none: its first ``step()`` raised ``TypeError`` after the first release (review 22). In a private module a
    rate set from a training loss would be a release no epsilon covers; a validation metric is not passed either."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return None
    return (f"`lr_scheduler`: {type(scheduler).__name__} steps on a monitored metric, but these modules step their "
            "scheduler once per training step without one: use a schedule of the step count (StepLR, "
            "CosineAnnealingLR, LambdaLR)")


def _refuse_collate_failing_on_empty_batches(trainer: "pl.Trainer") -> None:
    """A private loader whose sampler draws empty batches (Poisson, a single pass) must collate one, as a batch of zero
    rows. ``default_collate([])`` raises, so the fit stopped at the first step that sampled no example; a collate
    returning ``None`` made Lightning skip that step (no release, no step counted), so the step count was the number of
    non-empty batches. Either way when the fit stopped, or how many steps it took, told which batches held no example,
    the target included, outside any release (review 22: Poisson q = 0.15 of 8 rows, 20 batches: the fit stopped after
    6 steps, or took 15). Refused before the first step, on the loader's fetch of an empty index list."""
    for loader in _train_loaders(trainer):
        if isinstance(getattr(loader, "batch_sampler", None), (PoissonBatchSampler, SinglePassBatchSampler)):
            problem = _empty_batch_problem(loader)
            if problem:
                raise PrivacyConfigError(
                    f"The private loader's collate_fn {problem} for an empty batch, which its "
                    f"{loader.batch_sampler.description.name} sampling draws: the fit would stop (or skip the step) "
                    "exactly when no example was sampled, which tells of the target; return zero-row tensors for an "
                    "empty list (datamodules.collate.EmptySafeCollate wraps a collate function)")


def _empty_batch_problem(loader: Any) -> Optional[str]:
    """What goes wrong when ``loader`` collates an empty index list as its fetcher would (``None``: a batch)."""
    dataset = loader.dataset
    try:
        getitems = getattr(dataset, "__getitems__", None)
        batch = loader.collate_fn(getitems([]) if getitems else [])
    except Exception as error:  # (whatever the user's collate raises)
        return f"raises {type(error).__name__}"
    return "returns None" if batch is None else None


def _private_datasets(trainer: "pl.Trainer") -> list:
    """The datasets of the private training loaders this Trainer has (loaded, or given to ``fit``) and a
    DataModule's ``private_dataset``."""
    given = getattr(getattr(trainer.fit_loop, "_data_source", None), "instance", None)
    loaders = _train_loaders(trainer) + (_as_list(given) if not isinstance(given, pl.LightningDataModule)
                                                    else [])
    datasets = [loader.dataset for loader in loaders
                if isinstance(getattr(loader, "batch_sampler", None), PrivateBatchSampler)]
    private_dataset = getattr(trainer.datamodule, "private_dataset", None)
    return datasets + ([private_dataset] if private_dataset is not None else [])


def _mark_private_training_data(trainer: "pl.Trainer") -> None:
    """A private fit's training data, remembered for the evaluation refusal of every later Trainer of the process."""
    for dataset in _private_datasets(trainer):
        mark_private_data(dataset)


def _reads_any(dataset: Any, datasets: list) -> bool:
    """``dataset`` is one of ``datasets`` or marked private (:func:`~lit_zodp.privacy.sampling.mark_private_data`), or
    reads one through ``Subset`` or ``ConcatDataset``."""
    if dataset is None:
        return False
    if any(dataset is other for other in datasets) or is_private_data(dataset):
        return True
    if isinstance(dataset, torch.utils.data.Subset):
        return _reads_any(dataset.dataset, datasets)
    if isinstance(dataset, torch.utils.data.ConcatDataset):
        return any(_reads_any(part, datasets) for part in dataset.datasets)
    return False


def _as_list(loaders: Any) -> list:
    """A loader, or a list, tuple or dict of them (Lightning's forms), as a list; ``None`` as ``[]``."""
    if loaders is None:
        return []
    if isinstance(loaders, dict):
        return [loader for loader in loaders.values() if loader is not None]
    if isinstance(loaders, (list, tuple)):
        return [loader for loader in loaders if loader is not None]
    return [loaders]


def _train_loaders(trainer: "pl.Trainer") -> list:
    return _as_list(trainer.train_dataloader)


#: Planned steps from which the fit start says that accounting them takes a while (acceptance test, 2026-11-28:
#: silent for 10 s at 1e6 steps, 2 min at 1e7, over 7 min and 10 GB at 1e8).
LONG_PLAN_STEPS = 1_000_000


def _refuse_unreachable_minimum(trainer: "pl.Trainer", steps_allowed: Optional[int]) -> None:
    """A budget that stops training before ``min_steps`` / ``min_epochs``: Lightning ignores ``should_stop``
    until the minimum is met, and the budget lets no further step run, so the fit looped over empty epochs
    forever (nothing more was released; audit 7)."""
    if steps_allowed is None:
        return
    reachable = trainer.global_step + steps_allowed
    minimum = max(trainer.fit_loop.min_steps or 0, (trainer.fit_loop.min_epochs or 0) * trainer.num_training_batches)
    if reachable < minimum:
        name = "min_steps" if (trainer.fit_loop.min_steps or 0) == minimum else "min_epochs"
        raise PrivacyConfigError(
            f"The privacy budget allows {steps_allowed} more steps (to step {reachable}), but the Trainer's "
            f"`{name}` asks for {minimum}: Lightning would not stop at the budget. Lower `{name}` or raise the budget.")


def fit_steps(trainer: "pl.Trainer") -> int:
    """The optimizer steps this fit runs: ``max_steps`` where set, else Lightning's estimate from the epochs."""
    if trainer.max_steps and trainer.max_steps > 0:
        return trainer.max_steps
    return int(trainer.estimated_stepping_batches)


def remaining_steps(trainer: "pl.Trainer") -> float:
    """The optimizer steps this fit plans from here (``inf`` where nothing bounds it)."""
    return float(trainer.estimated_stepping_batches) - trainer.global_step


def _planned_steps(trainer: "pl.Trainer") -> int:
    steps = trainer.estimated_stepping_batches
    if not math.isfinite(steps) or steps <= 0:
        raise PrivacyConfigError(
            "Planning the privacy needs a finite number of steps: set `max_steps` or `max_epochs`.")
    return int(steps)


def _refuse_a_backbone_without_trainable_parameters(backbone: nn.Module, algorithm: str) -> None:
    """A fit of a backbone whose every parameter is frozen failed inside the optimizer or the engine ("optimizer got
    an empty parameter list", an IndexError): one line at setup instead."""
    if not any(p.requires_grad for p in backbone.parameters()):
        raise ConfigError(f"{algorithm} has nothing to train: every parameter of the backbone is frozen "
                          "(requires_grad=False); unfreeze the ones to fine-tune (a head, adapters) before `fit`")


def _refuse_loss_scaling(trainer: "pl.Trainer") -> None:
    """``precision="16-mixed"`` steps through a GradScaler that unscales gradients of a scaled loss;
    these modules take no backward (zeroth order) or run their own (the per-example engine), so the
    scaler has no scale and its step fails with an AssertionError deep in torch."""
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        raise ConfigError(
            "Invalid configuration: `trainer.precision='16-mixed'` scales the loss of a backward these modules "
            "do not run through Lightning: use precision 'bf16-mixed', '16-true' or 'bf16-true'")


def _refuse_input_mismatch(backbone: nn.Module, datamodule: Any) -> None:
    """A backbone that cannot read the data module's inputs (a text backbone on images, an image backbone on text,
    ``in_features`` or ``in_channels`` other than the images', an option both hold with two values: the phase
    retrieval signal's seed): one line at setup, from the configuration alone (:meth:`~lit_zodp.backbones.base.
    Backbone.data_mismatch`, :func:`~lit_zodp.backbones.base.shared_option_mismatch`; review 28). Before, the first
    forward raised a traceback: in the sanity check, or at the first private step, naming the realized Poisson batch
    size."""
    check = getattr(backbone, "data_mismatch", None)
    if datamodule is None or not callable(check):
        return
    example_shape = getattr(datamodule, "example_shape", None)
    # A declared tensor shape wins over a tokenizer: a data module may hold one for another purpose (the vocabulary of
    # bag-of-words features, an encoder's precomputed embeddings) and give tensors (review 29).
    text = example_shape is None and hasattr(getattr(datamodule, "tokenizer", None), "convert_tokens_to_ids")
    error = check(text=text, example_shape=example_shape) or shared_option_mismatch(backbone, datamodule)
    if error is not None:
        raise ConfigError(f"Model/data mismatch: {error}")


def _refuse_text_mismatch(backbone: nn.Module, datamodule: Any) -> None:
    """A text data module whose tokenizer or ``max_length`` the backbone's transformer cannot read: one line."""
    tokenizer = getattr(datamodule, "tokenizer", None)
    if not hasattr(tokenizer, "convert_tokens_to_ids"):  # no Hugging Face tokenizer: not a text data module
        return
    from lit_zodp.backbones.huggingface import text_data_mismatch

    error = text_data_mismatch(backbone, tokenizer, getattr(datamodule, "max_length", None))
    if error is not None:
        raise ConfigError(error)


def _refuse_length_dependent_state(backbone: nn.Module, datamodule: Any) -> None:
    """Layers whose state or output follows a private batch's longest row (a dynamic RoPE, BigBird's block-sparse
    switch, Nystromformer's convolution over padded columns) are refused before the first step, whatever the data
    (review 23): before, a rebuilt buffer or layer was refused at the first batch holding a long (or only short) row,
    so whether and when a fit stopped told of one private row's length."""
    from lit_zodp.backbones.huggingface import length_dependent_state

    raise_if_any(length_dependent_state(backbone, getattr(datamodule, "max_length", None),
                                        getattr(datamodule, "pad_to_max_length", None) is True))


def _refuse_tuner(trainer: "pl.Trainer") -> None:
    """Lightning's batch-size and learning-rate finders run real private steps, then restore a checkpoint
    taken before them: the restored ledger forgets steps whose releases chose the batch size or rate."""
    from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder

    _refuse_callbacks(trainer, (BatchSizeFinder, LearningRateFinder),
                      "{} (Lightning's Tuner) trains on private batches and then forgets those steps: tune the batch "
                      "size or learning rate on public data only (the non-private twin, MeZO, SGD or Adam, on a public "
                      "split): one chosen from un-noised private losses is a release no epsilon covers")


def _refuse_callbacks(trainer: "pl.Trainer", kinds: tuple[type, ...], message: str) -> None:
    """Refuse the first of the Trainer's callbacks of ``kinds``: ``message`` with ``{}`` for its class name."""
    found = [type(c).__name__ for c in trainer.callbacks if isinstance(c, kinds)]
    if found:
        raise PrivacyConfigError(message.format(found[0]))


def _labels_in_range(targets: Any, classes: Optional[int]) -> bool:
    """Whether a host batch's targets need no device check: every class target (a 1-D integer tensor on the CPU) in
    ``0..classes-1``, or no class targets at all (floats, a target per token or several per row). Unknown
    ``classes``, targets already on a device, or any other object: ``False`` (the device checks)."""
    if not isinstance(targets, Tensor) or targets.device.type != "cpu":
        return False
    if not are_class_indices(targets):
        return True  # (nothing to check: per_example_loss checks class indices only)
    if not classes:
        return False
    values = targets.tolist()  # (as a list: in a step's cold caches torch's aminmax took 37 us, this a few)
    return not values or (0 <= min(values) and max(values) < classes)


def _refuse_batch_size_monitors(trainer: "pl.Trainer") -> None:
    """Lightning's ``ThroughputMonitor`` logs the realized size of every private batch (``train/samples``, through
    its ``batch_size_fn``), and ``DeviceStatsMonitor`` the device's memory at every private step, which follows it.
    A Poisson batch's size is part of the secret sampling: published, it spends what the accountant never counts (the
    pool size under add/remove, each step's rate otherwise). Red-team review 20: ``train/samples`` read 75, 137, 202
    for batches of 75, 62 and 65 rows."""
    from lightning.pytorch.callbacks import DeviceStatsMonitor, ThroughputMonitor

    _refuse_callbacks(trainer, (ThroughputMonitor, DeviceStatsMonitor),
                      "{} logs the realized size of each private (Poisson) batch or the memory it takes, which the "
                      "privacy accounting keeps secret: remove it from a private fit (measure throughput with the "
                      "non-private twin, or on public data)")


def refuse_launchers_that_return_only_the_weights(trainer: "pl.Trainer") -> None:
    """``ddp_spawn``, ``ddp_fork``, ``ddp_notebook`` (and XLA) train in child processes and hand this one back the
    weights alone (``load_state_dict``, no ``on_load_checkpoint``): the module came back with an empty ledger,
    epsilon 0, for weights its private steps made, and a checkpoint of it resumed as a new run at epsilon 0
    (red-team review 18)."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    launcher = getattr(trainer.strategy, "launcher", None)
    if isinstance(launcher, _MultiProcessingLauncher):
        flag = getattr(getattr(trainer, "_accelerator_connector", None), "_strategy_flag", None)
        name = repr(flag) if isinstance(flag, str) else f"{type(trainer.strategy).__name__}({launcher._start_method})"
        raise PrivacyConfigError(
            f"strategy={name} trains in child processes and returns only the weights, so the module would come "
            "back with an empty privacy ledger (epsilon 0) for weights its private steps made: use strategy='ddp' "
            "(a script or `lightning fit`; in a notebook, run the fit as a script)")


def _require_no_distributed_sampler(trainer: "pl.Trainer") -> None:
    connector = getattr(trainer, "_accelerator_connector", None)
    if getattr(connector, "use_distributed_sampler", False):
        raise PrivacyConfigError(
            "DDP with a private module needs `Trainer(use_distributed_sampler=False)`: the DataModule "
            "samples each rank's shard itself (the `lightning`/`lit-zodp` CLI sets this).")


__all__ = ["ALGORITHMS", "AlgorithmModule", "read_sampling"]

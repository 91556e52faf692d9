"""The first-order private family base: per-example gradients through backprop, one flat clip, a torch optimizer.

The module owns the :class:`~lit_zodp.per_example.PerExampleGradientEngine` and a torch optimizer
(built by the algorithm). A step reads like DP-SGD's pseudo-code (Abadi et al. 2016, Alg. 1;
DP-GRAPE paper Alg. 3): per-example gradients of the private batch, flat-clipped across ALL
parameters and summed (``private_gradient``); one Gaussian release of the flat sum, divided by the
expected batch size (``release_gradient``); the optimizer's step on it (``apply_gradient``). The
ledger commits on that step.

Under DDP the per-example backward runs under ``no_sync``: Lightning's DistributedDataParallel
must not average ``.grad`` across ranks, since the privacy component's release all-reduces the
clipped SUM itself, once.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lit_zodp.algorithms.base import AlgorithmModule
from lit_zodp.backbones.base import batch_size_of
from lit_zodp.errors import check_choice, check_non_negative, check_positive_int, raise_if_any
from lit_zodp.per_example import ClippedSum, PerExampleGradientEngine
from lit_zodp.per_example.engine import MicroBatch, micro_batch, sum_dtype
from lit_zodp.privacy import GaussianRelease, StepPlan, clipped_fraction
from lit_zodp.privacy.fixed_shape import split_rows, take_rows
from lit_zodp.privacy.training_randomness import keyed_training_randomness, secret_training_randomness
from lit_zodp.zo.seeds import derive_seed

GRADIENT = "gradient"
#: Key of the public gradients' dropout draws (public randomness; never shared with other streams of the run seed).
PUBLIC_GRADIENT_STREAM = 0x9B1C
GRAD_MODES = ("hooks", "ghost", "bookkeeping", "vmap")


class FirstOrderModule(AlgorithmModule):
    """Base of the first-order algorithms (DP-SGD, DP-Adam and their non-private twins).

    Args (besides :class:`AlgorithmModule`'s):
        weight_decay: the optimizer's weight decay on every trained tensor, biases and norms included: torch SGD's
            L2 term added to the released gradient (DP-SGD, before momentum), AdamW's decoupled decay (DP-Adam);
            post-processing of the release either way (no privacy cost).
        grad_mode: ``"hooks"`` (per-example gradients per layer), ``"ghost"`` (per-example norms
            without per-example gradients, taken in the backward, then a second backward of the
            clip-weighted loss: Li et al. 2022 ghost clipping, the memory of Opacus' ghost mode; for
            large models), ``"bookkeeping"`` (the same norms, the sums from the kept output
            gradients: Bu et al. 2023, one backward, faster, more memory), or ``"vmap"``
            (torch.func; slow, any model).
        micro_batch_size: split one logical (Poisson) batch into micro-batches of at most this many
            examples; their clipped sums accumulate and the noise is added once. ``None``: one pass.
            With ``fixed_forward_rows`` (padded chunks of exactly that many rows) leave it unset.
    """

    abstract = True
    #: The engine checks each new call structure's forward on two halves itself; "halves" here checks the
    #: losses too (first batch, then the steps this module draws): ``per_example_loss``'s own arithmetic
    #: runs after every module the engine records (a loss divided by the batch's detached total moved each
    #: example).
    independence_checks = ("padding", "halves")
    # (a forward and a backward per step, beside which the check's few ops are nothing; and a forward retried after
    # a bad target raised would be recorded twice by the gradient engine's tape)
    labels_checked_in_every_forward = True

    def __init__(self, backbone: nn.Module, *, weight_decay: float = 0.0, grad_mode: str = "hooks",
                 micro_batch_size: Optional[int] = None, **kwargs: Any) -> None:
        raise_if_any([
            check_non_negative("weight_decay", weight_decay),
            check_choice("grad_mode", grad_mode, GRAD_MODES),
            None if micro_batch_size is None else check_positive_int("micro_batch_size", micro_batch_size),
            None if micro_batch_size is None or kwargs.get("fixed_forward_rows") is None else
            "`fixed_forward_rows` already splits the batch into chunks of that many rows: "
            "leave `micro_batch_size` unset",
            None if not (self.private and getattr(backbone, "several_rows_per_example", False)) else
            f"{type(backbone).__name__} forwards several rows per example, which per-example gradients cannot "
            f"attribute to their example: train it with a zeroth-order module (DPZero, DPMeZOBCD)"
            + (" or with `loss: lm` (one row per example)" if hasattr(backbone, "loss") else ""),
            _split_rows_error(backbone, kwargs.get("fixed_forward_rows")) if self.private else None,
        ])
        super().__init__(backbone, **kwargs)
        self.weight_decay = weight_decay
        self.grad_mode = grad_mode
        self.micro_batch_size = micro_batch_size
        # refuses BatchNorm now; re-checks its calls at the steps this module draws (one draw for both)
        self.engine = PerExampleGradientEngine(self.backbone, mode=grad_mode, recheck_probability=0.0)
        self.engine.keep_call_shape = self.fixed_shape is not None  # the checks' forwards keep the one shape too

    def step_plan(self) -> StepPlan:
        """One Gaussian release of the flat clipped gradient sum: sensitivity C (flat clip)."""
        return (GaussianRelease(GRADIENT),)

    def make_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        raise NotImplementedError

    def configure_optimizers(self):
        return self.with_scheduler(self.attach_privacy(self.make_optimizer(self.engine.params)))

    def _parameters_replaced_error(self) -> Optional[str]:
        """Parameters registered between private steps (``ModelPruning`` reparametrises ``weight`` as ``weight_orig``
        and a mask): the per-example engine and the optimizer hold the fit's first parameters, and the engine failed
        with an ``AttributeError`` (review 20). Refused in one line, before the step's forward."""
        names = _replaced_parameters(self.engine, self.backbone)
        if not names:
            return None
        return (f"The model's parameters changed between private steps ({', '.join(f'`{n}`' for n in names[:3])} "
                "registered: a callback such as ModelPruning reparametrising a layer), but the per-example gradient "
                "engine and the optimizer hold the fit's first ones: prune before or after a private fit")

    # ------------------------------------------------------------------------------ verbs
    def private_gradient(self, inputs, targets) -> ClippedSum:
        """``sum_i clip_C(grad f(x; xi_i))``, flat over all parameters, micro-batch by micro-batch."""
        if self.private and (torch.is_anomaly_enabled() or torch.is_inference_mode_enabled()):  # (C calls)
            raise_if_any([anomaly_mode_error(), inference_mode_error()])
        inputs, targets = normal_tensors(inputs), normal_tensors(targets)
        self.engine.recheck_next = self._recheck_pending  # this step's draw re-checks the engine's calls too
        if self._registrations is not None:
            if self._registrations.registered:  # (made outside this step's private forwards: rare, then one walk)
                raise_if_any([self._parameters_replaced_error()])
            self._registrations.forget()
        self.run_independence_checks(inputs, targets)
        if self._registrations is not None:
            self._registrations.refuse()
        loss_fns = self._micro_batches(inputs, targets)
        with self._no_ddp_grad_sync(), torch.enable_grad():
            if self.takes_batch_gradient():
                return self._batch_gradient(loss_fns)
            with self._training_randomness():
                clipped = self.clipped_sums(loss_fns)
        if self._registrations is not None:
            self._registrations.refuse()
        return clipped

    def _micro_batches(self, inputs, targets) -> list[MicroBatch]:
        """The step's micro-batches (fixed-shape chunks, or ``micro_batch_size`` rows), each with the losses of given
        rows of it alone, in the step's shape, for the engine's gradient halves: they then recompute the losses, so
        what ``per_example_loss`` does around the backbone is checked too (red-team review 67: a loss calling only
        the backbone's children, or scaling its backward by a batch statistic, released 6.54 C and 3.73 C)."""
        def batch(x, y, examples: Optional[int] = None) -> MicroBatch:
            return MicroBatch(lambda: self.example_losses(x, y), examples,
                              lambda rows: self._losses(take_rows(x, rows.to(y.device)), y[rows.to(y.device)]))

        if self.fixed_shape is not None:
            return [batch(x, y, len(positions)) for x, y, positions in self.fixed_shape.chunks(inputs, targets)]
        return [batch(x, y) for x, y in split_rows(inputs, targets, self.micro_batch_size)]

    def takes_batch_gradient(self) -> bool:
        """Whether a step is the plain batch gradient: no noise and no clip that binds (:meth:`_batch_gradient`)."""
        return self.clips_unbounded() and not self.privacy.is_private

    def clips_unbounded(self) -> bool:
        """Whether no clip binds (then a noiseless step is the plain batch gradient, :meth:`_batch_gradient`)."""
        return math.isinf(self.clip)

    def clipped_sums(self, loss_fns: list) -> ClippedSum:
        """The engine's flat clipped sum over the micro-batches (GEP clips two parts instead)."""
        return self.engine.clipped_sum_microbatched(loss_fns, self.clip)

    def _training_randomness(self):
        """A private module's forward and backward draw dropout (any training-mode randomness) from secret states,
        never from torch's public streams, which the run seed fixes and which would give row ``p`` the ``p``-th
        mask whoever sits there (:mod:`lit_zodp.privacy.training_randomness`)."""
        return secret_training_randomness(self.device) if self.private else contextlib.nullcontext()

    def public_gradient(self, public_batch, params: Optional[list[Tensor]] = None) -> list[Tensor]:
        """:meth:`AlgorithmModule.public_gradient` (DOPE-SGD, DPMD, the public warm start) with its dropout drawn from
        torch's streams keyed by the run seed, the step and the call's index in it, the streams restored after: public
        randomness on public data, so every DDP rank draws the same masks and steps along the same public gradient
        (secret states, as a private forward's, gave each rank its own: review 62), and a private step leaves torch's
        seeded streams where they were."""
        if self.run_seed is None:  # (outside a fit)
            return super().public_gradient(public_batch, params)
        step = self.global_step
        last_step, calls = getattr(self, "_public_calls", (None, 0))
        calls = calls + 1 if last_step == step else 0
        self._public_calls = (step, calls)
        seed = derive_seed(derive_seed(self.run_seed, PUBLIC_GRADIENT_STREAM, step), calls)
        with keyed_training_randomness(self.device, seed):
            return super().public_gradient(public_batch, params)

    def _batch_gradient(self, loss_fns: list) -> ClippedSum:
        """Without clipping and noise (the non-private twins' default, or a private module's sigma = 0,
        clip = inf ablation) the sum needs no per-example gradient: one ordinary backward per
        micro-batch, as plain torch training (a non-finite loss propagates; norms are not formed: ``[0]``)."""
        params, count = self.engine.params, 0
        total = [torch.zeros_like(p, dtype=sum_dtype(p.dtype)) for p in params]
        for loss_fn, examples, _ in map(micro_batch, loss_fns):
            losses = loss_fn()[:examples]
            count += len(losses)
            grads = torch.autograd.grad(losses.sum(), params, allow_unused=True) if len(losses) else ()
            for acc, grad in zip(total, grads):
                if grad is not None:
                    acc.add_(grad)
        return ClippedSum(total, torch.zeros(0, device=total[0].device), count)

    def release_gradient(self, clipped: ClippedSum) -> list[Tensor]:
        """``(sum_i clip_C(g_i) + N(0, sigma^2 C^2 I_d)) / B``, one release, split back per parameter."""
        flat = torch.cat([g.reshape(-1) for g in clipped.grads])
        released = self.privacy.release(flat, GRADIENT, batch_size=clipped.batch_size)
        return [part.view_as(g) for part, g in zip(released.split([g.numel() for g in clipped.grads]),
                                                    clipped.grads)]

    def apply_gradient(self, gradient: list[Tensor]) -> None:
        """Hand the released gradient to the optimizer and step it (the ledger commits)."""
        for param, grad in zip(self.engine.params, gradient):
            param.grad = grad.to(param.dtype)
        self.step_optimizer()
        self.optimizers().zero_grad(set_to_none=True)

    def _no_ddp_grad_sync(self):
        model = getattr(self.trainer.strategy, "model", None) if self._trainer is not None else None
        return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()

    # ------------------------------------------------------------------------------ step
    def training_step(self, batch, batch_idx: int) -> None:
        private, _ = self.split_batch(batch)
        inputs, targets = private
        size = batch_size_of(inputs)
        clipped = self.private_gradient(inputs, targets)          # sum_i clip_C(g_i), flat clip
        gradient = self.release_gradient(clipped)                 # (. + N(0, sigma^2 C^2 I)) / B
        self.apply_gradient(gradient)                             # optimizer step
        self.log_step(size, lambda: clipped_fraction(clipped.norms, self.clip))


def _replaced_parameters(engine: PerExampleGradientEngine, backbone: nn.Module) -> list[str]:
    """Names of the backbone's trainable parameters that the engine, built at the fit's start, does not hold under
    that name (pruning keeps the tensor, as ``weight_orig``)."""
    held = {(name, id(p)) for name, p in zip(engine.names, engine.params)}
    return [name for name, p in backbone.named_parameters() if p.requires_grad and (name, id(p)) not in held]


def _split_rows_error(backbone: nn.Module, fixed_forward_rows: Any) -> Optional[str]:
    """A candidate scorer that splits its rows across forwards (``max_rows_per_forward``, or row by row under
    ``fixed_forward_rows``) makes calls without one row per example, whose per-example gradients the engine cannot
    form: the step failed at the first Poisson batch larger than the split (review 51), so when the fit failed
    followed the private batch sizes. Refused at construction."""
    if not hasattr(backbone, "max_rows_per_forward"):
        return None
    if backbone.max_rows_per_forward is not None:
        return (f"{type(backbone).__name__}(max_rows_per_forward={backbone.max_rows_per_forward}) splits a batch's rows "
                "across forwards, which per-example gradients cannot attribute: leave it unset for first-order private "
                "training (use `micro_batch_size` to bound memory)")
    if fixed_forward_rows is not None:
        return (f"`fixed_forward_rows` runs {type(backbone).__name__}'s rows one by one, which per-example gradients "
                "cannot attribute: leave it unset for first-order private training (use `micro_batch_size`)")
    return None


def anomaly_mode_error() -> Optional[str]:
    """Autograd's anomaly mode (``Trainer(detect_anomaly=True)``) raises at the first backward that returns NaN, and an
    example whose loss is not finite gives its per-example backward NaN, where the engine would count it as zero. So
    a private fit failed at the first Poisson batch holding one such example, and ran on without it (review 20: a
    DP-SGD fit of 20 steps stopped after 3 with one crafted row, and ran its 20 without): whether and when it fails
    told of one private example, outside any release."""
    if not (torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()):
        return None
    return ("`Trainer(detect_anomaly=True)` (autograd anomaly mode) stops a private fit at the first batch holding an "
            "example whose loss is not finite (otherwise counted as zero), so whether and when the fit fails would "
            "depend on one private example: turn it off for private fits (debug with the non-private twin)")


def normal_tensors(tree: Any) -> Any:
    """``tree`` with its inference tensors (made under ``torch.inference_mode()``: a collate's frozen encoder) cloned into
    normal ones, which a backward can save. Kept, they failed the step at its forward, and a collate that made them
    for its rows but not for an empty batch's zero rows failed the fit at the first batch holding an example, after
    the empty batches' steps: when it failed told which batches were empty (review 27). A flag read per tensor."""
    if isinstance(tree, Tensor):
        return tree.clone() if tree.is_inference() else tree
    leaves, spec = tree_flatten(tree)
    if not any(isinstance(leaf, Tensor) and leaf.is_inference() for leaf in leaves):
        return tree
    return tree_unflatten([leaf.clone() if isinstance(leaf, Tensor) and leaf.is_inference() else leaf
                           for leaf in leaves], spec)


def inference_mode_error() -> Optional[str]:
    """A fit run inside ``torch.inference_mode()`` (around ``trainer.fit``, or entered by a callback): no forward can
    record a graph there, so the per-example engine refused the first batch holding an example, after the steps of the
    empty batches before it, which it releases without a forward. When the fit failed therefore followed which
    Poisson batches were empty, the target's included (review 24: it failed after 1 step with the target in the
    second batch, after 2 without). Refused at the first step, whatever the batch."""
    if not torch.is_inference_mode_enabled():
        return None
    return ("A private first-order step runs inside `torch.inference_mode()`, where no backward can run: it would fail "
            "at the first batch holding an example, so when the fit failed would tell which batches were empty; call "
            "trainer.fit outside inference_mode (Lightning's evaluation loops enter it themselves)")


__all__ = ["FirstOrderModule"]

"""Validation for the per-example engine: the messages name the bad value and the fix."""

from __future__ import annotations

import contextlib
import math
import os
import warnings
import weakref
from typing import Any, Callable, Iterator, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from lit_zodp.errors import LitZodpWarning, PrivacyConfigError, raise_if_any
from lit_zodp.per_example.rounding import model_convolutions, working_eps
from lit_zodp.privacy.training_randomness import (RandomState, checks_own_draws, random_state, replayed_streams,
                                                  secret_cpu_generator, secret_cpu_state, secret_cuda_state,
                                                  secret_streams)

#: Default ``recheck_probability`` (the engine's and every module's): one step in 100 re-runs the
#: batch-independence check (one forward in two halves, two with ``keep_call_shape``; a model with dropout
#: adds one of the whole batch and compares the halves twice: under a few steps, so a few % at most).
RECHECK_PROBABILITY = 0.01


class _OsUniforms:
    """Uniform floats in [0, 1) from the OS's entropy, read 512 at a time: a step's draw makes no system call
    (``SystemRandom`` made one per draw: ~7 us of a 1.4 ms quickstart step). A forked child (a DataLoader
    worker, a forked rank) reads its own instead of repeating its parent's."""

    PER_READ = 512

    def __init__(self) -> None:
        self._values: list[float] = []
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._values = []

    def __call__(self) -> float:
        if not self._values:
            words = np.frombuffer(os.urandom(8 * self.PER_READ), dtype="<u8") >> np.uint64(11)  # 53 bits each
            self._values = (words * 2.0 ** -53).tolist()
        return self._values.pop()


_OS_UNIFORM = _OsUniforms()


def check_recheck_probability(value: Any) -> Optional[str]:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0:
        return None
    return f"Expected `recheck_probability` to be a float in [0, 1], but got {value!r}"


class RecheckClock:
    """Which steps re-run the independence checks: each with ``probability``, independently (OS randomness).

    The law of one OS draw per step (``u < p``), drawn instead as the number of steps to the next re-check
    (geometric on 1, 2, ...: ``P(gap > k) = (1 - p)^k``), so a step only counts down: ~2 us less per step on
    the quickstart. A copy and a forked child draw their own gap, so a model cannot learn it from its parent.
    """

    def __init__(self, probability: float) -> None:
        raise_if_any([check_recheck_probability(probability)])
        self.probability = probability
        self._left = self._gap()
        _CLOCKS.add(self)

    def _gap(self) -> float:
        if self.probability <= 0:
            return math.inf
        if self.probability >= 1:
            return 1
        gap = math.log(1.0 - _OS_UNIFORM()) / math.log1p(-self.probability)
        return math.floor(gap) + 1 if gap < math.inf else math.inf  # (a subnormal p: beyond every float)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._left = self._gap()
        _CLOCKS.add(self)

    def due(self) -> bool:
        """Whether this step re-checks (one call per step)."""
        self._left -= 1
        if self._left > 0:
            return False
        self._left = self._gap()
        return True


class RecheckProbability:
    """The ``recheck_probability`` attribute of an owner of a ``recheck_clock``: reads the clock's probability,
    and setting it makes a new clock (a probability changed after construction takes effect)."""

    def __get__(self, owner: Any, cls: Any = None) -> Any:
        return self if owner is None else owner.recheck_clock.probability

    def __set__(self, owner: Any, probability: float) -> None:
        owner.recheck_clock = RecheckClock(probability)


_CLOCKS: "weakref.WeakSet[RecheckClock]" = weakref.WeakSet()


def _redraw_clocks() -> None:
    for clock in list(_CLOCKS):
        clock._left = clock._gap()


os.register_at_fork(after_in_child=_redraw_clocks)  # after _OS_UNIFORM forgot its parent's values

MODES = ("hooks", "ghost", "bookkeeping", "vmap")


def check_mode(mode: Any) -> Optional[str]:
    if mode not in MODES:
        return f"Expected `mode` to be one of {MODES}, but got {mode!r}"
    return None


def check_transform(transform: Any, mode: Any) -> Optional[str]:
    """Projections work in every mode; a generic rewrite (a callable, or a transform overriding
    ``apply``) needs materialised per-example gradients, which "ghost"/"bookkeeping" do not form."""
    from lit_zodp.per_example.transforms import GradientTransform

    if transform is None:
        return None
    if not (isinstance(transform, GradientTransform) or callable(transform)):
        return (f"Expected `transform` to be a GradientTransform or callable(name, param, per_example_grad), "
                f"but got {transform!r}")
    rewrites = not isinstance(transform, GradientTransform) or transform.rewrites
    if rewrites and mode in ("ghost", "bookkeeping"):
        return (f"A `transform` that rewrites materialised per-example gradients needs mode='hooks' or "
                f"'vmap', but got mode={mode!r} (projections alone work in every mode)")
    return None


def _batchnorms(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, layer)`` of the BatchNorm layers (incl. ``SyncBatchNorm``) in ``module``."""
    return [(name or "<root>", m) for name, m in module.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def batchnorm_layers(module: nn.Module) -> list[str]:
    """Qualified names of the BatchNorm layers (incl. ``SyncBatchNorm``) in ``module``."""
    return [name for name, _ in _batchnorms(module)]


def refuse_batchnorm(module: nn.Module) -> None:
    """BatchNorm normalises with statistics of the whole batch, so each output mixes examples:
    per-example gradients, and with them the clipping sensitivity, are undefined."""
    names = batchnorm_layers(module)
    raise_if_any([names and (
        f"{_layers('BatchNorm layer', names)} mix{'es' if len(names) == 1 else ''} the examples of a batch, so "
        "per-example gradients (and DP) are undefined; replace BatchNorm with nn.GroupNorm (or LayerNorm), or, "
        "for a timm backbone, keep `freeze_batchnorm: true` (running statistics, frozen) with a zeroth-order method")])


def _layers(kind: str, names: list[str], shown: int = 3) -> str:
    """``BatchNorm layer `a```, ``BatchNorm layers `a`, `b`, `c` and 17 more``: one line for any number."""
    listed = ", ".join(f"`{name}`" for name in names[:shown])
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{kind}{'s' if len(names) > 1 else ''} {listed}{more}"


def refuse_compiled(module: nn.Module) -> None:
    """A ``torch.compile``'d submodule runs under dynamo, which the engine's hooks and parameter-use
    check (a ``TorchFunctionMode``) cannot see through: it crashed inside dynamo (audit 5 L2)."""
    raise_if_any([f"`{name or '<root>'}` is a torch.compile'd module, which the per-example engine cannot "
                  f"record; compile the model without it (or use a zeroth-order method)"
                  for name, m in module.named_modules() if type(m).__name__ == "OptimizedModule"])


BufferState = dict[str, tuple[nn.Module, str, Tensor, Optional[int]]]
#: ``list(module.named_modules())``: one walk of the module shared by the checks of one step.
NamedModules = Optional[list[tuple[str, nn.Module]]]


def buffer_state(module: nn.Module, modules: NamedModules = None) -> BufferState:
    """``{qualified name: (owner, local name, buffer, version)}`` of ``module``'s buffers, read before a private
    forward. ``Tensor._version`` counts in-place writes; holding the tensor catches a reassigned buffer (an
    inference tensor, made by a lazy layer under ``inference_mode``, has no counter and cannot be written in
    place). ``modules``: ``module``'s walk, when the caller has it."""
    return {f"{owner_name}.{local}".lstrip("."): (owner, local, b, None if b.is_inference() else b._version)
            for owner_name, owner in (module.named_modules() if modules is None else modules)
            for local, b in owner._buffers.items() if b is not None}


def refuse_buffer_writes(module: nn.Module, before: BufferState, *, added: bool = True) -> None:
    """A forward that writes a buffer from the batch (running statistics of ``InstanceNorm`` with
    ``track_running_stats``, timm's EvoNorm B*, any custom layer) keeps an un-noised function of private
    data in the model and its checkpoints (audit 4 F4). Matching layer types would miss the next such
    layer, so the writes themselves are detected: any change of a buffer's version or identity across
    the private forward is refused (one line per layer), before anything is released. No copy;
    ``added=False`` skips the module walk that finds new buffers (a zeroth-order step's check: microseconds).
    """
    written = [name for name, entry in before.items() if _written(*entry)]
    if added:
        written += [name for name, _ in module.named_buffers() if name not in before]
    if not written:
        return
    by_owner = _by_owner(sorted(written))
    raise_if_any([
        f"`{owner or '<root>'}` ({type(module.get_submodule(owner)).__name__}) wrote "
        f"{', '.join(names)} in the private forward (running statistics in train mode?): an un-noised average "
        f"of private examples kept in the model; use a layer without them (track_running_stats=False, "
        f"nn.GroupNorm or LayerNorm)"
        for owner, names in by_owner.items()
    ])


def _by_owner(names: list[str]) -> dict[str, list[str]]:
    """Qualified tensor names grouped by their owning module: ``{"a.b": ["`w`", "`bias`"]}`` (one message line each)."""
    grouped: dict[str, list[str]] = {}
    for name in names:
        owner, _, local = name.rpartition(".")
        grouped.setdefault(owner, []).append(f"`{local}`")
    return grouped


def _written(owner: nn.Module, local: str, buffer: Tensor, version: Optional[int]) -> bool:
    """Reassigned, removed, or written in place since :func:`buffer_state`."""
    return owner._buffers.get(local) is not buffer or (version is not None and buffer._version != version)


class ParameterWrites:
    """Finds a private forward that writes a parameter of ``module``, trainable or frozen: an
    ``nn.Embedding(max_norm=...)`` renormalises the rows the batch looks up, a layer keeps running statistics in a
    frozen parameter. The parameters then hold an un-noised function of private examples, in the model and every
    checkpoint (audit, 2026-11-28: the norm of one token's row showed whether the one example using it was in the
    data). As :func:`refuse_buffer_writes`, the writes themselves are detected: a parameter's in-place version
    counter or its identity moved across the forward. The slots are listed once; :meth:`versions` before each
    forward and :meth:`refuse_since` after it cost a read per parameter (a zeroth-order step's own writes, the
    perturbations between its forwards, fall outside). Writes through ``.data`` bypass the version counter and are
    not seen.
    """

    def __init__(self, module: nn.Module, modules: NamedModules = None) -> None:
        self.module = module
        # (an inference tensor has no version counter, and nothing outside inference mode writes it in place)
        self.slots = [(f"{owner_name}.{local}".lstrip("."), owner, local, p)
                      for owner_name, owner in (module.named_modules() if modules is None else modules)
                      for local, p in owner._parameters.items() if p is not None and not p.is_inference()]
        self._params = [p for *_, p in self.slots]

    def versions(self) -> list[int]:
        return [p._version for p in self._params]

    def refuse_since(self, versions: list[int], *, reassigned: bool = True) -> None:
        """Refuse the writes since :meth:`versions`; ``reassigned=False`` looks at the version counters alone
        (a zeroth-order forward's check, under a microsecond: a reassigned parameter is looked for at the
        forwards that run the independence checks)."""
        if not reassigned and [p._version for p in self._params] == versions:
            return
        written = [name for (name, owner, local, p), version in zip(self.slots, versions)
                   if owner._parameters.get(local) is not p or p._version != version]
        by_owner = _by_owner(written)
        raise_if_any([
            f"`{owner or '<root>'}` ({type(self.module.get_submodule(owner)).__name__}) wrote its parameter "
            f"{', '.join(names)} in the private forward (an embedding's max_norm, statistics kept in a parameter?): "
            "an un-noised function of private examples kept in the model, which now holds it (discard it); "
            "use a layer that leaves its parameters alone in the forward"
            for owner, names in by_owner.items()
        ])


class RegistrationWatch:
    """Parameters, buffers and submodules registered on ``module``'s modules while watched: ``self.w =
    nn.Parameter(f(batch))``, ``self.register_buffer("m", f(batch))`` or a layer built in a forward, a slot
    reassigned. Such a tensor holds an un-noised function of private examples, in the model and every checkpoint, and
    no version counter listed at the fit's start sees it (red-team review, 2026-11-28: a parameter registered in the
    forward passed every check; a reassigned one passed the forwards without independence checks). torch's global
    registration hooks see each registration as it happens, so a forward's check is one truth test (a module walk per
    forward would cost 0.1 ms on MiniLM).
    Writes into ``module._parameters`` itself bypass the hooks and are not seen. :meth:`close` removes the hooks.
    """

    def __init__(self, module: nn.Module) -> None:
        from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                             register_module_module_registration_hook,
                                             register_module_parameter_registration_hook)

        owners = {id(m): name for name, m in module.named_modules()}  # (ids only: the hooks hold no module)
        registered: list[str] = []
        self.registered = registered

        def seen(owner: nn.Module, name: str, _value: Any) -> None:
            where = owners.get(id(owner))
            if where is not None:
                registered.append(f"{where}.{name}".lstrip("."))

        self._handles = [register(seen) for register in (register_module_parameter_registration_hook,
                                                         register_module_buffer_registration_hook,
                                                         register_module_module_registration_hook)]

    def refuse(self) -> None:
        """Refuse what was registered since the last :meth:`forget`."""
        if not self.registered:
            return
        names = sorted(set(self.registered))
        self.registered.clear()
        raise_if_any([
            f"The private forward registered {', '.join(f'`{n}`' for n in names)} on the model (a parameter, buffer or "
            "layer made or replaced in the forward): an un-noised function of private examples kept in the model, "
            "which now holds it (discard it); make every parameter, buffer and layer in __init__"])

    def forget(self) -> None:
        self.registered.clear()

    def __getstate__(self) -> dict:
        """A copy or pickle of a module during its fit (``torch.save(module)``, a callback's ``deepcopy``) holds a closed
        watch: the hooks are torch's global ones, and their function is local (``torch.save`` of any private module
        during a fit raised ``Can't pickle local object``, review 24). The module's next fit watches anew."""
        return {"registered": [], "_handles": []}

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def renormalising_embeddings(module: nn.Module) -> Optional[str]:
    """Embeddings with ``max_norm`` rescale, in place, the rows each forward looks up (:class:`ParameterWrites`):
    refused before a private fit starts, in one line."""
    names = [name or "<root>" for name, m in module.named_modules()
             if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None]
    return names and (f"{_layers('embedding', names)} set{'s' if len(names) == 1 else ''} max_norm, which rescales "
                      "in place the rows each private batch looks up: an un-noised trace of private examples in "
                      "the model; set max_norm=None")


def batch_statistics_layers(module: nn.Module) -> list[str]:
    """Qualified names of the BatchNorm layers that normalise with the batch's own statistics even in
    eval mode (``track_running_stats=False``, or running statistics removed)."""
    return [name for name, m in _batchnorms(module)
            if not m.track_running_stats or m.running_mean is None or m.running_var is None]


def refuse_batch_statistics(module: nn.Module) -> None:
    """Zeroth-order steps forward private batches in eval mode, where a BatchNorm with running
    statistics treats each example alone; one without them mixes the batch's examples into every
    loss, so clipping each loss no longer bounds one example's contribution (audit 3 F1)."""
    names = batch_statistics_layers(module)
    raise_if_any([names and (
        f"{_layers('BatchNorm layer', names)} normalise{'s' if len(names) == 1 else ''} with the batch's own "
        "statistics even in eval mode (track_running_stats=False), so each example's loss depends on its "
        "batch-mates and clipping does not bound its contribution; keep running statistics or use nn.GroupNorm "
        "(or LayerNorm)")])


def frozen_statistics_note(module: nn.Module) -> Optional[str]:
    """A line naming the BatchNorm layers whose running statistics a zeroth-order fit never updates (its forwards
    run in eval mode): right for a pretrained CNN, surprising for one that has not collected them yet."""
    names = [name for name in batchnorm_layers(module) if name not in batch_statistics_layers(module)]
    if not names:
        return None
    one = len(names) == 1
    return (f"{_layers('BatchNorm layer', names)} keep{'s' if one else ''} {'its' if one else 'their'} running "
            "statistics as they are: zeroth-order steps forward in eval mode (each example alone), so they never update")


def refuse_reentrant_checkpointing(losses: Tensor) -> None:
    """Reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``) runs
    its parameters' backward inside a node of its own (``CheckpointFunctionBackward``), which torch
    refuses under ``autograd.grad`` or ``backward(inputs=...)``, the engine's backwards, with a
    RuntimeError from inside the step. Refused here first, in one line naming the fix. Non-reentrant
    checkpointing (the default of Hugging Face ``gradient_checkpointing_enable``) is exact. One walk
    of the graph, on a batch of a new structure."""
    seen, stack = set(), [losses.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        raise_if_any([None if type(node).__name__ != "CheckpointFunctionBackward" else
                      "The model uses reentrant activation checkpointing (use_reentrant=True), whose parameters "
                      "the per-example engine cannot see: pass use_reentrant=False (Hugging Face: "
                      "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}))"])
        stack.extend(child for child, _ in node.next_functions)


def check_losses(losses: Any) -> None:
    """``loss_fn`` must return the per-example losses, a 1-D tensor ``[B]``. The message names no size: a Poisson
    batch's realized size is a function of the private data (red-team review 17)."""
    if not isinstance(losses, Tensor) or losses.dim() != 1:
        got = f"a {losses.dim()}-D tensor" if isinstance(losses, Tensor) else type(losses).__name__
        raise_if_any([f"Expected `loss_fn` to return per-example losses of shape [B], but got {got}"])
    if losses.numel() and not losses.requires_grad:
        raise_if_any(["Expected the per-example losses to depend on trainable parameters, but they do "
                      "not require grad (was `loss_fn` run under torch.no_grad, or is everything frozen?)"])


def random_halves(size: int) -> tuple[Tensor, Tensor]:
    """Two random halves of ``range(size)``, from a generator seeded by the OS: the split neither depends
    on nor advances the user's seeded streams, and a model cannot predict it."""
    with checks_own_draws():
        order = torch.randperm(size, generator=secret_cpu_generator())
    return order[: size // 2], order[size // 2:]


def secret_row(size: int) -> Tensor:
    """One position of ``range(size)`` (a 1-element index) from a generator seeded by the OS: a model cannot
    predict which."""
    with checks_own_draws():
        return torch.randint(size, (1,), generator=secret_cpu_generator())


def one_removed(size: int) -> Tensor:
    """``range(size)`` without one :func:`secret_row`: a batch of the row count of the neighbouring dataset that
    lacks one example."""
    dropped = int(secret_row(size))
    return torch.cat([torch.arange(dropped), torch.arange(dropped + 1, size)])


def flat_rows(values: Tensor) -> Tensor:
    """``values [B, ...]`` as detached rows ``[B, -1]`` of at least float32."""
    return values.detach().reshape(values.shape[0], -1).to(torch.promote_types(values.dtype, torch.float32))


def beyond_tolerance(ratio: float) -> str:
    """How far a mismatch (:func:`rows_differ`'s value, > 1) is beyond rounding, in three words' worth: the ratio
    is computed from private examples, and a refusal's message reaches logs (audit 6), so only its order of
    magnitude is shown."""
    if ratio < 10:
        return "up to 10 times the rounding tolerance"
    return "10 to 1000 times the rounding tolerance" if ratio <= 1000 else "over 1000 times the rounding tolerance"


def rows_differ(full: Tensor, again: Tensor, *, dtype: torch.dtype, device: torch.device,
                blocks: Sequence[int] = ()) -> Tensor:
    """Per row, by how much (relative) ``again[r]`` differs from ``full[r]`` beyond rounding, as a
    multiple of the tolerance ``sqrt(eps) (||full[r]|| + ||again[r]|| + median_r ||full[r]||)`` (the
    coverage check's tolerance, :mod:`.coverage`, with a median; ``eps`` of ``dtype`` and the forward's autocast,
    :func:`.rounding.working_eps`; the median, the lower one, over the rows finite in both): > 1 is a mismatch.
    Rows non-finite in both are 0; a row finite in only one of them is ``inf``. Computed in float64 and without a
    host synchronisation (the caller's verdict reads it).

    Red-team review 64 (2026-11-30): the mean row norm let one record with huge outputs widen every row's tolerance,
    so a forward mixing its batch by less than ``sqrt(eps)`` passed whatever the record's size (a detached batch mean
    at 3e-5: 4.5 C released on one removal, IEEE float32); one record cannot move the median. These checks compare
    the model's arithmetic with itself, so cuDNN's TF32 convolutions do not widen them (elementwise operand rounding
    is the same in the halves and the whole batch; a kernel chosen by the batch's shape is set apart by
    :func:`_beyond_shape_rounding`): under TF32 that widening admitted a mixing of 1e-2 (4.5 C).

    ``blocks``: the rows' column widths by part (a module's outputs, then each rule layer's inputs), each part
    compared on its own scale and the largest ratio kept: one part's norms do not set another's tolerance."""
    full, again = flat_rows(full).to(device, torch.float64), flat_rows(again).to(device, torch.float64)
    if len(blocks) > 1:
        parts = zip(full.split(list(blocks), 1), again.split(list(blocks), 1))
        return torch.stack([rows_differ(f, a, dtype=dtype, device=device) for f, a in parts]).amax(0)
    finite_full, finite_again = torch.isfinite(full).all(1), torch.isfinite(again).all(1)
    both = finite_full & finite_again
    full, again = full.where(both[:, None], 0.0), again.where(both[:, None], 0.0)
    norm_full, norm_again, gap = full.norm(dim=1), again.norm(dim=1), (full - again).norm(dim=1)
    typical = norm_full.where(both, math.nan).nanmedian().nan_to_num(0.0)  # (no row finite in both: 0)
    with model_convolutions(False):
        eps = working_eps(device.type, dtype)
    tolerance = eps ** 0.5 * (norm_full + norm_again + typical)
    ratio = torch.where(gap > 0, gap / tolerance, 0.0)  # (gap > 0 makes tolerance > 0)
    return ratio.masked_fill_(finite_full ^ finite_again, math.inf)


def rows_agree(full: Tensor, again: Tensor, *, dtype: torch.dtype, blocks: Sequence[int] = ()) -> bool:
    """Whether every row of ``again`` equals ``full``'s up to rounding (:func:`rows_differ` <= 1): a
    recomputation that reproduces."""
    return not bool((rows_differ(full, again, dtype=dtype, device=full.device, blocks=blocks) > 1).any())


def refuse_batch_mixing(values_of: Callable[[Tensor], Tensor], size: int, *, dtype: torch.dtype,
                        device: torch.device, what: str = "per-example losses",
                        full: Optional[Tensor] = None, in_place: Optional[Callable[[Tensor], Tensor]] = None,
                        blocks: Sequence[int] = ()) -> bool:
    """Refuse a forward whose per-example values depend on their batch-mates (audit 5 F1).

    Clipping each example's gradient (or loss) bounds its influence only if no other example's value
    depends on it. Mixing in forward values alone (``x - x.mean(0)``, detached batch statistics, a
    mixture of experts with capacity, an off-by-one gather) sends no gradient across rows, so the
    gradient-path checks (:mod:`.alignment`, :mod:`.coverage`) cannot see it. Here the rows are
    recomputed on two random halves of the batch (:func:`random_halves`) and compared with the whole
    batch's, to the rounding tolerance of :func:`rows_differ`, then on the batch without one random row
    (:func:`_beyond_one_removal`: the neighbouring dataset's row count). Sampled, not proved: data-dependent
    mixing shows only on the batches that trigger it.

    Args:
        values_of: ``index [n] -> values [n, ...]``: the per-example values (losses, or a module's
            outputs) of those rows of the batch, computed on those rows alone (no grad needed).
        size: The batch size ``B``.
        dtype, device: Of the computation, for the tolerance.
        what: Names the values in the refusal.
        full: The values of the whole batch, if already at hand (else ``values_of(arange(B))``).
        in_place: ``index [B] -> values [B, ...]`` of a batch of the whole batch's shape (default ``values_of``),
            for :func:`_beyond_shape_rounding`.
        blocks: The values' column widths by part, each compared on its own scale (:func:`rows_differ`).

    Returns:
        Whether the verdict counts: at least 2 rows finite in the whole batch were compared. A batch of
        one example (or one finite example) proves nothing; check again on the next batch (F2).
    """
    if size < 2:
        return False
    full = values_of(torch.arange(size)) if full is None else full
    halves = random_halves(size)
    ratio = rows_differ(full, halves_values(values_of, halves, full), dtype=dtype, device=device, blocks=blocks)
    changed = float(ratio.max())
    if changed > 1.0:
        changed = _beyond_shape_rounding(ratio, full, in_place or values_of, halves, dtype=dtype, device=device,
                                         blocks=blocks)
    if changed <= 1.0 and size > 2:  # (a batch of 2: its halves are its removals)
        changed = _beyond_one_removal(values_of, full, dtype=dtype, device=device, blocks=blocks)
    raise_if_any([None if changed <= 1.0 else
                  f"The {what} depend on their batch-mates (an example's value changed by "
                  f"{beyond_tolerance(changed)} when the batch was split in two): per-example clipping cannot bound "
                  f"one example's influence (BatchNorm-like statistics, batch centring, MoE capacity); make the "
                  f"forward per-example"])
    return int(torch.isfinite(flat_rows(full)).all(1).sum()) >= 2


def in_place_index(half: Tensor, size: int) -> Tensor:
    """Rows for a half run in the whole batch's shape: each of the half's rows at its own position, the other half's
    positions filled with the half's rows again (a kernel choosing its reduction order by the call's shape then
    rounds the half as the whole)."""
    index = half[torch.arange(size) % len(half)]
    index[half] = half
    return index


def halves_values(values_of: Callable[[Tensor], Tensor], halves: tuple[Tensor, Tensor], full: Tensor,
                  in_place: bool = False) -> Tensor:
    """Each half's rows computed without the other half: alone, or (``in_place``) in a batch of the whole batch's
    shape where each row keeps its position and the other half's positions repeat the half's own rows."""
    split = torch.empty_like(flat_rows(full))
    size = len(split)
    for half in halves:
        index = in_place_index(half, size) if in_place else half
        values = flat_rows(values_of(index))
        split[half.to(split.device)] = (values[half.to(values.device)] if in_place else values).to(split.dtype)
    return split


def _beyond_shape_rounding(ratio: Tensor, full: Tensor, in_place: Callable[[Tensor], Tensor],
                           halves: tuple[Tensor, Tensor], *, dtype: torch.dtype, device: torch.device,
                           blocks: Sequence[int] = ()) -> float:
    """How far a mismatch of the halves is beyond rounding once the batch's shape is set apart (:func:`rows_differ`'s
    scale). Batched kernels pick their reduction order by the shape of the call, and a row of huge terms that cancel
    (two inputs of 1e10 whose products nearly cancel in one unit) rounds to values 10% apart in a batch of 2 and of
    4: one such row refused a per-example MLP, so whether a run stopped told whether that row was in the batch
    (red-team review 20). The halves again in the whole batch's shape, each row in its place (bitwise the full
    batch's rows for a per-example forward): a mismatch there is mixing; one that the shape alone explains is
    refused where it moves two rows or more (a forward reading the row count, ``x / len(x)``), which one row cannot
    do (:func:`beyond_one_row`; until stop 58 "most finite rows", which a row count read by some rows passed)."""
    again = float(rows_differ(full, halves_values(in_place, halves, full, in_place=True), dtype=dtype,
                              device=device, blocks=blocks).max())
    return again if again > 1.0 else beyond_one_row(ratio)


def _beyond_one_removal(values_of: Callable[[Tensor], Tensor], full: Tensor, *, dtype: torch.dtype,
                        device: torch.device, blocks: Sequence[int] = ()) -> float:
    """How far the rows of the batch without one secret random row (:func:`one_removed`), computed alone, are
    beyond rounding from the whole batch's (:func:`beyond_one_row`): the row count of the neighbouring dataset.
    The halves compare row counts ``B // 2`` and ``B - B // 2`` with ``B``: a forward or loss scaled by a function
    of the row count for some rows only (44% of the batch's, under the rule "most rows move" that this replaces)
    released 7.8 C on one removal at ``B = 17`` (stop 58), and one equal at those counts and changed at ``B - 1``
    passed them whatever its rows."""
    rest = one_removed(len(full))
    ratio = rows_differ(full[rest.to(full.device)], values_of(rest), dtype=dtype, device=device, blocks=blocks)
    return beyond_one_row(ratio)


def beyond_one_row(ratio: Tensor) -> float:
    """A comparison's verdict (> 1: refused) where the batch's shape differed: the largest ratio where two or more
    rows moved beyond rounding, else at most 1. One row may round with the shape (terms that cancel, red-team
    review 20: refusing it told whether that row was in the batch); two rows may not."""
    largest = float(ratio.max()) if ratio.numel() else 0.0
    return largest if int((ratio > 1.0).sum()) >= 2 else min(largest, 1.0)


class MeanOfRandomDraws(TorchDispatchMode):
    """Every Bernoulli draw replaced by its mean, and the dropout of fused attention kernels turned off, for
    the independence checks' recomputations in the step's own mode (audit 8).

    The checks recompute values on parts of a batch and compare them with the whole batch's: dropout
    would differ on any rerun, so they used to run in eval mode, and a model that mixes its batch only in
    training (train-only MoE capacity, a train-only loss normalisation) passed them. Here the modules
    stay in their mode: inverted dropout (``native_dropout``, and the ``bernoulli_`` masks of the
    composite dropouts and of timm's DropPath) gives its mean, the identity, and any op taking a
    ``dropout_p`` (scaled-dot-product attention kernels) gets 0. At the ATen level, so a dropout called
    inside another function (``nn.MultiheadAttention``) is caught too. The model's other draws from torch's
    default generators take their means too (:data:`_MEANS`: ``rand``/``uniform_`` the middle of their range,
    ``randn``/``normal`` their mean, ``exponential_``, ``log_normal_``, ``geometric_``; RReLU's slopes
    ``(lower + upper) / 2``): before stop 57 they sent both halves checks to eval mode, where a scale active only
    in training passed (4.16 C released on one removal, red-team review 67). Since stop 58 draws without a mean take
    a fixed stand-in: ``randint``/``random_`` the middle of their range, ``randperm`` the identity, ``multinomial``
    the most likely categories, ``cauchy_`` its median, ``poisson`` its rate. The draws a recomputation still makes
    (``binomial``, ``_standard_gamma``) are made from fresh secret states: two recomputations differ there, and the
    callers replay the step's draws (:class:`Replay`), then fall back to eval mode, with a warning where the replay
    gave no verdict.

    A draw from an explicit generator (a model's own) is taken so too, from a fresh secret state of it, the
    generator set back after (:func:`_drawn_secretly`): its stream stays where the step left it. Before stop 61 such
    draws made every recomputation differ, and the checks fell back to eval mode: review 20's honest record beside a
    dropout mask drawn with ``rand(generator=g) > p`` was refused at 6 of 6 re-checked steps, none without it
    (red-team review 74). Until stop 62 only the generators whose states the engine's step kept were (the checks'
    own secret ones were drawn inside this mode, and a split at its stand-in would be fixed): a structure's first
    check drew from a model's own generator, moving its stream, and an honest model's input noise from one in its
    loss was refused (red-team review 75). The checks draw outside every dispatch mode now
    (:func:`~lit_zodp.privacy.training_randomness.checks_own_draws`).

    ``replaced``: whether a draw was replaced (dropout with ``p > 0`` in training, any other draw): the step drew
    where its recomputations do not, so its own values are no baseline for them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.replaced = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        generator = _generator_of(args, kwargs)
        if generator is not None:
            with _drawn_secretly(generator):
                return self._dispatch(func, args, kwargs)
        return self._dispatch(func, args, kwargs)

    def _dispatch(self, func, args: tuple, kwargs: dict):
        packet = func.overloadpacket
        if packet is torch.ops.aten.native_dropout:
            bound = _bound(func, args, kwargs)
            self.replaced |= bool(bound["train"] is not False and float(bound["p"]) > 0)
            return args[0].clone(), torch.ones_like(args[0], dtype=torch.bool)
        if packet in (torch.ops.aten.bernoulli_, torch.ops.aten.bernoulli):
            self.replaced = True
            bound = _bound(func, args, kwargs)
            mean, out = _bernoulli_mean(packet is torch.ops.aten.bernoulli_, bound), bound.get("out")
            # (``bernoulli(p, out=buf)``: until stop 63 the mean was not written into ``buf``, so a recomputation read
            # whatever ``buf`` held, an honest ``torch.empty`` buffer's leftover memory: refused at random, 1 in 10)
            return out.copy_(mean) if isinstance(out, Tensor) else mean
        if packet in _MEANS:
            bound = _bound(func, args, kwargs)
            if packet is torch.ops.aten.rrelu_with_noise:
                self.replaced |= bool(bound["training"])
                return _rrelu_mean(bound) if bound["training"] else func(*args, **kwargs)
            self.replaced = True
            return _MEANS[packet](func(*args, **kwargs), bound)
        for k, argument in enumerate(func._schema.arguments):
            if argument.name == "dropout_p":
                value = args[k] if k < len(args) else kwargs.get("dropout_p", argument.default_value)
                self.replaced |= bool(value is not None and float(value) > 0)
                if k < len(args):
                    args = (*args[:k], 0.0, *args[k + 1:])
                else:
                    kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


class Replay:
    """Runs that replay a step's random draws (dropout masks, ``randperm``, ``Beta``) from its generators' ``state``
    (:func:`~lit_zodp.privacy.training_randomness.replayed_streams`), and whether they all drew alike.

    The checks' recomputations take every draw at its mean or at a fixed stand-in (:class:`MeanOfRandomDraws`), so
    mixing done through the draws is in none of them: mixup inside the forward (``lam x + (1 - lam) x[randperm(B)]``)
    released 4.68 C on one removal, every mode (red-team review 72). Runs of one batch shape that replay the same
    state draw the same numbers for each position, so a row that moves between them moved with its batch-mates'
    content. That holds where they drew alike (:meth:`alike`): each ended at the same generators' state (as many
    numbers drawn: not so where the draws' shapes follow the content, a forward trimming its batch to its longest
    row), explicit generators included.

    A ``torch.Generator`` of the model's own is set, as each run begins, to its state in ``state.explicit`` (taken at
    the step: the engine's tape takes the states of those in ``known``, which every replay adds the ones it sees to),
    else to where it stood at its first draw in the first run that drew from it (the runs then draw alike, though not
    as the step did); after each run it is put back where the replay found it (:class:`_ReplayedGenerators`). Before
    stop 61 such draws were never replayed, and mixup from one passed with a warning: 3.77 C released on one removal
    (review 73). Each run's state of it at its first draw is compared, not set: at stop 61 it was set there, over
    whatever the forward had seeded it with, so a forward reseeding its own generator from the batch's content (a
    feature mask shared by the batch) drew alike in every run and passed with no warning, 2.17 C released on one
    removal (red-team review 74; a warning before).

    Runs in the batch's shape never change its size. A run of some rows ALONE (:meth:`run`'s ``alone``) draws each
    number at the step's size and keeps its rows' (:class:`StepSizedDraws`, from the shapes the first run from that
    state in the batch's shape drew), so where it ends as those runs did (:meth:`alone_alike`) it drew the step's
    numbers for its rows, and a forward reading the batch's size behind a draw shows (red-team review 76, finding 1:
    a gate 0 at its draw's mean hid it from every mean-draw recomputation, 2.76 C released on one removal)."""

    def __init__(self, known: Optional[List[torch.Generator]] = None) -> None:
        self._ends: dict[int, list[tuple[RandomState, list[tuple[Tensor, Tensor]]]]] = {}
        self._alone_ends: dict[int, list[tuple[RandomState, list[tuple[Tensor, Tensor]]]]] = {}
        self._shapes: dict[int, list[tuple[Any, Optional[tuple[int, ...]]]]] = {}
        self._explicit = _ExplicitStates(known)

    @contextlib.contextmanager
    def run(self, state: RandomState, alone: Optional[tuple[Tensor, int]] = None) -> Iterator[None]:
        """One replayed run: the generators at ``state`` inside (a model's own at the step's state or their replayed
        start), back where they were after. ``alone``: ``(rows, B)``, a run of those rows of the step's batch of
        ``B`` alone, each draw at the step's size (:class:`StepSizedDraws`: the shapes the first run from ``state``
        in the batch's shape drew)."""
        self._explicit.begin(state.explicit)
        explicit = _ReplayedGenerators(self._explicit)
        sized = (contextlib.nullcontext() if alone is None
                 else StepSizedDraws(self._shapes.get(id(state), []), *alone))
        try:
            with replayed_streams(state), explicit, sized:
                yield
                end = random_state(index for index, _ in state.cuda)
                drawn = explicit.drawn_states()
        finally:
            self._explicit.put_back()
        if alone is None:
            self._shapes.setdefault(id(state), explicit.shapes)
        (self._ends if alone is None else self._alone_ends).setdefault(id(state), []).append((end, drawn))

    def alike(self) -> bool:
        """Whether the runs from each state so far ended at one generators' state, and drew from explicit generators
        in the same order, each from and to the same states (a generator made in the forward is a new one per run)."""
        return all(_same_state(ends[0][0], end) and _same_explicit(ends[0][1], explicit)
                   for ends in self._ends.values() for end, explicit in ends)

    def alone_alike(self) -> bool:
        """Whether there were runs alone (:meth:`run`'s ``alone``) and each ended where the first run from its state
        in the batch's shape did, from and to the same explicit generators' states: they drew the step's numbers."""
        return bool(self._alone_ends) and all(
            key in self._ends and _same_state(self._ends[key][0][0], end)
            and _same_explicit(self._ends[key][0][1], explicit)
            for key, ends in self._alone_ends.items() for end, explicit in ends)


def _same_state(a: RandomState, b: RandomState) -> bool:
    return (torch.equal(a.cpu, b.cpu) and len(a.cuda) == len(b.cuda)
            and all(i == j and torch.equal(x, y) for (i, x), (j, y) in zip(a.cuda, b.cuda)))


def _same_explicit(a: list[tuple[Tensor, Tensor]], b: list[tuple[Tensor, Tensor]]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for pair, other in zip(a, b) for x, y in zip(pair, other))


#: How many of a model's own generators the engine keeps the states of at each step (the most recently seen).
KEPT_GENERATORS = 8


class _ExplicitStates:
    """A :class:`Replay`'s explicit generators (``id ->`` the generator and a state): where each stood when the replay
    first touched it (``found``: put back after every run), and where a run begins it where the step's state does
    not hold it (``starts``: its state at its first draw in the first run that drew from it). Each is added to
    ``known`` (the engine's: its tape takes their states at later steps). Held strongly: a draw shows a generator to
    a dispatch mode as a wrapper of its own (not the model's object), the same one only while one is alive, so the
    replay's keys by ``id`` and the tape's states hold only while these hold it."""

    def __init__(self, known: Optional[List[torch.Generator]]) -> None:
        self.found: dict[int, tuple[torch.Generator, Tensor]] = {}
        self.starts: dict[int, tuple[torch.Generator, Tensor]] = {}
        self.known = known

    def begin(self, at_step: tuple) -> None:
        """Each generator at its state in ``at_step`` (``(generator, state)`` pairs), the others at their starts."""
        held = {id(generator) for generator, _ in at_step}
        for generator, state in at_step:
            self.found.setdefault(id(generator), (generator, generator.get_state()))
            generator.set_state(state)
        for key, (generator, start) in self.starts.items():
            if key not in held:
                generator.set_state(start)

    def first_drawn(self, generator: torch.Generator, state: Tensor) -> None:
        """A run's first draw from ``generator``, at ``state``: known once a second run draws from it (a generator
        made in the forward is a new one in every run, and would pile up), the most recently seen last; the first of
        more than :data:`KEPT_GENERATORS` dropped (a model making a new one at every step)."""
        self.found.setdefault(id(generator), (generator, state))
        if id(generator) in self.starts and self.known is not None and (
                not self.known or self.known[-1] is not generator):
            self.known[:] = [g for g in self.known if g is not generator][-(KEPT_GENERATORS - 1):] + [generator]
        self.starts.setdefault(id(generator), (generator, state))

    def put_back(self) -> None:
        for generator, state in self.found.values():
            generator.set_state(state)


class _ReplayedGenerators(TorchDispatchMode):
    """Notes the state of each explicit generator a run draws from at its first draw in the run (set as the run began,
    :meth:`_ExplicitStates.begin`, where the replay knew it; the checks' own secret generators are drawn outside the
    runs). :meth:`drawn_states` gives each one's states at its first draw and now, in the order of their first draws.
    The state at the first draw is not set: a forward that reseeds its generator (from the batch's content) must
    show it (red-team review 74)."""

    def __init__(self, states: _ExplicitStates) -> None:
        super().__init__()
        self.states, self.drawn = states, {}
        self.shapes: list[tuple[Any, Optional[tuple[int, ...]]]] = []  # (each draw's op and shape, in order)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            bound = _bound(func, args, kwargs)
            self.shapes.append((func, _draw_shape(bound)))
            generator = bound.get("generator")
            if generator is not None and id(generator) not in self.drawn:
                state = generator.get_state()
                self.drawn[id(generator)] = (generator, state)
                self.states.first_drawn(generator, state)
        return func(*args, **kwargs)

    def drawn_states(self) -> list[tuple[Tensor, Tensor]]:
        return [(first, generator.get_state()) for generator, first in self.drawn.values()]


def _draw_shape(bound: dict) -> Optional[tuple[int, ...]]:
    """The shape a seeded op draws: its ``size`` (``rand``, ``randint``) or its first tensor's (``bernoulli_``,
    ``native_dropout``, ``rand_like``); ``None``: neither (``randperm``)."""
    size = bound.get("size")
    if isinstance(size, (list, tuple)):
        return tuple(int(n) for n in size)
    first = next((value for value in bound.values() if isinstance(value, Tensor)), None)
    return tuple(first.shape) if first is not None else None


def _sliced_dims(shape: Optional[tuple[int, ...]], step: Optional[tuple[int, ...]], rows: int,
                 size: int) -> list[int]:
    """The dimensions where a run of ``rows`` rows draws ``shape`` and the step drew ``step`` with ``size`` there:
    the batch's; ``[]`` where the shapes differ otherwise (or agree)."""
    if shape is None or step is None or len(shape) != len(step):
        return []
    dims = [d for d, (mine, theirs) in enumerate(zip(shape, step)) if mine != theirs]
    return dims if all(shape[d] == rows and step[d] == size for d in dims) else []


class StepSizedDraws(TorchDispatchMode):
    """Rows ``index`` of a batch of ``size`` run alone, each random draw at the step's shape: the ``k``-th seeded op
    of the run, where it is the ``k``-th of ``template`` (the ops and shapes a run in the batch's shape drew,
    :class:`_ReplayedGenerators`) and its shape differs from that one's only by the run's row count where the step
    had ``size``, is drawn at the step's shape (its tensor arguments' rows placed at ``index``, the other positions
    holding the first row's) and gives the rows ``index`` of it. Replaying the step's generators' states, such a run
    draws the step's numbers for its rows and ends where the step did (:meth:`Replay.alone_alike`); the other draws
    (scalars, parameter-shaped) are made as they are. Where a draw cannot be put at the step's shape (an op or a count
    of draws unlike the template's, an argument that does not broadcast, an op not in
    :data:`_PURE_DRAWS`), it is made as it is, and the run does not end where the step did unless it drew nothing."""

    def __init__(self, template: list[tuple[Any, Optional[tuple[int, ...]]]], index: Tensor, size: int) -> None:
        super().__init__()
        self.template, self.index, self.size = template, index, size
        self.placement = torch.zeros(size, dtype=torch.long)
        self.placement[index] = torch.arange(len(index))
        self.drawn = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        k, self.drawn = self.drawn, self.drawn + 1
        step = self.template[k] if k < len(self.template) and self.template[k][0] == func else None
        bound = _bound(func, args, kwargs)
        dims = _sliced_dims(_draw_shape(bound), step and step[1], len(self.index), self.size)
        if not dims or func.overloadpacket not in _PURE_DRAWS:
            return func(*args, **kwargs)
        return self._at_step_shape(func, args, kwargs, step[1], dims)

    def _at_step_shape(self, func, args: tuple, kwargs: dict, shape: tuple[int, ...], dims: list[int]):
        """``func`` drawn at ``shape``, its result's rows ``index`` along ``dims`` (written into its ``self`` for an
        in-place draw); as it is where an argument cannot be put at that shape. An argument with the run's rows along
        ``dims`` is placed, whatever its other sizes (``normal(mean[B, d], std[B, 1])``: until stop 63 only one of the
        half's exact shape was, and such a ``std`` made the fallback draw with ``mean`` already placed, so an honest
        model's re-checked step failed with a shape error). An ``out=`` buffer is drawn into at the step's shape and
        gets the run's rows."""
        given = (args, kwargs)
        own, args, kwargs = args[0] if args else None, list(args), dict(kwargs)
        for k, argument in enumerate(func._schema.arguments):
            held, value = (args, k) if k < len(args) else (kwargs, argument.name)
            if held is kwargs and value not in kwargs:
                continue
            found = held[value]
            if argument.name == "size":
                held[value] = list(shape)
            elif isinstance(found, Tensor) and self._holds_the_rows(found, dims, len(shape)):
                held[value] = self._placed(found, dims)
            if isinstance(held[value], Tensor) and not _broadcasts(held[value], shape):
                return func(*given[0], **given[1])
            if k and argument.alias_info is not None and argument.alias_info.is_write and argument.name != "out":
                return func(*given[0], **given[1])  # (an op writing an argument other than ``self``: rrelu's noise)
        drawn = func(*args, **kwargs)
        first = func._schema.arguments[0] if func._schema.arguments else None
        if isinstance(own, Tensor) and first.alias_info is not None and first.alias_info.is_write:
            return own.copy_(self._rows(args[0], dims))  # (``bernoulli_``: drawn into a copy at the step's shape)
        if "out" in kwargs and kwargs["out"] is not given[1]["out"]:
            # (``rand(..., out=buf)``: drawn into a copy at the step's shape; drawn as it is, at the half's size, such a
            # mask beside review 76's size gate gave no verdict, 2.38-2.61 C released silently: review 77, finding 6)
            return given[1]["out"].copy_(self._rows(kwargs["out"], dims))
        return tree_map_only(Tensor, lambda t: self._rows(t, dims) if _batched_at(t, dims, self.size) else t, drawn)

    def _holds_the_rows(self, tensor: Tensor, dims: list[int], ndim: int) -> bool:
        """Whether ``tensor`` (of the draw's rank ``ndim``) has the run's row count along each of ``dims``."""
        return tensor.dim() == ndim and all(tensor.shape[d] == len(self.index) for d in dims)

    def _placed(self, rows: Tensor, dims: list[int]) -> Tensor:
        """The run's ``rows`` at their places in a batch of the step's size (the others holding the first row's)."""
        return _along(rows, dims, self.placement)

    def _rows(self, drawn: Tensor, dims: list[int]) -> Tensor:
        """The run's rows of a draw at the step's shape."""
        return _along(drawn, dims, self.index)


def _along(tensor: Tensor, dims: list[int], index: Tensor) -> Tensor:
    """``tensor``'s entries ``index`` along each of ``dims``."""
    for d in dims:
        tensor = tensor.index_select(d, index.to(tensor.device))
    return tensor


def _batched_at(tensor: Tensor, dims: list[int], size: int) -> bool:
    """Whether ``tensor`` has ``size`` entries in each of ``dims`` (a draw's output at the step's shape)."""
    return tensor.dim() > max(dims) and all(tensor.shape[d] == size for d in dims)


def _broadcasts(tensor: Tensor, shape: tuple[int, ...]) -> bool:
    try:
        return tuple(torch.broadcast_shapes(tuple(tensor.shape), shape)) == tuple(shape)
    except RuntimeError:
        return False


def size_through_draws(what: str, changed: float) -> PrivacyConfigError:
    """The refusal of a step whose halves, run alone drawing the step's numbers (:class:`StepSizedDraws`), differ from
    the step's rows: one line naming the batch's size and mixing (``changed``: :func:`beyond_one_row`'s ratio)."""
    return PrivacyConfigError(
        f"The {what} depend on the batch's size or on their batch-mates behind the forward's random draws (with the "
        f"step's draws replayed, each half of the batch run alone changed two examples' values or more by "
        f"{beyond_tolerance(changed)}): removing one example changes every batch-mate's contribution, which "
        "per-example clipping cannot bound; compute each example's values from its own row, whatever the batch's size")


class StepDrew(Exception):
    """A check's recomputation replaced a random draw of the step's forward (:class:`Draws`)."""


class Draws:
    """Whether a check's recomputations replaced a random draw (:attr:`MeanOfRandomDraws.replaced`): the step drew
    its own (dropout in training), so its own values, norms and sums are no baseline for them."""

    def __init__(self) -> None:
        self.seen = False

    def stopping(self, values_of: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        """``values_of`` that raises :class:`StepDrew` as soon as one of its recomputations replaced a draw (one
        half's forward, not the whole comparison, spent on learning it)."""
        def checked(index: Tensor) -> Tensor:
            values = values_of(index)
            if self.seen:
                raise StepDrew
            return values
        return checked

    def note(self, mode: Optional[MeanOfRandomDraws]) -> None:
        """Note whether a recomputation's draws' mode replaced a draw (``None``: a replayed run, none replaced)."""
        self.seen |= mode is not None and mode.replaced


def _normal_mean(out: Tensor, bound: dict) -> Tensor:
    """``normal(mean, std)``'s result at ``mean`` (a tensor or a number)."""
    mean = bound["mean"]
    return out.copy_(mean) if isinstance(mean, Tensor) else out.fill_(mean)


#: A draw's mean written into its result, by op (``(result, the op's bound arguments) -> result``).
_MEANS = {
    torch.ops.aten.rand: lambda out, _: out.fill_(0.5),
    torch.ops.aten.rand_like: lambda out, _: out.fill_(0.5),
    torch.ops.aten.randn: lambda out, _: out.zero_(),
    torch.ops.aten.randn_like: lambda out, _: out.zero_(),
    torch.ops.aten.uniform_: lambda out, b: out.fill_((b["from"] + b["to"]) / 2),
    torch.ops.aten.normal_: lambda out, b: out.fill_(b["mean"]),
    torch.ops.aten.normal: _normal_mean,
    torch.ops.aten.exponential_: lambda out, b: out.fill_(1.0 / b["lambd"]),
    torch.ops.aten.log_normal_: lambda out, b: out.fill_(math.exp(b["mean"] + b["std"] ** 2 / 2)),
    torch.ops.aten.geometric_: lambda out, b: out.fill_(1.0 / b["p"]),
    torch.ops.aten.rrelu_with_noise: None,  # (:func:`_rrelu_mean`)
    # draws without a mean, at a fixed stand-in (stop 58: they sent the checks to eval mode, where a record that
    # made a train-only loss random with ``randint`` switched a train-only batch statistic off, 3.73 C)
    torch.ops.aten.randint: lambda out, b: _middle_of_range(out, b.get("low", 0), b["high"]),
    torch.ops.aten.randint_like: lambda out, b: _middle_of_range(out, b.get("low", 0), b["high"]),
    torch.ops.aten.random_: lambda out, b: _middle_of_range(out, b.get("from", 0), b.get("to")),
    torch.ops.aten.randperm: lambda out, b: out.copy_(torch.arange(b["n"], device=out.device)),
    torch.ops.aten.multinomial: lambda out, b: out.copy_(_most_likely(b["self"], b["num_samples"], b["replacement"])),
    torch.ops.aten.cauchy_: lambda out, b: out.fill_(b["median"]),
    torch.ops.aten.poisson: lambda out, b: out.copy_(b["self"]),
}


#: The ops :class:`StepSizedDraws` puts at the step's shape: draws whose every output is drawn (or a mask and the
#: masked input), so the rows of each are the run's. Not the attention kernels taking a ``dropout_p`` (their other
#: outputs, a ``logsumexp`` kept for the backward, would not be the run's: an honest ViT was refused) nor RReLU
#: (it writes its ``noise`` argument); those are drawn as they are. ``_sample_dirichlet`` (Beta and Dirichlet
#: samples) since review 77's finding 3: drawn at the half's size, a per-row Beta beside review 76's size gate left
#: the runs alone unlike, no verdict (2.43 C released, no warning).
_PURE_DRAWS = frozenset([*(op for op in _MEANS if op is not torch.ops.aten.rrelu_with_noise), torch.ops.aten.bernoulli,
                         torch.ops.aten.bernoulli_, torch.ops.aten.native_dropout, torch.ops.aten.binomial,
                         torch.ops.aten._standard_gamma, torch.ops.aten._sample_dirichlet])


def _middle_of_range(out: Tensor, low, high) -> Tensor:
    """An integer draw from ``[low, high)`` at the middle of its range (``random_`` without a bound: as drawn)."""
    if high is None:
        return out
    low, high = int(low), int(high)
    return out.fill_(low + (high - low - 1) // 2)


def _most_likely(probabilities: Tensor, count: int, replacement: bool) -> Tensor:
    """``multinomial``'s stand-in: the ``count`` most likely categories (with replacement: the most likely, repeated)."""
    if replacement:
        return probabilities.argmax(-1, keepdim=True).expand(*probabilities.shape[:-1], count)
    return probabilities.topk(count, -1).indices


@contextlib.contextmanager
def _drawn_secretly(generator: torch.Generator) -> Iterator[None]:
    """A recomputation's draw from a model's own ``generator``: from a fresh secret state, the generator set back
    after, as :func:`~lit_zodp.privacy.training_randomness.secret_streams` does for torch's default generators. Its
    stream is where the step left it, and the draw is one no model predicts. Before (set back only around the draws
    given a mean), draws the checks do not replace (``binomial``, ``_standard_gamma``) moved the model's stream at a
    re-check; and those whose stand-in keeps the draw (``random_()`` unbounded) were drawn alike from the set-back
    stream in every recomputation, at other positions in a half than in the whole batch, so an honest model drawing
    random bits so was refused at every re-check (red-team review 75)."""
    state = generator.get_state()
    try:
        if generator.device.type == "cpu":
            generator.set_state(secret_cpu_state())
        elif generator.device.type == "cuda":
            generator.set_state(secret_cuda_state())
        else:
            generator.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        yield
    finally:
        generator.set_state(state)


def _rrelu_mean(bound: dict) -> Tensor:
    """RReLU in training at the mean of its slopes: the negative part times ``(lower + upper) / 2``, written into
    ``noise`` too (its backward reads it)."""
    x, noise = bound["self"], bound["noise"]
    slope = (float(bound["lower"]) + float(bound["upper"])) / 2
    noise.copy_(torch.where(x >= 0, torch.ones_like(x), torch.full_like(x, slope)))
    return x * noise


def _generator_of(args: tuple, kwargs: dict) -> Optional[torch.Generator]:
    """An op's explicit generator, if it has one (keyword-only in most schemas, positional in ``binomial``'s,
    ``_standard_gamma``'s, ``poisson``'s and ``rrelu_with_noise``'s)."""
    generator = kwargs.get("generator")
    if generator is None:
        generator = next((a for a in args if isinstance(a, torch.Generator)), None)
    return generator


def _bound(func, args: tuple, kwargs: dict) -> dict:
    """The op's arguments by name, with the schema's defaults (the dispatcher drops arguments at their default)."""
    return {a.name: args[k] if k < len(args) else kwargs.get(a.name, a.default_value)
            for k, a in enumerate(func._schema.arguments)}


def _bernoulli_mean(in_place: bool, bound: dict) -> Tensor:
    """``bernoulli(x)`` (probabilities ``x``), ``bernoulli(x, p)`` and ``x.bernoulli_(p)`` by their mean."""
    x, p = bound["self"], bound.get("p")
    if "p" not in bound:  # bernoulli(probabilities)
        mean = x.clone()
    elif isinstance(p, Tensor):
        mean = p.to(x.dtype).expand_as(x)
    else:
        mean = torch.full_like(x, float(p))
    return x.copy_(mean) if in_place else mean.clone()


@contextlib.contextmanager
def step_mode_recompute(devices: Optional[list] = None) -> Iterator[MeanOfRandomDraws]:
    """The context of a check's recomputation in the step's mode: Bernoulli draws at their mean, autograd on
    (a forward may differ with it; the caller detaches the outputs) but nothing kept for a backward
    (:func:`nothing_saved_for_backward`), fresh seeds, and the user's random streams restored after
    (``devices``: the CUDA devices whose streams to keep; default all; a model's own generators are set back too).
    Yields the draws' mode (whether it :attr:`~MeanOfRandomDraws.replaced` one)."""
    if devices is None:
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with secret_streams(devices):  # two recomputations draw differently, so a forward random beyond dropout shows
        with torch.enable_grad(), nothing_saved_for_backward(), MeanOfRandomDraws() as draws:
            yield draws


def _not_saved(tensor: Tensor) -> None:
    """What a check's recomputation keeps of a tensor autograd saves for the backward: nothing."""
    return None


def _never_unpacked(saved: None) -> Tensor:
    raise RuntimeError("A batch-independence check recomputes the forward with autograd on but keeps no tensor for "
                       "a backward, and this forward ran a backward of its own (autograd.grad inside forward or "
                       "loss), which these checks do not support")


def nothing_saved_for_backward():
    """Autograd on, but the tensors it would save for a backward are dropped as they are saved: the values the
    forward computes, its grad mode and its outputs' ``requires_grad`` are those of the step, at the memory of a
    forward without grad. A check's recomputation never runs a backward: with the graph kept, the first-order fit
    start's checks held a whole forward graph (594 MiB on ViT-tiny/64) and the engine's check of a new structure
    held a half batch's on top of the step's (first step 890 MiB above the baseline against 624 for the next).
    Where saved-tensor hooks are disabled (inside a ``torch.func`` transform) the graph is kept as before."""
    if getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", lambda: True)():
        return torch.autograd.graph.saved_tensors_hooks(_not_saved, _never_unpacked)
    return contextlib.nullcontext()


def warn_unreplayed_draws(what: str) -> None:
    """The runs replaying a step's draws did not draw alike (:meth:`Replay.alike`): said once per place."""
    warnings.warn(f"The forward of {what} draws random numbers in training mode that the batch-independence checks "
                  "could not replay alike (draws whose number follows the batch's content, a torch.Generator the "
                  "forward seeds anew, or draws from outside torch: NumPy), so mixing of examples through those draws "
                  "(mixup inside the forward) went unchecked",
                  LitZodpWarning, stacklevel=3)


def warn_unchecked_training_mode(what: str) -> None:
    """A forward random beyond Bernoulli draws cannot be compared in training mode: said once per place."""
    warnings.warn(f"The forward of {what} draws random numbers other than dropout masks in training mode (rand, "
                  "randn: RReLU, noise layers), so the batch-independence checks compared it in eval mode: mixing "
                  "of examples that happens only in training would go unseen", LitZodpWarning, stacklevel=3)


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """``module.eval()`` for the block, each submodule's mode restored after (the checks' recomputations:
    dropout would differ on any rerun)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training

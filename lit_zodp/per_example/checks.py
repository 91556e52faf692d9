"""Validation for the per-example engine: the messages name the bad value and the fix."""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn

from lit_zodp.errors import raise_if_any

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
    raise_if_any([
        f"BatchNorm layer `{name}` mixes the examples of a batch, so per-example gradients (and DP) "
        f"are undefined; replace it with nn.GroupNorm (or LayerNorm)" for name in names
    ])


BufferState = dict[str, tuple[nn.Module, str, Tensor, Optional[int]]]


def buffer_state(module: nn.Module) -> BufferState:
    """``{qualified name: (owner, local name, buffer, version)}`` of ``module``'s buffers, read before a private
    forward. ``Tensor._version`` counts in-place writes; holding the tensor catches a reassigned buffer (an
    inference tensor, made by a lazy layer under ``inference_mode``, has no counter and cannot be written in
    place)."""
    return {f"{owner_name}.{local}".lstrip("."): (owner, local, b, None if b.is_inference() else b._version)
            for owner_name, owner in module.named_modules() for local, b in owner._buffers.items() if b is not None}


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
    by_owner: dict[str, list[str]] = {}
    for name in sorted(written):
        owner, _, local = name.rpartition(".")
        by_owner.setdefault(owner, []).append(f"`{local}`")
    raise_if_any([
        f"`{owner or '<root>'}` ({type(module.get_submodule(owner)).__name__}) wrote "
        f"{', '.join(names)} in the private forward (running statistics in train mode?): an un-noised average "
        f"of private examples kept in the model; use a layer without them (track_running_stats=False, "
        f"nn.GroupNorm or LayerNorm)"
        for owner, names in by_owner.items()
    ])


def _written(owner: nn.Module, local: str, buffer: Tensor, version: Optional[int]) -> bool:
    """Reassigned, removed, or written in place since :func:`buffer_state`."""
    return owner._buffers.get(local) is not buffer or (version is not None and buffer._version != version)


def batch_statistics_layers(module: nn.Module) -> list[str]:
    """Qualified names of the BatchNorm layers that normalise with the batch's own statistics even in
    eval mode (``track_running_stats=False``, or running statistics removed)."""
    return [name for name, m in _batchnorms(module)
            if not m.track_running_stats or m.running_mean is None or m.running_var is None]


def refuse_batch_statistics(module: nn.Module) -> None:
    """Zeroth-order steps forward private batches in eval mode, where a BatchNorm with running
    statistics treats each example alone; one without them mixes the batch's examples into every
    loss, so clipping each loss no longer bounds one example's contribution (audit 3 F1)."""
    raise_if_any([
        f"BatchNorm layer `{name}` normalises with the batch's own statistics even in eval mode "
        f"(track_running_stats=False), so each example's loss depends on its batch-mates and clipping "
        f"does not bound its contribution; keep running statistics or use nn.GroupNorm (or LayerNorm)"
        for name in batch_statistics_layers(module)
    ])


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
    """``loss_fn`` must return the per-example losses, a 1-D tensor ``[B]``."""
    if not isinstance(losses, Tensor) or losses.dim() != 1:
        shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
        raise_if_any([f"Expected `loss_fn` to return per-example losses of shape [B], but got {shape}"])
    if losses.numel() and not losses.requires_grad:
        raise_if_any(["Expected the per-example losses to depend on trainable parameters, but they do "
                      "not require grad (was `loss_fn` run under torch.no_grad, or is everything frozen?)"])

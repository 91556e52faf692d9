"""The slow, obviously correct per-example gradients: ``torch.func`` vmap over examples.

Two entry points share the recipe "give each example a batch of one, differentiate it alone,
vmap over the examples" (the torch.func per-sample-gradient recipe; Opacus' functorch fallback):

* :func:`per_example_gradients_vmap` differentiates a per-example *loss*; the tests' reference.
* :func:`call_gradients` differentiates one recorded module *call* against the output gradients
  captured in the batched backward (a vector-Jacobian product per example); the engine's fallback
  for parameters no layer rule covers. It recomputes that module's forward once more, vmapped,
  so its cost is about one extra forward and backward of the module; the module must be
  deterministic (no active dropout) and batch-first.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten


class LossOfOne(nn.Module):
    """Holds ``module`` so ``functional_call`` swaps its parameters while ``fn`` runs."""

    def __init__(self, module: nn.Module, fn: Callable[..., Tensor]):
        super().__init__()
        self.module = module
        self.fn = fn

    def forward(self, *example: Any) -> Tensor:
        return self.fn(*example)


def _selected(module: nn.Module, names: Optional[Iterable[str]]) -> Dict[str, Tensor]:
    wanted = None if names is None else set(names)
    return {n: p.detach() for n, p in module.named_parameters()
            if (p.requires_grad if wanted is None else n in wanted)}


def per_example_gradients_vmap(module: nn.Module, loss_of_one_example: Callable[..., Tensor],
                               *batch: Any, names: Optional[Iterable[str]] = None) -> Dict[str, Tensor]:
    """Per-example gradients ``{name: [B, *param.shape]}`` of ``loss_of_one_example``.

    Args:
        module: The model; ``loss_of_one_example`` must call it (its parameters are swapped for
            the differentiated ones by :func:`torch.func.functional_call`).
        loss_of_one_example: ``(*example) -> scalar``; each argument is one example's slice of
            the matching ``batch`` entry, kept with a leading batch dimension of 1.
        batch: Tensors (or pytrees of tensors) with the examples along dim 0.
        names: Parameters to differentiate; default every parameter with ``requires_grad``.
    """
    wrapper = LossOfOne(module, loss_of_one_example)

    def loss(params: Dict[str, Tensor], example: tuple) -> Tensor:
        example = tree_map(lambda t: t.unsqueeze(0), example)
        swapped = {f"module.{n}": t for n, t in params.items()}
        return functional_call(wrapper, swapped, example).reshape(())

    return vmap(grad(loss), in_dims=(None, 0))(_selected(module, names), batch)


def is_batched(leaf: Any, batch_size: int) -> bool:
    return isinstance(leaf, Tensor) and leaf.dim() >= 1 and leaf.shape[0] == batch_size


def call_gradients(module: nn.Module, names: Sequence[str], inputs: Sequence[Any], spec: Any,
                   output_grads: Dict[int, Tensor], batch_size: int) -> Dict[str, Tensor]:
    """Per-example gradients of the parameters ``names`` of ``module`` for one recorded call.

    Args:
        inputs, spec: The call's ``(args, kwargs)`` flattened by ``tree_flatten``; tensors with
            ``batch_size`` rows are split per example, everything else is shared.
        output_grads: Gradient of the summed loss for each flattened output leaf that got one,
            keyed by leaf index; row ``i`` is example ``i``'s output gradient.

    Returns ``{name: [B, *param.shape]}``; example ``i``'s entry is the vector-Jacobian product
    of its output gradients with the module run on its inputs alone.
    """
    params = _selected(module, names)
    batched = [i for i, leaf in enumerate(inputs) if is_batched(leaf, batch_size)]
    out_index = sorted(output_grads)
    leaves = [leaf.detach() if isinstance(leaf, Tensor) else leaf for leaf in inputs]

    def outputs_of_one(params: Dict[str, Tensor], rows: tuple) -> tuple:
        call = list(leaves)
        for i, row in zip(batched, rows):
            call[i] = row.unsqueeze(0)
        args, kwargs = tree_unflatten(call, spec)
        out = tree_flatten(functional_call(module, params, tuple(args), kwargs))[0]
        return tuple(out[j] for j in out_index)

    def one(rows: tuple, grads: tuple) -> Dict[str, Tensor]:
        _, pullback = vjp(lambda p: outputs_of_one(p, rows), params)
        return pullback(tuple(g.unsqueeze(0) for g in grads))[0]

    rows = tuple(leaves[i] for i in batched)
    grads = tuple(output_grads[j] for j in out_index)
    with warnings.catch_warnings(), torch.no_grad():  # no graph through the other parameters
        warnings.filterwarnings("ignore", message=".*performance drop.*")  # a loop: slow, not wrong
        return vmap(one)(rows, grads)

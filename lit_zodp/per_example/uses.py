"""Where each trainable parameter is used in the forward: the structural coverage check.

A layer rule sees only the calls of its own layer, and the vmap fallback only the calls of the
module it recomputes. A parameter used anywhere else (a weight reused through ``F.linear``,
``nn.MultiheadAttention``'s ``out_proj.weight`` whose module is never called, a term added in
``loss_fn``) would get per-example gradients missing that use, and so a norm below its true norm:
the clipping bound, and with it the privacy guarantee, would not hold.

:class:`ParameterUses` is a ``TorchFunctionMode`` active during the recorded forward: every torch
function or tensor method that receives a tracked parameter (directly or in a list or tuple
argument) and returns a tensor that requires grad (any tensor while grad is disabled: inside a
custom ``autograd.Function``'s forward the parameter's use produces no grad-requiring tensor, yet its
backward may still give the parameter a gradient) records the recorded modules whose calls enclose it. A use is covered when the source
that will form the parameter's per-example gradients (one of its owner layers, or the module it
is recomputed on) is among them. This replaces a numeric check on every step: the engine still
compares ``sum_i g_i`` with the batch gradient (:mod:`.coverage`) whenever the calls or the uses
differ from every batch checked before, so a use the mode cannot see is still caught.
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, Iterable, List, Sequence, Set

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode


def _has_tensor(out: Any) -> bool:
    items = out if isinstance(out, (list, tuple)) else (out,)
    return any(isinstance(item, Tensor) for item in items)


def _carries_gradient(out: Any) -> bool:
    items = out if isinstance(out, (list, tuple)) else (out,)
    return any(isinstance(item, Tensor) and item.requires_grad for item in items)


class ParameterUses(TorchFunctionMode):
    """Records ``uses[i]``: the sets of enclosing module ids of each use of ``params[i]``.

    Args:
        params: The tracked parameters.
        stack: The modules whose calls are running (maintained by the tape's hooks, outermost first).
    """

    def __init__(self, params: Sequence[Tensor], stack: List[Any]) -> None:
        super().__init__()
        self._index = {id(p): i for i, p in enumerate(params)}
        self._stack = stack
        self.uses: Dict[int, Set[FrozenSet[int]]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        used = self._tracked_in(args)
        if kwargs:
            used += self._tracked_in(kwargs.values())
        grad_enabled = torch.is_grad_enabled()
        out = func(*args, **kwargs)
        # metadata (.shape, .dtype, .size()) and .data are not uses; with grad disabled every tensor
        # result counts, since that is how a custom autograd.Function's forward sees its inputs
        if used and (_carries_gradient(out) if grad_enabled else _has_tensor(out)):
            enclosing = frozenset(map(id, self._stack))
            for i in used:
                self.uses.setdefault(i, set()).add(enclosing)
        return out

    def _tracked_in(self, values: Iterable[Any]) -> List[int]:
        """Indices of the tracked parameters among ``values``, directly or in a list or tuple argument. It runs on every
        torch call of the recorded forward (5,953 in PAZO's IMDB LSTM at 128 tokens, batch 64), so a loop without
        intermediate lists: the mode added 7.7 ms to that 41 ms forward, 17 ms with a list per argument (stop 64)."""
        index, used = self._index, []
        for value in values:
            if isinstance(value, (list, tuple)):
                used.extend(index[id(item)] for item in value if id(item) in index)
            elif id(value) in index:
                used.append(index[id(value)])
        return used

    def signature(self) -> FrozenSet:
        """The use pattern, to tell whether a batch's structure was seen (and checked) before."""
        return frozenset((i, enclosing) for i, sets in self.uses.items() for enclosing in sets)

    def uncovered(self, sources: Dict[int, Iterable[int]]) -> List[int]:
        """Parameters with a use that none of their ``sources`` (module ids) encloses."""
        failed = []
        for i, sets in self.uses.items():
            allowed = set(sources.get(i, ()))
            if any(not (allowed & enclosing) for enclosing in sets):
                failed.append(i)
        return sorted(failed)

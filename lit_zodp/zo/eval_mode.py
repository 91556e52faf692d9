"""Eval mode for every zeroth-order step, at the cost of reading the layers' flags.

The two points of a step must see the same function (no dropout, no batch statistics), so every step puts
the backbone in eval mode: Lightning puts it back in train mode at each epoch's start and after validation.
``Module.eval()`` sets each layer's flag through ``Module.__setattr__``: 266 us a step on all-MiniLM-L6-v2's
119 layers (AMD EPYC), about 4% of a 7 ms step on an H200 where the forwards are kernel launches, paid by
every zeroth-order module. :class:`EvalMode` reads the flags of a list of the layers instead (8 us there) and
calls ``eval()`` only when one is set.
"""

from __future__ import annotations

from typing import Optional

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

_registrations = [0]  # layers registered anywhere in this process since the counting hook went in
_counting = []  # the hook's handle, once installed


def _count(_owner: nn.Module, _name: str, _layer: Optional[nn.Module]) -> None:
    _registrations[0] += 1


def _count_registrations() -> None:
    """Install, once per process, torch's global hook that counts layer registrations (``self.layer = ...``,
    ``add_module``, ``ModuleList.append``): a counter bump, holding no module."""
    if not _counting:
        _counting.append(register_module_module_registration_hook(_count))


class EvalMode:
    """Puts a module and all its layers in eval mode when any of them is in training mode.

    The list of layers is read again whenever a layer has been registered anywhere since it was read, or
    another module is asked for, so a layer added between steps (in training mode, as every new layer) is seen.
    A layer written straight into a module's ``_modules`` dict bypasses torch's registration hooks and is not.
    """

    def __init__(self) -> None:
        _count_registrations()
        self._module: Optional[nn.Module] = None
        self._layers: list[nn.Module] = []
        self._read_at = -1

    def ensure(self, module: nn.Module) -> None:
        if not _counting:  # (a keeper unpickled in a fresh process: its __init__ ran in another)
            _count_registrations()
        if module is not self._module or self._read_at != _registrations[0]:
            self._module, self._read_at = module, _registrations[0]
            self._layers = list(module.modules())
        if any(layer.training for layer in self._layers):
            module.eval()


#: timm's layers that keep, in eval mode, a tensor computed from their parameters until their next ``train()``:
#: LeViT, EfficientFormer(V2), TinyViT and EfficientViT-MSRA cache their attention biases by device.
EVAL_MODE_CACHES = ("attention_bias_cache",)


def eval_mode_cache_owners(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(layer, attribute)`` of every eval-mode cache of :data:`EVAL_MODE_CACHES` in ``module``. A zeroth-order
    step forwards in eval mode at ``x + lam u`` and ``x - lam u``: from such a cache the second forward read the
    biases of the first, and every later step those of the fit's first forward, so the biases' perturbations and
    updates never reached the loss (review 23: moving LeViT's ``attention_biases`` by 5 moved its output by 0)."""
    return [(layer, name) for layer in module.modules() for name in EVAL_MODE_CACHES
            if isinstance(getattr(layer, name, None), dict)]


def clear_eval_mode_caches(owners: list[tuple[nn.Module, str]]) -> None:
    """Empty each cache before a forward at a new point (the layer fills it again from its parameters)."""
    for layer, name in owners:
        getattr(layer, name).clear()


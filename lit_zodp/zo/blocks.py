"""Parameter blocks for block-coordinate ZO (MeZO-BCD, Park et al., App. D): partitions, orders, engine.

Partitions (App. D.1) split a model's TRAINABLE parameters into disjoint blocks; tied weights count
once (their first occurrence in ``named_parameters``), frozen parameters are skipped, and every
trainable parameter is in exactly one block. Blocks are listed input first (index 1 nearest the
input, as Alg. 3 numbers them):

* ``layer`` (the paper's default): the embeddings (everything before the layer stack), each layer
  of the stack, then the head with the final norm (everything after it).
* ``layer`` with ``layers_per_block = k``: the paper's "multi-layer" (k = 2): k consecutive layers
  per block (the last block may hold fewer).
* ``linear``: the embeddings, each linear map (``nn.Linear``, GPT-2's ``Conv1D``) of each layer, the
  rest of each layer (its norms) as one block, then the head with the final norm.

The layer stack is found, not named: the ``nn.ModuleList`` / ``nn.Sequential`` of two or more
modules of one class that holds the most trainable parameters (``encoder.layer`` in BERT/RoBERTa,
``decoder.layers`` in OPT, ``h`` in GPT-2, ``blocks`` in timm ViTs). OPT registers its
``final_layer_norm`` (and ``project_out``) before its layers: modules with those names count on the
output side. A model without a stack (an MLP) gets one block per module that owns parameters.

Orders (Alg. 3, ``t >= 1``, blocks ``1..N``) are pure functions of ``(order, t, N)`` and, for the
random permutation, of a PUBLIC seed (the run seed): every DDP rank and a resumed run agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

PARTITIONS = ("layer", "linear")
ORDERS = ("ascending", "descending", "flip_flop", "random")
#: Output-side modules that some models (OPT) register before their layer stack.
OUTPUT_SIDE_NAMES = ("final_layer_norm", "project_out")
#: Spawn key of the block-order stream: never shared with the direction seeds (``derive_seed``).
BLOCK_ORDER_STREAM = 0xB0C
BLOCK_SAMPLING_STREAM = 0xB0D


@dataclass(frozen=True)
class Block:
    """One block: a name for logs and its parameters (in the model's order)."""

    name: str
    params: tuple[nn.Parameter, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


# ------------------------------------------------------------------------------ partitions
def partition(model: nn.Module, kind: str = "layer", layers_per_block: int = 1) -> list[Block]:
    """The blocks of ``model``'s trainable parameters, input first (App. D.1)."""
    if kind not in PARTITIONS:
        raise ValueError(f"Expected `partition` in {list(PARTITIONS)}, but got {kind!r}")
    if isinstance(layers_per_block, bool) or not isinstance(layers_per_block, int) or layers_per_block < 1:
        raise ValueError(f"Expected `layers_per_block` to be a positive int, but got {layers_per_block!r}")
    if kind == "linear" and layers_per_block != 1:
        raise ValueError(f"`partition='linear'` splits layers; it takes no `layers_per_block` "
                         f"(got {layers_per_block})")
    inputs, layers, outputs = split_by_layer(model)
    if kind == "layer":
        middle = _group_layers(layers, layers_per_block)
    else:
        middle = [block for name, params in layers for block in _linear_split(model, name, params)]
    blocks = ([Block("embeddings", tuple(inputs))] if inputs else []) + middle
    blocks += [Block("head", tuple(outputs))] if outputs else []
    return [b for b in blocks if b.params]


def groups_at_block_rates(groups: list[dict], blocks: Sequence[Block], factors: Sequence[float],
                          lr: float) -> list[dict]:
    """Param ``groups`` cut into runs of parameters of equal block rate, ``lr * factors[j]`` for block ``j``.

    Cutting (not regrouping) keeps the parameters' order, so a fused engine's global layout, and with
    it every element's direction, is the one of the uncut groups. All factors 1: ``groups`` unchanged.
    """
    if all(f == 1.0 for f in factors):
        return groups
    factor_of = {id(p): f for b, f in zip(blocks, factors) for p in b.params}
    runs: list[tuple[dict, float, list]] = []
    for group in groups:
        for p in group["params"]:
            factor = factor_of[id(p)]
            if not runs or runs[-1][0] is not group or runs[-1][1] != factor:
                runs.append((group, factor, []))
            runs[-1][2].append(p)
    return [dict(group, params=params, lr=lr * factor) for group, factor, params in runs]


def median_rate_factors(values: Sequence[float]) -> list[float]:
    """``min(1, m / v_j)`` per block, ``m`` the lower median of ``values`` (ours: ``block_lr`` size/curvature).

    A block whose value (its size, or its Hessian trace) exceeds the median gets its rate scaled down in
    proportion; the others keep it, and so does a block with ``v_j <= m`` (a non-positive trace
    included). All ones when ``m <= 0``: no positive scale to compare with.
    """
    median = sorted(values)[(len(values) - 1) // 2]
    if not median > 0:
        return [1.0] * len(values)
    return [1.0 if v <= median else median / v for v in values]


def split_by_layer(model: nn.Module) -> tuple[list[nn.Parameter], list[tuple[str, list[nn.Parameter]]],
                                               list[nn.Parameter]]:
    """``(input side, [(layer name, params)], output side)`` over the unique trainable parameters."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # tied: first occurrence
    stack = find_layer_stack(model)
    if stack is None:
        return [], _owners(model, named), []
    prefix, layer_count = stack
    layers: list[tuple[str, list[nn.Parameter]]] = [(f"{prefix}.{i}", []) for i in range(layer_count)]
    inputs, outputs, seen_stack = [], [], False
    for name, p in named:
        index = _layer_index(name, prefix)
        if index is not None:
            layers[index][1].append(p)
            seen_stack = True
        elif seen_stack or _output_side(name):
            outputs.append(p)
        else:
            inputs.append(p)
    return inputs, [(n, ps) for n, ps in layers if ps], outputs


def find_layer_stack(model: nn.Module) -> Optional[tuple[str, int]]:
    """``(name, length)`` of the largest homogeneous ModuleList/Sequential of 2+ modules, or None.

    Largest by parameter count, frozen ones included: freezing a layer must not change the structure.
    """
    best, best_size = None, 0
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())  # structure: frozen layers still count
        if size > best_size and all(any(True for _ in child.parameters()) for child in module):
            best, best_size = (name, len(module)), size
    return best


def _layer_index(name: str, prefix: str) -> Optional[int]:
    head = f"{prefix}." if prefix else ""
    if not name.startswith(head):
        return None
    first = name[len(head):].split(".", 1)[0]
    return int(first) if first.isdigit() else None


def _output_side(name: str) -> bool:
    return any(part in OUTPUT_SIDE_NAMES for part in name.split(".")[:-1])


def _owners(model: nn.Module, named: list[tuple[str, nn.Parameter]]) -> list[tuple[str, list[nn.Parameter]]]:
    """No stack: one group per module owning parameters, in ``named_parameters`` order."""
    groups: dict[str, list[nn.Parameter]] = {}
    for name, p in named:
        groups.setdefault(name.rpartition(".")[0] or name, []).append(p)
    return list(groups.items())


def _group_layers(layers: list[tuple[str, list[nn.Parameter]]], k: int) -> list[Block]:
    blocks = []
    for start in range(0, len(layers), k):
        group = layers[start:start + k]
        name = group[0][0] if len(group) == 1 else f"{group[0][0]}-{group[-1][0].rpartition('.')[2]}"
        blocks.append(Block(name, tuple(p for _, ps in group for p in ps)))
    return blocks


def _linear_split(model: nn.Module, layer_name: str, params: list[nn.Parameter]) -> list[Block]:
    """Each linear map of a layer one block, the layer's other parameters one block."""
    layer = model.get_submodule(layer_name) if layer_name in dict(model.named_modules()) else None
    members = {id(p) for p in params}
    blocks, taken = [], set()
    for name, module in (layer.named_modules() if layer is not None else ()):
        if _is_linear(module):
            own = [p for p in module.parameters(recurse=False) if id(p) in members and id(p) not in taken]
            taken |= {id(p) for p in own}
            if own:
                blocks.append(Block(f"{layer_name}.{name}" if name else layer_name, tuple(own)))
    rest = tuple(p for p in params if id(p) not in taken)
    return blocks + ([Block(f"{layer_name}.other" if blocks else layer_name, rest)] if rest else [])


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"  # GPT-2's transposed linear


# ------------------------------------------------------------------------------ orders (Alg. 3)
def update_block_idx(order: str, t: int, n: int, seed: int = 0) -> int:
    """``UpdateBlockIdx(order, t, N)`` of Alg. 3: the active block ``i`` in ``1..N`` at step ``t >= 1``.

    ``random``: Alg. 3 draws ``pi = Shuffle([N])`` when ``t mod N = 0`` and takes ``pi[t mod N]``
    (0-based), so the windows ``t = wN .. wN + N - 1`` each follow one permutation ``pi_w``; ``pi_0``
    (never initialised in Alg. 3) is drawn at the start and serves ``t = 1 .. N - 1``. ``pi_w`` comes
    from the public ``seed`` and ``w``: no state, the same on every rank and after a resume.
    """
    if order not in ORDERS:
        raise ValueError(f"Expected `order` in {list(ORDERS)}, but got {order!r}")
    if t < 1 or n < 1:
        raise ValueError(f"Expected t >= 1 and N >= 1, but got t={t}, N={n}")
    if n == 1:
        return 1
    if order == "ascending":
        return ((t - 1) % n) + 1
    if order == "descending":
        return n - ((t - 1) % n)
    if order == "flip_flop":
        return n - abs(((t - 1) % (2 * n - 2)) - (n - 1))
    return int(random_permutation(seed, t // n, n)[t % n])


def random_permutation(seed: int, window: int, n: int) -> np.ndarray:
    """``pi_window = Shuffle([N])`` (values ``1..N``) from the public ``seed``."""
    sequence = np.random.SeedSequence([int(seed), int(window)], spawn_key=(BLOCK_ORDER_STREAM,))
    return np.random.default_rng(sequence).permutation(n) + 1


def sample_block(probabilities: Sequence[float], seed: int, t: int) -> int:
    """``j ~ Categorical(p)`` (Alg. 4), ``j`` in ``1..N``, from the public ``seed`` and step ``t``."""
    sequence = np.random.SeedSequence([int(seed), int(t)], spawn_key=(BLOCK_SAMPLING_STREAM,))
    p = np.asarray(probabilities, dtype=np.float64)
    return int(np.random.default_rng(sequence).choice(len(p), p=p / p.sum())) + 1


def softmax_probabilities(scores: Sequence[float], temperature: float) -> np.ndarray:
    """``p_i = exp(zbar_i / tau) / sum_k exp(zbar_k / tau)`` (Alg. 4), computed stably."""
    z = np.asarray(scores, dtype=np.float64) / temperature
    z = np.exp(z - z.max())
    return z / z.sum()


# ------------------------------------------------------------------------------ the engine
class BlockPerturbation:
    """An engine over ALL parameters that perturbs and updates only the active block.

    ``ZOSGD`` sees the full parameter list (so param groups, learning rates, weight decay and
    Lightning's step count work as for MeZO); every pass goes to the active block's own engine,
    built once by ``make(indices)`` and cached. Learning rates and weight decays are sliced to the
    block, so a step changes the active block's parameters and nothing else.

    Args:
        params: every trainable parameter, in the optimizer's (param-group) order.
        blocks: each block as indices into ``params``; disjoint and covering.
        make: builds the engine of one block from its parameter indices.
        names: the blocks' names (logs).
    """

    def __init__(self, params: Sequence[Tensor], blocks: Sequence[Sequence[int]],
                 make: Callable[[list[int]], object], names: Optional[Sequence[str]] = None) -> None:
        self.params = list(params)
        self.blocks = [sorted(int(i) for i in block) for block in blocks]
        flat = sorted(i for block in self.blocks for i in block)
        if flat != list(range(len(self.params))) or any(not block for block in self.blocks):
            raise ValueError("Blocks must be non-empty and hold every parameter exactly once")
        self.names = list(names) if names is not None else [str(i + 1) for i in range(len(self.blocks))]
        self._make = make
        self._engines: dict[int, object] = {}
        self.active = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def block_size(self, index: int) -> int:
        return sum(self.params[i].numel() for i in self.blocks[index])

    def block_params(self, index: Optional[int] = None) -> list[Tensor]:
        return [self.params[i] for i in self.blocks[self.active if index is None else index]]

    def activate(self, index: int) -> None:
        """Make block ``index`` (0-based) the active one; refused while a perturbation is pending."""
        if not 0 <= index < self.num_blocks:
            raise ValueError(f"Expected a block index in [0, {self.num_blocks}), but got {index}")
        if index != self.active and self.pending:
            raise RuntimeError("activate() while a perturbation is pending: restore or update first")
        self.active = index

    @property
    def engine(self):
        """The active block's engine (built on first use, then cached)."""
        if self.active not in self._engines:
            self._engines[self.active] = self._make(self.blocks[self.active])
        return self._engines[self.active]

    @property
    def pending(self) -> dict[int, float]:
        engine = self._engines.get(self.active)
        return engine.pending if engine is not None else {}

    @property
    def dim(self) -> int:
        return self.block_size(self.active)

    def perturb_(self, seed: int, scale: float) -> None:
        """``theta_Bj += scale * u(seed)`` (Alg. 2 on the active block)."""
        self.engine.perturb_(seed, scale)

    def restore_and_update_(self, coefficients: Optional[Mapping[int, float | Tensor]] = None, *,
                            lr: Sequence[float] | float = 0.0, weight_decay: Sequence[float] | float = 0.0,
                            extra_terms: Sequence[tuple] = ()) -> None:
        """The active block's fused restore-and-update (Alg. 1, last lines), rates sliced to the block."""
        if extra_terms:
            raise ValueError("Block-coordinate ZO adds no noise vector (extra_terms)")
        indices = self.blocks[self.active]
        engine = self.engine
        if not hasattr(engine, "offsets"):  # the chunked engine takes Python floats
            coefficients = {k: float(v) for k, v in (coefficients or {}).items()}
        engine.restore_and_update_(coefficients, lr=_slice(lr, indices), weight_decay=_slice(weight_decay, indices))

    def restore_(self) -> None:
        if self.pending:
            self.engine.restore_()

    def direction(self, seed: int) -> list[Tensor]:
        """``e_Bj(u(seed))``: the block's direction zero-padded to every parameter (tests, references)."""
        out = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        for i, u in zip(self.blocks[self.active], self.engine.direction(seed)):
            out[i] = u.float()
        return out

    def block_direction(self, seed: int) -> list[Tensor]:
        """``u(seed)`` on the active block only, shaped like its parameters (float32)."""
        return [u.float() for u in self.engine.direction(seed)]

    def direction_norm(self, seed: int) -> float:
        return self.engine.direction_norm(seed)


def _slice(value, indices: list[int]):
    if isinstance(value, (int, float)):
        return value
    values = list(value)
    return [values[i] for i in indices]


__all__ = ["BLOCK_ORDER_STREAM", "Block", "BlockPerturbation", "ORDERS", "PARTITIONS", "find_layer_stack",
           "groups_at_block_rates", "median_rate_factors", "partition", "random_permutation", "sample_block",
           "softmax_probabilities", "split_by_layer", "update_block_idx"]

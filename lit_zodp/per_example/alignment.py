"""The alignment check: is row ``i`` of a recorded call's output example ``i``'s alone?

The layer rules and the vmap fallback credit row ``i`` of a call to example ``i``. That holds when
only ``loss_i`` reaches row ``i`` of the call's output: then the gradient of ``loss_i`` through the
call is formed from row ``i`` alone, whatever the activations. A call's shape cannot tell: a
time-first layer (``nn.TransformerEncoderLayer(batch_first=False)``, ``[T, B, D]``) with ``T = B``,
or a shared ``[Q, D]`` table with ``Q = B``, has ``B`` leading rows that mix every example, and
crediting them per example gave 1.4-1.6 C in the second audit of this engine.

The check is exact up to rounding and shape-independent. Back-propagate ``sum_i loss_i`` and
``sum_i w_i loss_i`` with random weights ``w_i`` (signs times ``[1, 2)``). If only ``loss_r``
reaches row ``r``, its two gradients satisfy ``G_w[r] = w_r G_1[r]``. Otherwise
``G_w[r] - w_r G_1[r] = sum_{i != r} (w_i - w_r) dloss_i/dout[r]``, which is non-zero for almost
every ``w``. Rows are compared through ``K =`` :data:`PROJECTIONS` random bilinear projections, so
no gradient is kept beyond the call at hand: the root mean square over ``k`` of
``u_k^T (G_w[r] - w_r G_1[r]) v_k`` estimates ``||G_w[r] - w_r G_1[r]||_F`` (``E[(u^T E v)^2] =
||E||_F^2`` for standard Gaussian ``u, v``) and must be at most ``2 sqrt(eps) |w_r| ||G_1[r]||``, the
tolerance of the coverage check (:mod:`.coverage`) with ``||G_w[r]||`` taken as ``|w_r| ||G_1[r]||``,
which it is when the rows agree (so only the first pass takes norms). When they do not, ``G_w[r] -
w_r G_1[r] = E != 0`` passes only if its estimate falls below a bound that does not grow with ``E``:
probability 0 as ``||E||`` grows, and the two bounds differ by at most ``sqrt(eps) ||E||``. Why ``K``
pairs and not one: a single projection is ``||E||`` times a standard normal, whose tail refuses honest
rows. In bfloat16 the rounding of a deep backward leaves honest rows at up to 0.12-0.15 of the
tolerance (ViT-tiny, MiniLM, RoBERTa-base, GPT-2; ``benchmarks/ghost_check_margin.py``); one
projection reached 0.42-0.74 within 60 steps, and extrapolated to 0.2-2.6 refused honest steps per
10,000-step run. The mean of ``K = 8`` squares exceeds the tolerance only if ``chi2_8 > 8 / rho^2``
(``rho = 0.2``: ``chi2_8 > 200``, probability below ``1e-38``); and a mismatch of twice the tolerance
passes one row with probability 0.019 (``chi2_8 < 2``) instead of 0.38 (``|N| < 0.5``).
Cost: two backwards, on a batch whose call structure (with which calls are aligned by shape) is new
to the engine (and one per rechecked row, below).

**Layers with a rule are compared through what their rule credits** (stop 65; ``credited``: layers whose trainable
parameters are untransformed or projected). A row's norm is not the scale of what is credited from it: a Linear credits
``sum_t g_{r,t} a_{r,t}^T``, so a position with zero input and a large gradient widened the tolerance at the row's other
positions (2.26 C, red-team review 78, finding 4), and a layer called twice, on ``x`` and ``-x``, credits the sum of two
rows whose own parts cancel, leaving a batch-mate's part that each row held within tolerance (2.2 C, stop 65). So for a
rule layer each pass takes ``sum_p v_{p,k}^T G_{p,r} u_{p,k}`` over its trainable parameters ``p``, for ``K =``
:data:`CREDITED_PROJECTIONS` secret Gaussian pairs per parameter, with ``G_{p,r}`` the per-example gradient the rule
forms from the call's input and output gradient (:meth:`.samplers.Sampler.project`: from the rows for Linear and
Embedding, materialised a few rows at a time otherwise), summed over every call of the layer (layers sharing a
parameter, a tied weight, are one group: :class:`_Credited`). The gap and the tolerance are those above with
``||G_1[r]||`` estimated by the root mean square of the first pass's projections (``E[(v^T G u)^2] = ||G||_F^2``): a
batch-mate's part passes only below about ``2 sqrt(eps)`` of the example's credited gradient of the layer, hence of its
whole gradient, whatever the row's norm, and the clipped sum moves by at most about twice that share of ``C`` when it is
removed. A group that fails sends every call crediting it to the fallback. A projected weight (DP-GRAPE, GEP) is
compared through its projection: its directions are mapped by ``P`` (:meth:`_Credited.directions`). The rows are
projected in float64 (:func:`.samplers.wide_positions`): scaled per row in float32, a dead position set one factor's
scale and a live position's product underflowed to 0 in both passes (2.26 C, red-team review 79, finding 1). What this
leaves open: the vmap fallback's module calls (review 79, finding 3, 2.27 C) and layers with a parameter under a generic
rewrite (DOPE-SGD's recentring by a centre, ``g_i - c``, not linear in the rows) are still compared row by row, and an
unchecked step is not compared at all (review 78, finding 2).

A row whose exact gradient is 0 but whose computed one is its own rounding noise is not ``w_r`` times
its first-pass value: rounding is not linear in ``w_r``. A one-token sequence under a causal mask has a
softmax of one entry, whose score gradient is exactly 0; the fused (SDPA) backward forms it as
``P (dP - rowsum(dO O))``, a difference of two roundings of one value (OPT, ``[1, 6]``: ``||G_1[r]|| =
6.9e-11`` in ``q_proj``/``k_proj`` against ``5.7e-4`` for the six-token row, a gap of ``2.9e-10`` against a
tolerance of ``8.4e-14``). Scaling every loss by a power of two scales every rounding with it, so such a
row is rechecked (:func:`_rows_rechecked`): one more backward per failing row ``r``, at most
:data:`ROW_RECHECKS` of them, with ``w_r = +-4`` and fresh weights ``+-[1, 2)`` for every other example.
Example ``r``'s own part of its row is then exactly ``w_r G_1[r]`` (where the backward is deterministic and
nothing under- or overflows; otherwise the row stays failed, the safe answer), so the recheck's tolerance is
``2 eps |w_r| ||G_1[r]||``, not ``2 sqrt(eps) ...``: another example's part ``c_i`` leaves ``(w_i - w_r) c_i`` with
``|w_i - w_r| >= 2``, and passes only below about ``4 eps`` of the row. With the first comparison's tolerance the
recheck passed shares up to ``1.33 sqrt(eps)`` of each row, and the rescued rows' shares added up (red-team review
69: 1.0031 C in float32, 1.57 C under TF32's tolerances, ``B = 16``). The tolerance stays relative to the row's own
first-pass value, with no absolute floor and nothing taken from other rows, so a record with a large gradient widens
nothing for its batch-mates. Other examples' weights are fresh, secret and continuous: parts of several examples
cancel with probability 0, as in the first comparison.

The row norms and the gap are taken so that neither underflows nor overflows (:func:`_row_norms`,
:func:`_root_mean_square`; stop 64): a float32 sum of squares gave rows above ``1e19`` a tolerance of ``inf``, through
which another example's part of 1e-2 of the row passed, and rows below ``1e-22`` one of 0; float64 squares of subnormal
gaps measured 0, through which half of another example's row passed. Rows among the subnormals are rounded in absolute
steps and fail by their own rounding; compared through what is credited, an LSTM's early steps at 290 tokens in float32
are a negligible part of the hidden layers' sums over their calls and keep the rules (they went to the exact fallback
until stop 65), while a layer whose credited gradient is itself subnormal still goes there. Running both passes again
with every loss times a power of two compared rows that were not the ones credited: a record whose own part underflowed
to 0 in the step's backward, leaving only a batch-mate's share, agreed there (1.95 C, red-team review 78), so that was
withdrawn.

Examples whose loss is not finite are left out of both sums (``where``), and their rows are not
compared (their rows may be nan). A non-finite projection, a nan or a mismatch in another row reads as
misaligned, the safe answer: those parameters are recomputed on the whole module.

The weights and projections come from a generator seeded by the OS, so the check neither depends
on nor advances the user's seeded random streams.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch import Tensor

from lit_zodp.per_example.ghost import float64_norm_sq
from lit_zodp.per_example.rounding import working_eps
from lit_zodp.per_example.samplers import Sampler, sampler_for
from lit_zodp.per_example.tape import LayerCall, Tape
from lit_zodp.per_example.transforms import Projection
from lit_zodp.privacy.training_randomness import checks_own_draws, secret_cpu_generator

#: ``("layer" | "module", position in the tape's calls of that kind)``
CallKey = Tuple[str, int]


def _random_weights(losses: Tensor, generator: torch.Generator) -> Tensor:
    """``w_i = +-(1 + U[0, 1))``: distinct, bounded away from 0 (no division blows up the tolerance)."""
    with checks_own_draws():
        magnitude = 1.0 + torch.rand(len(losses), generator=generator, dtype=torch.float64)
        sign = torch.randint(0, 2, (len(losses),), generator=generator).to(torch.float64) * 2 - 1
    return (sign * magnitude).to(device=losses.device, dtype=losses.dtype)


#: Rows failing the weighted comparison rechecked with their own weight a power of two (module docstring), one
#: backward each; with more (a misaligned call fails every row) none is.
ROW_RECHECKS = 8

#: ``|w_r|`` in a row's recheck: a power of two, at least 2 from every other weight (``+-[1, 2)``).
RECHECK_WEIGHT = 4.0

#: Projection pairs ``(u_k, v_k)`` per row: the root mean square of ``K`` projections estimates the
#: gap's norm without one Gaussian's tail (module docstring).
PROJECTIONS = 8

#: Random directions per parameter in the comparison of what the rules credit: the tolerance's norm is estimated from
#: them too (module docstring).
CREDITED_PROJECTIONS = 16


def _projection_dtype(dtype: torch.dtype) -> torch.dtype:
    """The gradient's own dtype, so a bfloat16 gradient is not copied to float32: ``G[r] V`` is
    accumulated in float32 and rounded once to bfloat16 (``2^-8`` relative), far inside the tolerance
    ``2 sqrt(eps) = 2^-2.5``. Float16 is widened: the projection can overflow where ``G`` does not."""
    return torch.float32 if dtype == torch.float16 else dtype


class _RowSummaries:
    """Per row of each observed output gradient, ``u_k^T G[r] v_k`` for ``k < K`` (the row as
    positions x features; ``u_k, v_k`` Gaussian: a mean square of ``||G[r]||_F^2``; ``G[r] V`` then a
    weighted sum over positions, reading the gradient once), with ``U, V`` redrawn identically in every
    pass from ``(seed, T, D)``; with ``norms``, ``||G[r]||`` too (the pass compared against:
    :func:`_disagreeing` needs no other norm, which saves a read of every gradient). The hooks run
    between backward kernels: a few operations each, compared after the pass."""

    def __init__(self, keys: Dict[int, CallKey], seed: int, *, norms: bool = True,
                 credited: Optional["_Credited"] = None):
        self.keys, self.seed, self.norms, self.credited = keys, seed, norms, credited
        self.values: Dict[Tuple[CallKey, int], Tuple[Tensor, Optional[Tensor], float]] = {}
        self._drawn: Dict[tuple, Tuple[Tensor, Tensor, float]] = {}
        #: Per group of the credited calls' parameters (:class:`_Credited`): the sum over its calls and parameters of
        #: ``v_k^T G_i u_k``, and ``sqrt(eps)``.
        self._credited_sums: Dict[CallKey, Tuple[Tensor, float]] = {}
        #: The credited calls whose output gradient arrived.
        self.credited_seen: Set[CallKey] = set()

    def __call__(self, call: object, index: int, grad: Tensor) -> None:
        key = self.keys.get(id(call))
        if key is None or grad.dim() == 0:
            return
        if self.credited is not None and id(call) in self.credited.samplers:
            self._credit(call, key, grad)
            return
        u, v, eps = self._pairs(grad)
        rows = (grad if grad.dtype == v.dtype else grad.to(v.dtype)).reshape(grad.shape[0], u.shape[0], v.shape[0])
        norm = _row_norms(rows) if self.norms else None
        projected = (torch.matmul(rows, v).to(u.dtype) * u).sum(1)  # [B, K]
        self.values[(key, index)] = (projected, norm, eps)

    def _credit(self, call: LayerCall, key: CallKey, grad: Tensor) -> None:
        """Add the call's per-example gradients, projected on each parameter's directions, to the parameter's sums
        (:class:`_Credited`)."""
        credited = self.credited
        sampler = credited.samplers[id(call)]
        dtypes = [t.dtype for t in (grad, call.activation) if t.is_floating_point()]
        eps = working_eps(grad.device.type, *dtypes) ** 0.5
        for name, projected in sampler.project(call.module, call.activation, grad, credited.directions).items():
            group = credited.groups[id(getattr(call.module, name))]
            total, known = self._credited_sums.get(group, (None, 0.0))
            self._credited_sums[group] = (projected if total is None else total + projected, max(known, eps))
        self.credited_seen.add(key)

    def finish(self) -> None:
        """After the pass: each credited group's summaries, with the root mean square of its projections as the
        norm (an estimate of ``||G_i||``; module docstring)."""
        for group, (total, eps) in self._credited_sums.items():
            self.values[(group, 0)] = (total, _root_mean_square(total) if self.norms else None, eps)

    def _pairs(self, grad: Tensor) -> Tuple[Tensor, Tensor, float]:
        """``U [T, K]`` and ``V [D, K]`` for rows ``[T, D]`` of ``grad`` (``D`` its last dimension), drawn
        once per shape and pass (calls of one shape share them: each call's comparison is still against
        secret Gaussian pairs drawn independently of its gradients), and the tolerance's ``sqrt(eps)``
        (the projection is a matmul: TF32 operands)."""
        found = (grad.shape[1:], grad.dtype, grad.device)
        if found not in self._drawn:
            features = grad.shape[-1] if grad.dim() > 1 else 1
            positions = math.prod(grad.shape[1:]) // features
            wide = torch.promote_types(grad.dtype, torch.float32)
            generator = torch.Generator(device=grad.device)
            generator.manual_seed((self.seed + 1_000_003 * positions + 7919 * features) % 2**63)
            with checks_own_draws():
                u = torch.randn(positions, PROJECTIONS, generator=generator, device=grad.device, dtype=wide)
                v = torch.randn(features, PROJECTIONS, generator=generator, device=grad.device, dtype=wide)
            eps = working_eps(grad.device.type, grad.dtype) ** 0.5
            self._drawn[found] = (u, v.to(_projection_dtype(grad.dtype)), eps)
        return self._drawn[found]


def _row_norms(rows: Tensor) -> Tensor:
    """``||rows[r]||`` in float64, neither under- nor overflowing where the values do not: a float32 sum of squares is 0
    below about ``1e-22`` and ``inf`` above ``1e19`` (a tolerance of 0 refused an honest row's own rounding; one of
    ``inf`` passed any gap), a float64 one 0 below ``1e-160``. Float64 rows are scaled by their largest value."""
    flat = rows.flatten(1)
    if flat.dtype != torch.float64 or flat.shape[1] == 0:
        return float64_norm_sq(flat).sqrt()
    return _scaled_norm(flat)


def _scaled_norm(x: Tensor) -> Tensor:
    """The norm over the last dimension, taken of ``x`` divided by its largest magnitude and multiplied back: float64
    squares of values below ``1e-154`` are 0 (and of subnormal ones always)."""
    largest = x.abs().amax(-1)
    return largest * torch.linalg.vector_norm(x / torch.where(largest > 0, largest, 1.0)[..., None], dim=-1)


def _backward_observed(total: Tensor, tape: Tape, summaries: _RowSummaries, edges: List) -> None:
    tape.observer = summaries
    try:
        torch.autograd.backward(total, inputs=edges, retain_graph=True)
    finally:
        tape.observer = None
    summaries.finish()


class _Credited:
    """The shape-aligned calls of layers with a rule, compared through what their rule credits (module docstring):
    ``samplers`` (call id -> its rule), ``groups`` (parameter id -> its group's key ``("rule", k)``: a layer's
    parameters, layers sharing a parameter joined), ``members`` (a group's key -> the calls crediting it) and
    ``directions`` (:data:`.samplers.Directions`, drawn from the secret ``seed`` per parameter: the same in every
    pass). A group's projections are its parameters' added up: those of its concatenated per-example gradient on a
    concatenated direction. Why a layer and not a parameter: an exactly-zero per-example gradient is compared in its
    rounding noise, which does not scale with the weight (an attention key's bias, to which the softmax is blind: every
    MiniLM key bias failed in bfloat16), while a batch-mate's share of a layer's gradient is one of the whole clipped
    gradient too."""

    def __init__(self, tape: Tape, candidates: Iterable[CallKey], seed: int,
                 projections: Dict[int, Optional[Projection]]):
        self.seed, self.projections = seed, projections
        self.samplers: Dict[int, Sampler] = {}
        self.groups: Dict[int, CallKey] = {}
        self.members: Dict[CallKey, Set[CallKey]] = {}
        self._index: Dict[int, int] = {}
        self._drawn: Dict[tuple, Tuple[Tensor, Optional[Tensor]]] = {}
        layers: Dict[int, Tuple[List[int], Set[CallKey]]] = {}
        for kind, position in candidates:
            call = tape.layer_calls[position] if kind == "layer" else None
            sampler = sampler_for(call.module) if call is not None else None
            if sampler is None:
                continue
            params = [id(p) for p in call.module.parameters(recurse=False) if p.requires_grad]
            if not all(p in projections for p in params):
                continue  # (a generic rewrite: compared row by row)
            self.samplers[id(call)] = sampler
            layers.setdefault(id(call.module), (params, set()))[1].add((kind, position))
            for param in params:
                self._index.setdefault(param, len(self._index))
        self._join(layers.values())

    def _join(self, layers: Iterable[Tuple[List[int], Set[CallKey]]]) -> None:
        """Groups: each layer's parameters, and layers sharing one joined (a tied weight)."""
        for params, calls in layers:
            key = ("rule", len(self.members))
            merged = {self.groups[p] for p in params if p in self.groups}
            self.members[key] = set(calls).union(*(self.members.pop(old) for old in merged))
            for param, group in list(self.groups.items()):
                if group in merged:
                    self.groups[param] = key
            self.groups.update(dict.fromkeys(params, key))

    def directions(self, param: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Optional[Tensor]]:
        """``v [S_0, K]`` and ``u [S_1 * ..., K]`` (``None`` for a vector): Gaussian, or for a projected weight
        ``R = P^T G`` (``G P``) ``v = P v'`` (``u = P u'``) with ``v'`` (``u'``) Gaussian in the projection's ``r``
        dimensions, so ``v^T G u = v'^T R u'`` (``E[(v'^T R u')^2] = ||R||^2``): what is credited is the projection."""
        found = (id(param), dtype)
        if found not in self._drawn:
            generator = torch.Generator(device=param.device)
            generator.manual_seed((self.seed + 1_000_003 * self._index[id(param)]) % 2**63)
            projection = self.projections.get(id(param))
            first = param.shape[0] if param.dim() >= 2 else param.numel()
            rest = param.numel() // max(first, 1)
            rows, columns = first, rest
            if projection is not None:
                rows, columns = (projection.matrix.shape[1], rest) if projection.side == "left" else (
                    first, projection.matrix.shape[1])
            with checks_own_draws():
                v = torch.randn(rows, CREDITED_PROJECTIONS, generator=generator, device=param.device, dtype=dtype)
                u = (torch.randn(columns, CREDITED_PROJECTIONS, generator=generator, device=param.device, dtype=dtype)
                     if param.dim() >= 2 else None)
            if projection is not None:
                matrix = projection.matrix.to(device=param.device, dtype=dtype)
                v, u = (matrix @ v, u) if projection.side == "left" else (v, matrix @ u)
            self._drawn[found] = (v, u)
        return self._drawn[found]

    def calls_of(self, keys: Iterable[CallKey]) -> Set[CallKey]:
        """``keys`` with each group's key replaced by the calls crediting it."""
        return {call for key in keys for call in (self.members[key] if key in self.members else (key,))}


def misaligned_calls(tape: Tape, losses: Tensor, candidates: Iterable[CallKey], *,
                     credited: Optional[Dict[int, Optional[Projection]]] = None) -> Set[CallKey]:
    """The ``candidates`` (calls aligned by shape) whose output rows are reached by other examples' losses. With
    ``credited`` (parameter id -> ``None`` or the projection of its per-example gradients), the calls of layers with a
    rule whose trainable parameters are all there are compared through the per-example gradients credited (module
    docstring); the other calls row by row.

    Leaves the graph retained and the tape's recordings untouched.
    """
    calls = {"layer": tape.layer_calls, "module": tape.module_calls}
    keys = {id(calls[kind][position]): (kind, position) for kind, position in candidates}
    if not keys or len(losses) < 2:
        return set()  # one example: every row is its own
    edges = [e for kind, position in keys.values() for e in calls[kind][position].output_edges()]
    ok = torch.isfinite(losses.detach())
    zero = torch.zeros((), dtype=losses.dtype, device=losses.device)
    generator = secret_cpu_generator()
    weights = _random_weights(losses, generator)
    with checks_own_draws():
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    credited = _Credited(tape, keys.values(), seed, credited) if credited is not None else None
    unit, weighted = (_RowSummaries(keys, seed, norms=norms, credited=credited) for norms in (True, False))
    _backward_observed(torch.where(ok, losses, zero).sum(), tape, unit, edges)
    _backward_observed(torch.where(ok, weights * losses, zero).sum(), tape, weighted, edges)
    observed = {key for key, _ in unit.values} | {key for key, _ in weighted.values}
    failed, whole, agree = _row_agreement(unit.values, weighted.values, observed, weights, ok)
    if agree is not None and not agree.all():

        def again(w: Tensor) -> dict:
            summaries = _RowSummaries(keys, seed, norms=False, credited=credited)  # unit's pairs: the same seed
            _backward_observed(torch.where(ok, w * losses, zero).sum(), tape, summaries, edges)
            return summaries.values

        agree = agree | _rows_rechecked(~agree, whole, unit.values, losses, ok, generator, again)
    failing = failed | _calls_failing(whole, agree)
    if credited is None:
        return failing
    return credited.calls_of(failing) | (unit.credited_seen ^ weighted.credited_seen)


def _rows_rechecked(failing: Tensor, whole: List, unit: dict, losses: Tensor, ok: Tensor,
                    generator: torch.Generator, again: Callable[[Tensor], dict]) -> Tensor:
    """``[len(whole), B]``: which of the ``failing`` rows agree when their own example's weight is
    ``+-`` :data:`RECHECK_WEIGHT` and every other example's a fresh ``+-[1, 2)`` (module docstring), one
    backward per row (``again(weights)``: its summaries, with ``unit``'s projections). None past
    :data:`ROW_RECHECKS` rows."""
    rescued = torch.zeros_like(failing)
    rows = failing.any(0).nonzero().flatten().tolist()
    if len(rows) > ROW_RECHECKS:
        return rescued
    for r in rows:
        weights = _random_weights(losses, generator)
        with checks_own_draws():
            weights[r] = RECHECK_WEIGHT * (1 - 2 * int(torch.randint(0, 2, (1,), generator=generator)))
        _, seen, agree = _row_agreement(unit, again(weights), {entry[0] for entry in whole}, weights, ok, exact=True)
        if seen == whole and agree is not None:
            rescued[:, r] = failing[:, r] & agree[:, r]
    return rescued


def _calls_failing(whole: List, agree: Optional[Tensor]) -> Set[CallKey]:
    if agree is None:
        return set()
    return {whole[i][0] for i in (~agree.all(1)).nonzero().flatten().tolist()}


def _disagreeing(unit: dict, weighted: dict, calls: Iterable[CallKey], weights: Tensor, ok: Tensor) -> Set[CallKey]:
    """The ``calls`` with ``G_w[r] != w_r G_1[r]`` on some output, rows of non-finite examples aside,
    in one comparison (:func:`_row_agreement`)."""
    failed, whole, agree = _row_agreement(unit, weighted, calls, weights, ok)
    return failed | _calls_failing(whole, agree)


def _root_mean_square(diff: Tensor) -> Tensor:
    """The root mean square over the last dimension, scaled by its largest value: float64 squares of subnormal float64
    differences are 0 (a gap of ``1e-322`` measured 0 and passed a tolerance of 0)."""
    return _scaled_norm(diff) / math.sqrt(diff.shape[-1])


def _row_agreement(unit: dict, weighted: dict, calls: Iterable[CallKey], weights: Tensor,
                   ok: Tensor, exact: bool = False) -> Tuple[Set[CallKey], List, Optional[Tensor]]:
    """The calls with an output reached in one pass only (they disagree), the outputs reached in both
    (``whole``, sorted) and ``[len(whole), B]``: whether row ``r`` of each has ``G_w[r] = w_r G_1[r]``
    (the row of a non-finite example agrees: not compared). The gap is the root mean square over the
    projections and the tolerance takes the norms of ``unit`` alone (module docstring); a gap that is not
    finite disagrees (``inf <= inf``)."""
    calls = set(calls)
    entries = [entry for entry in set(unit) | set(weighted) if entry[0] in calls]
    whole = sorted(entry for entry in entries if entry in unit and entry in weighted
                   and unit[entry][0].shape == weighted[entry][0].shape
                   and unit[entry][0].shape in ((*weights.shape, PROJECTIONS), (*weights.shape, CREDITED_PROJECTIONS)))
    failed = {entry[0] for entry in set(entries) - set(whole)}
    if not whole:
        return failed, whole, None
    w = weights.to(device=weights.device, dtype=torch.float64)
    gap = torch.stack([_root_mean_square(weighted[entry][0].to(weights.device).double()
                                         - w[:, None] * unit[entry][0].to(weights.device).double()) for entry in whole])
    n1 = torch.stack([unit[entry][1].to(weights.device) for entry in whole]).double()
    eps = torch.tensor([unit[entry][2] for entry in whole], dtype=torch.float64, device=weights.device)
    if exact:  # (a recheck at a power-of-two weight: the row's own part scales exactly; ``eps``, not its root)
        eps = eps.square()
    agree = (gap <= 2 * eps[:, None] * w.abs() * n1) & gap.isfinite() & n1.isfinite() | ~ok.to(weights.device)
    return failed, whole, agree

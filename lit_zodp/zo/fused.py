"""The fused perturbation engine: one read and one write of every parameter per pass (DESIGN.md, GPU).

The direction is generated in registers from Philox keyed by ``(seed, global element offset)``
(Salmon et al. 2011; :func:`lit_zodp.zo.philox.normal`, Triton's ``tl.randn4x`` four elements per
call; the kernel's Philox, :func:`_rand4x`, is ``tl.rand4x`` bit for bit with one widening multiply where
Triton's takes two), so a pass over all parameters is one Triton launch per parameter dtype and touches no
scratch memory. Same passes as :class:`lit_zodp.zo.perturbation.PerturbationEngine` (the MeZO
seed trick with the restore fused into the update); a new direction law, not the chunked one.

Layout. Every parameter gets a global offset in a flat layout (in order, each tensor starting at a
multiple of 4, so a Philox call never straddles two tensors); element ``i`` of tensor ``t`` takes
``z(seed, offset_t + i)``, independent of blocks, launches and dtype grouping. Offsets are int64:
models beyond ``2^32`` elements use Philox's second counter word. Per dtype, a device table holds
one row per tensor (address, numel, global offset, first block) and one int32 per block names its
tensor: a launch covers all tensors of that dtype, with no per-chunk Python loop.

Arithmetic. Parameters (fp32, bf16, fp16) are loaded and computed in float32 and rounded to
nearest-even once on store. A perturbation adds ``a = s z`` with its last bit set (``_sticky``), so
``theta + a`` is never a rounding tie while ``|a| < |theta| / 8``. A pass first removes each pending
perturbation and rounds to the parameter dtype, then applies ``shrink * theta + sum_k a_k z_k``. So
a restore (``+s, -s``) and MeZO's ``+s, -2s, +s`` give back ``theta`` bitwise wherever the
perturbation lost no bit (``theta`` and ``theta + a`` in one binade, ``theta`` not a power of two,
``|a| < |theta| / 8``: 97-98% of elements at ``|a| ~ 1% |theta|``; for 16-bit parameters also bar
the float32 sum's own rounding landing on a midpoint, ~1e-5 of elements), and within one ulp of
``max(|theta|, |theta + a|)`` (two ulps for the three-pass cycle) everywhere. Where a binade is
crossed upwards the map ``theta -> theta + a`` is many-to-one: no restore can be exact there. The
update then starts from the restored ``theta``, as if the probe had not happened.

Scalars. Seeds go in an int64 device table, the per-term scales in a float32 one; coefficients may
be device tensors (stacked on the device, no host synchronisation). Learning rates and weight
decays come per parameter (param groups) as a cached float32 table.

The CPU reference (``backend="reference"``) runs the same float32 arithmetic in torch with
:mod:`lit_zodp.zo.philox`; with ``math="numpy"`` it matches the Triton kernel run by
``TRITON_INTERPRET=1`` bitwise. On CUDA Box-Muller takes the hardware's ``lg2.approx`` (a series near
``u1 = 1``) and ``cos/sin.approx`` (:func:`_pair_to_normal`: ``z`` within 5.7e-6 of exact functions; tests
allow 1e-5 against the reference), and bf16 rounds with ``cvt.rn`` (the same bits as the reference's
integer rounding). The compiled kernel (sm_90, checked without a GPU in ``tests/zo/test_fused.py``) keeps
each thread's elements in its registers: rows of one 128-bit vector (:func:`row_length`), one or two
Philox calls per row, no shared memory and no local memory: 31-46 instructions per element per
direction in its loop (fp32 31, bf16 33 at the default tile), 67-91 before the hardware functions, the
register rows and the widening multiplies (``benchmarks/kernel_instructions.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor

from lit_zodp.transfer import to_device_without_waiting
from lit_zodp.zo import philox
from lit_zodp.zo.directions import flat_view, unflattened_like
from lit_zodp.zo.perturbation import _per_param

try:  # Triton ships with CUDA builds of torch; the reference path needs none of it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
try:  # the hardware log2/cos/sin (``fast_math``); without it the kernel keeps libdevice's software ones
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - an older or partial triton
    libdevice = None

#: Global offsets of tensors are multiples of this (one Philox call = four consecutive elements).
ALIGN = 4
#: Elements per Triton program (a multiple of ``ALIGN``); 4 warps -> 16 elements per thread.
DEFAULT_BLOCK = 2048
DEFAULT_WARPS = 4
#: Elements per step of the reference path's loop over a tensor.
REFERENCE_CHUNK = 1 << 16
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: ``fast_math``: below this ``v = 1 - u1``, Box-Muller's ``-2 ln u1`` comes from its series in ``v``, not
#: from the hardware ``lg2.approx`` (whose absolute error would move a small ``r``; ``_minus_two_log``).
LOG_SERIES_BELOW = 2.0 ** -6


def triton_available() -> bool:
    return triton is not None


def interpreting() -> bool:
    """Whether this module's kernels run under Triton's CPU interpreter.

    Triton decides when a kernel is decorated, i.e. when this module is imported: ``TRITON_INTERPRET=1``
    must be set before ``triton`` is first imported (tests do it in a subprocess).
    """
    return triton is not None and type(_zo_pass_kernel).__name__ == "InterpretedFunction"


def global_offsets(params: Sequence[Tensor], align: int = ALIGN) -> list[int]:
    """Offsets of ``params`` in the flat layout: in order, each rounded up to a multiple of ``align``."""
    offsets, cursor = [], 0
    for p in params:
        offsets.append(cursor)
        cursor += -(-p.numel() // align) * align
    return offsets


@dataclass
class _Terms:
    """One pass's directions: seeds, the pending scale to remove, a plain scale and a coefficient."""

    seeds: list[int]
    pending: list[float]
    scales: list[float]
    coefficients: list  # floats or 0-dim tensors (device-resident coefficients)

    def __len__(self) -> int:
        return len(self.seeds)

    @property
    def restores(self) -> bool:
        return any(p != 0.0 for p in self.pending)


class FusedPerturbation:
    """``theta += s z(seed)`` and fused restore-and-update passes, one read/write per parameter per pass.

    The interface mirrors :class:`~lit_zodp.zo.perturbation.PerturbationEngine` (``pending``,
    ``perturb_``, ``restore_and_update_``, ``restore_``, ``direction``) for the Gaussian law.

    Args:
        params: contiguous parameters on one device, in a fixed order (the order defines offsets).
        offsets: global offsets (multiples of 4, non-overlapping); default :func:`global_offsets`.
        backend: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"reference"`` (torch
            with :mod:`lit_zodp.zo.philox`), or ``"auto"``: Triton on CUDA when available.
        math: the reference's transcendental functions (:func:`lit_zodp.zo.philox.box_muller`).
        block, num_warps: Triton tile size and warps per program.
        fast_math: on CUDA, the hardware's ``lg2/cos/sin.approx`` in Box-Muller (``False``: libdevice's
            software ``log/cos/sin``, about twice the instructions per element; the same law, ``z`` within
            5.7e-6).
    """

    def __init__(self, params: Sequence[Tensor], *, offsets: Sequence[int] | None = None,
                 backend: str = "auto", math: str = "exact", block: int = DEFAULT_BLOCK,
                 num_warps: int = DEFAULT_WARPS, fast_math: bool = True) -> None:
        self.params = list(params)
        _check_params(self.params)
        self.offsets = [int(o) for o in offsets] if offsets is not None else global_offsets(self.params)
        _check_offsets(self.params, self.offsets)
        if block % ALIGN or block & (block - 1):
            raise ValueError(f"Expected `block` a power of two >= {ALIGN}, but got {block}")
        if num_warps < 1 or num_warps & (num_warps - 1):
            raise ValueError(f"Expected `num_warps` a power of two, but got {num_warps}")
        self.backend = _resolve_backend(backend, self.params[0].device)
        self.math, self.block, self.num_warps = math, block, num_warps
        # no PTX under the interpreter; ROCm's libdevice has no fast log2/cos/sin
        self.fast_math = (bool(fast_math) and libdevice is not None and not interpreting()
                          and torch.version.hip is None)
        self.hw_round = not interpreting()  # bf16 by cvt.rn (the interpreter's conversion truncates)
        self.pending: dict[int, float] = {}
        self._groups: list[_Group] | None = None
        self._layout_key: tuple = ()
        self._rates: dict[tuple, tuple[Tensor, Tensor]] = {}

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def dim(self) -> int:
        return sum(p.numel() for p in self.params)

    # ----------------------------------------------------------------------------- passes
    @torch.no_grad()
    def perturb_(self, seed: int, scale: float) -> None:
        """``theta += scale * z(seed)``; a pending perturbation of ``seed`` is first removed and rounded."""
        seed = int(seed)
        pending = self.pending.get(seed, 0.0)
        if float(scale) == 0.0:
            return
        total = _settle(pending + float(scale), float(scale))
        self._run(_Terms([seed], [pending], [total], [0.0]), lrs=None, decays=None)
        self._track(seed, total)

    @torch.no_grad()
    def restore_and_update_(self, coefficients: Mapping[int, float | Tensor] | None = None, *,
                            lr: Sequence[float] | float = 0.0,
                            weight_decay: Sequence[float] | float = 0.0) -> None:
        """One pass: remove every pending perturbation, then ``theta <- (1-lr*wd) theta - lr sum_k c_k z_k``.

        ``lr``, ``weight_decay``: scalars or one value per parameter (param groups). Coefficients may
        be 0-dim tensors on the parameters' device (no host synchronisation).
        """
        coefficients = dict(coefficients or {})
        seeds = sorted(set(self.pending) | {int(s) for s in coefficients})
        terms = _Terms(seeds, [self.pending.get(s, 0.0) for s in seeds], [0.0] * len(seeds),
                       [coefficients.get(s, 0.0) for s in seeds])
        lrs, decays = _per_param(lr, len(self.params)), _per_param(weight_decay, len(self.params))
        decaying = any(a * b != 0.0 for a, b in zip(lrs, decays))
        if terms.restores or any(_maybe_nonzero(c) for c in terms.coefficients) or decaying:
            self._run(terms, lrs=lrs, decays=decays)
        self.pending.clear()

    def restore_(self) -> None:
        """Undo every pending perturbation (bitwise in the common case, see the module docstring)."""
        if self.pending:
            self.restore_and_update_()

    def direction(self, seed: int) -> list[Tensor]:
        """``z(seed)`` shaped like each parameter, float32 (references and tests)."""
        return [unflattened_like(philox.normal_range(seed, o, p.numel(), self.math, p.device), p)
                for p, o in zip(self.params, self.offsets)]

    def _track(self, seed: int, total: float) -> None:
        if total == 0.0:
            self.pending.pop(seed, None)
        else:
            self.pending[seed] = total

    # ----------------------------------------------------------------------------- dispatch
    def _run(self, terms: _Terms, lrs: list[float] | None, decays: list[float] | None) -> None:
        if not len(terms) and lrs is None:
            return
        if self.backend == "reference":
            _reference_pass(self.params, self.offsets, terms, lrs, decays, self.math)
            return
        seeds, scalars = _term_tables(terms, self.device)
        for group in self._layout():
            rates = self._rate_tables(group, lrs, decays)
            _launch(group, seeds, scalars, len(terms), rates, terms.restores, self.block, self.num_warps,
                    self.fast_math, self.hw_round)

    def _layout(self) -> list["_Group"]:
        """Device tables per dtype, rebuilt if a parameter moved (``.to()``, ``.data =``)."""
        key = tuple((p.data_ptr(), p.dtype, p.device) for p in self.params)
        if self._groups is None or key != self._layout_key:
            _check_params(self.params)
            self._groups = _build_groups(self.params, self.offsets, self.block)
            self._layout_key, self._rates = key, {}
        return self._groups

    def _rate_tables(self, group: "_Group", lrs, decays) -> tuple[Tensor, Tensor] | None:
        if lrs is None:
            return None
        key = (group.dtype, tuple(lrs[i] for i in group.members), tuple(decays[i] for i in group.members))
        if key not in self._rates:
            if len(self._rates) > 64:
                self._rates.clear()
            table = _host_to_device([key[1], key[2]], torch.float32, self.device)
            self._rates[key] = (table[0].contiguous(), table[1].contiguous())
        return self._rates[key]


def _settle(total: float, scale: float) -> float:
    """A pending scale that cancels to rounding noise (``+s - 2s + s``) is exactly zero."""
    return 0.0 if abs(total) <= 1e-12 * max(1.0, abs(scale)) else total


def _maybe_nonzero(c) -> bool:
    return isinstance(c, Tensor) or float(c) != 0.0


def _check_params(params: Sequence[Tensor]) -> None:
    if not params:
        raise ValueError("The fused perturbation engine needs at least one parameter")
    device = params[0].device
    for i, p in enumerate(params):
        if p.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"Parameter {i} has dtype {p.dtype}; expected one of {SUPPORTED_DTYPES}")
        if p.device != device:
            raise ValueError(f"All parameters must be on one device, but got {device} and {p.device}")
        flat_view(p)  # (one dense buffer, written in memory order from its data pointer; refused otherwise)


def _check_offsets(params: Sequence[Tensor], offsets: Sequence[int]) -> None:
    if len(offsets) != len(params):
        raise ValueError(f"Expected {len(params)} offsets, but got {len(offsets)}")
    spans = sorted((o, o + p.numel()) for o, p in zip(offsets, params))
    for (start, end), (next_start, _) in zip(spans, spans[1:] + [(None, None)]):
        if start < 0 or start % ALIGN:
            raise ValueError(f"Offsets must be non-negative multiples of {ALIGN}, but got {start}")
        if next_start is not None and next_start < end:
            raise ValueError("Parameter offsets overlap: two elements would share a direction entry")


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if triton_available() and device.type == "cuda" else "reference"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' needs the `triton` package")
        if device.type != "cuda" and not interpreting():
            raise RuntimeError("backend='triton' runs on CUDA tensors, or on CPU under TRITON_INTERPRET=1")
        return backend
    if backend == "reference":
        return backend
    raise ValueError(f"Expected `backend` in ('auto', 'triton', 'reference'), but got {backend!r}")


# --------------------------------------------------------------------------------- reference
def _f32(value) -> Tensor:
    if isinstance(value, Tensor):
        return value.detach().to(device="cpu", dtype=torch.float32).reshape(())
    return torch.tensor(float(value), dtype=torch.float32)


def _reference_pass(params, offsets, terms: _Terms, lrs, decays, math: str) -> None:
    """The kernel's arithmetic in torch, tensor by tensor and chunk by chunk (float32 throughout)."""
    pending = [_f32(p) for p in terms.pending]
    scales = [_f32(s) for s in terms.scales]
    coefficients = [_f32(c) for c in terms.coefficients]
    for index, (p, offset) in enumerate(zip(params, offsets)):
        lr = _f32(lrs[index] if lrs is not None else 0.0)
        shrink = _f32(1.0) - lr * _f32(decays[index] if decays is not None else 0.0)
        alphas = [s - lr * c for s, c in zip(scales, coefficients)]
        flat = flat_view(p)
        for start in range(0, flat.numel(), REFERENCE_CHUNK):
            chunk = flat[start:start + REFERENCE_CHUNK]
            chunk.copy_(_reference_chunk(chunk, offset + start, terms.seeds, pending, alphas, shrink,
                                         terms.restores, lrs is not None, math))


def _sticky(a: Tensor) -> Tensor:
    """``a`` (float32) with its lowest significand bit set; zero stays zero.

    A perturbation ``a`` with an odd last bit never puts ``theta + a`` exactly half-way between two
    parameter values when ``|a| < |theta| / 2``, so round-to-nearest-even cannot send the restore
    ``(theta + a) - a`` to the wrong neighbour (a tie). Moves ``a`` by at most one ulp of ``a``.
    """
    odd = (a.view(torch.int32) | 1).view(torch.float32)
    return torch.where(a == 0, a, odd)


def _signed_zero(x: Tensor) -> Tensor:
    """``+0.0`` or ``-0.0`` with the sign of ``x``: the sum of terms starts here, so ``x + 0`` keeps a
    ``-0.0`` parameter (and the kernel keeps its accumulator in the parameters' register layout)."""
    return (x.view(torch.int32) & -(1 << 31)).view(torch.float32)


def _reference_chunk(chunk: Tensor, offset: int, seeds, pending, alphas, shrink, restores: bool,
                     update_pass: bool, math: str) -> Tensor:
    x = chunk.to(torch.float32)
    update = _signed_zero(x)
    for seed, p, alpha in zip(seeds, pending, alphas):
        z = philox.normal_range(seed, offset, chunk.numel(), math, chunk.device)
        if restores:
            x = (x - _sticky(p * z)).to(chunk.dtype).to(torch.float32)
        term = alpha * z
        update = update + (term if update_pass else _sticky(term))
    return (shrink * x + update).to(chunk.dtype)


# --------------------------------------------------------------------------------- triton
@dataclass
class _Group:
    """The launch over all tensors of one dtype: tensor rows, block owners, member indices."""

    dtype: torch.dtype
    members: list[int]
    table: Tensor  # int64 (T, 4): address, numel, global offset, first block
    owners: Tensor  # int32 (blocks,): the row each program works on
    aligned: bool  # every address 16-byte aligned (a vectorisation hint)


def _build_groups(params, offsets, block: int) -> list[_Group]:
    groups = []
    for dtype in SUPPORTED_DTYPES:
        members = [i for i, p in enumerate(params) if p.dtype == dtype and p.numel() > 0]
        if not members:
            continue
        rows, owners, first = [], [], 0
        for row, i in enumerate(members):
            blocks = -(-params[i].numel() // block)
            rows.append([params[i].data_ptr(), params[i].numel(), offsets[i], first])
            owners.extend([row] * blocks)
            first += blocks
        device = params[members[0]].device
        groups.append(_Group(dtype, members, _host_to_device(rows, torch.int64, device),
                             _host_to_device(owners, torch.int32, device),
                             all(params[i].data_ptr() % 16 == 0 for i in members)))
    return groups


def _term_tables(terms: _Terms, device: torch.device) -> tuple[Tensor, Tensor]:
    """int64 seeds (K,) and float32 scalars (3K,): the K pending scales, the K plain scales, the K coefficients.

    One host-to-device copy per pass: the seeds and the scalars' float32 bits travel in one int64
    buffer, of which both tables are views. Device-resident coefficients are copied into their row on
    the device (one small kernel each, no host synchronisation; before: a stack, a second host-to-device
    copy and a concatenation).
    """
    k = len(terms)
    on_device = [i for i, c in enumerate(terms.coefficients) if isinstance(c, Tensor)]
    coefficients = [0.0 if i in on_device else float(c) for i, c in enumerate(terms.coefficients)]
    words = 2 * -(-3 * k // 4)  # the scalars, padded to 16 bytes: both tables start 16-byte aligned, as
    host = torch.zeros(words + k, dtype=torch.int64)  # Triton specialises pointers on that
    host[:words].view(torch.float32)[:3 * k] = torch.tensor(terms.pending + terms.scales + coefficients,
                                                             dtype=torch.float32)
    host[words:] = torch.tensor([philox.seed_as_int64(s) for s in terms.seeds], dtype=torch.int64)
    packed = to_device_without_waiting(host, device)
    scalars, seeds = packed[:words].view(torch.float32)[:3 * k], packed[words:]
    for i in on_device:  # one small device copy each (a step has one per direction)
        scalars[2 * k + i].copy_(terms.coefficients[i].detach().reshape(()))
    return seeds, scalars


def _host_to_device(rows, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small table from Python values onto ``device`` WITHOUT waiting for the device's queue."""
    return to_device_without_waiting(torch.tensor(rows, dtype=dtype), device)


_TL_DTYPES = {}


def _tl_dtype(dtype: torch.dtype):
    if not _TL_DTYPES:
        _TL_DTYPES.update({torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16})
    return _TL_DTYPES[dtype]


def _launch(group: _Group, seeds: Tensor, scalars: Tensor, num_terms: int, rates, restores: bool,
            block: int, num_warps: int, fast_math: bool, hw_round: bool) -> None:
    lrs, decays = rates if rates is not None else (scalars, scalars)  # unused when UPDATE is False
    grid = (group.owners.numel(),)
    _zo_pass_kernel[grid](group.table, group.owners, seeds, scalars, num_terms, lrs, decays,
                          DTYPE=_tl_dtype(group.dtype), BLOCK=block, RESTORE=restores,
                          UPDATE=rates is not None, ALIGNED=group.aligned, FAST_MATH=fast_math,
                          HW_ROUND=hw_round, ROW=row_length(group.dtype, block, num_warps),
                          num_warps=num_warps)


def row_length(dtype: torch.dtype, block: int, num_warps: int) -> int:
    """Elements a kernel row holds: one 128-bit access (4 fp32, 8 bf16/fp16), at most a thread's share.

    A row is 1 or 2 Philox calls (:func:`_normal_rows`). Rows of one 16-byte vector let each thread load,
    compute and store its elements in its own registers (shorter rows give 64-bit accesses, longer
    ones an exchange through shared memory: seen in the sm_90 PTX).
    """
    per_thread = block // (32 * num_warps)
    return max(ALIGN, min(16 // dtype.itemsize, per_thread))


if triton is not None:
    _TWO_PI = tl.constexpr(philox.TWO_PI)  # the float32 angle's scale, as in ``tl.pair_uniform_to_normal``
    _MINUS_TWO_LN2 = tl.constexpr(-1.3862943611198906)  # -2 ln 2: -2 ln u = -2 ln 2 log2 u
    _LOG_SERIES_BELOW = tl.constexpr(LOG_SERIES_BELOW)

    @triton.jit
    def _round_as(x, DTYPE: tl.constexpr, HW_ROUND: tl.constexpr):
        """float32 ``x`` rounded to the nearest ``DTYPE`` value (ties to even), kept in float32.

        bf16: ``HW_ROUND`` (compiled kernels) takes the hardware's ``cvt.rn.bf16.f32``, one instruction;
        otherwise (Triton's interpreter, whose conversion truncates) the same rounding in integer
        arithmetic, about six (a GPU test checks that both give the same bits).
        """
        if DTYPE == tl.bfloat16:
            if HW_ROUND:
                return x.to(tl.bfloat16).to(tl.float32)
            else:
                bits = x.to(tl.uint32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
                return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
        elif DTYPE == tl.float16:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x

    @triton.jit
    def _store_as(x, DTYPE: tl.constexpr, HW_ROUND: tl.constexpr):
        """float32 -> ``DTYPE``, rounding to nearest even (bf16: as :func:`_round_as`)."""
        if DTYPE == tl.bfloat16 and not HW_ROUND:
            bits = _round_as(x, DTYPE, HW_ROUND).to(tl.uint32, bitcast=True)
            bits = tl.where(x == x, bits, bits | 0x400000)  # a NaN stays a NaN (quiet), not an infinity
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(DTYPE)

    @triton.jit
    def _load_f32(x, DTYPE: tl.constexpr):
        """``DTYPE`` -> float32 (exact); bf16 by moving its bits to the high half."""
        if DTYPE == tl.bfloat16:
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(tl.float32)

    @triton.jit
    def _minus_two_log_near_one(v):
        """``-2 ln(1 - v)`` for ``0 <= v < 2^-6`` from its series ``2 sum_k v^k / k`` (4 terms, Horner):
        truncation below ``v^4 / 5 < 2e-8`` relative, and float32 rounding a few ulps."""
        return v * (2.0 + v * (1.0 + v * (0.6666666666666666 + v * 0.5)))

    @triton.jit
    def _minus_two_log(u1, FAST_MATH: tl.constexpr):
        """``-2 ln u1`` for ``u1`` in ``[1e-7, 1)``: Box-Muller's ``r^2``.

        ``FAST_MATH`` (CUDA): the hardware's ``lg2.approx`` (one special-function instruction against ~20
        for libdevice's ``logf``), which CUDA documents within ``2^-22`` absolute on ``[1/2, 2]`` and 2 ulps
        elsewhere. Near ``u1 = 1`` that absolute error would move a vanishing ``r`` by up to 3e-4, or make
        ``r^2`` negative; there (``v = 1 - u1 < LOG_SERIES_BELOW``, ``v`` exact for ``u1 >= 1/2``) ``r^2``
        comes from the series in ``v``. So ``|dr| <= 2 ln 2 2^-22 / (2 r) <= 1.1e-6`` where ``r >= 0.177``
        (``u1`` in ``[1/2, 1 - 2^-6]``), and ``r`` moves by about 1e-7 relative below ``u1 = 1/2``.
        """
        if FAST_MATH:
            v = 1.0 - u1
            hardware = _MINUS_TWO_LN2 * libdevice.fast_log2f(u1)
            return tl.where(v < _LOG_SERIES_BELOW, _minus_two_log_near_one(v), hardware)
        else:
            return -2.0 * tl.log(u1)

    @triton.jit
    def _pair_to_normal(u1, u2, FAST_MATH: tl.constexpr):
        """Box-Muller as ``tl.pair_uniform_to_normal``: ``r = sqrt(-2 log u1)``, ``(r cos th, r sin th)``.

        ``FAST_MATH`` (CUDA): the hardware's ``lg2.approx`` (:func:`_minus_two_log`) and ``cos/sin.approx``
        (one special-function instruction each, against ~25 for a software sine), which CUDA documents on
        ``[-pi, pi]`` (absolute error: ``__cosf`` 2^-21.19, ``__sinf`` 2^-21.41). The angle is the
        reference's ``t = fl(c u2)`` (``c = fl(2 pi)``, an unfused multiply), moved to ``t - c`` (exact:
        ``t`` is in ``[c/2, c]``) when ``u2 >= 1/2``: off the true period by ``c - 2 pi = 1.7e-7``. Against
        exact functions of the same ``u1`` and ``t``, ``z`` moves by at most 5.7e-6 where ``r`` is largest
        (``r = 5.68``: sine 3.4e-6, ``sqrt.approx`` (3 ulps, in both variants) 1.4e-6, log 0.65e-6, the
        product's rounding 0.24e-6) and 1.3e-6 near ``r = 0.18``, the log's switch.
        """
        u1 = tl.maximum(1.0e-7, u1)
        r = tl.sqrt(_minus_two_log(u1, FAST_MATH))
        if FAST_MATH:
            t = libdevice.mul_rn(u2, _TWO_PI)  # not fused into t - c below
            th = tl.where(u2 >= 0.5, t - _TWO_PI, t)
            return r * libdevice.fast_cosf(th), r * libdevice.fast_sinf(th)
        else:
            th = _TWO_PI * u2
            return r * tl.cos(th), r * tl.sin(th)

    @triton.jit
    def _mulhilo(a, B: tl.constexpr):
        """``(umulhi(a, B), a * B)`` of uint32 ``a`` from ONE 32x32 -> 64-bit product (``mul.wide.u32``)."""
        p = a.to(tl.uint64) * B
        return (p >> 32).to(tl.uint32), p.to(tl.uint32)

    @triton.jit
    def _rand4x(seed, offset):
        """``tl.rand4x(seed, offset)`` (Philox4x32-10 on counter ``(offset, 0, 0)``, four uniforms), bit for bit,
        its multiplies each one widening product."""
        seed = tl.cast(seed, tl.uint64)  # a seed of 1 arrives as a constant (Triton specialises it; tl.to_tensor is 3.8+)
        k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        c0 = offset.to(tl.uint32)
        c2 = c0 * 0
        c3 = c0 * 0
        if tl.constexpr(offset.dtype.primitive_bitwidth) > 32:
            c1 = (offset >> 32).to(tl.uint32)
        else:
            c1 = c0 * 0
        for _ in tl.static_range(10):
            hi_b, lo_b = _mulhilo(c2, 0xCD9E8D57)
            hi_a, lo_a = _mulhilo(c0, 0xD2511F53)
            c0 = hi_b ^ c1 ^ k0
            c2 = hi_a ^ c3 ^ k1
            c1 = lo_b
            c3 = lo_a
            k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
            k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
        return (tl.uint_to_uniform_float(c0), tl.uint_to_uniform_float(c1), tl.uint_to_uniform_float(c2),
                tl.uint_to_uniform_float(c3))

    @triton.jit
    def _randn4x(seed, counters, FAST_MATH: tl.constexpr):
        """``tl.randn4x``: four normals per Philox call (with the choice of sine and cosine)."""
        u1, u2, u3, u4 = _rand4x(seed, counters)
        n1, n2 = _pair_to_normal(u1, u2, FAST_MATH)
        n3, n4 = _pair_to_normal(u3, u4, FAST_MATH)
        return n1, n2, n3, n4

    @triton.jit
    def _normal_rows(seed, first, CALLS: tl.constexpr, FAST_MATH: tl.constexpr):
        """``z`` for rows of ``4 * CALLS`` consecutive elements; row ``r`` starts at counter ``first[r]``
        and counter ``first[r] + c`` gives its elements ``4c .. 4c + 3``.

        ``tl.join`` adds a minor axis, so the rows are built from the minor index up (counter, then
        output ``2a + b``): every element stays in the thread that computed it.
        """
        a1, a2, a3, a4 = _randn4x(seed, first, FAST_MATH)
        if CALLS == 1:
            z = tl.join(tl.join(a1, a3), tl.join(a2, a4))  # [r, a, b] = output 2a + b
        else:
            tl.static_assert(CALLS == 2)
            b1, b2, b3, b4 = _randn4x(seed, first + 1, FAST_MATH)
            z = tl.join(tl.join(tl.join(a1, b1), tl.join(a3, b3)), tl.join(tl.join(a2, b2), tl.join(a4, b4)))
        return tl.reshape(z, (first.shape[0], 4 * CALLS))

    @triton.jit
    def _sticky_tl(a):
        """``a`` with its lowest significand bit set (zero stays zero): see :func:`_sticky`."""
        odd = (a.to(tl.int32, bitcast=True) | 1).to(tl.float32, bitcast=True)
        return tl.where(a == 0.0, a, odd)

    @triton.jit
    def _combine(x, first, seeds, scalars, num_terms, lr, shrink, DTYPE: tl.constexpr, RESTORE: tl.constexpr,
                 UPDATE: tl.constexpr, FAST_MATH: tl.constexpr, HW_ROUND: tl.constexpr, ROW: tl.constexpr):
        """Remove each pending ``p_k z_k`` (rounded to ``DTYPE``), then ``shrink x + sum_k a_k z_k``."""
        # +-0 with the sign of x (:func:`_signed_zero`): derived from x, the sum lives in x's registers
        # (a constant zero got another layout, and every z crossed shared memory to reach it)
        update = (x.to(tl.uint32, bitcast=True) & 0x80000000).to(tl.float32, bitcast=True)
        for k in range(num_terms):
            z = _normal_rows(tl.load(seeds + k), first, ROW // 4, FAST_MATH)
            if RESTORE:
                x = _round_as(x - _sticky_tl(tl.load(scalars + k) * z), DTYPE, HW_ROUND)
            term = (tl.load(scalars + num_terms + k) - lr * tl.load(scalars + 2 * num_terms + k)) * z
            if not UPDATE:
                term = _sticky_tl(term)
            update += term
        return shrink * x + update

    @triton.jit
    def _zo_pass_kernel(table, owners, seeds, scalars, num_terms, lrs, decays, DTYPE: tl.constexpr,
                        BLOCK: tl.constexpr, RESTORE: tl.constexpr, UPDATE: tl.constexpr,
                        ALIGNED: tl.constexpr, FAST_MATH: tl.constexpr, HW_ROUND: tl.constexpr,
                        ROW: tl.constexpr):
        """One ``BLOCK`` of one tensor: read once, apply every term, write once."""
        pid = tl.program_id(0)
        row = table + 4 * tl.load(owners + pid).to(tl.int64)
        base = tl.load(row).to(tl.pointer_type(DTYPE))
        if ALIGNED:
            base = tl.multiple_of(base, 16)
        numel = tl.load(row + 1)
        start = (pid - tl.load(row + 3)) * BLOCK
        rows: tl.constexpr = BLOCK // ROW
        first = ((tl.load(row + 2) + start) >> 2) + (ROW // 4) * tl.arange(0, rows)  # each row's first counter
        if UPDATE:
            owner = tl.load(owners + pid).to(tl.int64)
            lr = tl.load(lrs + owner)
            shrink = 1.0 - lr * tl.load(decays + owner)
        else:
            lr = 0.0
            shrink = 1.0
        offs = start + ROW * tl.arange(0, rows)[:, None] + tl.arange(0, ROW)[None, :]
        if start + BLOCK <= numel:  # full block: no mask, vectorisable
            x = _load_f32(tl.load(base + offs), DTYPE)
            y = _combine(x, first, seeds, scalars, num_terms, lr, shrink, DTYPE, RESTORE, UPDATE, FAST_MATH,
                         HW_ROUND, ROW)
            tl.store(base + offs, _store_as(y, DTYPE, HW_ROUND))
        else:
            mask = offs < numel
            x = _load_f32(tl.load(base + offs, mask=mask, other=0.0), DTYPE)
            y = _combine(x, first, seeds, scalars, num_terms, lr, shrink, DTYPE, RESTORE, UPDATE, FAST_MATH,
                         HW_ROUND, ROW)
            tl.store(base + offs, _store_as(y, DTYPE, HW_ROUND), mask=mask)


__all__ = ["FusedPerturbation", "global_offsets", "interpreting", "triton_available"]

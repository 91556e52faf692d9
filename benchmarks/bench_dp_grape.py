#!/usr/bin/env python
"""DP-GRAPE vs DP-Adam vs naive DP-GaLore (and Opacus DP-Adam): memory and throughput (DP-GRAPE paper Sec. 5,
Table 2 and Table 7), side by side in one process.

For each model and batch size, every method trains its own copy of the same model on the same fixed batch (clip 1,
sigma 1, dropout off; on ViT ``cls_token``/``pos_embed`` frozen for every method, since no Opacus rule covers them):

* ``dpgrape_<mode>``: :class:`~lit_zodp.algorithms.DPGRAPE` (rank ``r``, ``F`` steps per subspace), per-example
  gradients of every projected ``nn.Linear`` formed from projected rows in the backward (``B x r x n_l``).
* ``dpadam_<mode>``: :class:`~lit_zodp.algorithms.DPAdam` (``B x m_l x n_l``).
* ``dpgalore_<mode>``: :class:`~lit_zodp.algorithms.DPGaLore` (naive DP-GaLore, Alg. 5: DP-Adam's per-example
  gradients, then an SVD of every projected layer's released gradient every ``F`` steps).
* ``opacus_adam_hooks`` / ``opacus_adam_ghost``: Opacus ``PrivacyEngine.make_private`` with ``torch.optim.Adam``
  (``poisson_sampling=False``), hooks mode or ghost clipping.

``<mode>`` is the engine's ``grad_mode`` (``--grad-modes hooks,ghost``): ``hooks`` materialises every per-example
gradient (the paper's setting: its Table 2 is about that storage), ``ghost`` keeps norms only (two backwards),
``bookkeeping`` norms and sums from the kept rows (one backward).

Measured per method (all methods in this one process, interleaved, their order rotating each repetition):

* **Per-example gradient storage**: the bytes of the per-example gradients the engine holds when it clips (the
  tensors of its ``_Batch.dense`` at ``_clip_and_sum``: ``B x r x n_l`` for a projected layer, ``B x m_l x n_l``
  otherwise, plus the unprojected tensors; ``ghost`` mode holds none), beside the paper's formula
  ``4 B (r sum n_l + unprojected)`` vs ``4 B d``. For Opacus, the bytes of every ``p.grad_sample`` after the backward.
* **Peak step memory** above what was allocated before the step: on CUDA ``torch.cuda.max_memory_allocated`` (and
  ``max_memory_reserved``, the paper's measure) after ``reset_peak_memory_stats``; on the CPU the peak of the
  bytes allocated during the step through torch's CPU allocator, replayed from the allocation events of
  ``torch.profiler.profile(profile_memory=True)`` over one steady step (live tensors only: no allocator caching,
  no library code; the profiled step is not timed).
* **Optimizer state** (the Adam moments: ``2 d`` floats vs ``2 (r sum n_l + unprojected)``; DP-GaLore's SVD
  projectors apart), read from the optimizer after a step.
* **Step time**: ours through a real Lightning ``Trainer`` (a fresh fit per repetition whose first step, with the
  fit-start privacy checks and the ``t = 0`` projector draw / SVD, is reported apart); the timer wraps
  ``training_step``. Opacus: forward, backward, clip, noise, Adam step, ``zero_grad``. Median over repetitions,
  samples/s = B / median; DP-GRAPE/DP-Adam is the median of per-repetition (paired) ratios.
* **Projector renewal** (every ``F`` steps, outside the steady steps above): DP-GRAPE's draw of all ``P_l`` (Philox
  Gaussians) and DP-GaLore's SVD of every projected layer, timed alone; the table adds them amortised over ``F``.

Usage::

    python benchmarks/bench_dp_grape.py --device cuda                    # ViT-Base 224/16 + RoBERTa-large (GPU)
    python benchmarks/bench_dp_grape.py --device cuda --models roberta_large --grad-modes hooks,bookkeeping
    python benchmarks/bench_dp_grape.py --models vit_base --vit-depth 2 --img-size 32 --patch-size 4 \\
        --batches 8,16,32 --methods dpgrape,dpadam,opacus_adam_hooks --grad-modes hooks --device cpu \\
        --out benchmarks/results/bench_dp_grape_cpu_vitb2               # CPU: 2-block ViT-Base (~15 min, 2 cores)
    python benchmarks/bench_dp_grape.py --models roberta_large --roberta-layers 2 --seq-len 32 --batches 8 \\
        --methods dpgrape,dpadam --grad-modes hooks,bookkeeping --repeats 2 --steps-per-repeat 1 --device cpu \\
        --out benchmarks/results/bench_dp_grape_cpu_roberta2            # CPU: 2-layer RoBERTa-large
    python benchmarks/bench_dp_grape.py --tiny                           # seconds: a 1-block ViT-Base, CPU

On a busy CPU the SVDs of naive DP-GaLore take minutes per renewal (every fit's first step, and the renewal
timing): leave ``dpgalore`` out of long CPU runs, or run it alone at one batch size.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench_dpzero as bd  # noqa: E402  (light at import: heavy imports happen in its functions)
import bench_first_order as bfo  # noqa: E402  (light at import too)
from _common import (command_line, finish_meta, fmt, machine_info, median_of, probe_call,  # noqa: E402
                     probe_timed, resolve_device, results_stem, setup_worker, sync, write_results)

MODELS = ("vit_base", "roberta_large")
ALGOS = ("dpgrape", "dpadam", "dpgalore")
OPACUS = ("opacus_adam_hooks", "opacus_adam_ghost")
DEFAULT_METHODS = ("dpgrape", "dpadam", "dpgalore", "opacus_adam_hooks")
#: The paper's ranks: 64 for ViT, 16 for RoBERTa-large (Sec. 5).
DEFAULT_RANK = {"vit_base": 64, "roberta_large": 16}
#: On CUDA (an H200's 139 GiB): DP-Adam's B x d per-example gradients of RoBERTa-large are 1.4 GB per example.
DEFAULT_BATCHES = {"vit_base": "16,32,64", "roberta_large": "8,16,32"}
#: The verbs of a step timed inside it: the engine (forward, backward, per-example gradients, clip, sum), the release
#: (noise), the optimizer step, and the projectors of the step (DP-GRAPE's lookup, DP-GaLore's SVD at t mod F = 0).
PHASES = ("engine", "release", "apply", "projectors")
CLIP, SIGMA, LR, DELTA = 1.0, 1.0, 1e-6, 1e-5

#: ViT-Base (``vit_base_patch16_224``: width 768, 12 blocks, 12 heads, MLP 3072), random init.
VIT_BASE = "vit_base_patch16_224"


# =====================================================================================
# Models
# =====================================================================================

def build(args, model: str, batch: int, device):
    """``(backbone, inputs, targets, dataset)``: random-init ViT-Base (timm), or RoBERTa-large from its configuration
    as ``bench_first_order`` builds it (``--roberta-layers``, ``--seq-len``)."""
    if model == "roberta_large":
        return bfo.build(args, model, batch, device)
    if model != "vit_base":
        raise ValueError(f"unknown model {model!r}; choose from {MODELS}")
    import torch

    from lit_zodp.backbones import TimmClassifier

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    extra = {k: v for k, v in (("depth", args.vit_depth), ("embed_dim", args.vit_width),
                               ("num_heads", args.vit_heads)) if v}
    backbone = TimmClassifier(VIT_BASE, num_classes=10, img_size=args.img_size, patch_size=args.patch_size, **extra)
    inputs = torch.randn(batch, 3, args.img_size, args.img_size, generator=g)
    targets = torch.randint(0, 10, (batch,), generator=g)
    backbone, inputs, targets = backbone.to(device), inputs.to(device), targets.to(device)
    return backbone, inputs, targets, bd.FixedBatch(inputs, targets)


def prepare(backbone, model: str):
    """Dropout off and, on ViT, ``cls_token``/``pos_embed`` frozen: the same function and trainable set for all."""
    from torch import nn

    for m in backbone.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    if model == "vit_base":
        backbone.model.cls_token.requires_grad_(False)
        backbone.model.pos_embed.requires_grad_(False)
    backbone.train()
    return backbone


# =====================================================================================
# Measurements
# =====================================================================================

def tensor_bytes(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def optimizer_state_bytes(optimizer) -> dict:
    """Bytes of the optimizer's state: Adam's moments (``exp_avg``, ``exp_avg_sq``) and, apart, anything else
    (DP-GaLore's SVD projectors); scalar step counters are left out."""
    moments = other = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if key in ("exp_avg", "exp_avg_sq"):
                moments += tensor_bytes(value)
            elif key != "step":
                other += tensor_bytes(value)
    return {"moments": moments, "other": other}


def cpu_peak_during(fn) -> int:
    """Peak of the bytes allocated (and not yet freed) on the CPU during ``fn()``, from the allocation events of
    ``torch.profiler`` (torch's CPU allocator: live tensors, no caching; see ``profile_ghost_memory.py``)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()

    def walk(nodes):
        for n in nodes:
            yield n
            yield from walk(n.children)

    allocs = [n for n in walk(prof.profiler.kineto_results.experimental_event_tree())
              if n.tag == _EventType.Allocation and str(n.extra_fields.device) == "cpu"]
    allocs.sort(key=lambda n: n.start_time_ns)
    current = peak = 0
    for n in allocs:
        current += n.extra_fields.alloc_size
        peak = max(peak, current)
    return peak


def measured_peak(fn, device) -> dict:
    """``fn()``'s peak memory above what was allocated before it (see the module doc)."""
    import torch

    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()  # the other methods' freed blocks: the reserved peak is then this step's
        before, reserved_before = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        peak_reserved = torch.cuda.max_memory_reserved(device)
        return {"peak_step": torch.cuda.max_memory_allocated(device) - before,
                "peak_allocated": torch.cuda.max_memory_allocated(device), "peak_reserved": peak_reserved,
                "reserved_before": reserved_before, "reserved_step": peak_reserved - reserved_before}
    return {"peak_step": cpu_peak_during(fn)}


def make_ours(backbone, algo: str, grad_mode: str, rank: int, frequency: int):
    """DPGRAPE / DPAdam / DPGaLore whose ``training_step`` is timed, with the memory readings of its steps."""
    from lit_zodp.algorithms import DPAdam, DPGaLore, DPGRAPE
    from lit_zodp.projection import SeededProjections

    base = {"dpgrape": DPGRAPE, "dpadam": DPAdam, "dpgalore": DPGaLore}[algo]

    class Measured(probe_timed(base)):
        abstract = True  # not registered in lit_zodp.algorithms.ALGORITHMS

        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.measure_memory = False
            self.memory: dict = {}
            self.engine_bytes: list[int] = []
            clip_and_sum = self.engine._clip_and_sum

            def recorded(losses, batch, clip, tape, *args):
                self.engine_bytes.append(tensor_bytes(list(batch.dense.values())))
                return clip_and_sum(losses, batch, clip, tape, *args)

            self.engine._clip_and_sum = recorded
            self.phase_times: dict[str, list[float]] = {p: [] for p in PHASES}

        def _phase(self, name, fn, *a):
            sync(self.device)
            start = time.perf_counter()
            out = fn(*a)
            sync(self.device)
            self.phase_times[name].append(time.perf_counter() - start)
            return out

        def private_gradient(self, inputs, targets):
            return self._phase("engine", super().private_gradient, inputs, targets)

        def release_gradient(self, clipped):
            return self._phase("release", super().release_gradient, clipped)

        def apply_gradient(self, gradient):  # DP-Adam
            return self._phase("apply", super().apply_gradient, gradient)

        def apply_projected(self, gradients, projections):  # DP-GRAPE, DP-GaLore
            return self._phase("apply", super().apply_projected, gradients, projections)

        def projections_at(self, step):  # DP-GRAPE
            return self._phase("projectors", super().projections_at, step)

        def galore_projections(self, released):  # DP-GaLore
            return self._phase("projectors", super().galore_projections, released)

        def training_step(self, batch, batch_idx):
            if not (self.measure_memory and batch_idx == 1):  # step 0: the fit-start checks, the t = 0 projectors
                return super().training_step(batch, batch_idx)
            del self.engine_bytes[:]
            out = None

            def step():
                nonlocal out
                out = super(Measured, self).training_step(batch, batch_idx)

            self.memory = measured_peak(step, self.device)
            self.memory["per_example"] = sum(self.engine_bytes)
            self.memory["optimizer"] = optimizer_state_bytes(self.optimizers().optimizer)
            if isinstance(getattr(self, "projections", None), SeededProjections):  # DP-GRAPE's P_l of this period
                matrices = [p.matrix for p in self.projections._matrices.values()]
                self.memory["optimizer"]["other"] += tensor_bytes(matrices)
            return out

    Measured.__name__ = Measured.__qualname__ = f"Measured{base.__name__}"
    extra = {"rank": rank, "projection_frequency": frequency} if algo != "dpadam" else {}
    return Measured(backbone, lr=LR, clip=CLIP, noise_multiplier=SIGMA, delta=DELTA, seed=0, grad_mode=grad_mode,
                    **extra)


def make_opacus_adam(backbone, dataset, batch: int, mode: str):
    """Opacus DP-Adam (``make_private`` with ``torch.optim.Adam``): ``(step, per_sample_bytes, optimizer)``;
    ``per_sample_bytes()`` reads the ``grad_sample`` bytes the last step held after its backward."""
    import torch
    from opacus import PrivacyEngine
    from torch import nn
    from torch.utils.data import DataLoader

    params = [p for p in backbone.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=LR)
    common = dict(module=backbone, optimizer=optimizer, data_loader=DataLoader(dataset, batch_size=batch),
                  noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson_sampling=False, grad_sample_mode=mode)
    criterion = nn.CrossEntropyLoss()
    if mode == "ghost":
        model, optimizer, criterion, _ = PrivacyEngine().make_private(criterion=criterion, **common)
    else:
        model, optimizer, _ = PrivacyEngine().make_private(**common)
    inputs, targets = dataset.inputs, dataset.targets
    held = [0]

    def step() -> None:
        loss = criterion(model(inputs), targets)
        loss.backward()
        held[0] = sum(tensor_bytes(getattr(p, "grad_sample", None)) for p in params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, (lambda: held[0]), optimizer.original_optimizer


class Runner:
    """One method on its own copy of the model: ``run(k)`` -> ``k`` steady step times; ``memory()``."""

    def __init__(self, method: str, backbone, dataset, batch: int, device, args, rank: int) -> None:
        self.method, self.device, self.dataset, self.batch = method, device, dataset, batch
        self.first_times: list[float] = []
        self.first_indices: list[int] = []  # indices of the fits' first steps in the module's step records
        if method in OPACUS:
            self.step, self.per_sample, self.optimizer = make_opacus_adam(backbone, dataset, batch,
                                                                          method.rsplit("_", 1)[1])
            self.module = None
        else:
            algo, mode = method.rsplit("_", 1)
            self.module = make_ours(backbone, algo, mode, rank, args.projection_frequency).to(device)

    def run(self, k: int) -> list[float]:
        if self.module is None:
            return [probe_call(self.step, self.device)[0] for _ in range(k)]
        m = self.module
        first = bd.steady_fit(m, self.dataset, k, self.device)  # fresh Trainer; module back on device
        self.first_times.append(m.step_times[first])
        self.first_indices.append(first)
        return m.step_times[first + 1:]

    def phases(self) -> dict:
        """Median seconds of each verb over the steady steps timed so far (ours; the fits' first steps left out)."""
        if self.module is None:
            return {}
        m, first = self.module, set(self.first_indices)
        return {p: median_of([t for i, t in enumerate(m.phase_times[p]) if i not in first]) for p in PHASES}

    def memory(self) -> dict:
        if self.module is None:
            self.step()  # the optimizer's state exists from here on
            out = measured_peak(self.step, self.device)
            out["per_example"] = self.per_sample()
            out["optimizer"] = optimizer_state_bytes(self.optimizer)
            return out
        m = self.module
        m.measure_memory = True
        try:
            bd.dpzero_fit(m, self.dataset, 2, self.device)
        finally:
            m.measure_memory = False
        return dict(m.memory)


def sizes(backbone, rank: int) -> dict:
    """``d``, the released size ``r sum n_l + unprojected`` and the projected count, from the layer shapes (the
    projected set of :func:`lit_zodp.projection.projected_names`, as DP-GRAPE chooses it)."""
    from lit_zodp.algorithms.dp_grape import UNPROJECTED
    from lit_zodp.projection import projected_names

    projected = set(projected_names(backbone, rank, UNPROJECTED))
    d = released = count = 0
    for name, p in backbone.named_parameters():
        if not p.requires_grad:
            continue
        d += p.numel()
        if name in projected:
            count += 1
            released += rank * max(p.shape)  # P [m, r] on the smaller side m: R [r, n]
        else:
            released += p.numel()
    return {"d": d, "released": released, "projected_tensors": count}


def renewal_times(backbone, rank: int, device, repeats: int, algos) -> dict:
    """Seconds of one renewal of every projector: DP-GRAPE's Philox draws and DP-GaLore's SVDs (on random
    gradients of the projected layers' shapes), median of ``repeats``."""
    import torch

    from lit_zodp.algorithms.dp_grape import UNPROJECTED
    from lit_zodp.projection import SeededProjections, projected_names, projection_side

    names = projected_names(backbone, rank, UNPROJECTED)
    params = dict(backbone.named_parameters())
    grads = [torch.randn(params[n].shape, device=device) for n in names]

    def draw():
        proj = SeededProjections(names, rank, 100)
        proj.run_seed = 0
        proj.at_step(0)
        for n in names:
            proj.projection(n, params[n])

    def svd():
        for g in grads:
            u, _, vh = torch.linalg.svd(g, full_matrices=False)
            (u[:, :rank] if projection_side(g.shape) == "left" else vh[:rank].T).contiguous()

    out = {"dpgrape_draw": None, "dpgalore_svd": None}
    for key, fn in (("dpgrape_draw", draw), ("dpgalore_svd", svd)):
        if key.split("_")[0] not in algos:  # (the SVDs alone take minutes on a busy CPU)
            continue
        fn()
        out[key] = median_of([probe_call(fn, device)[0] for _ in range(repeats)])
    return out


def run_config(args, model: str, batch: int, device) -> dict:
    """Every method on (model, batch), interleaved; then each method's memory step."""
    rank = args.rank or DEFAULT_RANK[model]
    base, _, _, dataset = build(args, model, batch, device)
    base = prepare(base, model)
    methods = []
    for name in args.methods.split(","):
        methods += [name] if name in OPACUS else [f"{name}_{mode}" for mode in args.grad_modes.split(",")]
    row = {"model": model, "batch": batch, "rank": rank, "F": args.projection_frequency, **sizes(base, rank),
           "times": {}, "first_times": {}, "rep_of": {}, "memory": {}, "errors": {}}
    runners = {}
    for method in methods:
        try:
            runners[method] = Runner(method, copy.deepcopy(base), dataset, batch, device, args, rank)
        except Exception as err:  # record why this method cannot run this configuration
            row["errors"][method] = f"{type(err).__name__}: {err}"[:600]
    row["renewal"] = renewal_times(base, rank, device, max(args.repeats, 1),
                                   {m.split("_")[0] for m in methods})
    del base
    for method in runners:
        row["times"][method], row["rep_of"][method] = [], []
    for rep in range(-args.warmup, args.repeats):
        live = list(runners)
        shift = rep % max(len(live), 1)
        for method in live[shift:] + live[:shift]:
            try:
                samples = runners[method].run(args.steps_per_repeat)
            except Exception as err:
                row["errors"][method] = f"{type(err).__name__}: {err}"[:600]
                del runners[method]
                continue
            if rep >= 0:
                row["times"][method] += samples
                row["rep_of"][method] += [rep] * len(samples)
    for method, runner in list(runners.items()):
        row["first_times"][method] = runner.first_times[args.warmup:]
        row.setdefault("phases", {})[method] = runner.phases()
        if runner.module is not None and runner.module.engine.last_recomputed:  # the torch.func fallback ran
            recomputed = sorted(runner.module.engine.last_recomputed)
            row["errors"][f"{method} (note)"] = f"recomputed by torch.func: {recomputed}"
        if args.no_memory:
            continue
        try:
            row["memory"][method] = runner.memory()
        except Exception as err:
            row["errors"][method] = f"memory: {type(err).__name__}: {err}"[:600]
    del runners
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
    return row


# =====================================================================================
# Report
# =====================================================================================

def paired_ratio(row: dict, num: str, den: str):
    """Median over repetitions of (num's median step in that repetition / den's)."""
    ratios = []
    for rep in sorted(set(row["rep_of"].get(num, [])) & set(row["rep_of"].get(den, []))):
        a = median_of([t for t, r in zip(row["times"][num], row["rep_of"][num]) if r == rep])
        b = median_of([t for t, r in zip(row["times"][den], row["rep_of"][den]) if r == rep])
        if a and b:
            ratios.append(a / b)
    return statistics.median(ratios) if ratios else None


def summarize(row: dict) -> list[dict]:
    """One line per method of ``row``."""
    lines = []
    amortised = {"dpgrape": row["renewal"]["dpgrape_draw"], "dpgalore": row["renewal"]["dpgalore_svd"]}
    for method in row["times"]:
        step = median_of(row["times"][method])
        mem = row["memory"].get(method, {})
        algo, _, mode = method.rpartition("_")
        renewal = (amortised.get(algo) or 0.0) / row["F"]
        predicted = (row["released"] if algo == "dpgrape" else row["d"]) * row["batch"] * 4
        if mode in ("ghost", "bookkeeping"):  # norms and sums from the rows: no per-example gradient is held
            predicted = 0
        adam = "dpadam_" + mode
        lines.append({
            "method": method, "step_s": step, "samples_per_s": row["batch"] / step if step else None,
            "renewal_per_step_s": renewal,
            "samples_per_s_with_renewal": row["batch"] / (step + renewal) if step else None,
            "first_step_s": median_of(row["first_times"].get(method)),
            "vs_dpadam": paired_ratio(row, method, adam) if adam in row["times"] and method != adam else None,
            "per_example_bytes": mem.get("per_example"), "per_example_predicted": predicted,
            "peak_step_bytes": mem.get("peak_step"), "peak_reserved_bytes": mem.get("peak_reserved"),
            "reserved_step_bytes": mem.get("reserved_step"),
            "moments_bytes": (mem.get("optimizer") or {}).get("moments"),
            "projector_bytes": (mem.get("optimizer") or {}).get("other"),
        })
    return lines


def mib(x):
    return fmt(None if x is None else x / 2**20, ".1f")


def render(rows: list[dict], meta: dict) -> str:
    cuda = meta["device"].startswith("cuda")
    out = [f"# DP-GRAPE vs DP-Adam vs naive DP-GaLore ({meta['device']}"
           f"{', ' + meta['cuda_name'] if meta.get('cuda_name') else ''})", "",
           f"`{meta['command']}`", "",
           f"torch {meta['machine']['torch']}, opacus {meta['machine']['opacus']}, {meta['threads']} threads; "
           f"clip {CLIP}, sigma {SIGMA}; {meta['repeats']} repetitions x {meta['steps_per_repeat']} steady steps "
           f"(median); {meta.get('total_wall_s', 0):.0f} s in all.", "",
           "Per-example: bytes of the per-example gradients held at the clip (Opacus: `grad_sample`); *predicted*: "
           "`4 B (r sum n_l + unprojected)` for DP-GRAPE, `4 B d` otherwise (0 in ghost and bookkeeping modes). "
           "Peak step: "
           + ("`max_memory_allocated` above the allocation before the step; reserved step: `max_memory_reserved` (the "
              "paper's measure) above the reserve before the step, after `empty_cache` (the whole process's "
              "reserve, every method's model in it, is `peak_reserved` in the JSON)." if cuda else
              "peak of the bytes allocated during one steady step by torch's CPU allocator "
              "(torch.profiler allocation events).")
           + " Moments: Adam's `exp_avg` + `exp_avg_sq`; projectors: DP-GRAPE's `P_l` of the period, DP-GaLore's"
             " SVD projectors. *+renewal*: samples/s with the projector renewal "
             "(DP-GRAPE's draw, DP-GaLore's SVDs) amortised over F steps. *vs DP-Adam*: paired step-time ratio "
             "against DP-Adam in the same grad mode.", ""]
    for row in rows:
        out += [f"## {row['model']}, batch {row['batch']} (d = {row['d']:,} trained; r = {row['rank']}, F = "
                f"{row['F']}: {row['projected_tensors']} projected tensors, r sum n_l + unprojected = "
                f"{row['released']:,})", "",
                "| method | step s | samples/s | +renewal | vs DP-Adam | per-example MiB | predicted MiB | "
                f"peak step MiB |{' reserved step MiB |' if cuda else ''} moments MiB | projectors MiB | "
                "first step s |",
                f"|---|---:|---:|---:|---:|---:|---:|---:|{'---:|' if cuda else ''}---:|---:|---:|"]
        for line in summarize(row):
            out.append(f"| {line['method']} | {fmt(line['step_s'])} | {fmt(line['samples_per_s'], '.1f')} | "
                       f"{fmt(line['samples_per_s_with_renewal'], '.1f')} | {fmt(line['vs_dpadam'], '.2f')} | "
                       f"{mib(line['per_example_bytes'])} | {mib(line['per_example_predicted'])} | "
                       f"{mib(line['peak_step_bytes'])} |"
                       + (f" {mib(line['reserved_step_bytes'])} |" if cuda else "")
                       + f" {mib(line['moments_bytes'])} | {mib(line['projector_bytes'])} | "
                         f"{fmt(line['first_step_s'])} |")
        phases = {m: v for m, v in row.get("phases", {}).items() if v}
        if phases:
            out += ["", "| method (steady step, median s) | " + " | ".join(PHASES) + " |",
                    "|---|" + "---:|" * len(PHASES)]
            out += [f"| {m} | " + " | ".join(fmt(v.get(p), ".4f") for p in PHASES) + " |" for m, v in phases.items()]
        out += ["", "Projector renewal (once per F steps): DP-GRAPE draw "
                    f"{fmt(row['renewal']['dpgrape_draw'], '.4f')} s,"
                    f" DP-GaLore SVDs {fmt(row['renewal']['dpgalore_svd'], '.4f')} s."]
        for method, err in row["errors"].items():
            out.append(f"* {method}: {err}")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help=f"comma list of {MODELS} (default: both; --tiny: vit_base)")
    parser.add_argument("--batches", default=None,
                        help="comma list (default on CUDA: ViT 16,32,64, RoBERTa 8,16,32; on CPU 8,16)")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help=f"comma list of {ALGOS + OPACUS} (ours run in every --grad-modes mode)")
    parser.add_argument("--grad-modes", default="hooks,ghost", help="the engine's modes for ours")
    parser.add_argument("--rank", type=int, default=None, help="r (default: 64 ViT, 16 RoBERTa, the paper's)")
    parser.add_argument("--projection-frequency", type=int, default=100, help="F")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=0, help="unmeasured repetitions first")
    parser.add_argument("--steps-per-repeat", type=int, default=2, help="steady steps per repetition")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--vit-depth", type=int, default=None, help="blocks of ViT-Base (default 12)")
    parser.add_argument("--img-size", type=int, default=None, help="default 224 (--tiny: 32)")
    parser.add_argument("--patch-size", type=int, default=None, help="default 16 (--tiny: 4)")
    parser.add_argument("--vit-width", type=int, default=None, help="embedding width (default 768; --tiny: 64)")
    parser.add_argument("--vit-heads", type=int, default=None, help="attention heads (default 12; --tiny: 2)")
    parser.add_argument("--roberta-layers", type=int, default=None, help="layers of RoBERTa-large (default 24)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke run (seconds): a 1-block, width-64 ViT-Base at 32x32/patch 8, batch 4, r 16, "
                             "1 repetition of 1 step")
    parser.add_argument("--out", default=None, help="results stem (default benchmarks/results/bench_dp_grape; "
                                                    "--tiny: benchmarks/results/quick/bench_dp_grape)")
    args = parser.parse_args(argv)
    if args.tiny:
        given = {a.split("=")[0] for a in argv}
        for flag, value in (("--models", "vit_base"), ("--batches", "4"), ("--vit-depth", 1), ("--vit-width", 64),
                            ("--vit-heads", 2), ("--img-size", 32),
                            ("--patch-size", 8), ("--rank", 16), ("--repeats", 1), ("--steps-per-repeat", 1),
                            ("--device", "cpu")):
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
    args.img_size = args.img_size or 224
    args.patch_size = args.patch_size or 16
    started = time.perf_counter()
    setup_worker(args.threads)
    import torch

    device = resolve_device(args.device)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    models = (args.models or ",".join(MODELS)).split(",")
    rows = []
    for model in models:
        default = DEFAULT_BATCHES[model] if device.type == "cuda" else "8,16"
        for batch in [int(b) for b in (args.batches or default).split(",")]:
            print(f"[bench_dp_grape] {model} batch {batch} on {device}", flush=True)
            rows.append(run_config(args, model, batch, device))
            report(args, argv, rows, device, started, final=False)  # a long run leaves its finished rows
    return report(args, argv, rows, device, started, final=True)


def report(args, argv, rows: list, device, started: float, final: bool) -> int:
    """Write the table and JSON of ``rows`` (after each configuration, and at the end, printed)."""
    import torch

    meta = {"command": command_line("bench_dp_grape.py", argv), "machine": machine_info(), "device": str(device),
            "cuda_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "threads": torch.get_num_threads(), "repeats": args.repeats, "steps_per_repeat": args.steps_per_repeat,
            "args": vars(args)}
    finish_meta(meta, started)
    meta["finished"] = final
    markdown = render(rows, meta)
    if final:
        print(markdown)
    data = {"meta": meta, "rows": rows, "summary": [{"model": r["model"], "batch": r["batch"], "lines": summarize(r)}
                                                    for r in rows]}
    write_results(results_stem(args.out, "bench_dp_grape", quick=args.tiny), markdown, data, announce=final)
    return 0


if __name__ == "__main__":
    sys.exit(main())

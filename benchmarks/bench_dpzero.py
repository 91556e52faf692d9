#!/usr/bin/env python
"""DPZero step time and peak memory against inference and against Opacus DP-SGD, side by side.

For each model (ViT-tiny on 32x32 images, the packaged all-MiniLM-L6-v2 on token batches) and batch
size, in ONE run:

1. time: the DPZero step (``DPZero.training_step`` driven by a real Lightning ``Trainer``; the timer
   wraps ``training_step`` itself: two perturbed forward passes, the three seeded passes of the
   perturbation engine, clipping, noise and the optimizer step; each fit's first step, which also runs
   the fit-start privacy checks that a long run pays once, is timed apart: :func:`steady_fit`) against
   two no-grad, eval-mode forward passes computing per-example losses of the same batch
   (``private_losses``, the very function the step calls), and against one Opacus DP-SGD step
   (forward, backward with per-sample gradients, clipping, noise, SGD step). The three are interleaved inside one process, the order
   rotating every repetition; the median over repetitions is reported.
2. memory: one fresh subprocess per (model, batch, method) so peaks do not mix. Each imports the
   same libraries, builds the model and the batch, records the resident set size (RSS) as the
   baseline, resets the kernel's peak-RSS counter (``/proc/self/clear_refs``), runs the method,
   and reads the peak (``VmHWM``; ``ru_maxrss`` is recorded too). With CUDA the peak is
   ``torch.cuda.max_memory_allocated``.
3. a breakdown of the DPZero step (``--no-breakdown`` skips it): the engine's passes, the Gaussian
   generation alone, the in-place adds alone, and what is left (Python, Lightning, clipping, noise).

Usage (see benchmarks/README.md)::

    python benchmarks/bench_dpzero.py                 # full run, ~15-20 min on 2 CPU cores
    python benchmarks/bench_dpzero.py --quick         # smoke run, a few minutes
    python benchmarks/bench_dpzero.py --models vit_tiny --batches 64 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import (add_worker_options, apply_quick_defaults, command_line, finish_meta, fmt,  # noqa: E402
                     full_batch_fit, load_and_total, machine_info, median_of, mem_available, probe_call,
                     probe_timed, proc_status, ratio_of, reset_peak_rss, resolve_device, results_stem, rss_result,
                     run_worker_process, setup_worker, wall_times, worker_env, write_results)

MODELS = ("vit_tiny", "minilm")
TARGETS = {"ratio_vs_2fwd": 1.05, "mem_vs_inference": 1.05, "speedup_vs_opacus": 4.0, "mem_vs_opacus": 0.2}

# Hyper-parameters shared by DPZero and Opacus (they do not change the cost of a step).
CLIP = 1.0
SIGMA = 1.0
LR = 1e-6
LAM = 1e-3


# =====================================================================================
# Worker side (runs in a subprocess; heavy imports only here)
# =====================================================================================

def build_model(model: str, batch: int, seq_len: int, device, seed: int = 0):
    """The backbone, a fixed batch ``(inputs, targets)`` and a dataset holding exactly that batch."""
    import torch

    from lit_zodp.backbones import SentenceEncoderClassifier, TimmClassifier

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    if model == "vit_tiny":
        backbone = TimmClassifier("vit_tiny_patch16_224", num_classes=10, img_size=32, patch_size=4)
        inputs = torch.randn(batch, 3, 32, 32, generator=g)
        targets = torch.randint(0, 10, (batch,), generator=g)
    elif model == "minilm":
        backbone = SentenceEncoderClassifier(model_name_or_path="minilm", num_classes=2)
        vocab = backbone.encoder.config.vocab_size
        ids = torch.randint(1000, vocab, (batch, seq_len), generator=g)
        ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP]
        # Explicit per-example position/token-type ids: BERT's default position_ids buffer has batch
        # dimension 1, which Opacus' per-sample Embedding gradients cannot take. Same inputs for all.
        inputs = {"input_ids": ids, "attention_mask": torch.ones(batch, seq_len, dtype=torch.long),
                  "token_type_ids": torch.zeros(batch, seq_len, dtype=torch.long),
                  "position_ids": torch.arange(seq_len).repeat(batch, 1)}
        targets = torch.randint(0, 2, (batch,), generator=g)
    else:
        raise ValueError(f"unknown model {model!r}; choose from {MODELS}")
    backbone = backbone.to(device)
    with torch.no_grad():  # weights may be mmapped from the checkpoint: make them resident, private
        for p in backbone.parameters():  # pages now, so the first in-place update is not "training memory"
            p.mul_(1.0)
    if isinstance(inputs, dict):
        inputs = {k: v.to(device) for k, v in inputs.items()}
    else:
        inputs = inputs.to(device)
    return backbone, inputs, targets.to(device), FixedBatch(inputs, targets.to(device))


class FixedBatch:
    """A map-style dataset whose items are the rows of one batch (tensor or dict of tensors)."""

    def __init__(self, inputs, targets) -> None:
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i):
        x = {k: v[i] for k, v in self.inputs.items()} if isinstance(self.inputs, dict) else self.inputs[i]
        return x, self.targets[i]


def make_dpzero(backbone):
    """A DPZero module whose ``training_step`` is timed (the real method, wrapped)."""
    import torch

    from lit_zodp.algorithms import DPZero

    class TimedDPZero(probe_timed(DPZero)):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.threads_seen = None

        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.threads_seen = torch.get_num_threads()
            return out

    return TimedDPZero(backbone, lr=LR, lam=LAM, clip=CLIP, noise_multiplier=SIGMA, delta=1e-5, seed=0)


def dpzero_fit(module, dataset, steps: int, device) -> None:
    """``steps`` DPZero steps through a fresh Trainer over the whole ``dataset``
    (:func:`_common.full_batch_fit`); the module is moved back to ``device`` for the timings that follow."""
    full_batch_fit(module, dataset, steps, device)
    module.to(device)


def steady_fit(module, dataset, steps: int, device) -> int:
    """One :func:`dpzero_fit` of ``1 + steps`` steps; the index of its first step in ``module.step_times``.

    A fit's first step also runs the fit-start privacy checks (the independence checks on the first
    batch, and for a first-order module the engine's numeric checks of a new structure): a long run pays
    them once, so the steady step is the ``steps`` after it (the 1% re-checks stay in), and the first
    step is reported apart."""
    first = len(module.step_times)
    dpzero_fit(module, dataset, 1 + steps, device)
    return first


def make_opacus(backbone, dataset, batch: int, model_name: str, mode: str):
    """Opacus DP-SGD on ``backbone``: returns ``(step, notes)``; ``step()`` runs one full step."""
    import torch
    from opacus import PrivacyEngine
    from opacus.validators import ModuleValidator
    from torch import nn
    from torch.utils.data import DataLoader

    notes = []
    for m in backbone.modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            m.p = 0.0  # DPZero runs in eval mode; Opacus needs train mode: same function, no dropout
    if model_name == "vit_tiny":
        # timm's VisionTransformer holds cls_token and pos_embed directly; Opacus has no grad sampler
        # for that module (hooks mode would fall back to functorch over the WHOLE model).
        inner = backbone.model
        inner.cls_token.requires_grad_(False)
        inner.pos_embed.requires_grad_(False)
        frozen = inner.cls_token.numel() + inner.pos_embed.numel()
        notes.append(f"cls_token+pos_embed frozen for Opacus ({frozen} of "
                     f"{sum(p.numel() for p in backbone.parameters())} params)")
    errors = ModuleValidator.validate(backbone, strict=False)
    if errors:
        backbone = ModuleValidator.fix(backbone)
        notes.append(f"ModuleValidator.fix: {[str(e)[:60] for e in errors][:3]}")
    backbone.train()
    params = [p for p in backbone.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=LR)
    loader = DataLoader(dataset, batch_size=batch)
    engine = PrivacyEngine()
    criterion = nn.CrossEntropyLoss()
    common = dict(module=backbone, optimizer=optimizer, data_loader=loader, noise_multiplier=SIGMA,
                  max_grad_norm=CLIP, poisson_sampling=False, grad_sample_mode=mode)
    if mode == "ghost":
        model, optimizer, criterion, _ = engine.make_private(criterion=criterion, **common)
    else:
        model, optimizer, _ = engine.make_private(**common)
    inputs, targets = dataset.inputs, dataset.targets

    def step() -> None:
        out = model(inputs)
        loss = criterion(out, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, notes


def opacus_hooks_bytes(backbone, batch: int) -> int:
    """Per-sample gradients of Opacus' hooks mode: ``B x d`` floats (Embedding ones are dense)."""
    return 4 * batch * sum(p.numel() for p in backbone.parameters() if p.requires_grad)


def choose_opacus_mode(requested: str, backbone, batch: int, budget_gb: float | None) -> tuple[str, str]:
    if requested != "auto":
        return requested, ""
    need = opacus_hooks_bytes(backbone, batch)
    budget = budget_gb * 2**30 if budget_gb else 0.6 * mem_available()
    if need <= budget:
        return "hooks", ""
    return "ghost", (f"hooks mode needs {need / 2**30:.1f} GiB for per-sample gradients alone "
                     f"(> budget {budget / 2**30:.1f} GiB): ghost clipping instead")


def two_forwards(module, inputs, targets):
    """Two no-grad, eval-mode passes of per-example losses (exactly what the DPZero step calls)."""
    module.backbone.eval()
    module.private_losses(inputs, targets)
    module.private_losses(inputs, targets)


def worker_time(args) -> dict:
    """Interleaved timing of 2x forward, the DPZero step (Trainer) and the Opacus step."""
    import copy

    import torch

    device = resolve_device(args.device)
    backbone, inputs, targets, dataset = build_model(args.model, args.batch, args.seq_len, device)
    opacus_backbone = copy.deepcopy(backbone)
    module = make_dpzero(backbone).to(device)
    opacus_mode, opacus_why = choose_opacus_mode(args.opacus_mode, opacus_backbone, args.batch,
                                                 args.opacus_mem_budget_gb)
    result = {"opacus_mode": opacus_mode, "opacus_notes": [opacus_why] if opacus_why else []}
    opacus_step = None
    if not args.no_opacus:
        try:
            opacus_step, notes = make_opacus(opacus_backbone, dataset, args.batch, args.model, opacus_mode)
            result["opacus_notes"] += notes
        except Exception as err:  # record why Opacus cannot run this configuration
            result["opacus_error"] = f"{type(err).__name__}: {err}"[:500]

    def time_forwards() -> tuple:
        return probe_call(lambda: two_forwards(module, inputs, targets), device)

    def time_opacus() -> tuple:
        return probe_call(opacus_step, device)

    fwd, dpz, dpz_first, opa = [], [], [], []
    loads = {"fwd2": [], "dpzero": [], "opacus": []}
    methods = ["fwd", "dpzero"] + (["opacus"] if opacus_step else [])
    k = args.steps_per_repeat
    for rep in range(-args.warmup, args.repeats):
        shift = rep % len(methods)
        for method in methods[shift:] + methods[:shift]:
            if method == "opacus" and not 0 <= rep < args.opacus_repeats:
                continue
            reps = k if rep >= 0 else 1  # warm-up: once each
            if method == "fwd":
                runs = [time_forwards() for _ in range(reps)]
                if rep >= 0:
                    fwd += [w for w, _ in runs]
                    loads["fwd2"] += [x for _, x in runs]
            elif method == "dpzero":
                if rep < 0:
                    dpzero_fit(module, dataset, 1, device)
                    continue
                first = steady_fit(module, dataset, reps, device)
                dpz_first.append(module.step_times[first])
                dpz += module.step_times[first + 1:]
                loads["dpzero"] += module.step_loads[first + 1:]
            else:
                try:
                    t, load = time_opacus()
                except Exception as err:
                    result["opacus_error"] = f"{type(err).__name__}: {err}"[:500]
                    methods.remove("opacus")
                    opacus_step = None
                    continue
                if rep >= 0:
                    opa.append(t)
                    loads["opacus"].append(load)
                # Opacus churns GBs of memory: settle (page the freed memory back, refill caches) with
                # one untimed forward pair so that the next timed measurement does not pay for it.
                two_forwards(module, inputs, targets)
    result.update(fwd2_times=fwd, dpzero_times=dpz, dpzero_first_times=dpz_first, opacus_times=opa, other_load=loads,
                  device=str(device),
                  cuda_name=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                  threads=torch.get_num_threads(), threads_in_step=module.threads_seen,
                  n_params=sum(p.numel() for p in backbone.parameters()),
                  n_tensors=len(list(backbone.parameters())))
    if not args.no_breakdown:
        result["breakdown"] = breakdown(module, inputs, targets, device, repeats=max(3, args.repeats))
    return result


def breakdown(module, inputs, targets, device, repeats: int) -> dict:
    """Where the DPZero step's time goes beyond the two forward passes (engine passes timed alone)."""
    import torch

    from lit_zodp.zo import ZOSGD, derive_seed

    optimizer = ZOSGD([p for p in module.backbone.parameters() if p.requires_grad], lr=0.0)
    engine = optimizer.engine
    chunks = engine._chunks
    zero = torch.zeros(max(c.numel() for c in chunks), device=device)

    def timed(fn) -> float:
        return statistics.median(wall_times(fn, repeats, device))

    seed = derive_seed(0, 12345)

    def generate_only():
        for _ in engine.law.directions(chunks, seed):
            pass

    def add_only():
        with torch.no_grad():
            for chunk in chunks:
                chunk.add_(zero[: chunk.numel()], alpha=1.0)

    def perturb_pair():  # +lam then -lam: two passes, parameters restored
        engine.perturb_(seed, LAM)
        engine.perturb_(seed, -LAM)

    def fused_pair():  # +lam (a perturb pass) then the fused restore+update pass with lr = 0
        engine.perturb_(seed, LAM)
        engine.restore_and_update_({seed: 1.0}, lr=0.0)

    out = {
        "generate_pass_s": timed(generate_only),
        "add_pass_s": timed(add_only),
        "perturb_pass_s": timed(perturb_pair) / 2,
        "fused_pass_minus_perturb_pass_s": None,
        "chunks": len(chunks),
    }
    out["fused_pass_minus_perturb_pass_s"] = timed(fused_pair) - out["perturb_pass_s"]
    out["engine_3_passes_s"] = 2 * out["perturb_pass_s"] + out["fused_pass_minus_perturb_pass_s"]
    return out


def worker_memory(args) -> dict:
    """Peak memory of one method in this fresh process, above the model+batch baseline."""
    import gc

    import torch

    device = resolve_device(args.device)
    backbone, inputs, targets, dataset = build_model(args.model, args.batch, args.seq_len, device)
    cuda = device.type == "cuda"
    tensors = list(backbone.parameters()) + (list(inputs.values()) if isinstance(inputs, dict) else [inputs])
    model_bytes = sum(t.numel() * t.element_size() for t in tensors + [targets])
    one = FixedBatch({k: v[:1] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[:1],
                     targets[:1])
    if args.method == "inference":  # warm-up on ONE example: lazy imports and one-time state are not
        two_forwards(make_dpzero(backbone).to(device), one.inputs, one.targets)  # per-step memory
    elif args.method == "dpzero":
        dpzero_fit(make_dpzero(backbone).to(device), one, 1, device)
    gc.collect()
    baseline = proc_status("VmRSS")
    reset_ok = reset_peak_rss()
    if cuda:
        torch.cuda.synchronize(device)
        cuda_baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    k = args.steps_per_repeat
    result = {"method": args.method, "peak_reset": reset_ok}
    if args.method == "inference":
        module = make_dpzero(backbone).to(device)  # only for private_losses; no step is taken
        for _ in range(k):
            two_forwards(module, inputs, targets)
    elif args.method == "dpzero":
        module = make_dpzero(backbone).to(device)
        dpzero_fit(module, dataset, k, device)
    elif args.method == "opacus":
        mode, why = choose_opacus_mode(args.opacus_mode, backbone, args.batch, args.opacus_mem_budget_gb)
        result.update(opacus_mode=mode, opacus_notes=[why] if why else [])
        try:
            step, notes = make_opacus(backbone, dataset, args.batch, args.model, mode)
            result["opacus_notes"] += notes
            step()  # one step: Opacus' per-sample gradients are freed by zero_grad at its end
        except Exception as err:
            result["opacus_error"] = f"{type(err).__name__}: {err}"[:500]
    if cuda:
        torch.cuda.synchronize(device)
        result.update(cuda_baseline=cuda_baseline, cuda_peak=torch.cuda.max_memory_allocated(device))
    result["model_bytes"] = model_bytes
    result.update(rss_result(baseline, reset_ok))
    return result


def run_worker(args) -> None:
    setup_worker(args.threads, args.chunk_numel)
    result = worker_time(args) if args.worker == "time" else worker_memory(args)
    result.update(model=args.model, batch=args.batch)
    Path(args.result_file).write_text(json.dumps(result))


# =====================================================================================
# Orchestrator side (light imports only, so child processes start from a small parent)
# =====================================================================================

def spawn(args, worker: str, model: str, batch: int, method: str | None = None) -> dict:
    """One worker process (``time`` or ``memory``) for ``model`` at ``batch``; its result."""
    options = ["--worker", worker, "--model", model, "--batch", str(batch), "--threads", str(args.threads),
               "--seq-len", str(args.seq_len), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
               "--steps-per-repeat", str(args.steps_per_repeat), "--device", args.device,
               "--opacus-repeats", str(args.opacus_repeats), "--opacus-mode", args.opacus_mode]
    if args.opacus_mem_budget_gb:
        options += ["--opacus-mem-budget-gb", str(args.opacus_mem_budget_gb)]
    if args.chunk_numel:
        options += ["--chunk-numel", str(args.chunk_numel)]
    if method:
        options += ["--method", method]
    for flag in ("no_opacus", "no_breakdown"):
        if getattr(args, flag):
            options.append("--" + flag.replace("_", "-"))
    env = worker_env(args.threads, args.omp_wait_policy, mmap_freed=worker == "memory")
    return run_worker_process(__file__, options, env)


def summarize(model: str, batch: int, timing: dict, memory: dict) -> dict:
    row = {"model": model, "batch": batch}
    row["dpzero_s"] = median_of(timing.get("dpzero_times", []))
    row["dpzero_first_s"] = median_of(timing.get("dpzero_first_times", []))
    row["fwd2_s"] = median_of(timing.get("fwd2_times", []))
    row["opacus_s"] = median_of(timing.get("opacus_times", []))
    # Headline: median over repetitions of (DPZero step / 2x forward) within the same repetition, which
    # cancels slow drifts of the machine; the ratio of the two medians is kept beside it.
    pairs = list(zip(timing.get("dpzero_times", []), timing.get("fwd2_times", [])))
    row["ratio_vs_2fwd"] = median_of([d / f for d, f in pairs]) if pairs else None
    row["ratio_vs_2fwd_of_medians"] = ratio_of(row["dpzero_s"], row["fwd2_s"])
    row["ratio_vs_2fwd_min"] = ratio_of(min(timing.get("dpzero_times") or [0]) or None,
                                        min(timing.get("fwd2_times") or [0]) or None)
    row["speedup_vs_opacus"] = ratio_of(row["opacus_s"], row["dpzero_s"])
    all_loads = [x for xs in (timing.get("other_load") or {}).values() for x in xs if x is not None]
    row["other_load"] = median_of(all_loads)
    row["opacus_mode"] = timing.get("opacus_mode")
    key = "cuda" if "cuda_peak" in memory.get("dpzero", {}) else "rss"

    def peak(method):
        m = memory.get(method, {})
        return m.get(f"{key}_peak")

    def extra(method):
        m = memory.get(method, {})
        if m.get(f"{key}_peak") is None or m.get(f"{key}_baseline") is None:
            return None
        return m[f"{key}_peak"] - m[f"{key}_baseline"]

    def model_and_extra(method):  # weights + batch + working memory (what a GPU allocator counts)
        m = memory.get(method, {})
        if key == "cuda":
            return m.get("cuda_peak")
        if extra(method) is None or m.get("model_bytes") is None:
            return None
        return extra(method) + m["model_bytes"]

    row["memory_kind"] = key
    for method in ("inference", "dpzero", "opacus"):
        row[f"{method}_peak_mb"] = peak(method) / 2**20 if peak(method) else None
        row[f"{method}_extra_mb"] = extra(method) / 2**20 if extra(method) is not None else None
    row["mem_vs_inference"] = ratio_of(peak("dpzero"), peak("inference"))
    row["mem_extra_vs_inference"] = ratio_of(extra("dpzero"), extra("inference"))
    row["mem_vs_opacus"] = ratio_of(peak("dpzero"), peak("opacus")) if "opacus_error" not in memory.get("opacus", {}) else None
    row["mem_extra_vs_opacus"] = ratio_of(extra("dpzero"), extra("opacus")) if row["mem_vs_opacus"] else None
    for method in ("inference", "dpzero", "opacus"):
        value = model_and_extra(method)
        row[f"{method}_model_and_extra_mb"] = value / 2**20 if value else None
    row["mem_model_vs_inference"] = ratio_of(model_and_extra("dpzero"), model_and_extra("inference"))
    row["mem_model_vs_opacus"] = (ratio_of(model_and_extra("dpzero"), model_and_extra("opacus"))
                                  if row["mem_vs_opacus"] else None)
    row["ru_maxrss_ratio_vs_inference"] = ratio_of(memory.get("dpzero", {}).get("ru_maxrss"),
                                                   memory.get("inference", {}).get("ru_maxrss"))
    return row


def render(rows: list[dict], meta: dict) -> str:
    lines = [
        "| model | batch | DPZero s/step | 2x fwd s | ratio, median of paired (<=1.05) | mem ratio vs inference: peak / model+extra / "
        "extra (<=1.05) | Opacus s/step | speedup vs Opacus (>=4) | mem vs Opacus: peak / model+extra / extra (<=0.2) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mode = f" ({r['opacus_mode']})" if r.get("opacus_mode") not in (None, "hooks") else ""
        lines.append(
            f"| {r['model']} | {r['batch']} | {fmt(r['dpzero_s'])} | {fmt(r['fwd2_s'])} | "
            f"{fmt(r['ratio_vs_2fwd'])} | {fmt(r['mem_vs_inference'])} / {fmt(r.get('mem_model_vs_inference'))} / "
            f"{fmt(r['mem_extra_vs_inference'])} | {fmt(r['opacus_s'])}{mode} | {fmt(r['speedup_vs_opacus'], '.2f')}x | "
            f"{fmt(r['mem_vs_opacus'])} / {fmt(r.get('mem_model_vs_opacus'))} / {fmt(r['mem_extra_vs_opacus'])} |")
    lines.append("")
    lines.append("| model | batch | ratio: of medians / of minima | other processes' load (cores) "
                 "| peak RSS MB: inference / DPZero / Opacus | extra above baseline MB: inference / DPZero / Opacus "
                 "| engine: 3 passes s (serial randn / serial add_, per pass) | engine / 2x fwd "
                 "| first step of a fit s (fit-start checks) |")
    lines.append("|---|---:|---|---:|---|---|---|---:|---:|")
    for r in rows:
        b = r.get("breakdown") or {}
        lines.append(
            f"| {r['model']} | {r['batch']} | {fmt(r.get('ratio_vs_2fwd_of_medians'))} / "
            f"{fmt(r.get('ratio_vs_2fwd_min'))} | {fmt(r.get('other_load'), '.2f')} | "
            f"{fmt(r['inference_peak_mb'], '.0f')} / {fmt(r['dpzero_peak_mb'], '.0f')}"
            f" / {fmt(r['opacus_peak_mb'], '.0f')} | {fmt(r['inference_extra_mb'], '.0f')} / "
            f"{fmt(r['dpzero_extra_mb'], '.0f')} / {fmt(r['opacus_extra_mb'], '.0f')} | "
            f"{fmt(b.get('engine_3_passes_s'))} ({fmt(b.get('generate_pass_s'))} / {fmt(b.get('add_pass_s'), '.4f')})"
            f" | {fmt(ratio_of(b.get('engine_3_passes_s'), r.get('fwd2_s')))} | {fmt(r.get('dpzero_first_s'))} |")
    notes = [f"- {r['model']} b{r['batch']}: {n}" for r in rows for n in r.get("notes", [])]
    if notes:
        lines += ["", "Notes:"] + notes
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list from {MODELS}")
    parser.add_argument("--batches", default="64,256", help="comma list of batch sizes")
    parser.add_argument("--repeats", type=int, default=5, help="measured repetitions (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured repetitions first")
    parser.add_argument("--steps-per-repeat", type=int, default=1,
                        help="DPZero steps and 2x-forward timings per repetition (the DPZero fit takes one more "
                             "step first, its fit-start checks, reported apart); Opacus takes one step per "
                             "repetition")
    parser.add_argument("--opacus-repeats", type=int, default=2,
                        help="measured Opacus steps (its per-step cost dwarfs the noise; no warm-up)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--seq-len", type=int, default=128, help="MiniLM tokens per example")
    parser.add_argument("--omp-wait-policy", default="default", choices=["default", "passive", "active"],
                        help="OMP_WAIT_POLICY of the workers; default leaves it unset (libgomp spins "
                             "a few ms after each parallel region, which slows the engine pass that "
                             "follows each forward)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    parser.add_argument("--opacus-mode", default="auto", choices=["auto", "hooks", "ghost", "functorch", "ew"],
                        help="auto: hooks unless its per-sample gradients exceed the memory budget, then ghost")
    parser.add_argument("--opacus-mem-budget-gb", type=float, default=None,
                        help="budget for Opacus hooks' per-sample gradients (default 60%% of MemAvailable)")
    parser.add_argument("--chunk-numel", type=int, default=None,
                        help="override the perturbation engine's chunk size (A/B runs; default: the library's)")
    parser.add_argument("--no-opacus", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: batch 16, 32 tokens, 2 repeats, 1 step per repeat")
    parser.add_argument("--out", default=None,
                        help="results file stem (default results/bench_dpzero; results/quick/bench_dpzero with --quick)")
    add_worker_options(parser)
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(args)

    raw_argv = argv if argv is not None else sys.argv[1:]
    if args.quick:
        apply_quick_defaults(args, raw_argv, batches="16", seq_len=32, repeats=2, steps_per_repeat=1)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    for m in models:
        if m not in MODELS:
            parser.error(f"unknown model {m!r}; choose from {MODELS}")
    command = command_line("bench_dpzero.py", raw_argv, python=Path(sys.executable).name)
    meta = machine_info()
    meta.update(command=command, args={k: v for k, v in vars(args).items()
                                       if k not in ("worker", "model", "batch", "method", "result_file")})
    started = time.perf_counter()
    rows, raw = [], []
    for model in models:
        for batch in batches:
            print(f"[{time.perf_counter() - started:6.0f}s] {model} batch {batch}: timing ...", flush=True)
            timing = spawn(args, "time", model, batch)
            memory = {}
            if not args.no_memory:
                for method in ("inference", "dpzero") + (() if args.no_opacus else ("opacus",)):
                    print(f"[{time.perf_counter() - started:6.0f}s] {model} batch {batch}: memory {method} ...",
                          flush=True)
                    memory[method] = spawn(args, "memory", model, batch, method)
            row = summarize(model, batch, timing, memory)
            row["breakdown"] = timing.get("breakdown")
            notes = []
            for note in timing.get("opacus_notes", []) + memory.get("opacus", {}).get("opacus_notes", []):
                if not any(n[:40] == note[:40] for n in notes):  # same note from both workers
                    notes.append(note)
            for where, res in [("timing", timing)] + list(memory.items()):
                for key in ("error", "opacus_error"):
                    if res.get(key):
                        notes.append(f"{where}: {res[key]}" + (f" -- {res['stderr_tail'][-300:]}" if key == "error" else ""))
            row["notes"] = notes
            meta["cuda"] = meta["cuda"] or timing.get("cuda_name")
            rows.append(row)
            raw.append({"model": model, "batch": batch, "timing": timing, "memory": memory})
            print(render([row], meta).split("\n\n")[0].split("\n")[-1], flush=True)
    finish_meta(meta, started)
    table = render(rows, meta)
    header = (f"# DPZero benchmark\n\n`{command}`  \n{meta['cpu']}, {meta['cpus']} CPUs, torch {meta['torch']}, "
              f"threads {args.threads}, device {args.device}, OMP_WAIT_POLICY {args.omp_wait_policy}"
              f"{' (' + meta['cuda'] + ')' if meta['cuda'] else ''}; MiniLM sequence length {args.seq_len}; "
              f"repeats {args.repeats} (+{args.warmup} warm-up), {args.steps_per_repeat} DPZero steps per repeat; "
              f"{load_and_total(meta)}\n\n")
    print("\n" + table)
    write_results(results_stem(args.out, "bench_dpzero", args.quick), header + table,
                  {"meta": meta, "rows": rows, "raw": raw})


if __name__ == "__main__":
    main()

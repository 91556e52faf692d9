#!/usr/bin/env python
"""MeZO-BCD (layer-wise blocks, random order) against MeZO on a 12-layer transformer, on CPU, in one run.

Park et al. ("Elucidating Subspace Perturbation in Zeroth-Order Optimization", MeZO-BCD) report
1.83x (OPT-125M) to 2.77x (OPT-13B) per step against MeZO *as the reference code writes it*. This
benchmark measures, with the same model, batch and ``lam``:

* ``bcd``: :class:`lit_zodp.algorithms.MeZOBCD` (``partition="layer"``, ``order="random"``): one
  block of the 14 (embeddings, 12 layers, pooler + classifier) perturbed and updated per step, two
  full forwards. On CPU the block's direction is drawn once per step into a cache (the default,
  ``cache_direction``; memory: the largest block in float32); ``bcd_nocache`` draws it in each of
  the three passes, at inference memory. Each repetition is ONE full random-order cycle (N steps through one Trainer, every
  block once), so the per-step time is the cycle's mean: a median over single steps would only see
  the small layer blocks, never the 12M-parameter embedding block.
* ``mezo``: this package's :class:`lit_zodp.algorithms.MeZO` (the DPZero step, non-private): the
  engine perturbs all parameters (+lam, -2lam, fused restore+update: three passes), two forwards.
* ``paper``: **the paper's baseline**, MeZO as the reference code (princeton-nlp/MeZO,
  ``trainer.py``: ``zo_perturb_parameters`` / ``zo_step`` / ``zo_update``) writes it, as a small
  function here (:func:`paper_mezo_step`): for each of the three perturbation passes (+eps, -2eps,
  +eps) and the update pass, ``torch.manual_seed(seed)`` and then, for each parameter tensor,
  ``z = torch.normal(0, 1, size=param.shape)`` and ``param.data = param.data + scale * eps * z``
  (out-of-place, as the reference does); two forwards (no grad, eval mode) between the passes.
* ``fwd2``: the two forward passes alone (``private_losses`` twice: exactly what both steps call).

Time: all methods in one worker process on one model copy each, interleaved with their order
rotating each repetition; the timer wraps ``training_step`` under a real Lightning ``Trainer``
(``bench_dpzero.dpzero_fit``) for ``bcd`` and ``mezo``, and the function call for ``paper`` and
``fwd2``. Medians over repetitions; ratios are medians of per-repetition (paired) ratios.
Memory: one fresh worker process per method, peak RSS (``/proc/self/clear_refs`` + ``VmHWM``)
above the model+batch baseline, as in ``bench_dpzero.py``.

The Trainer driver comes from ``bench_dpzero.py``; the worker setup and processes, the load probe and
the RSS helpers from ``_common.py`` (imported, not copied). See benchmarks/README.md.

Usage::

    python benchmarks/bench_mezo_bcd.py                # 12 layers, hidden 384, b16 x 64 tokens
    python benchmarks/bench_mezo_bcd.py --quick        # smoke run: 2 layers, 2 repeats
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

import bench_dpzero as bd  # noqa: E402  (light at import: heavy imports happen in its functions)
from _common import (add_worker_options, command_line, finish_meta, fmt, load_and_total,  # noqa: E402
                     machine_info, median_of, probe_call, probe_timed, proc_status, ratio_of,
                     reset_peak_rss, results_stem, rss_result, run_worker_process, setup_worker,
                     worker_env, write_results)

METHODS = ("fwd2", "bcd", "bcd_nocache", "mezo", "paper")
MEMORY_METHODS = ("inference", "bcd", "bcd_nocache", "mezo", "paper")
BCD_METHODS = ("bcd", "bcd_nocache")
TARGETS = {"speedup_vs_paper": 2.0, "bcd_vs_2fwd": 1.02}
LR = bd.LR    # 1e-6: the step size does not change the cost of a step
LAM = bd.LAM  # 1e-3


def config(layers: int) -> dict:
    """A BERT-style (MiniLM-sized) encoder deepened to ``layers``: hidden 384, 6 heads, FFN 1536."""
    return {"model_type": "bert", "vocab_size": 30522, "hidden_size": 384, "num_hidden_layers": layers,
            "num_attention_heads": 6, "intermediate_size": 1536, "max_position_embeddings": 512,
            "type_vocab_size": 2, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


# =====================================================================================
# Worker side
# =====================================================================================

def build(args, seed: int = 0):
    """``(backbone, inputs, targets, dataset)``: random weights from the configuration, a fixed batch."""
    import torch

    from lit_zodp.backbones import HFSequenceClassifier

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    cfg = config(args.layers)
    backbone = HFSequenceClassifier(config=cfg, num_classes=2)
    ids = torch.randint(1000, cfg["vocab_size"], (args.batch, args.seq_len), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102
    inputs = {"input_ids": ids, "attention_mask": torch.ones(args.batch, args.seq_len, dtype=torch.long),
              "token_type_ids": torch.zeros(args.batch, args.seq_len, dtype=torch.long)}
    targets = torch.randint(0, 2, (args.batch,), generator=g)
    backbone.eval()
    with torch.no_grad():  # resident, private pages before any measurement
        for p in backbone.parameters():
            p.mul_(1.0)
    return backbone, inputs, targets, bd.FixedBatch(inputs, targets)


def make(method: str, backbone):
    from lit_zodp.algorithms import MeZO, MeZOBCD

    if method in BCD_METHODS:
        return probe_timed(MeZOBCD)(backbone, lr=LR, lam=LAM, seed=0, partition="layer", order="random",
                                    cache_direction=method == "bcd")
    if method in ("mezo", "inference", "fwd2"):
        return probe_timed(MeZO)(backbone, lr=LR, lam=LAM, seed=0)
    raise ValueError(method)


# ----------------------------------------------------------------------------- the paper's baseline
class PaperMeZO:
    """THE PAPER'S BASELINE: MeZO as the reference code (princeton-nlp/MeZO ``trainer.py``) writes it.

    ``zo_perturb_parameters(scale)``: ``torch.manual_seed(seed)``; for each parameter tensor
    ``z = torch.normal(mean=0, std=1, size=param.data.size())``, ``param.data = param.data + scale * z * eps``.
    ``zo_step``: perturb(+1), loss1, perturb(-2), loss2, ``pg = (loss1 - loss2) / (2 eps)``, perturb(+1).
    ``zo_update``: ``torch.manual_seed(seed)``; per tensor the same ``z``, ``param.data = param.data - lr * pg * z``
    (weight decay 0, so the reference's bias/LayerNorm branch is the same expression).
    The reference reseeds once per pass and then draws the tensors in order (reseeding before every
    tensor would give same-shaped tensors the same ``z``); the cost is the same either way.
    The losses are the batch means of the same per-example losses the package's steps use.
    """

    def __init__(self, module, eps: float = LAM, lr: float = LR) -> None:
        self.module, self.eps, self.lr = module, eps, lr
        self.params = [(n, p) for n, p in module.backbone.named_parameters() if p.requires_grad]
        self.step_count = 0

    def perturb(self, seed: int, scaling_factor: float) -> None:
        import torch

        torch.manual_seed(seed)
        for _, param in self.params:
            z = torch.normal(mean=0, std=1, size=param.data.size(), device=param.data.device,
                             dtype=param.data.dtype)
            param.data = param.data + scaling_factor * z * self.eps

    def forward(self, inputs, targets):
        import torch

        self.module.backbone.eval()
        with torch.inference_mode():
            return self.module.private_losses(inputs, targets).mean()

    def step(self, inputs, targets) -> float:
        import numpy as np
        import torch

        seed = int(np.random.default_rng(self.step_count).integers(1_000_000_000))
        self.step_count += 1
        self.perturb(seed, 1)                                   # zo_step
        loss1 = self.forward(inputs, targets)
        self.perturb(seed, -2)
        loss2 = self.forward(inputs, targets)
        projected_grad = ((loss1 - loss2) / (2 * self.eps)).item()
        self.perturb(seed, 1)
        torch.manual_seed(seed)                                 # zo_update
        for _, param in self.params:
            z = torch.normal(mean=0, std=1, size=param.data.size(), device=param.data.device,
                             dtype=param.data.dtype)
            param.data = param.data - self.lr * (projected_grad * z)
        return float(loss1)


def paper_mezo_step(runner: PaperMeZO, inputs, targets) -> float:
    """One step of the paper's baseline (see :class:`PaperMeZO`)."""
    return runner.step(inputs, targets)


def worker_time(args) -> dict:
    import copy

    import torch

    device = torch.device("cpu")
    backbone, inputs, targets, dataset = build(args)
    modules = {m: make(m, copy.deepcopy(backbone)) for m in BCD_METHODS + ("mezo",)}
    fwd_module = make("fwd2", backbone)  # only private_losses; never stepped
    paper = PaperMeZO(make("fwd2", copy.deepcopy(backbone)))
    n_blocks = modules["bcd"].num_blocks
    block_sizes = [b.numel for b in modules["bcd"].blocks()]

    times = {m: [] for m in METHODS}
    loads = {m: [] for m in METHODS}
    methods = list(METHODS)
    for rep in range(-args.warmup, args.repeats):
        shift = rep % len(methods)
        for method in methods[shift:] + methods[:shift]:
            if method in modules:
                module = modules[method]
                # bcd: one full random-order cycle (every block once) per repetition; mezo: k steps.
                steps = n_blocks if method in BCD_METHODS else args.steps_per_repeat
                before = len(module.step_times)
                bd.dpzero_fit(module, dataset, steps, device)
                runs = list(zip(module.step_times[before:], module.step_loads[before:]))
            elif method == "fwd2":
                runs = [probe_call(lambda: bd.two_forwards(fwd_module, inputs, targets))
                        for _ in range(args.steps_per_repeat)]
            else:
                runs = [probe_call(lambda: paper_mezo_step(paper, inputs, targets))
                        for _ in range(args.steps_per_repeat)]
            if rep >= 0:
                times[method].append(statistics.mean(w for w, _ in runs))   # per-step time of this repetition
                loads[method] += [x for _, x in runs if x is not None]
    per_block = None
    bcd = modules["bcd"]
    if bcd.step_times:
        per_block = {"note": "last cycle's step times in execution order", "times": bcd.step_times[-n_blocks:]}
    return {"times": times, "loads": loads, "threads": torch.get_num_threads(), "n_blocks": n_blocks,
            "block_names": bcd.block_names, "block_numel": block_sizes, "bcd_last_cycle": per_block,
            "n_params": sum(p.numel() for p in backbone.parameters()),
            "n_tensors": len(list(backbone.parameters()))}


def worker_memory(args) -> dict:
    import gc

    device = __import__("torch").device("cpu")
    backbone, inputs, targets, dataset = build(args)
    model_bytes = sum(t.numel() * t.element_size() for t in list(backbone.parameters()) + list(inputs.values()))
    one = bd.FixedBatch({k: v[:1] for k, v in inputs.items()}, targets[:1])
    method = args.method
    # warm-up on ONE example: lazy imports and one-time state are not per-step memory
    if method in BCD_METHODS + ("mezo",):
        module = make(method, backbone)
        bd.dpzero_fit(module, one, 1, device)
    else:
        module = make("fwd2", backbone)
        bd.two_forwards(module, one.inputs, one.targets)
        if method == "paper":
            paper = PaperMeZO(module)
            paper_mezo_step(paper, one.inputs, one.targets)
    gc.collect()
    baseline = proc_status("VmRSS")
    reset_ok = reset_peak_rss()
    k = args.steps_per_repeat
    if method in BCD_METHODS + ("mezo",):
        module = make(method, backbone)
        bd.dpzero_fit(module, dataset, module.num_blocks if method in BCD_METHODS else k, device)
    elif method == "paper":
        for _ in range(k):
            paper_mezo_step(paper, inputs, targets)
    else:
        for _ in range(k):
            bd.two_forwards(module, inputs, targets)
    return {"method": method, "peak_reset": reset_ok, "model_bytes": model_bytes, **rss_result(baseline, reset_ok)}


def run_worker(args) -> None:
    setup_worker(args.threads)
    result = worker_time(args) if args.worker == "time" else worker_memory(args)
    Path(args.result_file).write_text(json.dumps(result))


# =====================================================================================
# Orchestrator side
# =====================================================================================

def spawn(args, worker: str, method: str | None = None) -> dict:
    """One worker process (``time``, or ``memory`` for ``method``); its result."""
    options = ["--worker", worker, "--threads", str(args.threads), "--layers", str(args.layers),
               "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--repeats", str(args.repeats),
               "--warmup", str(args.warmup), "--steps-per-repeat", str(args.steps_per_repeat)]
    if method:
        options += ["--method", method]
    return run_worker_process(__file__, options, worker_env(args.threads, mmap_freed=worker == "memory"))


def summarize(timing: dict, memory: dict) -> dict:
    t = timing.get("times", {})
    med = {m: median_of(t.get(m, [])) for m in METHODS}

    def paired(a, b):
        pairs = [x / y for x, y in zip(t.get(a, []), t.get(b, [])) if y]
        return median_of(pairs)

    row = {f"{m}_s": med[m] for m in METHODS}
    row.update(speedup_vs_paper=paired("paper", "bcd"), speedup_vs_mezo=paired("mezo", "bcd"),
               bcd_vs_2fwd=paired("bcd", "fwd2"), mezo_vs_2fwd=paired("mezo", "fwd2"),
               bcd_nocache_vs_2fwd=paired("bcd_nocache", "fwd2"), speedup_nocache_vs_mezo=paired("mezo", "bcd_nocache"),
               paper_vs_2fwd=paired("paper", "fwd2"),
               speedup_vs_paper_of_medians=ratio_of(med["paper"], med["bcd"]),
               bcd_vs_2fwd_of_medians=ratio_of(med["bcd"], med["fwd2"]))
    all_loads = [x for xs in (timing.get("loads") or {}).values() for x in xs]
    row["other_load"] = median_of(all_loads)
    for m in MEMORY_METHODS:
        r = memory.get(m, {})
        peak, base = r.get("rss_peak"), r.get("rss_baseline")
        row[f"{m}_peak_mb"] = peak / 2**20 if peak else None
        row[f"{m}_extra_mb"] = (peak - base) / 2**20 if peak and base else None
    row["mem_bcd_vs_mezo"] = ratio_of(row["bcd_peak_mb"], row["mezo_peak_mb"])
    row["mem_bcd_nocache_vs_mezo"] = ratio_of(row["bcd_nocache_peak_mb"], row["mezo_peak_mb"])
    return row


def render(row: dict, timing: dict) -> str:
    f = fmt
    lines = [
        "| method | s/step (median) | vs 2x forward (paired) | peak RSS MB | extra above model+batch MB |",
        "|---|---:|---:|---:|---:|",
        f"| two forwards alone | {f(row['fwd2_s'])} | 1.000 | {f(row['inference_peak_mb'], '.0f')} | "
        f"{f(row['inference_extra_mb'], '.0f')} |",
        f"| MeZO-BCD (layer blocks, random order; direction cached, the CPU default) | {f(row['bcd_s'])} | "
        f"{f(row['bcd_vs_2fwd'])} | {f(row['bcd_peak_mb'], '.0f')} | {f(row['bcd_extra_mb'], '.0f')} |",
        f"| MeZO-BCD, `cache_direction=False` | {f(row['bcd_nocache_s'])} | {f(row['bcd_nocache_vs_2fwd'])} | "
        f"{f(row['bcd_nocache_peak_mb'], '.0f')} | {f(row['bcd_nocache_extra_mb'], '.0f')} |",
        f"| MeZO (lit_zodp) | {f(row['mezo_s'])} | {f(row['mezo_vs_2fwd'])} | {f(row['mezo_peak_mb'], '.0f')} | "
        f"{f(row['mezo_extra_mb'], '.0f')} |",
        f"| MeZO, the paper's baseline (reference code) | {f(row['paper_s'])} | {f(row['paper_vs_2fwd'])} | "
        f"{f(row['paper_peak_mb'], '.0f')} | {f(row['paper_extra_mb'], '.0f')} |",
        "",
        "| ratio (median of per-repetition ratios) | value | target |",
        "|---|---:|---:|",
        f"| BCD speedup vs the paper's baseline | {f(row['speedup_vs_paper'], '.2f')}x | >= {TARGETS['speedup_vs_paper']}x |",
        f"| BCD speedup vs lit_zodp MeZO | {f(row['speedup_vs_mezo'], '.3f')}x | (engine's share only) |",
        f"| BCD step / two forwards | {f(row['bcd_vs_2fwd'])} | <= {TARGETS['bcd_vs_2fwd']} |",
        f"| BCD without the cache: step / two forwards, speedup vs lit_zodp MeZO | "
        f"{f(row['bcd_nocache_vs_2fwd'])}, {f(row['speedup_nocache_vs_mezo'], '.3f')}x | |",
        f"| peak RSS BCD / MeZO (cached, not cached) | {f(row['mem_bcd_vs_mezo'])}, "
        f"{f(row['mem_bcd_nocache_vs_mezo'])} | |",
        "",
        f"Other processes' load during the timings (median, cores): {f(row['other_load'], '.2f')}. "
        f"Blocks: {timing.get('n_blocks')} ({', '.join(timing.get('block_names') or [])[:120]}...); "
        f"parameters {timing.get('n_params')} in {timing.get('n_tensors')} tensors; block sizes "
        f"{timing.get('block_numel')}.",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="measured repetitions (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured repetitions first")
    parser.add_argument("--steps-per-repeat", type=int, default=3,
                        help="MeZO / paper / 2x-forward timings per repetition (BCD: one full cycle of N blocks)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 layers, 2 repeats, 1 step per repeat")
    parser.add_argument("--out", default=None,
                        help="results file stem (default results/bench_mezo_bcd; results/quick/bench_mezo_bcd with --quick)")
    add_worker_options(parser, config=False)
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(args)
    if args.quick:
        args.layers, args.repeats, args.steps_per_repeat = 2, 2, 1
    command = command_line("bench_mezo_bcd.py", argv if argv is not None else sys.argv[1:],
                           python=Path(sys.executable).name)
    meta = machine_info()
    meta.update(command=command, model=config(args.layers),
                args={k: v for k, v in vars(args).items() if k not in ("worker", "method", "result_file")})
    started = time.perf_counter()
    print(f"[{time.perf_counter() - started:6.0f}s] timing ...", flush=True)
    timing = spawn(args, "time")
    if timing.get("error"):
        print(timing["error"], timing.get("stderr_tail"), file=sys.stderr)
    memory = {}
    if not args.no_memory:
        for method in MEMORY_METHODS:
            print(f"[{time.perf_counter() - started:6.0f}s] memory {method} ...", flush=True)
            memory[method] = spawn(args, "memory", method)
            if memory[method].get("error"):
                print(memory[method]["error"], memory[method].get("stderr_tail"), file=sys.stderr)
    row = summarize(timing, memory)
    finish_meta(meta, started)
    table = render(row, timing)
    header = (f"# MeZO-BCD benchmark\n\n`{command}`  \n{meta['cpu']}, {meta['cpus']} CPUs, torch {meta['torch']}, "
              f"lightning {meta['lightning']}, threads {args.threads}, device cpu; BERT-style encoder from its "
              f"configuration: {args.layers} layers, hidden 384, 6 heads, FFN 1536, random weights; batch "
              f"{args.batch} x {args.seq_len} tokens; repeats {args.repeats} (+{args.warmup} warm-up): per "
              f"repetition one full random-order BCD cycle ({timing.get('n_blocks')} steps) and "
              f"{args.steps_per_repeat} steps of each other method; {load_and_total(meta)}\n\n")
    print("\n" + table)
    write_results(results_stem(args.out, "bench_mezo_bcd", args.quick), header + table,
                  {"meta": meta, "row": row, "timing": timing, "memory": memory})


if __name__ == "__main__":
    main()

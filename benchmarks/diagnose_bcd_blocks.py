#!/usr/bin/env python
"""Why MeZO-BCD's test loss stops falling above MeZO's: each block's share of the curvature.

The accuracy runs (``bench_mezo_bcd_accuracy.py``, README) train MeZO at ``eta`` and MeZO-BCD at
``c eta`` (c = 10, the paper's layer-wise grids are 5-10x MeZO's). BCD's test loss then plateaus
at 0.551-0.559 while MeZO's keeps falling. This script measures the quantity that a second-order
expansion of the ZO step says decides that.

**The expansion.** One ZO-SGD step on block ``B`` (``lam -> 0``, Gaussian ``z_B``) moves
``theta_B -= eta_B (z_B . g~_B) z_B``, with ``g~`` the minibatch gradient. To second order, with
``g`` the full gradient and ``H_BB`` the block's Hessian,

    E[dL] = -eta_B ||g_B||^2 + eta_B^2 / 2 * (E||g~_B||^2 tr(H_BB) + 2 E[g~_B' H_BB g~_B])

(MeZO is the one-block case: all of ``theta``). The first term is the descent, the second the
noise the random direction injects; the loss stops falling where they balance. Relative to MeZO's
balance, block ``B`` at ``c eta`` balances at a gradient ``kappa_B`` times larger when the gradient and
minibatch-noise shares of the block are alike:

    kappa_B = c * tr(H_BB) / tr(H)   (and exactly: c tr(H_BB) E||g~_B||^2 ||g||^2 / (tr(H) E||g~||^2 ||g_B||^2)).

With ``N`` blocks sharing the curvature evenly, ``kappa_B = c / N`` (1.25 here); a block that holds
more of ``tr(H)`` than ``1 / c`` of it runs hotter than MeZO and holds BCD's loss above MeZO's.

**The measurement** (at the zero-shot start of the runs; the runs move the weights little):
a seeded random subset of ``--examples`` training reviews (the accuracy runs' model, data, blocks and
tokenizer: ``configs/mezo_bcd/minilm_rotten_tomatoes_mezo_bcd.yaml``), in minibatches of 32 (the runs'
``B``), the model in eval mode (as the ZO step runs it):

* ``||g_B||^2`` of the subset's mean-loss gradient and ``E||g~_B||^2`` over its minibatches (autograd);
* ``tr(H_BB)`` of the subset's mean loss by Hutchinson's estimator: per minibatch and block,
  ``--samples`` Rademacher ``z_B`` on that block alone, ``z_B . H_BB z_B`` from one Hessian-vector
  product (a double backward through the minibatch's gradient graph); the mean over minibatches and
  samples is unbiased for the subset's ``tr(H_BB)``, its standard error is reported. (One HVP with
  ``z`` over all blocks also has mean ``tr(H_BB)`` on each block, but its cross-block terms made the
  estimates useless: negative traces for the head, whose Hessian is positive semi-definite.)
* the predicted ``E[dL]`` per step of MeZO at ``--mezo-lr`` and of BCD at ``--bcd-lr`` (a uniform
  block), from the expansion above.

Attention runs in eager mode (Hessian-vector products need double backward).

Usage::

    python benchmarks/diagnose_bcd_blocks.py                      # ~5 min on 2 cores
    python benchmarks/diagnose_bcd_blocks.py --examples 64 --samples 2 --out /tmp/d   # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MINIBATCH = 32  # the accuracy runs' batch size


def load(args):
    """The accuracy runs' MeZO-BCD module (eager attention) and ``--examples`` seeded training reviews."""
    import torch
    import yaml
    from torch.utils.data import Subset

    import bench_mezo_bcd_accuracy as acc

    cfg = yaml.safe_load(acc.CONFIGS["bcd"].read_text())
    backbone_cfg = cfg["model"]["init_args"]["backbone"]
    backbone_args = dict(backbone_cfg["init_args"], model_kwargs={"attn_implementation": "eager"})
    backbone = acc._class(backbone_cfg["class_path"])(**backbone_args)
    init = {k: v for k, v in cfg["model"]["init_args"].items() if k != "backbone"}
    module = acc._class(cfg["model"]["class_path"])(backbone, **init)
    dm = acc._class(cfg["data"]["class_path"])(**dict(cfg["data"]["init_args"], eval_batch_size=MINIBATCH))
    dm.setup("fit")
    order = torch.randperm(len(dm.private_dataset), generator=torch.Generator().manual_seed(0))
    subset = Subset(dm.private_dataset, order[:args.examples].tolist())
    module.eval()
    return module, list(dm._eval_loader(subset))   # minibatches of 32, each padded to its longest review


def mean_loss(module, batch):
    import torch.nn.functional as F

    inputs, targets = batch
    return F.cross_entropy(module(inputs).float(), targets)


def gradient_terms(module, params, blocks, batches):
    """``||g_B||^2`` of the mean over all batches and ``E||g~_B||^2`` over the minibatches, per block."""
    import torch

    total = [torch.zeros_like(p) for p in params]
    noisy = torch.zeros(len(blocks), dtype=torch.float64)
    for batch in batches:
        grads = torch.autograd.grad(mean_loss(module, batch), params)
        for acc_g, g in zip(total, grads):
            acc_g += g
        noisy += block_sq_norms(grads, blocks)
    full = [g / len(batches) for g in total]
    return block_sq_norms(full, blocks), noisy / len(batches)


def block_sq_norms(tensors, blocks):
    import torch

    out = torch.zeros(len(blocks), dtype=torch.float64)
    for b, idx in enumerate(blocks):
        out[b] = sum(float(tensors[i].double().pow(2).sum()) for i in idx)
    return out


def hutchinson_block_traces(module, params, blocks, batches, samples: int, seed: int):
    """Estimates of every ``tr(H_BB)`` of the mean loss: per minibatch, ``samples`` Rademacher ``z_B`` per
    block, each through one Hessian-vector product on that block alone (no cross-block terms); rows are
    (minibatch, sample) estimates, columns blocks."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for k, batch in enumerate(batches):
        grads = torch.autograd.grad(mean_loss(module, batch), params, create_graph=True)
        for _ in range(samples):
            row = []
            for idx in blocks:
                z = [torch.randint(0, 2, params[i].shape, generator=gen).to(params[i].dtype).mul_(2).sub_(1)
                     for i in idx]
                dot = sum((grads[i] * v).sum() for i, v in zip(idx, z))
                hz = torch.autograd.grad(dot, [params[i] for i in idx], retain_graph=True)
                row.append(sum(float((v.double() * h.double()).sum()) for v, h in zip(z, hz)))
            rows.append(row)
        print(f"  minibatch {k + 1}/{len(batches)}: tr(H) ~ {sum(rows[-1]):.3e}", file=sys.stderr, flush=True)
    return torch.tensor(rows, dtype=torch.float64)


def predicted_step(lr, g2, noisy_g2, trace) -> float:
    """``E[dL]`` of one ZO-SGD step to second order, without the ``2 g~'Hg~`` term (<= 2 / tr(H) of the other)."""
    return -lr * g2 + lr * lr / 2 * noisy_g2 * trace


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=256, help="training reviews (seeded random subset)")
    parser.add_argument("--samples", type=int, default=2, help="Hutchinson samples per block and minibatch")
    parser.add_argument("--mezo-lr", type=float, default=3e-5)
    parser.add_argument("--bcd-lr", type=float, default=3e-4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="results stem (default results/diagnose_bcd_blocks)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    module, batches = load(args)
    named_blocks = module.blocks()
    params = [p for blk in named_blocks for p in blk.params]
    index, blocks = 0, []
    for blk in named_blocks:
        blocks.append(list(range(index, index + len(blk.params))))
        index += len(blk.params)
    g2, noisy_g2 = gradient_terms(module, params, blocks, batches)
    traces = hutchinson_block_traces(module, params, blocks, batches, args.samples, seed=0)
    tr_mean = traces.mean(0)
    n_est = traces.shape[0]
    tr_se = traces.std(0, unbiased=True) / math.sqrt(n_est) if n_est > 1 else torch.zeros_like(tr_mean)
    total_tr = float(tr_mean.sum())
    total_tr_se = float(traces.sum(1).std(unbiased=True) / math.sqrt(n_est)) if n_est > 1 else 0.0
    c = args.bcd_lr / args.mezo_lr
    mezo_step = predicted_step(args.mezo_lr, float(g2.sum()), float(noisy_g2.sum()), total_tr)
    rows = []
    for b, blk in enumerate(named_blocks):
        kappa_exact = (c * float(tr_mean[b]) * float(noisy_g2[b]) * float(g2.sum())
                       / (total_tr * float(noisy_g2.sum()) * float(g2[b])))
        rows.append({"block": blk.name, "numel": blk.numel, "g2": float(g2[b]), "noisy_g2": float(noisy_g2[b]),
                     "trace": float(tr_mean[b]), "trace_se": float(tr_se[b]),
                     "trace_share": float(tr_mean[b]) / total_tr, "g2_share": float(g2[b] / g2.sum()),
                     "noisy_share": float(noisy_g2[b] / noisy_g2.sum()), "numel_share": blk.numel / sum(p.numel() for p in params),
                     "kappa": c * float(tr_mean[b]) / total_tr, "kappa_exact": kappa_exact,
                     "bcd_step": predicted_step(args.bcd_lr, float(g2[b]), float(noisy_g2[b]), float(tr_mean[b]))})
    bcd_step = sum(r["bcd_step"] for r in rows) / len(rows)
    command = " ".join(["python", "benchmarks/diagnose_bcd_blocks.py"] + [shlex.quote(a) for a in (argv or sys.argv[1:])])
    result = {"command": command, "args": vars(args), "examples": len(torch.cat([b[1] for b in batches])),
              "minibatches": len(batches), "total_trace": total_tr, "total_trace_se": total_tr_se,
              "g2": float(g2.sum()), "noisy_g2": float(noisy_g2.sum()), "c": c,
              "mezo_step": mezo_step, "bcd_step_mean": bcd_step, "blocks": rows,
              "wall_s": round(time.perf_counter() - started, 1)}
    text = render(result)
    print(text)
    stem = Path(args.out) if args.out else RESULTS / "diagnose_bcd_blocks"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(f"wrote {stem.with_suffix('.md')} and {stem.with_suffix('.json')}", file=sys.stderr)


def render(r: dict) -> str:
    a = r["args"]
    lines = ["# MeZO-BCD blocks: curvature and gradient shares (MiniLM, Rotten Tomatoes, zero-shot start)\n",
             f"`{r['command']}`  ",
             f"{r['examples']} training reviews (seeded random subset) in {r['minibatches']} minibatches of {MINIBATCH}; "
             f"Hutchinson: {a['samples']} Rademacher samples per block and minibatch, one HVP on the block alone each "
             f"(SE over the {r['minibatches'] * a['samples']} estimates); "
             f"MeZO lr {a['mezo_lr']:g}, BCD lr {a['bcd_lr']:g} (c = {r['c']:g}); {r['wall_s']:.0f} s.\n",
             f"tr(H) = {r['total_trace']:.4g} +- {r['total_trace_se']:.2g}; ||g||^2 = {r['g2']:.4g}; "
             f"E||g~||^2 (minibatch {MINIBATCH}) = {r['noisy_g2']:.4g}.\n",
             "| block | params share | tr(H_BB) (+- SE) | tr share | g^2 share | E g~^2 share | kappa = c tr share | kappa (exact shares) | predicted E[dL] per BCD step on it |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for b in r["blocks"]:
        lines.append(f"| {b['block']} | {b['numel_share']:.3f} | {b['trace']:.3g} +- {b['trace_se']:.2g} | "
                     f"{b['trace_share']:.3f} | {b['g2_share']:.3f} | {b['noisy_share']:.3f} | {b['kappa']:.2f} | "
                     f"{b['kappa_exact']:.2f} | {b['bcd_step']:.3g} |")
    lines += ["", f"Predicted E[dL] per step at the start: MeZO {r['mezo_step']:.3g}; BCD (uniform block) "
                  f"{r['bcd_step_mean']:.3g}; ratio BCD / MeZO {r['bcd_step_mean'] / r['mezo_step']:.2f} per step.",
              "kappa > 1: at these lrs the block's direction noise balances its descent at a larger gradient than "
              "MeZO's whole-model step does (a higher loss floor); kappa < 1: lower."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

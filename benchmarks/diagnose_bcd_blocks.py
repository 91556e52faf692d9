"""Why MeZO-BCD's test loss stops falling above MeZO's: each block's share of the curvature.

The accuracy runs (``bench_mezo_bcd_accuracy.py``, README) train MeZO at ``eta`` and MeZO-BCD at
``c eta`` (c = 10; the paper's layer-wise grids are 5-10x MeZO's). BCD's test loss then plateaus
at 0.551-0.559 while MeZO's keeps falling. This script measures the quantity that a second-order
expansion of the ZO step says decides that.

**The expansion.** One ZO-SGD step on block ``B`` (``lam -> 0``, Gaussian ``z_B``) moves
``theta_B -= eta_B (z_B . g~_B) z_B``, with ``g~`` the minibatch gradient. To second order, with
``g`` the full gradient and ``H_BB`` the block's Hessian,

    E[dL] = -eta_B ||g_B||^2 + eta_B^2 / 2 * (E||g~_B||^2 tr(H_BB) + 2 E[g~_B' H_BB g~_B])

(MeZO is the one-block case: all of ``theta``). The first term is the descent, the second the
noise the random direction injects; the loss stops falling where they balance. Where a block's
shares of ``||g||^2`` and of the minibatch noise ``E||g~||^2`` are alike, a step on block ``B`` at
``c eta`` has ``kappa_B`` times MeZO's noise-to-descent ratio, with

    kappa_B = c * tr(H_BB) / tr(H).

With ``N`` blocks sharing the curvature evenly, ``kappa_B = c / N`` (1.25 here); a block that holds
more than ``1 / c`` of ``tr(H)`` runs hotter than MeZO, reaches its balance at a larger gradient, and
holds BCD's loss above MeZO's. ``block_lr`` factors ``min(1, 1 / kappa_B)`` cool each block to MeZO's
ratio (printed; ``MeZOBCD(block_lr=[...])``).

**The measurement** (at the zero-shot start of the runs; the runs move the weights little):
a seeded random subset of ``--examples`` training reviews (the accuracy runs' model, data, blocks and
tokenizer: ``configs/mezo_bcd/minilm_rotten_tomatoes_mezo_bcd.yaml``), in minibatches of 32 (the runs'
``B``), the model in eval mode (as the ZO step runs it):

* ``tr(H_BB)`` of the subset's mean loss by Hutchinson's estimator: per minibatch and block,
  ``--samples`` Rademacher ``z_B`` on that block alone, ``z_B . H_BB z_B`` from one Hessian-vector
  product (a double backward through the minibatch's gradient graph); the mean over minibatches and
  samples is unbiased for the subset's ``tr(H_BB)``, its standard error is reported. (One HVP with
  ``z`` over all blocks also has mean ``tr(H_BB)`` on each block, but its cross-block terms made the
  estimates useless: negative traces for the head, whose Hessian is positive semi-definite.)
* each block's share of ``||g_n||^2`` (the subset's mean gradient) and of ``E||g~_32||^2`` (its
  minibatches), by autograd, and the i.i.d. split ``E||g_m||^2 = ||g||^2 + tr(Sigma) / m`` of the two
  into the population ``||g||^2`` and the per-example noise ``tr(Sigma)``. At the MiniLM start the
  subset's gradient is nearly all sampling noise (``||g_512||^2`` about ``E||g~_32||^2 / 16``), so
  ``||g||^2`` is not resolved and neither is the absolute loss change per step; ``kappa`` needs only
  the trace shares.

Attention runs in eager mode (Hessian-vector products need double backward).

Usage::

    python benchmarks/diagnose_bcd_blocks.py                      # ~6 min on 2 cores (512 reviews)
    python benchmarks/diagnose_bcd_blocks.py --examples 64 --samples 1 --out /tmp/d   # smoke run
    python benchmarks/diagnose_bcd_blocks.py --render benchmarks/results/diagnose_bcd_blocks.json
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
    from torch.utils.data import Subset

    import bench_mezo_bcd_accuracy as acc

    module, dm, _ = acc.build("bcd", args.bcd_lr, argparse.Namespace(),
                              backbone_extra={"model_kwargs": {"attn_implementation": "eager"}},
                              data_extra={"eval_batch_size": MINIBATCH})
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


def derive(r: dict) -> dict:
    """The shares, ``kappa`` and the suggested factors from the measured sums (also for --render)."""
    blocks, c = r["blocks"], r["args"]["bcd_lr"] / r["args"]["mezo_lr"]
    total_tr = sum(b["trace"] for b in blocks)
    g2, noisy = sum(b["g2"] for b in blocks), sum(b["noisy_g2"] for b in blocks)
    numel = sum(b["numel"] for b in blocks)
    n, m = r["examples"], MINIBATCH
    noise_trace = (noisy - g2) / (1 / m - 1 / n) if n > m else float("nan")   # tr(Sigma), per example
    r.update(c=c, total_trace=total_tr, g2=g2, noisy_g2=noisy, noise_trace=noise_trace,
             population_g2=g2 - noise_trace / n)
    for b in blocks:
        b.update(numel_share=b["numel"] / numel, trace_share=b["trace"] / total_tr, g2_share=b["g2"] / g2,
                 noisy_share=b["noisy_g2"] / noisy, kappa=c * b["trace"] / total_tr,
                 factor=min(1.0, total_tr / (c * b["trace"])) if b["trace"] > 0 else 1.0)
    return r


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=512,
                        help="training reviews (seeded random subset; more than one minibatch of 32)")
    parser.add_argument("--samples", type=int, default=2, help="Hutchinson samples per block and minibatch")
    parser.add_argument("--mezo-lr", type=float, default=3e-5)
    parser.add_argument("--bcd-lr", type=float, default=3e-4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="results stem (default results/diagnose_bcd_blocks)")
    parser.add_argument("--render", metavar="JSON", default=None, help="rewrite the .md and .json of a finished run")
    args = parser.parse_args(argv)
    if not args.render and args.examples <= MINIBATCH:
        parser.error(f"--examples must exceed one minibatch ({MINIBATCH}): the noise split needs two sizes")
    if args.render:
        return write(derive(json.loads(Path(args.render).read_text())), Path(args.render).with_suffix(""))
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
    n_est = traces.shape[0]
    tr_se = traces.std(0, unbiased=True) / math.sqrt(n_est) if n_est > 1 else torch.zeros(len(blocks))
    total_tr_se = float(traces.sum(1).std(unbiased=True) / math.sqrt(n_est)) if n_est > 1 else 0.0
    rows = [{"block": blk.name, "numel": blk.numel, "g2": float(g2[b]), "noisy_g2": float(noisy_g2[b]),
             "trace": float(traces[:, b].mean()), "trace_se": float(tr_se[b])} for b, blk in enumerate(named_blocks)]
    command = " ".join(["python", "benchmarks/diagnose_bcd_blocks.py"] + [shlex.quote(a) for a in (argv or sys.argv[1:])])
    result = {"command": command, "args": vars(args), "examples": sum(len(b[1]) for b in batches),
              "minibatches": len(batches), "total_trace_se": total_tr_se, "blocks": rows,
              "wall_s": round(time.perf_counter() - started, 1)}
    write(derive(result), Path(args.out) if args.out else RESULTS / "diagnose_bcd_blocks")


def write(result: dict, stem: Path) -> None:
    text = render(result)
    print(text)
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
             f"tr(H) = {r['total_trace']:.4g} +- {r['total_trace_se']:.2g}. Gradients: ||g_{r['examples']}||^2 = "
             f"{r['g2']:.4g} (the subset's mean), E||g~_{MINIBATCH}||^2 = {r['noisy_g2']:.4g} (its minibatches); the "
             f"i.i.d. split gives per-example noise tr(Sigma) = {r['noise_trace']:.4g} and a population "
             f"||g||^2 = {r['population_g2']:.3g}, not resolved (the subset's gradient is nearly all sampling noise).\n",
             "| block | params share | tr(H_BB) (+- SE) | tr share | ||g_n||^2 share | E||g~||^2 share | kappa = c tr share | block_lr factor min(1, 1/kappa) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for b in r["blocks"]:
        lines.append(f"| {b['block']} | {b['numel_share']:.4f} | {b['trace']:.3g} +- {b['trace_se']:.2g} | "
                     f"{b['trace_share']:.3f} | {b['g2_share']:.3f} | {b['noisy_share']:.3f} | {b['kappa']:.2f} | "
                     f"{b['factor']:.2f} |")
    lines += ["", "kappa > 1: at c times MeZO's lr a step on the block has a larger noise-to-descent ratio than a "
                  "MeZO step (its loss stops falling at a larger gradient); kappa < 1: smaller.",
              "Factors: `MeZOBCD(block_lr=[" + ", ".join(f"{b['factor']:.2f}" for b in r["blocks"]) + "])`."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

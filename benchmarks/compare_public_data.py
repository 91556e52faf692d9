#!/usr/bin/env python
"""Test accuracy with and without public data on the real sklearn digits: the PAZO paper's Table 2/6 comparison at
toy scale (CPU, seconds per fit).

Each method is its quickstart config, run through the real CLI (``python -m lit_zodp.cli fit --config ...``) with the
same DataModule split (``--public-fraction`` of the pool held out as public data, the rest private; the same
``val_fraction`` and test set for every method), at epsilon 4 (the configs' budget), each ``--repeats`` times,
methods interleaved (run 1 of every method, then run 2, ...) so that a load change on this shared machine touches
every method alike. A private fit's noise and Poisson batches are drawn from the OS, so repeats differ; the public
batches and the initialisation follow ``seed_everything`` and ``data_seed`` (the same in every run).

Methods (``configs/pazo/quickstart_*.yaml``, ``configs/quickstart.yaml``, ``configs/first_order/quickstart_dpsgd.yaml``):
DPZero and DP-SGD (private data only), PAZO-M, PAZO-P, PAZO-S (ZO with public data), DOPE-SGD, DPMD and GEP (first order
with public data), and public-only SGD (``quickstart_public_only.yaml``: no privacy spent).

Usage::

    python benchmarks/compare_public_data.py                          # 3 repeats at public fraction 0.1 (~6 min)
    python benchmarks/compare_public_data.py --public-fraction 0.04 --max-steps 3000 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (chosen_methods, cli_fit_result, command_line, machine_info, results_stem,  # noqa: E402
                     write_results)

METHODS = {
    "DPZero": "configs/quickstart.yaml",
    "DP-SGD": "configs/first_order/quickstart_dpsgd.yaml",
    "PAZO-M": "configs/pazo/quickstart_pazom.yaml",
    "PAZO-P": "configs/pazo/quickstart_pazop.yaml",
    "PAZO-S": "configs/pazo/quickstart_pazos.yaml",
    "DOPE-SGD": "configs/pazo/quickstart_dopesgd.yaml",
    "DPMD": "configs/pazo/quickstart_dpmd.yaml",
    "GEP": "configs/pazo/quickstart_gep.yaml",
    "public only": "configs/pazo/quickstart_public_only.yaml",
}


def fit(config: str, public_fraction: float, max_steps: int | None) -> tuple[float, float]:
    """One CLI fit: (test accuracy, wall seconds of its training, as its RESULT line reports)."""
    arguments = ["--data.init_args.public_fraction", str(public_fraction)]
    if max_steps:
        arguments += ["--trainer.max_steps", str(max_steps)]
    values = cli_fit_result(config, arguments)
    return float(values["accuracy"]), float(values["wall_s"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--public-fraction", type=float, default=0.1)
    parser.add_argument("--max-steps", type=int, default=None, help="override every config's max_steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    methods = chosen_methods(parser, args.methods, METHODS)
    started, runs = time.time(), {m: [] for m in methods}
    for repeat in range(args.repeats):
        for method in methods:
            accuracy, seconds = fit(METHODS[method], args.public_fraction, args.max_steps)
            runs[method].append({"accuracy": accuracy, "wall_s": seconds})
            print(f"[{repeat + 1}/{args.repeats}] {method}: accuracy {accuracy:.4f} ({seconds:.1f} s)", flush=True)
    rows = ["| method | config | test accuracy (runs) | mean | wall s (median) |", "|---|---|---|---:|---:|"]
    for method in methods:
        accuracies = [r["accuracy"] for r in runs[method]]
        rows.append(f"| {method} | `{METHODS[method]}` | {', '.join(f'{a:.3f}' for a in accuracies)} | "
                    f"{statistics.mean(accuracies):.3f} | {statistics.median(r['wall_s'] for r in runs[method]):.1f} |")
    meta = {"command": command_line("compare_public_data.py", sys.argv[1:] if argv is None else argv),
            "machine": machine_info(), "public_fraction": args.public_fraction, "max_steps": args.max_steps,
            "seconds": round(time.time() - started, 1)}
    steps = f"{args.max_steps} steps each" if args.max_steps else "each config's steps"
    markdown = (f"Digits, epsilon 4 (delta 1e-5), public fraction {args.public_fraction}, "
                f"{steps}; `{meta['command']}`\n\n" + "\n".join(rows) + "\n")
    print(markdown)
    write_results(results_stem(args.out, f"compare_public_data_public{round(100 * args.public_fraction)}pct"), markdown,
                  {"meta": meta, "runs": runs})


if __name__ == "__main__":
    main()

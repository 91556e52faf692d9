#!/usr/bin/env python
"""Robust phase retrieval (the O2NC paper's reading notes, experiment E2): O2NC's private oracles against DPZero and
DP-SGD over one pass of the same data, at the same budget (CPU, seconds per fit).

Each method is a config in ``configs/o2nc/`` run through the real CLI (``python -m lit_zodp.cli fit --config ...``),
with the dimension ``d`` and the budget set on the command line; ``--repeats`` runs each, methods interleaved (run 1 of
every method, then run 2, ...). The metrics are the test ``distance`` ``min_s ||x - s x*||`` to the planted unit signal
and the ``goldstein`` bound on ``||dbar_r F(x)||`` at ``r = 0.1`` (``2 alpha`` for O2NC's ``alpha = 0.05``: the
stationarity its guarantee is about; :class:`~lit_zodp.backbones.phase_retrieval.GoldsteinBound`), both from the RESULT
line; for O2NC at ``x_out``, a uniformly drawn window average (Alg. 2 line 4). A fit's noise is drawn from
the OS and the single pass's assignment from ``data_seed``, so repeats differ in their noise only.

Methods: DPO2NC with Alg. 3 at period 1 (every step an anchor: the quickstart), at period 16 with the paper's
independent directions at ``z_{t-1}``, at period 4 with shared directions, and at period 4 on an anchored pass (``B1 =
40`` rows at each anchor, ``B2 = 10`` between: Thm. 3.1's ``B1 = Sigma B2``); the first-order oracle (Alg. 5) at period
1 and on the anchored pass (``C = 1 = L``, ``C' = 0.25``); Zhang et al.'s baseline as the reading notes reconstruct it
(``m = d``, noise for the worst-case sensitivity, the anchored pass); DPO2NC with Alg. 4 on Poisson batches
(2,000 steps at ``q = 20 / n``: not one pass); DPZero; DP-SGD (first order); and the non-private O2NC.

Usage::

    python benchmarks/compare_o2nc.py                                  # d = 16, epsilon 4, 3 repeats (~8 min)
    python benchmarks/compare_o2nc.py --dims 8,32,64 --repeats 2
    python benchmarks/compare_o2nc.py --methods "DPO2NC Alg. 5 (first order) period 1,DP-SGD (first order)" \
        --out benchmarks/results/compare_o2nc_first_order_d16_eps4                  # some rows, another file
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cli_fit_result, command_line, machine_info, results_stem, write_results  # noqa: E402

DPO2NC = "configs/o2nc/quickstart_dpo2nc.yaml"
METHODS = {
    "DPO2NC Alg. 3 period 1": (DPO2NC, []),
    "DPO2NC Alg. 3 period 16 (independent directions)": (DPO2NC, ["--model.init_args.period", "16"]),
    "DPO2NC Alg. 3 period 4 (shared directions)": (DPO2NC, ["--model.init_args.period", "4",
                                                               "--model.init_args.difference_directions", "shared"]),
    "DPO2NC Alg. 3 period 4 anchored (B1 = 40; B2 = 10; shared directions)": (
        "configs/o2nc/quickstart_dpo2nc_anchored.yaml", []),
    "Zhang et al. (reconstruction: m = d; worst-case sensitivity; anchored)": (
        "configs/o2nc/quickstart_zhang_baseline.yaml", []),
    "DPO2NC Alg. 5 (first order) period 1": ("configs/o2nc/quickstart_dpo2nc_first_order.yaml", []),
    "DPO2NC Alg. 5 (first order) period 4 anchored (B1 = 40; B2 = 10; shared points)": (
        "configs/o2nc/quickstart_dpo2nc_anchored.yaml", ["--model.init_args.estimator", "first_order",
                                                          "--model.init_args.clip", "1.0",
                                                          "--model.init_args.difference_clip", "0.25"]),
    "DPO2NC Alg. 4 (multi-pass Poisson) period 1": ("configs/o2nc/quickstart_dpo2nc_multipass.yaml", []),
    "DPZero": ("configs/o2nc/quickstart_dpzero.yaml", []),
    "DP-SGD (first order)": ("configs/o2nc/quickstart_dpsgd.yaml", []),
    "O2NC non-private period 1": ("configs/o2nc/quickstart_o2nc.yaml", []),
}


def fit(config: str, extra: list[str], dim: int, epsilon: float) -> dict[str, float]:
    """One CLI fit: its RESULT line's test ``distance`` and ``goldstein`` and the wall seconds of its training."""
    arguments = [*extra, "--model.init_args.backbone.init_args.dim", str(dim), "--data.init_args.dim", str(dim)]
    if "o2nc.yaml" not in config:  # (the non-private one has no budget)
        arguments += ["--model.init_args.target_epsilon", str(epsilon)]
    values = cli_fit_result(config, arguments)
    return {key: float(values[key]) for key in ("distance", "goldstein", "wall_s")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", default="16", help="comma-separated dimensions d")
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of: " + ", ".join(METHODS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    dims = [int(d) for d in args.dims.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown --methods {unknown}: choose from {list(METHODS)}")
    started, runs = time.time(), {(m, d): [] for m in methods for d in dims}
    for repeat in range(args.repeats):
        for dim in dims:
            for method in methods:
                config, extra = METHODS[method]
                result = fit(config, extra, dim, args.epsilon)
                runs[(method, dim)].append(result)
                print(f"[{repeat + 1}/{args.repeats}] d={dim} {method}: distance {result['distance']:.4f}, "
                      f"goldstein {result['goldstein']:.4f} ({result['wall_s']:.1f} s)", flush=True)
    rows = ["| method | d | test distance (runs) | mean | Goldstein bound at r = 0.1 (mean) | wall s (median) |",
            "|---|---:|---|---:|---:|---:|"]
    for dim in dims:
        for method in methods:
            done = runs[(method, dim)]
            distances = [r["distance"] for r in done]
            rows.append(f"| {method} | {dim} | {', '.join(f'{x:.3f}' for x in distances)} | "
                        f"{statistics.mean(distances):.3f} | {statistics.mean(r['goldstein'] for r in done):.3f} | "
                        f"{statistics.median(r['wall_s'] for r in done):.1f} |")
    meta = {"command": command_line("compare_o2nc.py", sys.argv[1:] if argv is None else argv),
            "machine": machine_info(), "dims": dims, "epsilon": args.epsilon, "seconds": round(time.time() - started, 1)}
    markdown = (f"Robust phase retrieval, one pass of 40,000 rows in batches of 20 (the anchored pass: 40 and 10), "
                f"epsilon {args.epsilon:g} (delta 1e-6); `{meta['command']}`\n\n" + "\n".join(rows) + "\n")
    print(markdown)
    stem = f"compare_o2nc_d{'-'.join(map(str, dims))}_eps{args.epsilon:g}"
    write_results(results_stem(args.out, stem), markdown,
                  {"meta": meta, "runs": {f"{m} | d={d}": r for (m, d), r in runs.items()}})


if __name__ == "__main__":
    main()

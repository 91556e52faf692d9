"""DPZero's synthetic experiment (Zhang et al., Sec. 5.1 and App. B.1, Fig. 1) with this package's modules.

    python benchmarks/repro_dpzero_synthetic.py                    # default: d in {20, 200}, reduced grid (~15 min)
    python benchmarks/repro_dpzero_synthetic.py --dims all         # the paper's seven dimensions, 20 to 2000
    python benchmarks/repro_dpzero_synthetic.py --grid paper       # Table 6's full grid (days on one core)
    python benchmarks/repro_dpzero_synthetic.py --noise paper      # Alg. 1-2's noise (see below)

Every number comes from a real fit: ``QuadraticDataModule`` (the rows ``x_i ~ N(1, I)``, 10,000 to train and
10,000 to test), ``QuadraticLoss`` (``f(x; x_i) = (x - x_i)^T A (x - x_i) / 2``, ``x_0 = 0``) and the module of
each method, driven by a Lightning ``Trainer``: ``DPZero`` (Alg. 2), ``DPGD0th`` (Alg. 1), both with directions
on the ``sqrt(d)`` sphere (Alg. 1-2 line 2) and ``lam = 1e-4`` (Table 6), and DP-GD, which is ``DPSGD`` without
momentum on full batches. The gradient norm of a fit's last iterate is exact: ``||A (x_T - mean_i x_i)||`` over
the training rows (read by this script, as the paper reports it: a statistic of the private set outside the
guarantee) and over the test rows (the module's own ``test_grad_norm``, logged by ``trainer.test``). For each
(pattern, d, method) the best configuration of the grid is picked by the training gradient norm.

Choices where the paper is silent, and why:

* Batches. Alg. 1-2 average over all ``n`` examples at every step, and the code App. B.1 says the synthetic
  example builds on (Li et al. 2022, github.com/lxuechen/private-transformers ``examples/decay_toy.py``) takes
  the full-batch gradient too; Table 6 gives no batch size. So every method here is full batch
  (``sampling: full_batch``): each step is one Gaussian mechanism on the whole set, no subsampling.
* Noise. ``--noise prv`` (default): the package's accounting, ``sigma`` calibrated by the PRV accountant to
  (2, 1e-6) under add/remove neighbours for the run's ``T`` full-batch steps (about ``2.28 sqrt(T)``).
  ``--noise paper``: Alg. 1-2 line 3's ``sigma = 4 C sqrt(2 T log(e + eps/delta)) / (n eps)`` on the mean
  (advanced composition, replace-one: about ``10.8 sqrt(T)`` times ``C / n``, 4.7x the default), passed as the
  noise multiplier; the ledger then reports the epsilon the PRV accountant certifies for it (below 2). Li et
  al.'s code calibrates by advanced composition too. The paper does not say which its figure used.
* ``x_0 = 0`` (Li et al.'s code starts its iterate at zero; the paper states none): ``QuadraticLoss``.
* Output: the last iterate (the paper's Alg. 1-2 output a uniformly drawn iterate; the package's modules, and
  the authors' language-model scripts, keep the last).

The reduced grid (``--grid reduced``, the default) and its reasons are in :data:`REDUCED_GRID`; ``--grid paper`` is
Table 6's ``10 x 11 x 8`` per cell. Results: ``benchmarks/results/repro_dpzero_synthetic.{md,json}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(HERE), str(ROOT)):  # (run as a script from anywhere: _common, lit_zodp, datamodules)
    if path not in sys.path:
        sys.path.insert(0, path)

from _common import setup_worker, write_results  # noqa: E402

PAPER_DIMS = (20, 50, 100, 200, 500, 1000, 2000)
DEFAULT_DIMS = (20, 200)
HESSIANS = ("identity", "sqrt", "log")
METHODS = ("DPZero", "DPGD-0th", "DP-GD")
EPSILON, DELTA, LAM, N_TRAIN, N_TEST = 2.0, 1e-6, 1e-4, 10_000, 10_000

#: Table 6: T, step size and clip are searched over these (the best is plotted).
PAPER_GRID = {
    "steps": (10, 20, 40, 80, 160, 320, 640, 1280, 2560, 5120),
    "lr": (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0),
    "clip": (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0),
}

#: The reduced grid (``--grid reduced``): Table 6's values, fewer of them (Table 6's full grid is 880 fits and 900,000
#: steps per cell: about a day of one core for d = 20 and 200 alone, at the step times measured here). Its reasons,
#: where they rest on "exploratory runs": a plain-torch re-implementation of the three methods with 1,000 rows and
#: this script's noise (not part of the results), used only to place the grid:
#:
#: * One clip per cell, at Table 6's largest value not above the typical per-example value ``rho`` at the optimum,
#:   which the problem's public definition gives (rows ``N(1, I)``, so ``x_i - mean`` has covariance ``I``):
#:   ``rho = sqrt(Tr(A^2))`` for DP-GD's ``||A (x - x_i)||`` and for DPZero's ``u^T A (x - x_i)`` (``E u u^T = I``),
#:   and ``sqrt(d Tr(A^2))`` for DPGD-0th's ``||s_i u||``. Below ``rho``, clipping scales every example's term by
#:   about ``C / rho`` and the noise by ``C``: fits at ``(lr, C)`` and ``(lr C / C', C')`` nearly coincide, so the
#:   step sizes sweep the product ``lr C`` that a clip grid would sweep; above ``rho`` a larger clip only adds
#:   noise. (In exploratory runs over clips 0.3 to 100, the best configurations lay along ``lr C`` = const.)
#: * Step sizes: four of Table 6's half-decades. Zeroth-order steps stop at 0.3: the estimator's variance grows
#:   with the effective rank, so they must stay below about ``1 / (l (r + 2))`` (Thm. 3 takes ``1 / (4 l (r + 2))``;
#:   ``l = ||A|| = 1``); where ``r + 2`` exceeds 200 (A = I beyond d = 200) their four values move down by as many
#:   half-decades as ``(r + 2) / 200`` spans (:func:`step_sizes`). DP-GD's go up to 1 (``1 / l``, one step to the
#:   optimum of an isotropic quadratic).
#: * T: the zeroth-order methods need many steps (their step sizes are small, and the coordinates of small
#:   curvature converge slowly from ``x_0 = 0``): 640 and 2560 (5120, Table 6's largest, improved DPZero and
#:   DPGD-0th by up to 1.5x at d = 2000 in exploratory runs, at 2x the cost); DP-GD: 160 and 640 (with the log
#:   pattern, d = 20 to 2000, 2560 and 5120 steps gained at most 20% over 640 in exploratory runs).
#: * Edges: where a cell's best step size is the smallest or the largest of its grid, the next two of Table 6's
#:   step sizes beyond it are tried too (at every T of the cell), until the best lies inside; where its best T is
#:   the smallest, the two smaller T of Table 6 (:func:`edge_extension`). A best at T = 2560 is not extended (cost).
#: * Cost: 8 fits per cell and the extensions, about 15 minutes of CPU for d in {20, 200}, every pattern and
#:   method, on one core.
#:
#: ``--grid paper`` runs Table 6's grid.
REDUCED_GRID = {
    "DPZero": {"steps": (640, 2560), "lr": (0.01, 0.03, 0.1, 0.3)},
    "DPGD-0th": {"steps": (640, 2560), "lr": (0.01, 0.03, 0.1, 0.3)},
    "DP-GD": {"steps": (160, 640), "lr": (0.03, 0.1, 0.3, 1.0)},
}


def typical_value(method: str, hessian: str, dim: int) -> float:
    """``rho``: the typical size of what each method clips, at the optimum (see :data:`REDUCED_GRID`)."""
    from lit_zodp.backbones.quadratic import hessian_diagonal

    trace_a2 = float((hessian_diagonal(hessian, dim) ** 2).sum())
    return math.sqrt(trace_a2 * (dim if method == "DPGD-0th" else 1))


def step_sizes(grid: dict, method: str, hessian: str, dim: int) -> tuple[float, ...]:
    """The grid's step sizes; a zeroth-order method's moved down the half-decades of Table 6 where ``r + 2 > 200``."""
    from lit_zodp.backbones.quadratic import hessian_diagonal

    if method == "DP-GD" or "clip" in grid:  # (Table 6's own grid is used as it is)
        return tuple(grid["lr"])
    shift = max(0, round(2 * math.log10((float(hessian_diagonal(hessian, dim).sum()) + 2) / 200)))
    values = PAPER_GRID["lr"]
    return tuple(values[max(0, values.index(lr) - shift)] for lr in grid["lr"])


def placed_clip(method: str, hessian: str, dim: int) -> float:
    """Table 6's largest clip not above ``rho`` (its smallest if none is)."""
    below = [c for c in PAPER_GRID["clip"] if c <= typical_value(method, hessian, dim)]
    return max(below) if below else min(PAPER_GRID["clip"])


GRIDS = {"reduced": REDUCED_GRID, "paper": {method: PAPER_GRID for method in METHODS}}


def grid_points(grid: dict, method: str, hessian: str, dim: int) -> list[tuple[int, float, float]]:
    clips = grid["clip"] if "clip" in grid else (placed_clip(method, hessian, dim),)
    return list(itertools.product(grid["steps"], step_sizes(grid, method, hessian, dim), clips))


def paper_noise_multiplier(steps: int) -> float:
    """Alg. 1-2 line 3's ``sigma`` as this package's noise multiplier: std ``sigma_m C`` on the sum, over ``n``."""
    from lit_zodp.privacy.calibration import dpzero_theory_sigma

    return dpzero_theory_sigma(clip=1.0, steps=steps, n=N_TRAIN, epsilon=EPSILON, delta=DELTA) * N_TRAIN


def make_module(method: str, backbone, *, lr: float, clip: float, steps: int, noise: str, seed: int,
                noise_seed: int | None, grad_mode: str):
    from lit_zodp.algorithms import DPGD0th, DPSGD, DPZero

    privacy = {"clip": clip, "delta": DELTA, "noise_seed": noise_seed}
    if noise == "paper":
        privacy["noise_multiplier"] = paper_noise_multiplier(steps)
    else:
        privacy["target_epsilon"] = EPSILON
    if method == "DPZero":
        return DPZero(backbone, lr=lr, lam=LAM, directions="sphere", perturbation="chunked", seed=seed, **privacy)
    if method == "DPGD-0th":
        return DPGD0th(backbone, lr=lr, lam=LAM, directions="sphere", perturbation="chunked", seed=seed, **privacy)
    return DPSGD(backbone, lr=lr, momentum=0.0, grad_mode=grad_mode, seed=seed, **privacy)


def run_one(data, method: str, hessian: str, dim: int, steps: int, lr: float, clip: float, args) -> dict:
    """One fit of ``steps`` full-batch steps; the exact train and test gradient norms of its last iterate."""
    import lightning.pytorch as pl
    import torch

    from lit_zodp.backbones import QuadraticLoss

    backbone = QuadraticLoss(dim, hessian)
    module = make_module(method, backbone, lr=lr, clip=clip, steps=steps, noise=args.noise, seed=args.seed,
                         noise_seed=args.noise_seed, grad_mode=args.grad_mode)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0)
    started, cpu_started = time.perf_counter(), time.process_time()
    trainer.fit(module, datamodule=data)
    fit_seconds = time.perf_counter() - started
    (tested,) = trainer.test(module, datamodule=data, verbose=False)
    train_rows = data.private_dataset.inputs
    with torch.no_grad():
        train_grad = float(backbone.gradient(train_rows).norm())
        train_loss = float(backbone(train_rows).mean())
    finite = math.isfinite(train_grad) and math.isfinite(tested["test_grad_norm"])
    return {"method": method, "hessian": hessian, "dim": dim, "steps": steps, "lr": lr, "clip": clip,
            "train_grad_norm": train_grad if finite else math.inf,
            "test_grad_norm": tested["test_grad_norm"] if finite else math.inf,
            "train_loss": train_loss, "test_loss": tested["test_loss"],
            "sigma": float(module.privacy.noise_multiplier), "epsilon": float(module.privacy.epsilon()),
            "steps_taken": trainer.global_step, "fit_seconds": fit_seconds,
            "seconds": time.perf_counter() - started, "cpu_seconds": time.process_time() - cpu_started}


def edge_extension(cell: list[dict], points: list[tuple[int, float, float]]) -> list[tuple[int, float, float]]:
    """Where the cell's best step size is the smallest or largest it tried, the next two of Table 6's step sizes
    beyond it, at every T of the cell; where its best T is the smallest it tried, the next two smaller of Table 6's
    T, at every step size (a larger T than 2560 is not tried: its cost). Empty when the best lies inside, or at the
    end of Table 6's values."""
    best = best_of(cell)
    steps = sorted({p[0] for p in points})
    rates = sorted({p[1] for p in points})
    clip = points[0][2]
    table_rates, table_steps = PAPER_GRID["lr"], PAPER_GRID["steps"]
    extra = []
    if math.isfinite(best["train_grad_norm"]):
        if best["lr"] == rates[0]:
            at = table_rates.index(rates[0])
            extra += [(t, lr, clip) for lr in table_rates[max(0, at - 2):at] for t in steps]
        elif best["lr"] == rates[-1]:
            at = table_rates.index(rates[-1])
            extra += [(t, lr, clip) for lr in table_rates[at + 1:at + 3] for t in steps]
        if best["steps"] == steps[0] and len(steps) > 0:
            at = table_steps.index(steps[0])
            extra += [(t, lr, clip) for t in table_steps[max(0, at - 2):at] for lr in rates]
    return extra


def best_of(runs: list[dict]) -> dict:
    return min(runs, key=lambda r: (r["train_grad_norm"], r["steps"], r["lr"]))


def initial_grad_norm(data, hessian: str, dim: int) -> tuple[float, float]:
    """``||A (x_0 - mean)||`` on train and test: where every method starts (and what not moving scores)."""
    from lit_zodp.backbones import QuadraticLoss

    backbone = QuadraticLoss(dim, hessian)
    return (float(backbone.gradient(data.private_dataset.inputs).norm()),
            float(backbone.gradient(data.test_dataset.inputs).norm()))


def table(best: dict, dims: list[int], start: dict) -> str:
    lines = []
    for hessian in HESSIANS:
        cells = [key for key in best if key[0] == hessian]
        if not cells:
            continue
        lines += [f"### A = {hessian} (effective rank {'O(d)' if hessian == 'identity' else 'O(sqrt(d))' if hessian == 'sqrt' else 'O(log d)'})",
                  "",
                  "| d | x_0 (train) | " + " | ".join(f"{m} train | {m} test | {m} (T, lr, C)" for m in METHODS) + " |",
                  "|---|---|" + "---|---|---|" * len(METHODS)]
        for dim in dims:
            row = [str(dim), f"{start[(hessian, dim)][0]:.3g}"]
            for method in METHODS:
                run = best.get((hessian, dim, method))
                row += (["-", "-", "-"] if run is None else
                        [f"{run['train_grad_norm']:.3g}", f"{run['test_grad_norm']:.3g}",
                         f"({run['steps']}, {run['lr']:g}, {run['clip']:g})"])
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def growth(best: dict, dims: list[int]) -> str:
    """Best train gradient norm at the largest d over the smallest, per pattern and method (Fig. 1's slopes)."""
    if len(dims) < 2:
        return ""
    low, high = dims[0], dims[-1]
    lines = [f"Growth of the best train gradient norm from d = {low} to d = {high}:", ""]
    for hessian in HESSIANS:
        parts = []
        for method in METHODS:
            a, b = best.get((hessian, low, method)), best.get((hessian, high, method))
            if a and b:
                parts.append(f"{method} x{b['train_grad_norm'] / a['train_grad_norm']:.2f}")
        if parts:
            lines.append(f"* {hessian}: " + ", ".join(parts))
    return "\n".join(lines)


def parse_dims(text: str) -> list[int]:
    if text == "all":
        return list(PAPER_DIMS)
    return [int(part) for part in text.split(",")]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dims", default=",".join(map(str, DEFAULT_DIMS)),
                        help="comma-separated dimensions, or 'all' for the paper's 20..2000")
    parser.add_argument("--hessians", default=",".join(HESSIANS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--grid", choices=sorted(GRIDS), default="reduced")
    parser.add_argument("--noise", choices=("prv", "paper"), default="prv")
    parser.add_argument("--seed", type=int, default=0, help="public run seed (directions)")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the rows")
    parser.add_argument("--noise-seed", type=int, default=None,
                        help="TEST ONLY: reproducible noise (the runs are then not private)")
    parser.add_argument("--grad-mode", default="bookkeeping",
                        help="DP-GD's per-example gradient mode (the same clipped sums; bookkeeping is the fastest here)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(HERE / "results" / "repro_dpzero_synthetic"))
    args = parser.parse_args(argv)

    setup_worker(args.threads)
    import torch

    from datamodules import QuadraticDataModule
    dims, hessians, methods = parse_dims(args.dims), args.hessians.split(","), args.methods.split(",")
    grid = GRIDS[args.grid]
    total_runs = sum(len(grid_points(grid[m], m, h, d)) for m in methods for h in hessians for d in dims)
    print(f"{total_runs} fits (and the edge extensions): dims {dims}, patterns {hessians}, methods {methods}, grid {args.grid}, "
          f"noise {args.noise}", flush=True)
    runs, best, start = [], {}, {}
    began, cpu_began = time.perf_counter(), time.process_time()
    for dim in dims:
        data = QuadraticDataModule(dim=dim, n_train=N_TRAIN, n_test=N_TEST, seed=args.data_seed,
                                   eval_batch_size=N_TEST, epoch_steps=max(grid[m]["steps"][-1] for m in methods))
        data.setup()
        for hessian in hessians:
            start[(hessian, dim)] = initial_grad_norm(data, hessian, dim)
            for method in methods:
                points = grid_points(grid[method], method, hessian, dim)
                cell = [run_one(data, method, hessian, dim, *point, args) for point in points]
                while args.grid == "reduced":  # a best step size or T at the edge of the grid: extend it (Table 6's)
                    more = sorted(set(edge_extension(cell, points)) - set(points))
                    if not more:
                        break
                    points += more
                    cell += [run_one(data, method, hessian, dim, *point, args) for point in more]
                runs += cell
                best[(hessian, dim, method)] = best_of(cell)
                b = best[(hessian, dim, method)]
                print(f"{hessian:8s} d={dim:5d} {method:8s} best train {b['train_grad_norm']:.4g} test "
                      f"{b['test_grad_norm']:.4g} at T={b['steps']} lr={b['lr']:g} C={b['clip']:g} "
                      f"({sum(r['seconds'] for r in cell):.0f} s, {time.perf_counter() - began:.0f} s in all, "
                      f"{time.process_time() - cpu_began:.0f} s CPU)", flush=True)
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu_began
    header = (f"# DPZero synthetic quadratic (Sec. 5.1, App. B.1, Fig. 1) with lit_zodp's modules\n\n"
              f"Best exact gradient norm ||A (x_T - mean x_i)|| of the last iterate over the {args.grid} grid, "
              f"picked by the train value; n_train = n_test = {N_TRAIN}, eps = {EPSILON:g}, delta = {DELTA:g}, "
              f"lam = {LAM:g}, x_0 = 0, full batch, sphere directions, noise: {args.noise} "
              f"({'PRV add/remove calibrated' if args.noise == 'prv' else 'Alg. 1-2 line 3 sigma'}). "
              f"{len(runs)} fits in {wall / 60:.1f} min ({cpu / 60:.1f} min of CPU time) on {args.threads} CPU "
              f"thread(s).\n")
    markdown = header + "\n" + table(best, dims, start) + "\n" + growth(best, dims)
    print("\n" + markdown)
    data_out = {"config": {**vars(args), "dims": dims, "hessians": hessians, "methods": methods,
                           "grid_values": {m: grid[m] for m in methods},
                           "clips": {f"{m}/{h}/{d}": grid_points(grid[m], m, h, d)[0][2] for m in methods
                                     for h in hessians for d in dims}, "epsilon": EPSILON, "delta": DELTA,
                           "lam": LAM, "n_train": N_TRAIN, "n_test": N_TEST},
                "environment": {"python": platform.python_version(), "torch": torch.__version__,
                                "machine": platform.machine(), "threads": args.threads},
                "wall_seconds": wall, "cpu_seconds": cpu,
                "initial_grad_norm": {f"{h}/{d}": v for (h, d), v in start.items()},
                "best": {f"{h}/{d}/{m}": run for (h, d, m), run in best.items()},
                "runs": runs}
    write_results(Path(args.out), markdown, json.loads(json.dumps(data_out, default=str)))
    return data_out


if __name__ == "__main__":
    main()

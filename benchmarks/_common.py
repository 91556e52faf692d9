"""What the benchmark scripts share: worker processes, the load probe, memory readings, results files.

Light at import (the standard library only): an orchestrator imports it and spawns its workers from a
small parent; the heavy imports (torch, Lightning, Opacus, lit_zodp) happen inside the functions that
run in the workers.
"""

from __future__ import annotations

import json
import os
import platform
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


# =====================================================================================
# Worker side
# =====================================================================================

def setup_worker(threads: int, chunk_numel: int | None = None) -> None:
    """Offline, quiet, ``threads`` torch threads, and the same imports in every worker."""
    import logging
    import warnings

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(threads)
    # Same imports in every worker, so the memory baselines are comparable; before quieting the loggers, whose level
    # Lightning's import sets (to INFO: set first, the quieting was undone).
    import lightning.pytorch  # noqa: F401
    import opacus  # noqa: F401

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers", "opacus"):
        logging.getLogger(name).setLevel(logging.ERROR)

    import lit_zodp.algorithms  # noqa: F401

    if chunk_numel:  # A/B runs of the engine's chunk size (the library default otherwise)
        import lit_zodp.zo.directions as directions

        directions.DEFAULT_CHUNK = directions.DEFAULT_ACCELERATOR_CHUNK = chunk_numel


def full_batch_fit(module, dataset, steps: int, device, collate_fn=None) -> None:
    """``steps`` steps of ``module`` through a fresh Trainer whose every batch is the whole ``dataset``.

    The loader is the library's full-batch sampler, so every step (and every method) sees exactly the
    same examples as the forward and peer baselines it is timed against. Lightning's teardown moves the
    module to the CPU after ``fit``: a caller timing on ``device`` afterwards moves it back.
    """
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lit_zodp.privacy import FullBatchSampler

    loader = DataLoader(dataset, batch_sampler=FullBatchSampler(len(dataset), steps_per_epoch=steps),
                        collate_fn=collate_fn)
    trainer = pl.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, loader)


def resolve_device(name: str):
    """``torch.device(name)``; ``"auto"`` is CUDA when available, else the CPU."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def sync(device) -> None:
    """Wait for the CUDA device's queued work (nothing to do on the CPU or for ``None``)."""
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


class LoadProbe:
    """CPU time used by OTHER processes during a measurement, in cores (0 = the machine was ours).

    ``(busy jiffies of all CPUs - this process's CPU time) / wall time``, from ``/proc/stat``.
    """

    def __init__(self) -> None:
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._start = None

    def _read(self):
        try:
            with open("/proc/stat") as f:
                values = [int(v) for v in f.readline().split()[1:9]]
            busy = (sum(values) - values[3] - values[4]) / self.hz
        except OSError:
            busy = None
        t = os.times()
        return time.perf_counter(), busy, t.user + t.system

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> tuple[float, float | None]:
        end = self._read()
        wall = end[0] - self._start[0]
        if end[1] is None or wall <= 0:
            return wall, None
        return wall, max(0.0, (end[1] - self._start[1]) - (end[2] - self._start[2])) / wall


PROBE = LoadProbe()


def probe_call(fn, device=None) -> tuple[float, float | None]:
    """``(wall seconds, other processes' load)`` of ``fn()``, between two synchronisations of ``device``."""
    sync(device)
    PROBE.start()
    fn()
    sync(device)
    return PROBE.stop()


def probe_timed(cls):
    """``cls`` (a LightningModule) whose ``training_step`` is timed by :data:`PROBE` between device
    synchronisations: each step's wall seconds go to ``step_times``, the other processes' load to
    ``step_loads``."""

    class Timed(cls):
        abstract = True  # not registered in lit_zodp.algorithms.ALGORITHMS

        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.step_times: list[float] = []
            self.step_loads: list = []

        def training_step(self, batch, batch_idx):
            sync(self.device)
            PROBE.start()
            out = super().training_step(batch, batch_idx)
            sync(self.device)
            wall, load = PROBE.stop()
            self.step_times.append(wall)
            self.step_loads.append(load)
            return out

    Timed.__name__ = Timed.__qualname__ = f"Timed{cls.__name__}"
    return Timed


def wall_times(fn, reps: int, device) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn()``, each between two synchronisations of ``device``."""
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def make_nonprivate_step(backbone, inputs, targets, optimizer: str, lr: float):
    """A plain training step: forward, backward of the mean per-example loss, a step of
    ``torch.optim.<optimizer>`` over the trainable parameters, ``zero_grad``."""
    import torch

    from lit_zodp.backbones.base import per_example_loss

    params = [p for p in backbone.parameters() if p.requires_grad]
    opt = getattr(torch.optim, optimizer)(params, lr=lr)

    def step() -> None:
        per_example_loss(backbone, inputs, targets).float().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def mem_available() -> float:
    """Bytes the kernel reports available (``MemAvailable``; 8 GiB when unknown)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(8 * 2**30)


def proc_status(key: str) -> int | None:
    """A size from ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...), in bytes."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (``VmHWM``); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def read_peak(device) -> int | None:
    """The peak memory since the last reset: ``torch.cuda.max_memory_allocated`` on CUDA, else ``VmHWM``."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return proc_status("VmHWM")


def reset_peak(device) -> bool:
    """Reset the peak counter that :func:`read_peak` reads; False where the RSS one cannot be reset."""
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        return True
    return reset_peak_rss()


def rss_result(baseline: int | None, reset_ok: bool, readings: list | None = None) -> dict:
    """A memory worker's RSS numbers: ``rss_baseline``, ``rss_peak`` (``VmHWM``, or the largest of it
    and ``readings``, peaks read before earlier resets), ``rss_after`` and ``ru_maxrss``."""
    import resource

    peak = proc_status("VmHWM")
    if readings is not None:
        peak = max([peak or 0] + readings)
    result = {"rss_baseline": baseline, "rss_peak": peak, "rss_after": proc_status("VmRSS"),
              "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if not reset_ok:  # VmHWM then covers the whole process life, like ru_maxrss
        result["rss_peak"] = max(result["rss_peak"] or 0, result["ru_maxrss"])
    return result


# =====================================================================================
# Orchestrator side
# =====================================================================================

def cli_fit_result(config: str, arguments: list[str]) -> dict[str, str]:
    """One fit through the real CLI (``python -m lit_zodp.cli fit --config config *arguments``, one thread, offline):
    the fields of its RESULT line (``accuracy``, ``distance``, ``wall_s``, ...) as strings; a failed fit raises
    with its output's tail."""
    return cli_fit_output(config, arguments)[0]


def cli_fit_output(config: str, arguments: list[str], timeout: float = 1800) -> tuple[dict[str, str], str]:
    """:func:`cli_fit_result`'s fields and the fit's whole output (stdout, then stderr)."""
    command = [sys.executable, "-m", "lit_zodp.cli", "fit", "--config", config, *arguments]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{config} failed ({done.returncode}):\n{output[-2000:]}")
    return dict(field.split("=", 1) for field in lines[-1].split()[1:]), output


def machine_info() -> dict:
    """Without importing torch: children start from a small parent (ru_maxrss is inherited at exec)."""
    from importlib.metadata import version

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"python": platform.python_version(), "torch": version("torch"), "opacus": version("opacus"),
            "lightning": version("lightning"), "cpu": cpu, "cpus": os.cpu_count(), "cuda": None,
            "loadavg_start": os.getloadavg()}


def cuda_available() -> bool:
    """Without importing torch in this process (children start from a small parent)."""
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                          capture_output=True, text=True)
    return proc.stdout.strip() == "True"


def worker_env(threads: int, wait_policy: str = "default", mmap_freed: bool = False, **extra: str) -> dict:
    """The environment of a worker process: offline Hugging Face, ``threads`` OpenMP/MKL threads, the
    repository on ``PYTHONPATH``, ``OMP_WAIT_POLICY`` unless ``wait_policy`` is ``"default"``, ``extra``.

    ``mmap_freed`` (memory workers): glibc's dynamic mmap threshold otherwise keeps freed activations
    cached in the heap, so the peak RSS drifts by tens of MB from run to run; with a fixed threshold
    every tensor of 128 KiB or more is mmapped and returned on free, and the peak RSS tracks live memory.
    """
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join(
                   [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])), **extra)
    if wait_policy != "default":
        env["OMP_WAIT_POLICY"] = wait_policy.upper()
    if mmap_freed:
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    return env


def temp_result_file() -> str:
    """A fresh path for a worker's JSON result (the orchestrator removes it after reading)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        return f.name


def pop_json(path: str, default: dict) -> dict:
    """The JSON in ``path`` (``default`` when it is missing or unreadable); the file is removed."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return default
    finally:
        Path(path).unlink(missing_ok=True)


def exit_message(returncode: int) -> str:
    """Why a worker gave no result, from its exit status."""
    return f"worker exited with {returncode}" + (" (killed: out of memory?)" if returncode in (-9, 137) else "")


def run_worker_process(script: str, options: list[str], env: dict) -> dict:
    """Run ``script`` with ``options`` and a fresh ``--result-file`` from the repository root; return the
    JSON the worker wrote, or ``{"error", "stderr_tail"}`` when it failed, with ``worker_wall_s``."""
    result_file = temp_result_file()
    cmd = [sys.executable, str(Path(script).resolve())] + options + ["--result-file", result_file]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(ROOT))
    wall = time.perf_counter() - start
    result = pop_json(result_file, {})
    if proc.returncode != 0:
        result = {"error": exit_message(proc.returncode), "stderr_tail": (proc.stderr or proc.stdout)[-1500:]}
    result["worker_wall_s"] = round(wall, 1)
    return result


def add_worker_options(parser, config: bool = True) -> None:
    """The hidden options the orchestrator passes to its workers: ``--worker {time,memory}``,
    ``--method``, ``--result-file`` and, with ``config``, ``--model`` and ``--batch``."""
    import argparse

    parser.add_argument("--worker", choices=["time", "memory"], help=argparse.SUPPRESS)
    if config:
        parser.add_argument("--model", help=argparse.SUPPRESS)
        parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)


def apply_quick_defaults(args, argv: list[str], **values) -> None:
    """Set each of ``values`` on ``args`` unless its option (``--name-with-dashes``) is in ``argv``."""
    given = {a.split("=")[0] for a in argv}
    for dest, value in values.items():
        if "--" + dest.replace("_", "-") not in given:
            setattr(args, dest, value)


def chosen_methods(parser, text: str, known) -> list[str]:
    """The comma-separated ``--methods`` of ``text``; an unknown name ends the script with the parser's error."""
    methods = [m.strip() for m in text.split(",")]
    unknown = [m for m in methods if m not in known]
    if unknown:
        parser.error(f"unknown --methods {unknown}: choose from {list(known)}")
    return methods


def command_line(script: str, argv: list[str], python: str = "python") -> str:
    """The command as the results header shows it: ``python benchmarks/<script> <argv>``."""
    return " ".join([python, f"benchmarks/{script}"] + [shlex.quote(a) for a in argv])


def finish_meta(meta: dict, started: float) -> None:
    """Record the load average at the end and the total wall time since ``started`` in ``meta``."""
    meta["loadavg_end"] = os.getloadavg()
    meta["total_wall_s"] = round(time.perf_counter() - started, 1)


def load_and_total(meta: dict) -> str:
    """The closing words of a results header: the load average over the run and its total time."""
    return (f"load average {meta['loadavg_start'][0]:.2f} -> {meta['loadavg_end'][0]:.2f}; "
            f"total {meta['total_wall_s']:.0f} s")


#: Where a ``--quick`` smoke run writes by default: ignored by git, so following the README leaves the checkout clean.
QUICK_RESULTS = RESULTS / "quick"


def results_stem(out: str | None, name: str, quick: bool = False) -> Path:
    """``--out`` if given, else ``benchmarks/results/<name>`` (``benchmarks/results/quick/<name>`` for a quick run)."""
    return Path(out) if out else (QUICK_RESULTS if quick else RESULTS) / name


def write_results(stem: Path, markdown: str, data: dict, announce: bool = True) -> None:
    """``<stem>.md`` (``markdown`` and a newline) and ``<stem>.json`` (``data``); say so if ``announce``."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(markdown + "\n")
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))
    if announce:
        announce_written(stem)


def announce_written(stem: Path) -> None:
    print(f"\nwrote {stem.with_suffix('.md')} and {stem.with_suffix('.json')}")


def median_of(xs):
    """The median of the values that are not None (None when there are none)."""
    xs = [x for x in (xs or []) if x is not None]
    return statistics.median(xs) if xs else None


def ratio_of(a, b):
    """``a / b``, or None when either is missing (or ``b`` is 0)."""
    return a / b if a is not None and b else None


def fmt(x, spec=".3f", none="n/a"):
    """``x`` formatted with ``spec``, or ``none`` for None."""
    return none if x is None else format(x, spec)


def parse_tiles(text: str) -> list[tuple[int, int]]:
    """``"1024x8,512x4"`` -> ``[(1024, 8), (512, 4)]`` (the fused kernel's elements per program x warps)."""
    tiles = []
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        block, _, warps = item.partition("x")
        if not (block.isdigit() and warps.isdigit()):
            raise SystemExit(f"--tiles: '{item}' is not BLOCKxWARPS (e.g. 1024x8)")
        tiles.append((int(block), int(warps)))
    return tiles

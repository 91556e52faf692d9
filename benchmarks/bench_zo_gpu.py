#!/usr/bin/env python
"""The zeroth-order step against its two forward passes, MeZO, AdamW and Opacus DP-SGD on a GPU (issue 8).

For each model (RoBERTa-large, OPT-1.3B and a MiniLM-sized BERT, all built from their configurations
with random weights: nothing is downloaded), dtype (fp32, bf16) and batch size, in ONE worker process
per (model, dtype), the following are timed side by side, interleaved, their order rotating every
repetition (medians over repetitions; ratios are medians of per-repetition, paired, ratios):

* ``fwd2``: two no-grad, eval-mode passes of per-example losses (``private_losses``, exactly what the
  ZO step runs twice);
* ``dpzero`` / ``mezo``: ``DPZero.training_step`` / ``MeZO.training_step`` driven by a real Lightning
  ``Trainer`` (a fresh one per repetition, ``--steps-per-repeat`` steps each after a first one); the timer
  wraps ``training_step`` itself (two perturbed forwards, the engine's three passes, clipping, the noise, the
  optimizer step through Lightning, the ledger, the logs). The first step of each fit runs the fit-start
  privacy checks (DPZero recomputes its batch on two halves and its shorter rows cut to their length:
  about two more forwards) and is timed apart (``dpzero_first``, ``mezo_first``, its own column), so that
  the step columns are the steady state of a long run, where those checks happen once per fit (the 1%
  re-checks stay in). ``loop`` is the interval between the starts of consecutive batches of one fit,
  after the first: the step plus everything Lightning does around it;
* ``engine``: one pass of the fused engine (``FusedPerturbation.perturb_``: Triton on CUDA, the torch
  reference on CPU) and of the chunked engine (``PerturbationEngine.perturb_``), alone, and one fused
  restore+update pass of each; ``copy``: ``dst.copy_(src)`` over a buffer the size of the parameters
  (the measured copy bandwidth). A pass reads and writes every parameter once:
  ``bytes = 2 * numel * itemsize``; ``pass / copy`` is the pass time over ``bytes / bandwidth``;
* ``adamw``: forward + backward of the mean loss + ``torch.optim.AdamW`` step (train mode, dropout 0);
* ``opacus``: Opacus DP-SGD with ghost clipping (``make_private(..., grad_sample_mode="ghost")``):
  forward, the two backward passes, clipping, noise, SGD step. An OOM or an error is reported as
  "fails" with its reason;
* with ``--bcd`` (issue 9), two more methods in the same interleaved loop: ``bcd``,
  ``MeZOBCD(partition="layer", order="random")`` through a real ``Trainer`` like ``mezo``, each
  repetition ONE full random-order cycle (``num_blocks`` steps, every block once; the repetition's value
  is the MEAN of the cycle's step times, as in ``bench_mezo_bcd.py``: the blocks differ a lot in size and
  the embedding block dominates); ``paper_mezo``: the paper's MeZO baseline as the reference code writes
  it (``bench_mezo_bcd.PaperMeZO`` / ``paper_mezo_step``, imported: ``z`` drawn per tensor with
  ``torch.normal`` on the parameter's device and dtype, out-of-place updates), on its own copy of the
  model, ``--steps-per-repeat`` steps per repetition. A third table ("MeZO-BCD (issue 9)") gives BCD /
  2 fwd (target <= 1.02), MeZO / BCD and paper / BCD (target >= 2), and the peak of a BCD cycle.

Memory (``--memory inprocess``, the default): after the timings, in the same worker, each method runs
once more alone (the first-order copies of the model freed), the peak counter reset just before it:
``torch.cuda.max_memory_allocated`` on CUDA, ``VmHWM`` (after a reset through ``/proc/self/clear_refs``)
on CPU. A first-order method runs on its own copy of the model, made before the reset, so every method's
footprint is ``weights + batch + (peak - level before the method)``.

Usage (see benchmarks/README.md)::

    python benchmarks/bench_zo_gpu.py                                   # everything, on the GPU
    python benchmarks/bench_zo_gpu.py --models roberta_large --out benchmarks/results/bench_zo_gpu_roberta
    python benchmarks/bench_zo_gpu.py --merge benchmarks/results/bench_zo_gpu_roberta \\
        benchmarks/results/bench_zo_gpu_opt benchmarks/results/bench_zo_gpu_minilm   # one table from parts
    python benchmarks/bench_zo_gpu.py --tiny --device cpu --repeats 1 --out /tmp/bench_zo_gpu_smoke
    python benchmarks/bench_zo_gpu.py --models opt_1_3b --dtypes fp32 --batches 16 --bcd --no-opacus \\
        --no-adamw --out benchmarks/results/bench_zo_gpu_bcd_opt            # + MeZO-BCD and the paper's MeZO
    python benchmarks/bench_zo_gpu.py --tiny --device cpu --repeats 1 --models minilm,opt_1_3b --dtypes fp32 \\
        --bcd --no-opacus --out /tmp/bench_zo_gpu_bcd_smoke                 # CPU smoke test of --bcd
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench_dpzero as bd  # noqa: E402  (light at import: heavy imports happen in its functions)
from _common import (ROOT, announce_written, command_line, cuda_available, exit_message, full_batch_fit,  # noqa: E402
                     finish_meta, fmt, machine_info, make_nonprivate_step, median_of, parse_tiles, pop_json,
                     proc_status, ratio_of, read_peak, reset_peak, resolve_device, results_stem, setup_worker,
                     sync, temp_result_file, wall_times, worker_env, write_results)
from bench_mezo_bcd import PaperMeZO, paper_mezo_step  # noqa: E402  (--bcd: the paper's MeZO baseline)

MODELS = ("roberta_large", "opt_1_3b", "minilm")
DEFAULT_BATCHES = {"roberta_large": [16, 64], "opt_1_3b": [16, 64], "minilm": [32]}
DEFAULT_SEQ_LEN = {"roberta_large": 128, "opt_1_3b": 128, "minilm": 32}
DEFAULT_STEPS = {"roberta_large": 3, "opt_1_3b": 3, "minilm": 10}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
LABELS = {"roberta_large": "RoBERTa-large", "opt_1_3b": "OPT-1.3B", "minilm": "MiniLM (BERT 384x6)"}

#: Targets of issue 8 (ratios measured side by side in one run).
TARGET_STEP_VS_FWD2 = {("roberta_large", 64): 1.05, ("roberta_large", 16): 1.10, ("opt_1_3b", 16): 1.10}
TARGET_DPZERO_VS_MEZO = 1.02
TARGET_PASS_VS_COPY = 1.5
TARGET_SMALL_OVERHEAD_MS = 3.0  # MiniLM b32 L32: DPZero step - two forwards

#: Configurations (the models' config.json sizes), built with random weights.
CONFIGS = {
    "roberta_large": dict(model_type="roberta", vocab_size=50265, hidden_size=1024, num_hidden_layers=24,
                          num_attention_heads=16, intermediate_size=4096, max_position_embeddings=514,
                          type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0,
                          eos_token_id=2),
    "opt_1_3b": dict(model_type="opt", vocab_size=50272, hidden_size=2048, num_hidden_layers=24,
                     num_attention_heads=32, ffn_dim=8192, max_position_embeddings=2048,
                     word_embed_proj_dim=2048, do_layer_norm_before=True, pad_token_id=1, bos_token_id=2,
                     eos_token_id=2),
    "minilm": dict(model_type="bert", vocab_size=30522, hidden_size=384, num_hidden_layers=6,
                   num_attention_heads=12, intermediate_size=1536, max_position_embeddings=512),
}
#: ``--tiny``: every model shrunk to 2 layers, hidden 64 (CPU smoke tests of the whole pipeline).
TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=4096)
#: OPT: the last tokens of each row are the candidate whose log-likelihood is the loss.
OPT_CANDIDATE_TOKENS = 8

CLIP, SIGMA, LR, LAM, DELTA = bd.CLIP, bd.SIGMA, bd.LR, bd.LAM, 1e-5
ZO_METHODS = ("fwd2", "dpzero", "mezo", "engine")
FO_METHODS = ("adamw", "opacus")
MEMORY_METHODS = ("inference", "dpzero", "mezo", "adamw", "opacus")
COPY_CAP = 1 << 28
#: The tiles table's label for the default tile with libdevice's software log/cos/sin (``fast_math=False``).
SOFTWARE_MATH = "default, software log/cos/sin"
ENGINE_KEYS = ("copy", "fused_pass", "fused_update", "chunked_pass", "chunked_update")
#: ``--bcd`` (issue 9): MeZO-BCD (one full random-order cycle per repetition) and the paper's MeZO baseline.
BCD_METHODS = ("bcd", "paper_mezo")
TARGET_BCD_VS_FWD2 = 1.02    # BCD step (cycle mean) / two forwards
TARGET_PAPER_VS_BCD = 2.0    # the paper's MeZO baseline / BCD step


#: Marks a worker's progress lines in its output (the orchestrator echoes those, keeps the rest for errors).
PROGRESS = "@progress "


def log(msg: str) -> None:
    print(PROGRESS + msg, flush=True)


# =====================================================================================
# Worker side (one process per model and dtype; heavy imports only here)
# =====================================================================================

def model_config(model: str, tiny: bool) -> dict:
    cfg = dict(CONFIGS[model])
    if tiny:
        cfg.update(TINY)
        for key in ("intermediate_size", "ffn_dim"):
            if key in cfg:
                cfg[key] = 4 * TINY["hidden_size"]
        if "word_embed_proj_dim" in cfg:
            cfg["word_embed_proj_dim"] = TINY["hidden_size"]
    return cfg


class Batch(bd.FixedBatch):
    """The fixed batch as a dataset whose loader hands the whole batch at once (``__getitems__`` with
    an identity collate): no per-example indexing and stacking in the loop, as a pre-batched loader."""

    def __getitems__(self, indices):
        indices = list(indices)
        if indices == list(range(len(self))):
            return self.inputs, self.targets
        index = self.targets.new_tensor(indices)
        inputs = ({k: v[index] for k, v in self.inputs.items()} if isinstance(self.inputs, dict)
                  else self.inputs[index])
        return inputs, self.targets[index]

    def on_host(self) -> "Batch":
        """The batch in host memory (pinned where CUDA is there), as a real loader hands it: Lightning moves
        it to the device before each step, outside the timed ``training_step``. Handed over on the device, the
        private modules' padding check (which waits for a batch with a row shorter than its longest: these
        rows are all full length) could only be answered by asking the device, on every step."""
        if getattr(self, "_host", None) is None:
            import torch

            def host(t):
                t = t.cpu()
                return t.pin_memory() if torch.cuda.is_available() else t

            inputs = ({k: host(v) for k, v in self.inputs.items()} if isinstance(self.inputs, dict)
                      else host(self.inputs))
            self._host = Batch(inputs, host(self.targets))
        return self._host


def build(model: str, batch: int, seq_len: int, dtype: str, device, tiny: bool):
    """``(backbone, inputs, targets, dataset, notes)``: the model built on ``device`` from its config."""
    import torch

    from lit_zodp.backbones import HFCandidateScorer, HFSequenceClassifier

    cfg = model_config(model, tiny)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    with torch.device(device):  # random init on the device itself (OPT-1.3B: seconds, not minutes)
        if model == "opt_1_3b":
            # MeZO's setting for OPT: the log-likelihood of a candidate continuation; one candidate per
            # example with loss="lm" runs exactly B x L tokens through the model (Opacus' cross-entropy
            # over the single score runs the same forward and backward).
            backbone = HFCandidateScorer(config=cfg, num_classes=1, loss="lm", dtype=DTYPES[dtype])
        else:
            backbone = HFSequenceClassifier(config=cfg, num_classes=2, dtype=DTYPES[dtype])
    backbone = backbone.to(device)
    vocab = cfg["vocab_size"]
    if model == "opt_1_3b":
        ids = torch.randint(3, vocab, (batch, 1, seq_len), generator=g)
        ids[:, :, 0] = cfg["bos_token_id"]
        candidate = torch.zeros(batch, 1, seq_len, dtype=torch.bool)
        candidate[:, :, -OPT_CANDIDATE_TOKENS:] = True
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "candidate_mask": candidate}
        targets = torch.zeros(batch, dtype=torch.long)
    elif model == "roberta_large":
        ids = torch.randint(3, vocab, (batch, seq_len), generator=g)
        ids[:, 0], ids[:, -1] = cfg["bos_token_id"], cfg["eos_token_id"]
        # No position_ids: RoBERTa derives them per example ([B, T]) from input_ids.
        inputs = {"input_ids": ids, "attention_mask": torch.ones(batch, seq_len, dtype=torch.long),
                  "token_type_ids": torch.zeros(batch, seq_len, dtype=torch.long)}
        targets = torch.randint(0, 2, (batch,), generator=g)
    else:  # BERT: explicit [B, T] position ids (Opacus' per-sample Embedding gradients need them)
        ids = torch.randint(1000 % vocab, vocab, (batch, seq_len), generator=g)
        ids[:, 0], ids[:, -1] = 101 % vocab, 102 % vocab
        inputs = {"input_ids": ids, "attention_mask": torch.ones(batch, seq_len, dtype=torch.long),
                  "token_type_ids": torch.zeros(batch, seq_len, dtype=torch.long),
                  "position_ids": torch.arange(seq_len).repeat(batch, 1)}
        targets = torch.randint(0, 2, (batch,), generator=g)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    targets = targets.to(device)
    return backbone, inputs, targets, Batch(inputs, targets)


def timed_module(kind: str, backbone, engine: str, model: str):
    """A DPZero, MeZO or MeZO-BCD (``kind="bcd"``: layer blocks, random order) module whose
    ``training_step`` is timed and whose batch starts (and, for BCD, active blocks) are recorded.

    ``cpu()`` is a no-op: Lightning's teardown moves the module to the CPU after every ``fit``, which
    would move the (shared) backbone off the GPU between repetitions (seconds for OPT-1.3B) and leave the
    standalone engines pointing at freed memory.
    """
    from lit_zodp.algorithms import DPZero, MeZO, MeZOBCD

    base = {"dpzero": DPZero, "mezo": MeZO, "bcd": MeZOBCD}[kind]

    class Timed(base):
        abstract = True  # not registered in lit_zodp.algorithms.ALGORITHMS

        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.step_times: list[float] = []
            self.loop_times: list[float] = []
            self.step_blocks: list = []  # BCD: the active block (1-based) of each timed step
            self._last_start = None

        def on_train_batch_start(self, batch, batch_idx):
            out = super().on_train_batch_start(batch, batch_idx)
            now = time.perf_counter()
            if self._last_start is not None:
                self.loop_times.append(now - self._last_start)
            self._last_start = now
            return out

        def on_train_start(self) -> None:
            super().on_train_start()
            self._last_start = None  # intervals within one fit only

        def training_step(self, batch, batch_idx):
            sync(self.device)
            start = time.perf_counter()
            out = super().training_step(batch, batch_idx)
            sync(self.device)
            self.step_times.append(time.perf_counter() - start)
            self.step_blocks.append(getattr(self, "active_block", None))
            return out

        def cpu(self):
            return self

    Timed.__name__ = Timed.__qualname__ = f"Timed{base.__name__}"
    kwargs = dict(lr=LR, lam=LAM, seed=0, perturbation=engine)
    if model == "opt_1_3b":
        kwargs["num_classes"] = 2  # accuracy metrics need >= 2 classes; unused in training
    if kind == "dpzero":
        kwargs.update(clip=CLIP, noise_multiplier=SIGMA, delta=DELTA)
    if kind == "bcd":
        kwargs.update(partition="layer", order="random")
    return Timed(backbone, **kwargs)


def paper_runner(base, model: str):
    """The paper's MeZO baseline (``bench_mezo_bcd.PaperMeZO``, imported) on its OWN copy of ``base``.

    Its out-of-place updates (``param.data = param.data + ...``) re-allocate every parameter: on the
    shared backbone they would move the parameters under the other modules' engines (the fused engine
    rebuilds its tables when a parameter moved, inside the next timed step). The wrapped MeZO module
    only lends ``private_losses`` and ``backbone``; it is never fitted (no engine is built).
    """
    from lit_zodp.algorithms import MeZO

    kwargs = dict(lr=LR, lam=LAM, seed=0, perturbation="chunked")
    if model == "opt_1_3b":
        kwargs["num_classes"] = 2
    return PaperMeZO(MeZO(copy.deepcopy(base).eval(), **kwargs), eps=LAM, lr=LR)


def fit(module, dataset, steps: int, device) -> None:
    """``steps`` steps of ``module`` through a fresh Trainer over the whole batch
    (:func:`_common.full_batch_fit`), handed over from host memory (:meth:`Batch.on_host`)."""
    full_batch_fit(module, dataset.on_host(), steps, device, collate_fn=_as_it_is)


def _as_it_is(batch):
    return batch  # Batch.__getitems__ returns the collated batch


def prepare_first_order(backbone):
    """Train mode with every dropout probability 0: the function the ZO passes see (eval mode)."""
    from torch import nn

    for m in backbone.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    for cfg_attr in ("attention_dropout", "dropout", "activation_dropout", "hidden_dropout_prob",
                     "attention_probs_dropout_prob"):
        config = getattr(getattr(backbone, "model", None), "config", None)
        if config is not None and hasattr(config, cfg_attr):
            setattr(config, cfg_attr, 0.0)
    return backbone.train()


def make_first_order(method: str, base, inputs, targets, dataset, batch: int, model: str):
    """``(step, holder, notes)``: a step on its own copy of ``base``; ``holder`` keeps what must be freed."""
    backbone = prepare_first_order(copy.deepcopy(base))
    if method == "adamw":
        return make_nonprivate_step(backbone, inputs, targets, "AdamW", LR), [backbone], []
    step, notes = bd.make_opacus(backbone, dataset, batch, model, "ghost")
    return step, [backbone], notes


#: Why Opacus' ghost clipping fails on OPT as transformers builds it (found on CPU with --tiny; each one
#: masks the next): the learned position embedding is called with an int (the cache length), which its
#: hooks cannot capture; the token embedding is tied to the LM head ("Parameter tying is not supported
#: with Ghost Clipping"); the decoder MLP flattens [B, L, H] to [B*L, H], so fc1/fc2's per-sample norms
#: have B*L rows. Added to the notes when Opacus fails on OPT.
OPACUS_OPT_NOTE = ("Opacus ghost clipping cannot run OPT as transformers builds it: embed_positions is called "
                   "with an int (hooks fail), embed_tokens is tied to lm_head (no parameter tying in ghost "
                   "clipping), and the MLP flattens [B, L, H] to [B*L, H] (per-sample norms get B*L rows)")


def _is_oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def _is_oom_text(text: str) -> bool:
    return text.startswith("OOM")


def _describe(err: BaseException) -> str:
    if _is_oom(err):
        return "OOM: " + str(err).split("\n")[0][:200]
    return f"{type(err).__name__}: {err}"[:400]


def _free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class Engines:
    """The fused and chunked engines over the model's parameters, alone, and the copy of their bytes."""

    def __init__(self, params, device, tiles=()) -> None:
        import torch

        from lit_zodp.zo import PerturbationEngine
        from lit_zodp.zo.fused import FusedPerturbation

        self.params, self.device = params, device
        self.numel = sum(p.numel() for p in params)
        self.bytes_per_pass = sum(2 * p.numel() * p.element_size() for p in params)
        self.dtype = params[0].dtype
        self.errors: dict[str, str] = {}
        self.engines = {}
        try:
            self.engines["fused"] = FusedPerturbation(params, backend="auto")
        except Exception as err:  # e.g. a dtype the kernel does not take
            self.errors["fused"] = _describe(err)
        self.engines["chunked"] = PerturbationEngine(params)
        self.fused_backend = getattr(self.engines.get("fused"), "backend", None)
        self.coefficient = {"fused": torch.tensor(1.0, device=device), "chunked": 1.0}
        if self.fused_backend == "triton":  # other tile sizes of the same kernel (the reference has none)
            for block, warps in tiles:
                name = f"fused@{block}x{warps}"
                self.engines[name] = FusedPerturbation(params, backend="auto", block=block, num_warps=warps)
                self.coefficient[name] = self.coefficient["fused"]
            name = f"fused@{SOFTWARE_MATH}"  # what the hardware log and sine save, same tile and layout
            self.engines[name] = FusedPerturbation(params, backend="auto", fast_math=False)
            self.coefficient[name] = self.coefficient["fused"]
        self.seed = 12345
        self.calls: dict[str, int] = {}

    def _batched(self, fn, n: int) -> float:
        """Seconds per call of ``fn(i)``, ``n`` calls back to back between two synchronisations."""
        sync(self.device)
        start = time.perf_counter()
        for i in range(n):
            fn(i)
        sync(self.device)
        return (time.perf_counter() - start) / n

    def _calls(self, key: str, fn) -> int:
        """Calls per sample (even): one on CPU; on CUDA enough for ~2 ms, so that the launch and the
        synchronisation do not count for a small model (MiniLM's pass takes tens of microseconds)."""
        if key not in self.calls:
            self._batched(fn, 2)  # compiles the kernel (Triton) the first time: not part of the estimate
            once = self._batched(fn, 2)
            self.calls[key] = 2 if self.device.type != "cuda" else 2 * max(1, min(100, round(1e-3 / max(once, 1e-7))))
        return self.calls[key]

    def run(self, k: int) -> dict[str, list[float]]:
        """``k`` samples of each: the copy; a perturb pass (+lam and -lam alternately: the parameters
        come back); a restore+update pass (a perturb, then ``restore_and_update_`` with lr = 0: the same
        work as an update, the parameters restored), from the time of the pair minus the pass's."""
        import torch

        out = {key: [] for key in ENGINE_KEYS}
        out.update({f"{name}_{what}": [] for name in self.engines for what in ("pass", "update")})
        # The copy runs over at most COPY_CAP elements (bandwidth is flat well before that) and is scaled
        # to the parameters' size: two full-size buffers would need 10 GB more for OPT-1.3B in fp32.
        n = min(self.numel, COPY_CAP)
        src = torch.empty(n, dtype=self.dtype, device=self.device).fill_(1.0)
        dst = torch.empty_like(src)
        copy = lambda i: dst.copy_(src)  # noqa: E731
        calls = self._calls("copy", copy)
        for _ in range(k):
            out["copy"].append(self._batched(copy, calls) * self.numel / n)
        del src, dst, copy
        for name, engine in self.engines.items():
            c, seed = self.coefficient[name], self.seed
            perturb = lambda i: engine.perturb_(seed, LAM if i % 2 == 0 else -LAM)  # noqa: E731
            pair = lambda i: (engine.perturb_(seed, LAM), engine.restore_and_update_({seed: c}, lr=0.0))  # noqa: E731
            # The fused engine's CPU reference (Philox in torch) is exact but ~1000x slower than a copy:
            # one sample per repetition is enough to see that it runs.
            reference = getattr(engine, "backend", None) == "reference"
            calls = 2 if reference else self._calls(f"{name}_pass", perturb)
            for _ in range(1 if reference else k):
                one = self._batched(perturb, calls)
                out[f"{name}_pass"].append(one)
                out[f"{name}_update"].append(self._batched(pair, calls // 2) - one)
        return out


def worker(args) -> None:
    """All batches of one (model, dtype): timing, then memory, batch by batch; results after each."""
    setup_worker(args.threads)
    import torch

    device = resolve_device(args.device)
    out = {"model": args.model, "dtype": args.dtype, "device": str(device), "rows": [],
           "cuda_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    for batch in [int(b) for b in args.worker_batches.split(",")]:
        try:
            row = run_config(args, device, batch)
        except Exception as err:  # the whole configuration failed (e.g. the model does not fit)
            import traceback

            row = {"model": args.model, "dtype": args.dtype, "batch": batch, "error": _describe(err),
                   "traceback": traceback.format_exc()[-2000:]}
            log(f"    {args.model} {args.dtype} b{batch}: FAILED {row['error']}")
        _free(device)
        out["rows"].append(row)
        Path(args.result_file).write_text(json.dumps(out))


def run_config(args, device, batch: int) -> dict:
    import torch

    tag = f"    {args.model} {args.dtype} b{batch}:"
    seq_len = args.seq_len or DEFAULT_SEQ_LEN[args.model]
    k = args.steps_per_repeat or DEFAULT_STEPS[args.model]
    base, inputs, targets, dataset = build(args.model, batch, seq_len, args.dtype, device, args.tiny)
    base.eval()
    params = [p for p in base.parameters() if p.requires_grad]
    model_bytes = (sum(p.numel() * p.element_size() for p in base.parameters())
                   + sum(t.numel() * t.element_size() for t in list(inputs.values()) + [targets]))
    row = {"model": args.model, "dtype": args.dtype, "batch": batch, "seq_len": seq_len, "steps_per_repeat": k,
           "n_params": sum(p.numel() for p in params), "model_bytes": model_bytes, "tiny": args.tiny,
           "times": {}, "rep_of": {}, "errors": {}, "notes": [], "memory": {}}
    log(f"{tag} {row['n_params'] / 1e6:.1f}M parameters, sequence {seq_len}, {k} steps per repeat")
    bcd = getattr(args, "bcd", False)
    zo = {kind: timed_module(kind, base, args.engine, args.model)
          for kind in ("dpzero", "mezo") + (("bcd",) if bcd else ())}
    paper = None
    if bcd:
        row["bcd_blocks"] = {"names": zo["bcd"].block_names, "numel": [b.numel for b in zo["bcd"].blocks()]}
        log(f"{tag} MeZO-BCD: {zo['bcd'].num_blocks} blocks (one full cycle per repetition)")
        try:
            paper = paper_runner(base, args.model)
        except Exception as err:
            row["errors"]["paper_mezo"] = _describe(err)
            log(f"{tag} paper_mezo fails: {row['errors']['paper_mezo']}")
            _free(device)
    from lit_zodp.zo import fused as fused_default

    engines = Engines(params, device, parse_tiles(args.tiles))
    row.update(bytes_per_pass=engines.bytes_per_pass, fused_backend=engines.fused_backend,
               default_tile=f"{fused_default.DEFAULT_BLOCK}x{fused_default.DEFAULT_WARPS}")
    row["errors"].update({f"engine_{k_}": v for k_, v in engines.errors.items()})

    first_order = {}
    for method in FO_METHODS:
        if getattr(args, f"no_{method}"):
            continue
        try:
            first_order[method] = make_first_order(method, base, inputs, targets, dataset, batch, args.model)
            row["notes"] += [f"{method}: {n}" for n in first_order[method][2]]
        except Exception as err:
            row["errors"][method] = _describe(err)
            log(f"{tag} {method} fails: {row['errors'][method]}")
            _free(device)

    def record(name: str, values, rep: int) -> None:
        if rep >= 0:
            row["times"].setdefault(name, []).extend(values)
            row["rep_of"].setdefault(name, []).extend([rep] * len(values))

    def run_method(method: str, rep: int, reps: int) -> None:
        if method == "fwd2":
            record("fwd2", wall_times(lambda: bd.two_forwards(zo["dpzero"], inputs, targets), reps, device), rep)
        elif method == "bcd":
            # ONE full random-order cycle (every block once) per repetition, warm-up included (each
            # block's engine runs once before the measurement); the repetition's value is the cycle's
            # MEAN step time: a median over single steps would mostly see the small layer blocks.
            module = zo["bcd"]
            before, before_loop = len(module.step_times), len(module.loop_times)
            fit(module, dataset, module.num_blocks, device)
            cycle = module.step_times[before:]
            record("bcd", [statistics.mean(cycle)], rep)
            record("bcd_steps", cycle, rep)
            record("bcd_loop", module.loop_times[before_loop:], rep)
            if rep >= 0:
                row["bcd_last_cycle"] = {"blocks": module.step_blocks[before:], "times": cycle}
        elif method == "paper_mezo":
            record("paper_mezo", wall_times(lambda: paper_mezo_step(paper, inputs, targets), reps, device), rep)
        elif method in zo:
            module = zo[method]
            before, before_loop = len(module.step_times), len(module.loop_times)
            fit(module, dataset, 1 + max(reps, 2), device)
            record(f"{method}_first", module.step_times[before:before + 1], rep)  # the fit-start checks
            record(method, module.step_times[before + 1:], rep)
            record(f"{method}_loop", module.loop_times[before_loop + 1:], rep)
        elif method == "engine":
            for key, values in engines.run(reps).items():
                record(key, values, rep)
        else:
            record(method, wall_times(first_order[method][0], reps, device), rep)

    methods = list(ZO_METHODS) + ([m for m in BCD_METHODS if m not in row["errors"]] if bcd else []) \
        + list(first_order)
    started = time.perf_counter()
    for rep in range(-args.warmup, args.repeats):
        shift = rep % len(methods)
        for method in methods[shift:] + methods[:shift]:
            if method not in methods:  # dropped after a failure in this repetition
                continue
            try:
                run_method(method, rep, k if rep >= 0 else 1)
            except Exception as err:
                row["errors"][method] = _describe(err)
                log(f"{tag} {method} fails: {row['errors'][method]}")
                if method in first_order:
                    del first_order[method]
                if method == "paper_mezo":
                    paper = None  # its copy of the model
                methods.remove(method)
                _free(device)
        med = lambda name: _median_ms(row["times"].get(name))  # noqa: E731
        log(f"{tag} {'warm-up' if rep < 0 else f'repeat {rep + 1}/{args.repeats}'} done "
            f"({time.perf_counter() - started:.0f} s): 2fwd {med('fwd2')} ms, DPZero {med('dpzero')} ms, "
            f"MeZO {med('mezo')} ms, fused pass {med('fused_pass')} ms, copy {med('copy')} ms, "
            f"AdamW {med('adamw')} ms, Opacus {med('opacus')} ms"
            + (f", BCD {med('bcd')} ms (cycle mean), paper MeZO {med('paper_mezo')} ms" if bcd else ""))
    if args.model == "opt_1_3b" and "opacus" in row["errors"] and not _is_oom_text(row["errors"]["opacus"]):
        row["notes"].append(OPACUS_OPT_NOTE)
    row["zo_engine"] = type(zo["dpzero"].engine).__name__ + (
        f" ({zo['dpzero'].engine.backend})" if hasattr(zo["dpzero"].engine, "backend") else "")
    first_order.clear()
    paper = None  # its copy of the model: freed before the first-order retries and the memory
    _free(device)
    for method in FO_METHODS:  # an OOM next to the other methods' copies: time it alone
        if not _is_oom_text(row["errors"].get(method, "")):
            continue
        row["times"].pop(method, None)
        row["rep_of"].pop(method, None)
        try:
            first_order[method] = make_first_order(method, base, inputs, targets, dataset, batch, args.model)
            for rep in range(-1, args.repeats):
                run_method(method, rep, k if rep >= 0 else 1)
            row["notes"].append(f"{method}: timed alone after the interleaved loop (it ran out of memory "
                                f"next to the other methods: {row['errors'].pop(method)[:120]})")
            log(f"{tag} {method} alone: {_median_ms(row['times'].get(method))} ms")
        except Exception as err:
            row["errors"][method] = _describe(err)
            log(f"{tag} {method} alone fails: {row['errors'][method]}")
        first_order.clear()
        _free(device)
    if args.memory != "none":
        row["memory"] = measure_memory(args, device, base, inputs, targets, dataset, batch, zo, row, tag)
    return row


def _median_ms(xs):
    return "n/a" if not xs else f"{1e3 * statistics.median(xs):.1f}"


def measure_memory(args, device, base, inputs, targets, dataset, batch, zo, row, tag) -> dict:
    """Each method alone, the peak counter reset just before it (see the module docstring)."""
    import torch

    cuda = device.type == "cuda"
    out = {"kind": "cuda_max_memory_allocated" if cuda else "rss_vmhwm"}

    def level() -> int | None:
        if cuda:
            torch.cuda.synchronize(device)
            return torch.cuda.memory_allocated(device)
        return proc_status("VmRSS")

    for method in MEMORY_METHODS + (("bcd",) if "bcd" in zo else ()):
        if method in FO_METHODS and getattr(args, f"no_{method}"):
            continue
        _free(device)
        entry = {}
        holder = None
        failed = (row.get("errors") or {}).get(method)
        if failed and not _is_oom_text(failed):  # the same error again; an OOM may fit when run alone
            out[method] = {"error": failed, "skipped": True}
            log(f"{tag} memory {method}: skipped (failed in the timing)")
            continue
        try:
            if method in FO_METHODS:
                step, holder, _ = make_first_order(method, base, inputs, targets, dataset, batch, args.model)
            _free(device)
            before = level()
            entry["reset"] = reset_peak(device)
            if method == "inference":
                bd.two_forwards(zo["dpzero"], inputs, targets)
            elif method == "bcd":  # the peak of one full cycle: the largest block's engine included
                fit(zo[method], dataset, zo[method].num_blocks, device)
            elif method in zo:
                fit(zo[method], dataset, 1, device)
            else:
                step()
            top = read_peak(device)
            entry.update(before=before, peak=top, extra=top - before if top and before else None)
            entry["footprint"] = row["model_bytes"] + entry["extra"] if entry["extra"] is not None else None
        except Exception as err:
            entry["error"] = _describe(err)
        holder = step = None  # noqa: F841
        out[method] = entry
        what = entry.get("error") or f"{entry['footprint'] / 2**20:.0f} MiB"
        log(f"{tag} memory {method}: {what}")
    _free(device)
    return out


# =====================================================================================
# Orchestrator side (light imports only)
# =====================================================================================

def spawn(args, model: str, dtype: str, batches: list[int]) -> dict:
    """One worker for (model, dtype); its progress lines are echoed as they come."""
    result_file = temp_result_file()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", model, "--dtype", dtype,
           "--worker-batches", ",".join(map(str, batches)), "--result-file", result_file,
           "--threads", str(args.threads), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
           "--device", args.device, "--engine", args.engine, "--memory", args.memory, "--tiles", args.tiles]
    if args.seq_len:
        cmd += ["--seq-len", str(args.seq_len)]
    if args.steps_per_repeat:
        cmd += ["--steps-per-repeat", str(args.steps_per_repeat)]
    for flag in ("tiny", "no_adamw", "no_opacus", "bcd"):
        if getattr(args, flag):
            cmd.append("--" + flag.replace("_", "-"))
    env = worker_env(args.threads, mmap_freed=args.memory != "none", PYTHONUNBUFFERED="1")
    tail: deque = deque(maxlen=40)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    for line in proc.stdout:
        if line.startswith(PROGRESS):  # the worker's progress lines; warnings and logs go to the tail only
            print(line[len(PROGRESS):].rstrip(), flush=True)
        else:
            tail.append(line.rstrip())
    proc.wait()
    result = pop_json(result_file, {"model": model, "dtype": dtype, "rows": []})
    done = {r["batch"] for r in result["rows"]}
    if proc.returncode != 0:
        why = exit_message(proc.returncode)
        for b in batches:
            if b not in done:
                result["rows"].append({"model": model, "dtype": dtype, "batch": b, "error": why,
                                       "traceback": "\n".join(tail)[-2000:]})
        print("\n".join(list(tail)[-15:]), flush=True)
    result["worker_wall_s"] = round(time.perf_counter() - start, 1)
    return result


def _per_rep(row: dict, name: str) -> dict:
    reps: dict = {}
    for t, rep in zip(row.get("times", {}).get(name, []), row.get("rep_of", {}).get(name, [])):
        reps.setdefault(rep, []).append(t)
    return {rep: statistics.median(ts) for rep, ts in reps.items()}


def _paired(row: dict, num: str, den: str):
    """Median over repetitions of (median of ``num`` in the repetition / median of ``den`` in it)."""
    a, b = _per_rep(row, num), _per_rep(row, den)
    return median_of([a[r] / b[r] for r in a if r in b and b[r]])


def summarize(row: dict) -> dict:
    times = row.get("times", {})
    s = {key: median_of(times.get(key)) for key in
         ("fwd2", "dpzero", "mezo", "dpzero_loop", "mezo_loop", "dpzero_first", "mezo_first", "adamw", "opacus")
         + ENGINE_KEYS}
    s["dpzero_vs_fwd2"] = _paired(row, "dpzero", "fwd2")
    s["mezo_vs_fwd2"] = _paired(row, "mezo", "fwd2")
    s["dpzero_vs_mezo"] = _paired(row, "dpzero", "mezo")
    s["dpzero_minus_fwd2"] = (s["dpzero"] - s["fwd2"]) if s["dpzero"] is not None and s["fwd2"] else None
    s["dpzero_loop_minus_fwd2"] = (s["dpzero_loop"] - s["fwd2"]) if s["dpzero_loop"] and s["fwd2"] else None
    for name in ("fused_pass", "fused_update", "chunked_pass", "chunked_update"):
        s[f"{name}_vs_copy"] = _paired(row, name, "copy")
    s["bandwidth"] = ratio_of(row.get("bytes_per_pass"), s["copy"])
    # The best a 3-pass step can do: two forwards plus three passes at the card's copy speed.
    s["floor_vs_fwd2"] = 1 + 3 * s["copy"] / s["fwd2"] if s["copy"] is not None and s["fwd2"] else None
    s["target_vs_fwd2"] = TARGET_STEP_VS_FWD2.get((row["model"], row["batch"]))
    # --bcd: "bcd" holds one value per repetition, the mean step time of its full cycle.
    for key in BCD_METHODS:
        s[key] = median_of(times.get(key))
    s["bcd_vs_fwd2"] = _paired(row, "bcd", "fwd2")
    s["mezo_vs_bcd"] = _paired(row, "mezo", "bcd")
    s["paper_vs_bcd"] = _paired(row, "paper_mezo", "bcd")
    return s


def has_bcd(row: dict) -> bool:
    """Whether the row was measured with ``--bcd`` (data, or an error, for MeZO-BCD or the paper's MeZO)."""
    return any(m in row.get("times", {}) or m in (row.get("errors") or {}) for m in BCD_METHODS) \
        or "bcd_blocks" in row


def _ms(x):
    return fmt(None if x is None else 1e3 * x, ".1f")


def first_steps(s: dict) -> str:
    """The first step of a fit, DPZero / MeZO (rows measured before it was timed apart: "-")."""
    if s["dpzero_first"] is None and s["mezo_first"] is None:
        return "-"
    return f"{_ms(s['dpzero_first'])} / {_ms(s['mezo_first'])}"


def _fails(row: dict, method: str) -> str | None:
    err = (row.get("errors") or {}).get(method)
    if not err:
        return None
    return "fails (OOM)" if err.startswith("OOM") else "fails"


def _check(value, target, le=True) -> str:
    if value is None or target is None:
        return ""
    return " ✓" if (value <= target if le else value >= target) else " ✗"


def render(rows: list[dict]) -> str:
    lines = ["**Step vs two forwards** (ms: medians over repetitions; ratios: medians of per-repetition "
             "ratios; ✓/✗ against the issue's targets; the step columns leave out each fit's first step, "
             "which runs the fit-start privacy checks: its own column, \"-\" where a run predates it)", "",
             "| model | dtype | batch | 2 fwd ms | DPZero step ms | MeZO step ms | DPZero / 2 fwd (target) | "
             f"DPZero / MeZO (<= {TARGET_DPZERO_VS_MEZO}) | DPZero - 2 fwd ms | loop step - 2 fwd ms | "
             "first step of a fit ms: DPZero / MeZO | "
             "AdamW step ms | Opacus ghost ms | peak MiB: inference / DPZero / MeZO / AdamW / Opacus ghost |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        label = LABELS.get(row["model"], row["model"]) + (" (tiny)" if row.get("tiny") else "")
        if row.get("error"):
            lines.append(f"| {label} | {row['dtype']} | {row['batch']} | fails: {row['error'][:120]} |"
                         + " |" * 10)
            continue
        s = summarize(row)
        target = s["target_vs_fwd2"]
        ratio = fmt(s["dpzero_vs_fwd2"]) + (f" (<= {target:.2f}){_check(s['dpzero_vs_fwd2'], target)}"
                                            if target else "")
        small = row["model"] == "minilm"
        overhead = _ms(s["dpzero_minus_fwd2"]) + (
            f" (<= {TARGET_SMALL_OVERHEAD_MS:g}){_check(None if s['dpzero_minus_fwd2'] is None else 1e3 * s['dpzero_minus_fwd2'], TARGET_SMALL_OVERHEAD_MS)}"
            if small else "")
        mem = row.get("memory") or {}

        def mib(method):
            e = mem.get(method)
            if not e:
                return "-"
            if e.get("error"):
                return "fails (OOM)" if e["error"].startswith("OOM") else "fails"
            return fmt(e["footprint"] / 2**20 if e.get("footprint") is not None else None, ".0f")

        lines.append(
            f"| {label} | {row['dtype']} | {row['batch']} | {_ms(s['fwd2'])} | {_ms(s['dpzero'])} | "
            f"{_ms(s['mezo'])} | {ratio} | {fmt(s['dpzero_vs_mezo'])}"
            f"{_check(s['dpzero_vs_mezo'], TARGET_DPZERO_VS_MEZO)} | {overhead} | "
            f"{_ms(s['dpzero_loop_minus_fwd2'])} | {first_steps(s)} | {_fails(row, 'adamw') or _ms(s['adamw'])} | "
            f"{_fails(row, 'opacus') or _ms(s['opacus'])} | "
            + " / ".join(mib(m) for m in MEMORY_METHODS) + " |")
    lines += ["", f"**Engine pass vs copy bandwidth** (a pass reads and writes every parameter once: bytes = "
              f"2 x numel x itemsize; pass / copy = pass time / (bytes / measured copy bandwidth), target "
              f"<= {TARGET_PASS_VS_COPY})", "",
              "| model | dtype | batch | params M | MB per pass | copy ms | copy GB/s | fused pass ms | "
              "fused / copy | fused update ms | fused update / copy | chunked pass ms | chunked / copy | "
              "chunked update ms | step floor / 2 fwd (3 passes at copy speed) | engine in the step |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        if row.get("error"):
            continue
        s = summarize(row)
        label = LABELS.get(row["model"], row["model"]) + (" (tiny)" if row.get("tiny") else "")
        fused = "fused" + (f" ({row['fused_backend']})" if row.get("fused_backend") else "")
        lines.append(
            f"| {label} | {row['dtype']} | {row['batch']} | {row['n_params'] / 1e6:.1f} | "
            f"{row['bytes_per_pass'] / 1e6:.0f} | {_ms(s['copy'])} | {fmt(ratio_of(s['bandwidth'], 1e9), '.0f')} | "
            f"{_ms(s['fused_pass'])} | {fmt(s['fused_pass_vs_copy'], '.2f')}"
            f"{_check(s['fused_pass_vs_copy'], TARGET_PASS_VS_COPY)} | {_ms(s['fused_update'])} | "
            f"{fmt(s['fused_update_vs_copy'], '.2f')} | {_ms(s['chunked_pass'])} | "
            f"{fmt(s['chunked_pass_vs_copy'], '.2f')} | {_ms(s['chunked_update'])} | "
            f"{fmt(s['floor_vs_fwd2'])} | {row.get('zo_engine', 'n/a')}; standalone {fused} |")
    lines += render_tiles(rows)
    bcd_rows = [row for row in rows if not row.get("error") and has_bcd(row)]
    if bcd_rows:
        lines += ["", "**MeZO-BCD (issue 9)** (BCD: `MeZOBCD(partition=\"layer\", order=\"random\")`, each "
                  "repetition one full random-order cycle, its value the MEAN step time of the cycle, ms the "
                  "median over repetitions; paper baseline: MeZO as the reference code writes it "
                  "(`bench_mezo_bcd.PaperMeZO`); ratios: medians of per-repetition ratios)", "",
                  "| model | dtype | batch | blocks | 2 fwd ms | BCD step ms (cycle mean) | MeZO step ms | "
                  f"paper baseline ms | BCD / 2 fwd (<= {TARGET_BCD_VS_FWD2}) | MeZO / BCD | "
                  f"paper / BCD (>= {TARGET_PAPER_VS_BCD:g}) | peak MiB BCD (cycle) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in bcd_rows:
            s = summarize(row)
            label = LABELS.get(row["model"], row["model"]) + (" (tiny)" if row.get("tiny") else "")
            e = (row.get("memory") or {}).get("bcd")
            if not e:
                peak = "-"
            elif e.get("error"):
                peak = "fails (OOM)" if e["error"].startswith("OOM") else "fails"
            else:
                peak = fmt(e["footprint"] / 2**20 if e.get("footprint") is not None else None, ".0f")
            blocks = len((row.get("bcd_blocks") or {}).get("names") or []) or "n/a"
            lines.append(
                f"| {label} | {row['dtype']} | {row['batch']} | {blocks} | {_ms(s['fwd2'])} | "
                f"{_fails(row, 'bcd') or _ms(s['bcd'])} | {_ms(s['mezo'])} | "
                f"{_fails(row, 'paper_mezo') or _ms(s['paper_mezo'])} | {fmt(s['bcd_vs_fwd2'])}"
                f"{_check(s['bcd_vs_fwd2'], TARGET_BCD_VS_FWD2)} | {fmt(s['mezo_vs_bcd'])} | "
                f"{fmt(s['paper_vs_bcd'], '.2f')}{_check(s['paper_vs_bcd'], TARGET_PAPER_VS_BCD, le=False)} | "
                f"{peak} |")
    where: dict[str, list[str]] = {}  # note -> the rows it concerns (each note once)

    def note(row, text):
        where.setdefault(text, []).append(f"{row['model']} {row['dtype']} b{row['batch']}")

    for row in rows:
        for text in row.get("notes") or []:
            note(row, text)
        for what, err in (row.get("errors") or {}).items():
            note(row, f"{what}: {err[:300]}")
        for method, e in (row.get("memory") or {}).items():
            if isinstance(e, dict) and e.get("error") and not e.get("skipped"):
                note(row, f"memory {method}: {e['error'][:300]}")
            if isinstance(e, dict) and e.get("reset") is False:
                note(row, f"memory {method}: peak counter not reset (the peak covers the whole process)")
        if row.get("error"):
            note(row, row["error"][:300])
    notes = [f"- {', '.join(rows_)}: {text}" for text, rows_ in where.items()]
    if notes:
        lines += ["", "Notes:"] + notes
    return "\n".join(lines)


def render_tiles(rows: list[dict]) -> list[str]:
    """The fused kernel at other tile sizes (``--tiles``) beside its default: pass and update vs the copy."""
    tiled = [row for row in rows if not row.get("error")
             and any(k.startswith("fused@") for k in row.get("times", {}))]
    if not tiled:
        return []
    lines = ["", "**Fused kernel tiles** (elements per program x warps; pass / copy and update / copy as above, "
             "the default tile first)", "", "| model | dtype | batch | tile | pass ms | pass / copy | update / copy |",
             "|---|---|---:|---|---:|---:|---:|"]
    for row in tiled:
        label = LABELS.get(row["model"], row["model"]) + (" (tiny)" if row.get("tiny") else "")
        names = ["fused"] + sorted({k[:-len("_pass")] for k in row["times"] if k.startswith("fused@")
                                    and k.endswith("_pass")})
        for name in names:
            tile = f"{row.get('default_tile', 'default')} (default)" if name == "fused" else name[len("fused@"):]
            passes = median_of(row["times"].get(f"{name}_pass"))
            lines.append(f"| {label} | {row['dtype']} | {row['batch']} | {tile} | {_ms(passes)} | "
                         f"{fmt(_paired(row, f'{name}_pass', 'copy'), '.2f')} | "
                         f"{fmt(_paired(row, f'{name}_update', 'copy'), '.2f')} |")
    return lines


def header(meta: dict) -> str:
    a = meta.get("args", {})
    device = meta.get("cuda") or f"CPU ({meta.get('cpu')}, {meta.get('cpus')} CPUs, {a.get('threads')} threads)"
    return (f"# Zeroth-order step vs two forwards, MeZO, AdamW and Opacus (issue 8)\n\n`{meta['command']}`  \n"
            f"device: **{device}**; torch {meta.get('torch')}, triton {meta.get('triton')}, opacus "
            f"{meta.get('opacus')}, lightning {meta.get('lightning')}; engine in the ZO modules: "
            f"`perturbation={a.get('engine')}`; repeats {a.get('repeats')} (+{a.get('warmup')} warm-up); "
            f"memory: {a.get('memory')}"
            f"{'; --bcd: MeZO-BCD (one full cycle per repetition) and the paper MeZO baseline' if a.get('bcd') else ''}"
            f"{'; TINY configs (2 layers, hidden 64): a smoke test, not a measurement' if a.get('tiny') else ''}; "
            f"total {meta.get('total_wall_s', 0):.0f} s"
            + ("".join(f"  \npart: `{part}`" for part in meta.get("parts", [])) + "\n\n"))


def write(stem: Path, meta: dict, rows: list[dict], raw: list[dict]) -> None:
    """``<stem>.md`` (the header and the tables) and ``<stem>.json`` (``meta``, ``rows``, ``raw``)."""
    write_results(stem, header(meta) + render(rows), {"meta": meta, "rows": rows, "raw": raw}, announce=False)


def merge(args, command: str) -> None:
    rows, raw, metas = [], [], []
    for stem in args.merge:
        data = json.loads(Path(stem).with_suffix(".json").read_text())
        rows += data["rows"]
        raw += data.get("raw", [])
        metas.append(data["meta"])
    # The header shows the first part's settings; each part's own command line follows it.
    meta = dict(metas[0], command=command, parts=[m["command"] for m in metas],
                total_wall_s=sum(m.get("total_wall_s", 0) for m in metas))
    devices = {m.get("cuda") for m in metas}
    if len(devices) > 1:
        print(f"warning: the parts ran on different devices: {devices}", flush=True)
    stem = results_stem(args.out, "bench_zo_gpu")
    write(stem, meta, rows, raw)
    print(header(meta) + render(rows))
    announce_written(stem)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list from {MODELS}")
    parser.add_argument("--batches", default=None,
                        help="comma list for every model (default: 16,64 for roberta_large and opt_1_3b, 32 for minilm)")
    parser.add_argument("--dtypes", default="fp32,bf16", help=f"comma list from {tuple(DTYPES)}")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per example (default 128; 32 for minilm)")
    parser.add_argument("--repeats", type=int, default=5, help="measured repetitions (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured repetitions first (one step each)")
    parser.add_argument("--steps-per-repeat", type=int, default=None,
                        help="steps (one fit, after its first step) / forward pairs / passes per repetition "
                             "(default 3; 10 for minilm)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--engine", default="auto", choices=["auto", "chunked", "fused"],
                        help="`perturbation=` of the DPZero/MeZO modules (auto: fused on CUDA with Triton)")
    parser.add_argument("--memory", default="inprocess", choices=["inprocess", "none"],
                        help="peak memory of each method alone after the timings (none: skip)")
    parser.add_argument("--no-memory", dest="memory", action="store_const", const="none")
    parser.add_argument("--tiles", default="1024x8,1024x4,512x4",
                        help="extra tiles (BLOCKxWARPS, comma list; '' for none) of the fused kernel, timed "
                             "beside the default in the engine measurement (and the default with software log/cos/sin)")
    parser.add_argument("--no-opacus", action="store_true")
    parser.add_argument("--no-adamw", action="store_true")
    parser.add_argument("--bcd", action="store_true",
                        help="also time MeZO-BCD (one full random-order layer-block cycle per repetition) and "
                             "the paper's MeZO baseline (bench_mezo_bcd.PaperMeZO); adds the MeZO-BCD table")
    parser.add_argument("--tiny", action="store_true",
                        help="every model shrunk to 2 layers, hidden 64, vocabulary 4096 (CPU smoke test)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    parser.add_argument("--out", default=None, help="results file stem (default benchmarks/results/bench_zo_gpu; "
                             "with --tiny benchmarks/results/quick/bench_zo_gpu)")
    parser.add_argument("--merge", nargs="+", default=None, metavar="STEM",
                        help="render one table from the .json of earlier runs (per-model parts) into --out")
    # worker-only
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--worker-batches", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)

    raw_argv = argv if argv is not None else sys.argv[1:]
    command = command_line("bench_zo_gpu.py", raw_argv)
    if args.merge:
        return merge(args, command)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for m in models:
        if m not in MODELS:
            parser.error(f"unknown model {m!r}; choose from {MODELS}")
    for d in dtypes:
        if d not in DTYPES:
            parser.error(f"unknown dtype {d!r}; choose from {tuple(DTYPES)}")
    on_cuda = cuda_available()
    if args.device == "cuda" and not on_cuda:
        parser.error("--device cuda, but torch sees no CUDA device")
    if args.device == "auto" and not on_cuda and not args.tiny:
        print("warning: no CUDA device: full-size models on the CPU take very long (use --tiny for a smoke test)",
              flush=True)
    meta = machine_info()
    meta.update(command=command, on_cuda=on_cuda and args.device != "cpu",
                args={k: v for k, v in vars(args).items()
                      if k not in ("worker", "model", "dtype", "worker_batches", "result_file", "merge")})
    stem = results_stem(args.out, "bench_zo_gpu", quick=args.tiny)  # a --tiny smoke run leaves the GPU results alone
    started = time.perf_counter()
    rows, raw = [], []
    plan = [(m, d, [int(b) for b in args.batches.split(",")] if args.batches else DEFAULT_BATCHES[m])
            for m in models for d in dtypes]
    for i, (model, dtype, batches) in enumerate(plan):
        print(f"[{time.perf_counter() - started:6.0f}s] ({i + 1}/{len(plan)}) {model} {dtype} batches "
              f"{batches}: one worker ...", flush=True)
        result = spawn(args, model, dtype, batches)
        for key in ("cuda_name", "torch", "triton"):
            if result.get(key):
                meta[{"cuda_name": "cuda"}.get(key, key)] = result[key]
        rows += result["rows"]
        raw.append({k: v for k, v in result.items() if k != "rows"})
        finish_meta(meta, started)
        write(stem, meta, rows, raw)  # after every worker: a run cut short keeps what it measured
        print(render(result["rows"]).split("\n\n")[1], flush=True)
    print("\n" + header(meta) + render(rows))
    announce_written(stem)


if __name__ == "__main__":
    main()

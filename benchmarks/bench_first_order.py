#!/usr/bin/env python
"""DPSGD and DPAdam (lit_zodp's per-example gradient engine) against Opacus DP-SGD, side by side.

For each model and batch size, in ONE run, with the same model, batch, clip (1.0) and sigma (1.0):

* ``dpsgd_hooks`` / ``dpsgd_ghost`` / ``dpsgd_bookkeeping`` / ``dpadam_hooks``: ``DPSGD`` / ``DPAdam``
  with ``grad_mode="hooks"`` (every per-example gradient materialised), ``"ghost"`` (per-example
  norms in the backward, a second backward for the clipped sums: the memory of ghost clipping) or
  ``"bookkeeping"`` (norms and sums from the kept output gradients, one backward). The timer wraps the LightningModule's ``training_step`` itself, driven by
  a real Lightning ``Trainer`` over the library's ``FullBatchSampler`` on a dataset that is exactly the
  batch (per-example gradients, flat clip, sum, one Gaussian release, optimizer step, ledger, logs);
  the engine's share (``private_gradient``: forward, backward, per-example gradients or norms, clip,
  sum) is timed inside it. Each repetition is a fresh fit of ``1 + k`` steps: its first step also runs the
  fit-start privacy checks (the independence checks; the engine's checks of a structure it has not seen),
  which a long run pays once, so it is reported in its own column and the ``k`` after it are timed (until
  2026-11-28 the timed step WAS a fit's first step: 1.5-1.8x the steady step on ViT-tiny/64).
* ``opacus_hooks`` / ``opacus_ghost``: ``PrivacyEngine.make_private`` (SGD, ``poisson_sampling=False``),
  hooks mode or ghost clipping (``grad_sample_mode="ghost"``, with the criterion it returns): forward,
  backward, clip, noise, SGD step, ``zero_grad``.
* ``nonprivate``: forward, backward of the mean loss and an SGD step: the floor.
* ``opacus_dplstm`` (``lstm`` only, in its default methods): the same LSTM as an Opacus user writes it, embedding
  -> ``opacus.layers.DPLSTM(128, 64, num_layers=2, batch_first=True)`` on a ``PackedSequence`` of the rows' real
  lengths -> the last layer's final hidden state -> ``Linear(64, 2)`` (the LSTMClassifier's weights copied: the same
  logits; DPLSTM's extra hidden-to-gates bias, 512 parameters, starts at 0), made private like ``opacus_hooks``.

Models: ``vit_tiny`` and ``minilm`` (by default; ``roberta_large`` too on CUDA), and ``lstm`` when asked for
(``--models lstm``): PAZO Table 4's IMDB model, ``LSTMClassifier()`` (vocabulary 10,002, embedding 128, 2 layers of
64; 1.36M parameters), batch 64, on random reviews of ``--seq-len`` tokens (default 290 for this model, the paper's
maximum length): ids >= 2, each row of a random length between half the width and the width, right-padded with 0
under an ``attention_mask``, rows sorted longest first (Opacus' DPLSTM needs that for correct per-example gradients:
see ``dplstm_class``); every method gets the same rows. Opacus' ghost clipping refuses the model (a layer called
more than once per forward: the hidden-to-gates layer runs once per token); a one-forward probe finds that and
``opacus_ghost`` is reported skipped with Opacus' error.

Time: all methods in one worker process, interleaved, their order rotating each repetition; the
median over repetitions is reported, and ratios are medians of per-repetition (paired) ratios.
Memory: one fresh worker process per (model, batch, method): peak RSS on CPU (``VmHWM`` after a
reset of the kernel's counter), ``torch.cuda.max_memory_allocated`` on GPU.

The model builders, the Trainer driver and the Opacus setup come from ``bench_dpzero.py``; the worker
processes, the load probe and the RSS helpers from ``_common.py`` (imported, not copied). See
benchmarks/README.md.

Usage::

    python benchmarks/bench_first_order.py                 # ViT-tiny b64, b256 and MiniLM b32 (+ RoBERTa-large b16 on GPU)
    python benchmarks/bench_first_order.py --quick         # smoke run: batch 16, 32 tokens, 2 repeats
    python benchmarks/bench_first_order.py --device cuda --models roberta_large
    python benchmarks/bench_first_order.py --models lstm      # PAZO's IMDB LSTM, batch 64, 290 tokens
    python benchmarks/bench_first_order.py --models roberta_large --roberta-layers 1 --batches 2 --seq-len 16 \\
        --repeats 1 --out /tmp/roberta_smoke                # CPU smoke test of the RoBERTa builder
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import functools
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench_dpzero as bd  # noqa: E402  (light at import: heavy imports happen in its functions)
from _common import (add_worker_options, apply_quick_defaults, command_line, cuda_available,  # noqa: E402
                     finish_meta, fmt, load_and_total, machine_info, make_nonprivate_step, median_of,
                     mem_available, probe_call, probe_timed, proc_status, ratio_of, read_peak, reset_peak,
                     reset_peak_rss, resolve_device, results_stem, rss_result, run_worker_process,
                     setup_worker, sync, worker_env, write_results)

MODELS = ("vit_tiny", "minilm", "roberta_large", "lstm")
DEFAULT_MODELS = ("vit_tiny", "minilm")  # + roberta_large on CUDA; lstm only when asked for
DEFAULT_BATCHES = {"vit_tiny": [64, 256], "minilm": [32], "roberta_large": [16], "lstm": [64]}
#: Tokens per example when ``--seq-len`` is not given: the LSTM's is the PAZO paper's IMDB maximum length.
DEFAULT_SEQ_LEN = {"lstm": 290}
SEQ_LEN = 128
METHODS = ("nonprivate", "dpsgd_hooks", "dpsgd_ghost", "dpsgd_bookkeeping", "dpadam_hooks", "opacus_hooks",
           "opacus_ghost")
#: Methods of one model only (in that model's default method list, refused on the others).
MODEL_METHODS = {"opacus_dplstm": "lstm"}
#: Optional: ViT with cls_token/pos_embed trainable for OUR engine only (Opacus has no rule for them and
#: freezes them in every default method): the engine's torch.func fallback over the whole VisionTransformer.
EXTRA_METHODS = ("dpsgd_hooks_allparams", "dpsgd_ghost_allparams")
OURS = {"dpsgd_hooks": ("dpsgd", "hooks"), "dpsgd_ghost": ("dpsgd", "ghost"),
        "dpsgd_bookkeeping": ("dpsgd", "bookkeeping"), "dpadam_hooks": ("dpadam", "hooks"),
        "dpsgd_hooks_allparams": ("dpsgd", "hooks"), "dpsgd_ghost_allparams": ("dpsgd", "ghost")}
OPACUS = {"opacus_hooks": "hooks", "opacus_ghost": "ghost", "opacus_dplstm": "hooks"}
MATERIALISING = {"dpsgd_hooks", "dpadam_hooks", "opacus_hooks", "opacus_dplstm", "dpsgd_hooks_allparams"}

CLIP = bd.CLIP      # 1.0
SIGMA = bd.SIGMA    # 1.0
LR = bd.LR          # 1e-6 (the step size does not change the cost of a step)
DELTA = 1e-5

#: RoBERTa-large (``roberta-large``'s config.json) built from ``RobertaConfig`` with random weights.
ROBERTA_LARGE = dict(vocab_size=50265, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                     intermediate_size=4096, max_position_embeddings=514, type_vocab_size=1,
                     layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2)


# =====================================================================================
# Worker side
# =====================================================================================

def build(args, model: str, batch: int, device):
    """``bd.build_model`` plus RoBERTa-large from its configuration and the LSTM: ``(backbone, inputs, targets,
    dataset)``."""
    if model == "lstm":
        return build_lstm(batch, args.seq_len, device)
    if model != "roberta_large":
        return bd.build_model(model, batch, args.seq_len, device)
    import torch

    from lit_zodp.backbones import HFSequenceClassifier

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    overrides = dict(ROBERTA_LARGE)
    if args.roberta_layers:
        overrides["num_hidden_layers"] = args.roberta_layers
    # AutoConfig.for_model("roberta", **overrides): RobertaConfig's defaults with roberta-large's sizes.
    backbone = HFSequenceClassifier(config={"model_type": "roberta", **overrides}, num_classes=2)
    ids = torch.randint(3, overrides["vocab_size"], (batch, args.seq_len), generator=g)
    ids[:, 0], ids[:, -1] = overrides["bos_token_id"], overrides["eos_token_id"]
    # No position_ids: RoBERTa derives them per example ([B, T]) from input_ids (padding offset).
    inputs = {"input_ids": ids, "attention_mask": torch.ones(batch, args.seq_len, dtype=torch.long),
              "token_type_ids": torch.zeros(batch, args.seq_len, dtype=torch.long)}
    targets = torch.randint(0, 2, (batch,), generator=g)
    backbone = backbone.to(device)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    targets = targets.to(device)
    return backbone, inputs, targets, bd.FixedBatch(inputs, targets)


#: PAZO Table 4's IMDB model (App. C.1): :class:`~lit_zodp.backbones.LSTMClassifier`'s defaults.
LSTM = dict(vocab_size=10_002, embedding_dim=128, hidden_size=64, num_layers=2, num_classes=2)


def build_lstm(batch: int, seq_len: int, device, seed: int = 0):
    """The LSTM on random reviews: ids in ``[2, vocab)`` (0 is padding, 1 unknown), each row of a random length
    between half the width and the width, right-padded with 0 and an ``attention_mask``. Rows are sorted by length,
    longest first (see :class:`DPLSTMClassifier`); every method gets the same rows."""
    import torch

    from lit_zodp.backbones import LSTMClassifier

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    backbone = LSTMClassifier(**LSTM)
    ids = torch.randint(2, LSTM["vocab_size"], (batch, seq_len), generator=g)
    lengths = torch.randint((seq_len + 1) // 2, seq_len + 1, (batch,), generator=g)
    lengths = lengths.sort(descending=True, stable=True).values
    mask = (torch.arange(seq_len) < lengths[:, None]).long()
    inputs = {"input_ids": (ids * mask).to(device), "attention_mask": mask.to(device)}
    targets = torch.randint(0, LSTM["num_classes"], (batch,), generator=g).to(device)
    backbone = backbone.to(device)
    return backbone, inputs, targets, bd.FixedBatch(inputs, targets)


def dplstm_classifier(backbone):
    """:class:`DPLSTMClassifier` computing the same function as the ``LSTMClassifier`` ``backbone`` (its weights
    copied; DPLSTM's extra hidden-to-gates bias set to 0)."""
    import torch

    model = dplstm_class()(backbone.vocab_size, backbone.embedding.embedding_dim, backbone.layers[0].hidden_size,
                             len(backbone.layers), backbone.num_classes)
    params = dict(model.lstm.named_parameters())
    with torch.no_grad():
        model.embedding.weight.copy_(backbone.embedding.weight)
        for k, layer in enumerate(backbone.layers):  # both in nn.LSTM's gate order (i, f, g, o)
            params[f"weight_ih_l{k}"].copy_(layer.input.weight)
            params[f"bias_ih_l{k}"].copy_(layer.input.bias)
            params[f"weight_hh_l{k}"].copy_(layer.hidden.weight)
            params[f"bias_hh_l{k}"].zero_()
        model.head.weight.copy_(backbone.head.weight)
        model.head.bias.copy_(backbone.head.bias)
    return model.to(backbone.head.weight.device)


@functools.lru_cache(maxsize=None)
def dplstm_class():
    """The ``DPLSTMClassifier`` class (built on first use: Opacus and torch are imported in the workers only)."""
    from opacus.layers import DPLSTM
    from torch import nn
    from torch.nn.utils.rnn import pack_padded_sequence

    class DPLSTMClassifier(nn.Module):
        """The LSTM as an Opacus user writes it: embedding -> ``opacus.layers.DPLSTM`` (``batch_first``) on a
        ``PackedSequence`` of the rows' real lengths -> the last layer's final hidden state -> linear head.

        Packed with ``enforce_sorted=True`` on rows already sorted longest first (:func:`build_lstm`): Opacus 1.6's
        DPLSTM leaves a packed batch in its length-sorted order inside, so with ``enforce_sorted=False`` on unsorted
        rows its per-example gradients of the LSTM weights belong to the sorted rows while the embedding's and the
        head's belong to the batch's rows: each row's clipped gradient mixes two examples' (checked on Opacus 1.6.0:
        exact after the sort, off by up to 0.3 without it)."""

        def __init__(self, vocab_size, embedding_dim, hidden_size, num_layers, num_classes) -> None:
            super().__init__()
            self.embedding = nn.Embedding(vocab_size, embedding_dim)
            self.lstm = DPLSTM(embedding_dim, hidden_size, num_layers=num_layers, batch_first=True)
            self.head = nn.Linear(hidden_size, num_classes)

        def forward(self, inputs):
            lengths = inputs["attention_mask"].sum(1).cpu()
            packed = pack_padded_sequence(self.embedding(inputs["input_ids"]), lengths, batch_first=True,
                                          enforce_sorted=True)
            _, (h, _) = self.lstm(packed)
            return self.head(h[-1])

        def per_example_loss(self, inputs, targets):  # the memory worker's warm-up (it would pass ``**inputs``)
            return nn.functional.cross_entropy(self(inputs), targets, reduction="none")

    return DPLSTMClassifier


def method_backbone(backbone, method: str):
    """The model ``method`` trains: ``opacus_dplstm`` its DPLSTM twin of the LSTM, any other ``backbone`` itself."""
    return dplstm_classifier(backbone) if method == "opacus_dplstm" else backbone


def opacus_ghost_refusal(backbone, inputs) -> str | None:
    """Why Opacus' ghost clipping cannot run ``backbone`` (one forward on 2 rows, 4 tokens), or ``None``. Opacus
    1.6 refuses a layer called more than once per forward (the LSTM's hidden-to-gates layer, once per token)."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    probe = GradSampleModuleFastGradientClipping(copy.deepcopy(backbone).train(), max_grad_norm=CLIP,
                                                 use_ghost_clipping=True)
    try:
        probe({k: v[:2, :4] for k, v in inputs.items()})
    except NotImplementedError as err:
        return (f"opacus_ghost skipped: Opacus ghost clipping refuses this model (NotImplementedError: {err}): "
                "it does not take a layer called more than once per forward, as the LSTM's hidden-to-gates "
                "nn.Linear is, once per token")
    return None


def prepare(backbone, model: str, method: str):
    """The same function and trainable set for every method: dropout off (Opacus' setup in
    ``bd.make_opacus`` does the same), and on ViT cls_token/pos_embed frozen (no Opacus rule covers
    them) except for the ``*_allparams`` variants of our engine."""
    from torch import nn

    for m in backbone.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0  # HF attention reads its dropout probability from this module too
    if model == "vit_tiny" and not method.endswith("_allparams"):
        backbone.model.cls_token.requires_grad_(False)
        backbone.model.pos_embed.requires_grad_(False)
    backbone.train()
    return backbone


PHASES = ("engine", "release", "apply")


def make_ours(backbone, algo: str, grad_mode: str, track_memory: bool = False):
    """DPSGD / DPAdam whose ``training_step`` is timed, and its three verbs inside it: ``engine``
    (``private_gradient``: forward, backward, per-example gradients or norms, clip, sum), ``release``
    (``release_gradient``: flatten, Gaussian noise, divide) and ``apply`` (``apply_gradient``: the
    optimizer step, ledger). With ``track_memory`` each verb's peak memory is recorded too (the peak
    counter is read, then reset, around each verb: the overall peak is the max of all readings)."""
    from lit_zodp.algorithms import DPAdam, DPSGD

    base = {"dpsgd": DPSGD, "dpadam": DPAdam}[algo]

    class Timed(probe_timed(base)):
        abstract = True  # not registered in lit_zodp.algorithms.ALGORITHMS

        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.phase_times: dict[str, list[float]] = {p: [] for p in PHASES}
            self.phase_peaks: list[tuple[str, int | None]] = []
            self.track_memory = track_memory
            self.profiler = None  # profile_methods: a torch.profiler entered around the fit's steady steps

        def training_step(self, batch, batch_idx):
            if self.profiler is None or batch_idx == 0:  # (a fit's first step runs the fit-start checks)
                return super().training_step(batch, batch_idx)
            with self.profiler:
                return super().training_step(batch, batch_idx)

        def _phase(self, name, fn, *a):
            device = self.device
            if self.track_memory:
                self.phase_peaks.append((f"before {name}", read_peak(device)))
                reset_peak(device)
            sync(device)
            start = time.perf_counter()
            out = fn(*a)
            sync(device)
            self.phase_times[name].append(time.perf_counter() - start)
            if self.track_memory:
                self.phase_peaks.append((name, read_peak(device)))
                reset_peak(device)
            return out

        def private_gradient(self, inputs, targets):
            return self._phase("engine", super().private_gradient, inputs, targets)

        def release_gradient(self, clipped):
            return self._phase("release", super().release_gradient, clipped)

        def apply_gradient(self, gradient):
            return self._phase("apply", super().apply_gradient, gradient)

    Timed.__name__ = Timed.__qualname__ = f"Timed{base.__name__}"
    return Timed(backbone, lr=LR, clip=CLIP, noise_multiplier=SIGMA, delta=DELTA, seed=0, grad_mode=grad_mode)


def per_sample_bytes(backbone) -> int:
    return bd.opacus_hooks_bytes(backbone, 1)


def memory_budget(args, device) -> float:
    """Bytes allowed for B x d per-sample gradients (hooks modes): ``--mem-budget-gb`` or 60% of free."""
    if args.mem_budget_gb:
        return args.mem_budget_gb * 2**30
    if device.type == "cuda":
        import torch

        return 0.6 * torch.cuda.mem_get_info(device)[0]
    return 0.6 * mem_available()


def skip_reason(args, method: str, backbone, batch: int, device, inputs=None) -> str | None:
    only = MODEL_METHODS.get(method)
    if only and only != args.model:
        return f"{method} skipped: a method of the {only} model only"
    if method == "opacus_ghost" and args.model == "lstm" and inputs is not None:
        return opacus_ghost_refusal(backbone, inputs)
    if method not in MATERIALISING:
        return None
    need = per_sample_bytes(backbone) * batch
    budget = memory_budget(args, device)
    if need <= budget:
        return None
    return (f"{method} skipped: B x d per-sample gradients need {need / 2**30:.1f} GiB "
            f"(> budget {budget / 2**30:.1f} GiB, --mem-budget-gb)")


class Runner:
    """One method on its own prepared copy of the model: ``run(k)`` takes ``k`` steps and returns
    ``[(wall, load, verb times or None), ...]``."""

    def __init__(self, method: str, backbone, inputs, targets, dataset, model: str, batch: int, device,
                 track_memory: bool = False):
        self.method, self.device = method, device
        self.notes: list[str] = []
        self.first_times: list[float] = []  # ours: each measured fit's first step
        self.backbone = prepare(backbone, model, method)
        if method in OURS:
            algo, mode = OURS[method]
            self.module = make_ours(self.backbone, algo, mode, track_memory).to(device)
            self.dataset = dataset
        elif method in OPACUS:
            self.step, notes = bd.make_opacus(self.backbone, dataset, batch, model, OPACUS[method])
            self.notes += [n for n in notes if not n.startswith("cls_token")]
        elif method == "nonprivate":
            self.step = make_nonprivate_step(self.backbone, inputs, targets, "SGD", LR)
        else:
            raise ValueError(f"unknown method {method!r}")

    def run(self, k: int, *, first_apart: bool = True) -> list[tuple]:
        """``k`` steps; ours after one more step that starts a fresh fit (:func:`bench_dpzero.steady_fit`:
        the fit-start privacy checks, a long run's once-per-fit cost), whose seconds go to ``first_times``;
        without ``first_apart``, one fit of ``k`` steps, its first among them (the memory workers)."""
        if self.method in OURS:
            m = self.module
            if not first_apart:
                bd.dpzero_fit(m, self.dataset, k, self.device)
                return []
            first = bd.steady_fit(m, self.dataset, k, self.device)  # fresh Trainer; module back on device
            self.first_times.append(m.step_times[first])
            phases = [{p: m.phase_times[p][i] for p in PHASES} for i in range(first + 1, len(m.step_times))]
            return list(zip(m.step_times[first + 1:], m.step_loads[first + 1:], phases))
        return [probe_call(self.step, self.device) + (None,) for _ in range(k)]


def worker_time(args) -> dict:
    """Every method interleaved in this process, the order rotating each repetition."""
    import torch

    device = resolve_device(args.device)
    base, inputs, targets, dataset = build(args, args.model, args.batch, device)
    methods = [m for m in args.methods.split(",") if m]
    result = {"notes": [], "skipped": {}, "errors": {}, "times": {}, "phases": {}, "loads": {}, "rep_of": {}}
    runners = {}
    for method in methods:
        why = skip_reason(args, method, base, args.batch, device, inputs)
        if why:
            result["skipped"][method] = why
            continue
        try:
            runners[method] = Runner(method, method_backbone(copy.deepcopy(base), method), inputs, targets,
                                     dataset, args.model, args.batch, device)
            result["notes"] += [f"{method}: {n}" for n in runners[method].notes]
        except Exception as err:  # record why this method cannot run this configuration
            result["errors"][method] = f"{type(err).__name__}: {err}"[:600]
    if "opacus_dplstm" in runners:
        n_ours, n_dplstm = (sum(p.numel() for p in b.parameters())
                            for b in (base, runners["opacus_dplstm"].backbone))
        result["notes"].append(f"opacus_dplstm: Opacus' DPLSTM on a PackedSequence of the rows' lengths, the "
                               f"same weights ({n_dplstm:,} params: DPLSTM's hidden-to-gates bias, 0 at the start, "
                               f"adds {n_dplstm - n_ours:,} to LSTMClassifier's {n_ours:,})")
    if args.model == "vit_tiny" and any(not m.endswith("_allparams") for m in runners):
        result["notes"].append("cls_token+pos_embed (12,672 params) frozen for every method except *_allparams "
                               "(no Opacus grad sampler covers them)")
    del base
    order = list(runners)
    for method in order:
        result["times"][method], result["phases"][method], result["loads"][method], result["rep_of"][method] = [], [], [], []
    for rep in range(-args.warmup, args.repeats):
        live = [m for m in order if m in runners]
        if not live:
            break
        shift = rep % len(live)
        for method in live[shift:] + live[:shift]:
            try:
                samples = runners[method].run(args.steps_per_repeat if rep >= 0 else 1)
            except Exception as err:
                result["errors"][method] = f"{type(err).__name__}: {err}"[:600]
                del runners[method]
                continue
            if rep >= 0:
                for wall, load, phases in samples:
                    result["times"][method].append(wall)
                    result["loads"][method].append(load)
                    result["phases"][method].append(phases)
                    result["rep_of"][method].append(rep)
    for method, runner in runners.items():
        if method in OURS:
            result.setdefault("first_times", {})[method] = runner.first_times[args.warmup:]
            recomputed = runner.module.engine.last_recomputed
            if recomputed:
                result["notes"].append(f"{method}: engine recomputed by the torch.func fallback: "
                                       f"{sorted(recomputed)} (on {sorted(set(recomputed.values()))})")
    if args.profile:
        result["profile"] = profile_methods(runners, device, args.profile_rows)
    result.update(device=str(device), threads=torch.get_num_threads(),
                  cuda_name=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                  n_params={m: sum(p.numel() for p in r.backbone.parameters()) for m, r in runners.items()},
                  n_trainable={m: sum(p.numel() for p in r.backbone.parameters() if p.requires_grad)
                               for m, r in runners.items()})
    return result


def profile_methods(runners: dict, device, rows: int) -> dict:
    """torch.profiler over one (steady) step of each method: the top ops by self time (CPU, or CUDA on GPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out = {}
    for method, runner in runners.items():
        prof = profile(activities=activities)
        if method in OURS:
            runner.module.profiler = prof
            runner.run(1)
            runner.module.profiler = None
        else:
            with prof:
                runner.run(1)
        events = prof.key_averages()
        total = sum(getattr(e, key, 0) or 0 for e in events)
        top = sorted(events, key=lambda e: getattr(e, key, 0) or 0, reverse=True)[:rows]
        out[method] = {"total_self_ms": total / 1e3,
                       "top": [{"op": e.key, "self_ms": (getattr(e, key, 0) or 0) / 1e3, "calls": e.count}
                               for e in top]}
    return out


def worker_memory(args) -> dict:
    """Peak memory of ONE method in this fresh process, above the model+batch baseline."""
    import gc

    import torch

    device = resolve_device(args.device)
    method = args.method
    backbone, inputs, targets, dataset = build(args, args.model, args.batch, device)
    if MODEL_METHODS.get(method, args.model) == args.model:
        backbone = method_backbone(backbone, method)
    backbone = prepare(backbone, args.model, method)
    cuda = device.type == "cuda"
    tensors = list(backbone.parameters()) + (list(inputs.values()) if isinstance(inputs, dict) else [inputs])
    model_bytes = sum(t.numel() * t.element_size() for t in tensors + [targets])
    result = {"method": method, "model_bytes": model_bytes}
    why = skip_reason(args, method, backbone, args.batch, device, inputs)
    if why:
        result["skipped"] = why
        return result
    one = bd.FixedBatch({k: v[:1] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[:1],
                        targets[:1])
    # Warm-up on ONE example (lazy imports, kernels' one-time state, Lightning's): not per-step memory.
    if method in OURS:
        warm = make_ours(backbone, *OURS[method]).to(device)
        bd.dpzero_fit(warm, one, 1, device)
        del warm
    else:
        from lit_zodp.backbones.base import per_example_loss

        per_example_loss(backbone, one.inputs, one.targets).float().mean().backward()
        for p in backbone.parameters():
            p.grad = None
    gc.collect()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    baseline = proc_status("VmRSS")
    reset_ok = reset_peak_rss()
    if cuda:
        cuda_baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    result["peak_reset"] = reset_ok
    phase_peaks = []
    try:
        runner = Runner(method, backbone, inputs, targets, dataset, args.model, args.batch, device,
                        track_memory=reset_ok or cuda)
        result["notes"] = runner.notes
        runner.run(args.memory_steps, first_apart=False)  # the fit's first step, with its checks, inside the peak
        if method in OURS:
            phase_peaks = runner.module.phase_peaks
    except Exception as err:
        result["error"] = f"{type(err).__name__}: {err}"[:600]
    # Our modules reset the peak counter around each verb (after reading it): the overall peak is the
    # max of those readings and the final one.
    readings = [v for _, v in phase_peaks if v is not None]
    if cuda:
        torch.cuda.synchronize(device)
        result.update(cuda_baseline=cuda_baseline,
                      cuda_peak=max([torch.cuda.max_memory_allocated(device)] + readings))
    result.update(rss_result(baseline, reset_ok, None if cuda else readings))
    base = cuda_baseline if cuda else baseline
    if phase_peaks and base is not None:  # max over steps of each verb's peak above the baseline
        extra = {}
        for name, value in phase_peaks:
            if value is not None:
                extra[name] = max(extra.get(name, 0), value - base)
        result["phase_extra"] = extra
    return result


def run_worker(args) -> None:
    setup_worker(args.threads)
    result = worker_time(args) if args.worker == "time" else worker_memory(args)
    result.update(model=args.model, batch=args.batch)
    Path(args.result_file).write_text(json.dumps(result))


# =====================================================================================
# Orchestrator side (light imports only)
# =====================================================================================

def seq_len_of(args, model: str) -> int:
    """``--seq-len``, else the model's default (:data:`DEFAULT_SEQ_LEN`, else :data:`SEQ_LEN`)."""
    return args.seq_len if args.seq_len is not None else DEFAULT_SEQ_LEN.get(model, SEQ_LEN)


def methods_of(args, model: str) -> list[str]:
    """The methods run on ``model``: ``--methods``, else :data:`METHODS` plus the model's own
    (:data:`MODEL_METHODS`); another model's own method is left out (a note says so)."""
    chosen = args.methods.split(",") if args.methods else list(METHODS) + [
        m for m, only in MODEL_METHODS.items() if only == model]
    return [m for m in chosen if MODEL_METHODS.get(m, model) == model]


def spawn(args, worker: str, model: str, batch: int, method: str | None = None) -> dict:
    """One worker process (``time`` or ``memory``) for ``model`` at ``batch``; its result."""
    options = ["--worker", worker, "--model", model, "--batch", str(batch), "--threads", str(args.threads),
               "--seq-len", str(seq_len_of(args, model)), "--repeats", str(args.repeats),
               "--warmup", str(args.warmup), "--steps-per-repeat", str(args.steps_per_repeat),
               "--memory-steps", str(args.memory_steps), "--device", args.device,
               "--methods", ",".join(methods_of(args, model)), "--profile-rows", str(args.profile_rows)]
    if args.mem_budget_gb:
        options += ["--mem-budget-gb", str(args.mem_budget_gb)]
    if args.roberta_layers:
        options += ["--roberta-layers", str(args.roberta_layers)]
    if args.profile:
        options.append("--profile")
    if method:
        options += ["--method", method]
    env = worker_env(args.threads, args.omp_wait_policy, mmap_freed=worker == "memory")
    return run_worker_process(__file__, options, env)


#: A repetition is "quiet" when every sample in it saw less than this much CPU use by other processes
#: (cores). On a shared 2-core machine a busy neighbour slows 2-thread steps down 10x or more, so
#: medians and ratios use the quiet repetitions when there are any (all repetitions otherwise).
QUIET_LOAD = 0.3


def quiet_reps(timing: dict) -> tuple[set, set]:
    """``(quiet repetitions, all repetitions)`` of a timing worker's samples."""
    worst: dict = {}
    for method, reps in timing.get("rep_of", {}).items():
        for rep, load in zip(reps, timing.get("loads", {}).get(method, [])):
            worst[rep] = max(worst.get(rep, 0.0), 1e9 if load is None else load)
    return {rep for rep, w in worst.items() if w < QUIET_LOAD}, set(worst)


def _used_reps(timing: dict) -> set:
    quiet, everything = quiet_reps(timing)
    return quiet or everything


def _samples(timing: dict, method: str, key: str = "times") -> list:
    use = _used_reps(timing)
    return [x for x, rep in zip(timing.get(key, {}).get(method, []), timing.get("rep_of", {}).get(method, []))
            if rep in use]


def _per_rep(timing: dict, method: str) -> dict:
    """Mean step time of ``method`` in each (used) repetition, for paired ratios."""
    use = _used_reps(timing)
    reps: dict = {}
    for t, rep in zip(timing.get("times", {}).get(method, []), timing.get("rep_of", {}).get(method, [])):
        if rep in use:
            reps.setdefault(rep, []).append(t)
    return {rep: sum(ts) / len(ts) for rep, ts in reps.items()}


def _paired(timing: dict, num: list[str], den: list[str]):
    """Median over repetitions of ``min(num methods) / min(den methods)`` within the repetition."""
    a = [_per_rep(timing, m) for m in num]
    b = [_per_rep(timing, m) for m in den]
    ratios = []
    for rep in sorted(set().union(*[set(x) for x in a + b])):
        na = [x[rep] for x in a if rep in x]
        nb = [x[rep] for x in b if rep in x]
        if len(na) == len(a) and len(nb) == len(b) and na and nb:
            ratios.append(min(na) / min(nb))
    return median_of(ratios)


OPACUS_REFS = ("opacus_hooks", "opacus_ghost", "opacus_dplstm")


def summarize(model: str, batch: int, methods: list[str], timing: dict, memory: dict) -> dict:
    row = {"model": model, "batch": batch, "methods": {}}
    cuda = any("cuda_peak" in m for m in memory.values())
    row["memory_kind"] = "cuda" if cuda else "rss"
    quiet, everything = quiet_reps(timing)
    row["quiet_reps"], row["reps"] = len(quiet), len(everything)
    for method in methods:
        all_times = timing.get("times", {}).get(method, [])
        times = _samples(timing, method)
        mem = memory.get(method, {})
        phases = [p for p in _samples(timing, method, "phases") if p]
        r = {"s": median_of(times), "s_min": min(all_times) if all_times else None, "n": len(times),
             "s_all_median": median_of(all_times), "load": median_of(_samples(timing, method, "loads"))}
        for p in PHASES:
            r[f"{p}_s"] = median_of([x[p] for x in phases]) if phases else None
        r["first_s"] = median_of(timing.get("first_times", {}).get(method, []))
        pe = mem.get("phase_extra") or {}
        for p in PHASES:
            r[f"{p}_extra_mb"] = pe[p] / 2**20 if p in pe else None
        if cuda:
            peak, base = mem.get("cuda_peak"), mem.get("cuda_baseline")
            r["peak_mb"] = peak / 2**20 if peak else None
            r["model_extra_mb"] = r["peak_mb"]
        else:
            peak, base = mem.get("rss_peak"), mem.get("rss_baseline")
            r["peak_mb"] = peak / 2**20 if peak else None
            r["model_extra_mb"] = ((peak - base + mem["model_bytes"]) / 2**20
                                   if peak and base and mem.get("model_bytes") else None)
        r["extra_mb"] = (peak - base) / 2**20 if peak and base else None
        if mem.get("error") or mem.get("skipped"):
            r["peak_mb"] = r["model_extra_mb"] = r["extra_mb"] = None
        for ref in ("nonprivate",) + OPACUS_REFS:
            if ref != method:
                r[f"time_vs_{ref}"] = _paired(timing, [method], [ref])
        row["methods"][method] = r
    for method, r in row["methods"].items():  # memory ratios once every method's numbers are known
        for ref in OPACUS_REFS:
            o = row["methods"].get(ref)
            if ref == method or o is None:
                continue
            for k in ("peak_mb", "model_extra_mb", "extra_mb"):
                r[f"{k}_vs_{ref}"] = ratio_of(r.get(k), o.get(k))
    ours = [m for m in ("dpsgd_hooks", "dpsgd_ghost", "dpsgd_bookkeeping") if m in methods and timing.get("times", {}).get(m)]
    theirs = [m for m in OPACUS_REFS if m in methods and timing.get("times", {}).get(m)]
    row["best_ours_vs_best_opacus"] = _paired(timing, ours, theirs) if ours and theirs else None
    row["other_load"] = median_of([x for xs in timing.get("loads", {}).values() for x in xs])
    row["other_load_used"] = median_of([x for m in timing.get("loads", {}) for x in _samples(timing, m, "loads")])
    return row


LABELS = {"nonprivate": "non-private SGD", "dpsgd_hooks": "DPSGD hooks", "dpsgd_ghost": "DPSGD ghost",
          "dpsgd_bookkeeping": "DPSGD bookkeeping",
          "dpadam_hooks": "DPAdam hooks", "opacus_hooks": "Opacus hooks", "opacus_ghost": "Opacus ghost",
          "opacus_dplstm": "Opacus DPLSTM (hooks)",
          "dpsgd_hooks_allparams": "DPSGD hooks (ViT all params)",
          "dpsgd_ghost_allparams": "DPSGD ghost (ViT all params)"}


def render(rows: list[dict], cuda: bool) -> str:
    mem3 = "peak / extra" if cuda else "peak / model+extra / extra"

    def mem_ratio(r, ref):
        keys = ("peak_mb", "extra_mb") if cuda else ("peak_mb", "model_extra_mb", "extra_mb")
        return " / ".join(fmt(r.get(f"{k}_vs_{ref}")) for k in keys)

    # Opacus' DPLSTM (the LSTM's Opacus-native peer) gets its own columns when a row ran it
    dplstm = any("opacus_dplstm" in row["methods"] for row in rows)
    lines = ["**Targets** (time ratios: median over repetitions of the paired per-repetition ratio, over the "
             f"quiet repetitions (other processes' load < {QUIET_LOAD} cores in every sample) when there are any; "
             "memory ratios from separate processes)", "",
             f"| model | batch | best ours / best Opacus time (<=1) | DPSGD hooks / Opacus hooks time | "
             f"DPSGD ghost / Opacus ghost time | DPSGD bookkeeping / Opacus ghost time | "
             f"DPAdam hooks / Opacus hooks time | "
             f"DPSGD ghost / Opacus ghost mem: {mem3} (<=1) | DPSGD hooks / Opacus hooks mem: {mem3} | "
             + (f"DPSGD hooks / Opacus DPLSTM time | DPSGD hooks / Opacus DPLSTM mem: {mem3} | " if dplstm else "")
             + "quiet reps used / all | other load (cores): used / all |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if dplstm else "") + "---:|---:|"]
    for row in rows:
        m = row["methods"]
        g = lambda meth, key: (m.get(meth) or {}).get(key)  # noqa: E731
        lines.append(
            f"| {row['model']} | {row['batch']} | {fmt(row['best_ours_vs_best_opacus'])} | "
            f"{fmt(g('dpsgd_hooks', 'time_vs_opacus_hooks'))} | {fmt(g('dpsgd_ghost', 'time_vs_opacus_ghost'))} | "
            f"{fmt(g('dpsgd_bookkeeping', 'time_vs_opacus_ghost'))} | {fmt(g('dpadam_hooks', 'time_vs_opacus_hooks'))} | "
            f"{mem_ratio(m.get('dpsgd_ghost') or {}, 'opacus_ghost')} | "
            f"{mem_ratio(m.get('dpsgd_hooks') or {}, 'opacus_hooks')} | "
            + (f"{fmt(g('dpsgd_hooks', 'time_vs_opacus_dplstm'))} | "
               f"{mem_ratio(m.get('dpsgd_hooks') or {}, 'opacus_dplstm')} | " if dplstm else "")
            + f"{row['quiet_reps']} / {row['reps']} | "
            f"{fmt(row['other_load_used'], '.2f')} / {fmt(row['other_load'], '.2f')} |")
    mem_cols = "peak MiB | extra MiB" if cuda else "peak RSS MiB | model+extra MiB | extra MiB"
    lines += ["", "**Per method** (s/step: median over the repetitions used above, min over all in brackets. Ours, inside the step: engine = "
              "`private_gradient` (forward, backward, per-example gradients or norms, clip, sum), release = "
              "`release_gradient` (flatten, Gaussian noise, divide), apply = `apply_gradient` (optimizer step, "
              "ledger); the steps timed are each fit's steady steps: its first step, which also runs the fit-start "
              "privacy checks (independence checks; the engine's checks of a new structure), has its own column; "
              "extra MiB by verb = each verb's peak above the baseline)", "",
              "| model | batch | method | s/step | engine / release / apply s | first step of a fit s | "
              "/ non-private | / Opacus hooks | "
              "/ Opacus ghost | " + ("/ Opacus DPLSTM | " if dplstm else "")
              + f"{mem_cols} | extra MiB by verb: engine / release / apply | peak / Opacus hooks | "
              f"peak / Opacus ghost | " + ("peak / Opacus DPLSTM | " if dplstm else "") + "extra / Opacus ghost |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|" + "---:|" * (2 if cuda else 3) + "---:|---:|---:|---:|"
              + ("---:|---:|" if dplstm else "")]
    for row in rows:
        for method, r in row["methods"].items():
            mems = [fmt(r.get("peak_mb"), ".0f")] + ([] if cuda else [fmt(r.get("model_extra_mb"), ".0f")]) \
                + [fmt(r.get("extra_mb"), ".0f")]
            verbs = (" / ".join(fmt(r.get(f"{p}_s")) for p in PHASES) if r.get("engine_s") is not None else "")
            verb_mem = (" / ".join(fmt(r.get(f"{p}_extra_mb"), ".0f") for p in PHASES)
                        if r.get("engine_extra_mb") is not None else "")
            lines.append(
                f"| {row['model']} | {row['batch']} | {LABELS.get(method, method)} | {fmt(r['s'])} "
                f"({fmt(r['s_min'])}) | {verbs} | {fmt(r.get('first_s'))} | "
                f"{fmt(r.get('time_vs_nonprivate'), '.2f')} | "
                f"{fmt(r.get('time_vs_opacus_hooks'))} | {fmt(r.get('time_vs_opacus_ghost'))} | "
                + (f"{fmt(r.get('time_vs_opacus_dplstm'))} | " if dplstm else "")
                + " | ".join(mems) + f" | {verb_mem} | {fmt(r.get('peak_mb_vs_opacus_hooks'))} | "
                f"{fmt(r.get('peak_mb_vs_opacus_ghost'))} | "
                + (f"{fmt(r.get('peak_mb_vs_opacus_dplstm'))} | " if dplstm else "")
                + f"{fmt(r.get('extra_mb_vs_opacus_ghost'))} |")
    notes = [f"- {r['model']} b{r['batch']}: {n}" for r in rows for n in r.get("notes", [])]
    if notes:
        lines += ["", "Notes:"] + notes
    profiles = [(r, r["profile"]) for r in rows if r.get("profile")]
    for r, prof in profiles:
        lines += ["", f"<details><summary>profile {r['model']} b{r['batch']} (top ops by self time, one step)"
                      f"</summary>", ""]
        for method, p in prof.items():
            ops = "; ".join(f"{o['op']} {o['self_ms']:.0f} ms x{o['calls']}" for o in p["top"])
            lines.append(f"- **{LABELS.get(method, method)}** (total {p['total_self_ms']:.0f} ms): {ops}")
        lines += ["", "</details>"]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None,
                        help=f"comma list from {MODELS} (default: vit_tiny,minilm, plus roberta_large on CUDA)")
    parser.add_argument("--batches", default=None,
                        help="comma list of batch sizes for every model (default: vit_tiny 64,256; minilm 32; "
                             "roberta_large 16)")
    parser.add_argument("--methods", default=None,
                        help=f"comma list from {METHODS + EXTRA_METHODS + tuple(MODEL_METHODS)} (default: "
                             f"{','.join(METHODS)}, plus opacus_dplstm on lstm; a model's own method runs on "
                             "that model only)")
    parser.add_argument("--repeats", type=int, default=3, help="measured repetitions (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured repetitions first (one step each)")
    parser.add_argument("--steps-per-repeat", type=int, default=1, help="steps of each method per repetition")
    parser.add_argument("--memory-steps", type=int, default=1, help="steps in each memory worker")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--seq-len", type=int, default=None,
                        help=f"tokens per example (MiniLM, RoBERTa, LSTM; default {SEQ_LEN}, LSTM "
                             f"{DEFAULT_SEQ_LEN['lstm']}: the PAZO paper's IMDB maximum length)")
    parser.add_argument("--omp-wait-policy", default="default", choices=["default", "passive", "active"],
                        help="OMP_WAIT_POLICY of the workers (default: unset). When another process holds a "
                             "core, 2 spinning intra-op threads can slow small ops down 10x or more; "
                             "'passive' makes waiting threads sleep")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--roberta-layers", type=int, default=None,
                        help="override RoBERTa-large's 24 layers (smoke tests on CPU)")
    parser.add_argument("--mem-budget-gb", type=float, default=None,
                        help="budget for B x d per-sample gradients of the hooks modes (default 60%% of "
                             "free memory); a method above it is skipped")
    parser.add_argument("--memory-jobs", type=int, default=None,
                        help="memory workers run at once (default 2 on CPU when small, else 1)")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--profile", action="store_true", help="torch.profiler over one step of each method")
    parser.add_argument("--profile-rows", type=int, default=8)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: batch 16, 32 tokens, 2 repeats")
    parser.add_argument("--out", default=None,
                        help="results file stem (default results/bench_first_order; results/quick/bench_first_order with --quick)")
    add_worker_options(parser)
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(args)

    raw_argv = argv if argv is not None else sys.argv[1:]
    if args.quick:
        apply_quick_defaults(args, raw_argv, batches="16", seq_len=32, repeats=2)
    known = METHODS + EXTRA_METHODS + tuple(MODEL_METHODS)
    if args.methods is not None:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        for m in methods:
            if m not in known:
                parser.error(f"unknown method {m!r}; choose from {known}")
        args.methods = ",".join(methods)
    on_cuda = args.device == "cuda" or (args.device == "auto" and cuda_available())
    models = ([m.strip() for m in args.models.split(",") if m.strip()] if args.models
              else list(DEFAULT_MODELS) + (["roberta_large"] if on_cuda else []))
    for m in models:
        if m not in MODELS:
            parser.error(f"unknown model {m!r}; choose from {MODELS}")
    plan = [(m, b) for m in models
            for b in ([int(x) for x in args.batches.split(",") if x.strip()] if args.batches else DEFAULT_BATCHES[m])]
    command = command_line("bench_first_order.py", raw_argv)
    meta = machine_info()
    meta.update(command=command, device_requested=args.device, on_cuda=on_cuda,
                args={k: v for k, v in vars(args).items() if k not in ("worker", "model", "batch", "method",
                                                                       "result_file")})
    started = time.perf_counter()
    stamp = lambda: f"[{time.perf_counter() - started:6.0f}s]"  # noqa: E731
    rows, raw = [], []
    for model, batch in plan:
        methods = methods_of(args, model)
        print(f"{stamp()} {model} batch {batch}, {seq_len_of(args, model)} tokens: timing {','.join(methods)} ...",
              flush=True)
        timing = spawn(args, "time", model, batch)
        memory = {}
        if not args.no_memory:
            jobs = args.memory_jobs or (1 if on_cuda or batch * {"vit_tiny": 5.4e6, "minilm": 22.7e6,
                                                                  "lstm": 1.4e6}.get(
                model, 3.6e8) * 4 > 1.5 * 2**30 else 2)
            print(f"{stamp()} {model} batch {batch}: memory, one process per method ({jobs} at a time) ...",
                  flush=True)
            with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
                futures = {m: pool.submit(spawn, args, "memory", model, batch, m) for m in methods}
                memory = {m: f.result() for m, f in futures.items()}
        row = summarize(model, batch, methods, timing, memory)
        notes = list(timing.get("notes", []))
        notes += [f"{m}: not run on {model} (a method of the {MODEL_METHODS[m]} model only)"
                  for m in (args.methods or "").split(",") if MODEL_METHODS.get(m, model) != model]
        for m in methods:
            mem = memory.get(m, {})
            notes += [f"{m}: {n}" for n in mem.get("notes", []) if f"{m}: {n}" not in notes]
        notes += list(timing.get("skipped", {}).values())
        notes += [f"timing {m}: {e}" for m, e in timing.get("errors", {}).items()]
        if timing.get("error"):
            notes.append(f"timing worker: {timing['error']} -- {timing.get('stderr_tail', '')[-400:]}")
        for m, mem in memory.items():
            if mem.get("error"):
                notes.append(f"memory {m}: {mem['error']}" + (f" -- {mem['stderr_tail'][-300:]}"
                                                              if mem.get("stderr_tail") else ""))
        row["notes"] = notes
        row["profile"] = timing.get("profile")
        row["n_trainable"] = timing.get("n_trainable")
        meta["cuda"] = meta.get("cuda") or timing.get("cuda_name")
        rows.append(row)
        raw.append({"model": model, "batch": batch, "timing": timing, "memory": memory})
        print(render([row], on_cuda).split("\n\n")[1], flush=True)
    finish_meta(meta, started)
    table = render(rows, on_cuda)
    seq_lens = ", ".join(f"{m} {seq_len_of(args, m)}" for m in models if m != "vit_tiny") or "-"
    header = (f"# First-order benchmark: DPSGD / DPAdam vs Opacus\n\n`{command}`  \n"
              f"{meta['cpu']}, {meta['cpus']} CPUs, torch {meta['torch']}, opacus {meta['opacus']}, "
              f"threads {args.threads}, OMP_WAIT_POLICY {args.omp_wait_policy}, device {args.device}{' (' + meta['cuda'] + ')' if meta.get('cuda') else ''}; "
              f"clip {CLIP}, sigma {SIGMA}; sequence length {seq_lens}; repeats {args.repeats} "
              f"(+{args.warmup} warm-up), {args.steps_per_repeat} step(s) per repeat; "
              f"{load_and_total(meta)}\n\n")
    print("\n" + table)
    write_results(results_stem(args.out, "bench_first_order", args.quick), header + table,
                  {"meta": meta, "rows": rows, "raw": raw})


if __name__ == "__main__":
    main()

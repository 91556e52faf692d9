"""Writes the DP-GRAPE paper's experiment configs (Mulrooney et al., "Memory-Efficient Differentially Private Training
with Gradient Random Projection": Table 3, RoBERTa-large; Tables 4 and 12, OPT-1.3B/2.7B/6.7B). Run from the repo root:

    python configs/dp_grape/generate.py

The YAML files are committed; ``tests/test_dp_grape_configs.py`` checks they match this script, so edit here and
regenerate. The two ViT MNIST files of this folder (``vit_mnist_dpgrape.yaml``, ``vit_mnist_dpgalore.yaml``) are
hand-written, offline and CPU-sized.

The paper's NLP experiments "follow the same experimental setup and build off the same codebase" as DPZero (Zhang
et al. 2024) and MeZO (App. C.2, C.3), so the data, prompts, lengths and models are those of the DPZero configs
(``configs/dpzero/generate.py``, imported here): Table 3 as DPZero's Table 2 (LM-BFF's k = 512 per class, 1000 test
examples, the prompt-based MLM head, the LM head's decoder its own copy of the word embeddings), Tables 4 and 12 as
DPZero's Tables 4 and 5 (MeZO's prompts, 1000 train / 500 dev / 1000 test, ``<s>`` first).

Stated by the paper:

* Table 3 (App. C.2): r = 16, F = 100, lr = 1e-4, T = 1000, B = 64; C per task from {0.1, 0.5, 1, 5, 10, 20}, chosen on
  the dev set at epsilon 6: SST-2 0.5, SST-5 20, SNLI 0.1, MNLI 10, RTE 0.5, TREC 0.5; (epsilon, delta) = (6 or 2,
  1e-5); seeds 13, 21, 42 (data draws); the final test accuracy is reported. The embeddings and the LM head are not
  projected (Sec. 5.2): ``unprojected`` keeps its default (``lm_head``), and the embeddings are no Linear layers.
* Tables 4 and 12 (App. C.3): DP-GRAPE lr = 1e-4, F = 100, T = 2000, r = 16 / 32 / 64 for OPT-1.3B / 2.7B / 6.7B;
  DP-Adam lr = 1e-5, T = 3000 (1.3B and 2.7B: it runs out of memory at 6.7B); B = 8; C from {0.1, 1, 5, 20} per model
  and task (Table 11); the final test accuracy (Table 4) or F1 (Table 12) is reported. The DP-Adam rows of Table 3
  are copied from DPZero's paper: their configs are ``configs/dpzero/table2_*_dpadamw_eps*.yaml``.

Chosen here where the paper is silent (each also named in the files' headers):

* Adam (Alg. 2, 3 name beta1, beta2 and phi without values): betas (0.9, 0.999), phi = 1e-8, weight decay 0 (Alg. 2
  has no decay term; DPZero's scripts pass ``WD=0``), torch's bias correction (:class:`~lit_zodp.projection.
  ProjectedAdam`).
* Schedule: constant lr (Alg. 1-3 step with one eta; DPZero's scripts, the codebase built on, pass
  ``--lr_scheduler_type constant``).
* Model selection: none. The paper reports the final test accuracy (App. C.2, C.3; Tables 3, 4, 12 captions), so the
  last iterate is tested; validation on the dev examples (never on the test set, not in the private pool) only
  monitors. The dev set chose C once for all seeds (App. C.2: seed 100; App. C.3).
* Accounting (Sec. 6 names no accountant): RDP (Opacus's calibration) under add/remove-one neighbours with Poisson
  batches of expected size B, q = B / n, T steps, the noise ``N(0, sigma^2 C^2)`` on the sum of the clipped
  (projected) gradients, divided by B (Alg. 1 line 10): the same accounting as the DP-AdamW rows of DPZero's Table 2,
  which the paper compares against. (The theory, Sec. 4, uses replace-one neighbours and sensitivity 2C / B.)
* Per-example gradients: DP-GRAPE ``grad_mode: bookkeeping`` (the clipped sum of the paper's projected per-example
  gradients, ``B x m x n`` never built; the projected rows' norms taken in the backward and the sums formed from the
  kept output gradients, so the unprojected embeddings' per-example gradients are never dense ``[B, V, D]`` either:
  in ``hooks`` they were 89% of DP-GRAPE's per-example bytes on RoBERTa-large, review 50); DP-Adam
  ``grad_mode: ghost`` (ghost clipping: the same clipped sum without ``B x d`` per-example gradients). Set
  ``micro_batch_size`` on a smaller GPU (the paper: "batch size ... may be achieved by gradient accumulation").
* OPT dtype: float32 (the torch default; Adam's phi = 1e-8 rounds to 0 in float16, which DP-Adam refuses). It agrees
  with the paper's "DP-Adam OOM at 6.7B even at batch 1" on 80 GB (float32 weights + Adam moments of 6.7B > 80 GB).

The SQuAD and DROP rows (Table 12) run: ``HFAnswerGenerator`` trains on each example's answer row alone (one row per
example). Not runnable today (``tests/test_dp_grape_configs.py`` records it): the SST-2 and BoolQ rows (Table 4), whose
``HFCandidateScorer`` classification loss forwards every candidate's row of an example, which the first-order private
modules refuse (their per-example gradients could not attribute the rows). They are written as the paper specifies.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent

_spec = importlib.util.spec_from_file_location("configs_dpzero_generate", ROOT.parent / "dpzero" / "generate.py")
dpzero = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dpzero)

EPSILONS = {"eps6": 6.0, "eps2": 2.0}
DELTA = 1.0e-5
#: Alg. 2/3's beta1, beta2, phi (unstated: torch's defaults) and no weight decay
ADAM = {"betas": [0.9, 0.999], "eps": 1.0e-8, "weight_decay": 0.0}
#: Table 3 (App. C.2): r, F, lr, T, B and the chosen C per task
ROBERTA = {"rank": 16, "projection_frequency": 100, "lr": 1.0e-4, "steps": 1000, "batch_size": 64}
ROBERTA_CLIP = {"SST-2": 0.5, "SST-5": 20.0, "SNLI": 0.1, "MNLI": 10.0, "RTE": 0.5, "TREC": 0.5}
#: Tables 4 and 12 (App. C.3)
OPT_RANK = {"1.3b": 16, "2.7b": 32, "6.7b": 64}
OPT_DPGRAPE = {"projection_frequency": 100, "lr": 1.0e-4, "steps": 2000}
OPT_DPADAM = {"lr": 1.0e-5, "steps": 3000}
OPT_BATCH = 8
#: Table 11: C per (method, model, task); DP-Adam has no 6.7B column (out of memory)
OPT_CLIP = {
    "dpgrape": {"1.3b": {"SST-2": 20.0, "BoolQ": 20.0, "SQuAD": 0.1, "DROP": 0.1},
                "2.7b": {"SST-2": 20.0, "BoolQ": 20.0, "SQuAD": 0.1, "DROP": 0.1},
                "6.7b": {"SST-2": 1.0, "BoolQ": 5.0, "SQuAD": 0.1, "DROP": 1.0}},
    "dpadam": {"1.3b": {"SST-2": 20.0, "BoolQ": 5.0, "SQuAD": 5.0, "DROP": 5.0},
               "2.7b": {"SST-2": 20.0, "BoolQ": 20.0, "SQuAD": 5.0, "DROP": 20.0}},
}
PRIVACY = {"delta": DELTA, "neighbours": "add_remove", "accountant": "rdp"}

SILENT = ("Where the paper is silent (configs/dp_grape/generate.py): Adam betas (0.9, 0.999), phi 1e-8, weight\n"
          "decay 0 (Alg. 2 names no values); constant lr (Alg. 1-3: one eta; DPZero's scripts: constant); the last\n"
          "iterate is tested (the paper reports final test accuracy, App. C.2/C.3; dev only monitors); RDP accounting,\n"
          "add/remove-one neighbours, Poisson batches of expected size B (Sec. 6 names no accountant).")


def dpgrape(backbone: dict, *, rank: int, projection_frequency: int, lr: float, clip: float, epsilon: float,
            seed: int) -> dict:
    return {"class_path": "lit_zodp.algorithms.DPGRAPE", "init_args": {
        "backbone": backbone, "rank": rank, "projection_frequency": projection_frequency, "lr": lr, **ADAM,
        "clip": clip, "target_epsilon": epsilon, **PRIVACY, "grad_mode": "bookkeeping", "seed": seed}}


def dpadam(backbone: dict, *, lr: float, clip: float, epsilon: float, seed: int) -> dict:
    return {"class_path": "lit_zodp.algorithms.DPAdam", "init_args": {
        "backbone": backbone, "lr": lr, **ADAM, "clip": clip, "target_epsilon": epsilon, **PRIVACY,
        "grad_mode": "ghost", "seed": seed}}


def roberta_config(task: str, level: str) -> tuple[str, dict]:
    epsilon = EPSILONS[level]
    backbone = dpzero.roberta_backbone(task, untie_word_embeddings=True)
    model = dpgrape(backbone, rank=ROBERTA["rank"], projection_frequency=ROBERTA["projection_frequency"],
                    lr=ROBERTA["lr"], clip=ROBERTA_CLIP[task], epsilon=epsilon, seed=42)
    config = {"seed_everything": 42, "trainer": dpzero.trainer(ROBERTA["steps"], 100), "model": model,
              "data": dpzero.roberta_data(task)}
    header = (f"DP-GRAPE paper, Table 3, row 'DP-GRAPE eps={epsilon:g}', column {task}: RoBERTa-large (355M),\n"
              "prompt-based fine-tuning as DPZero's Table 2 (LM-BFF template, label words at <mask>), k = 512 per\n"
              "class, 1000 test examples. r = 16, F = 100, lr = 1e-4, T = 1000, B = 64 (App. C.2); C = "
              f"{ROBERTA_CLIP[task]:g}, the paper's\n"
              "choice for this task from {0.1, 0.5, 1, 5, 10, 20} (dev set, epsilon 6). Every Linear weight of the\n"
              "encoder is projected; the embeddings and the LM head are not (Sec. 5.2), inside the same flat clip.\n"
              "The LM head's decoder is its own copy of the word embeddings, as in the DPZero/MeZO model\n"
              "(untie_word_embeddings). Paper: mean final test accuracy over data seeds {13, 21, 42} (set\n"
              "data.init_args.data_seed and seed_everything).\n" + SILENT + "\n" + dpzero.ROBERTA_DATA_HEADER)
    if task == "SST-2":
        header += dpzero.SST2_HEADER
    return header, config


def opt_backbone(size: str, qa: bool) -> dict:
    if qa:
        return {"class_path": "lit_zodp.backbones.HFAnswerGenerator",
                "init_args": {"model_name_or_path": dpzero.OPT_MODELS[size], "max_new_tokens": 50,
                              "dtype": "float32"}}
    return {"class_path": "lit_zodp.backbones.HFCandidateScorer",
            "init_args": {"model_name_or_path": dpzero.OPT_MODELS[size], "length_normalize": True,
                          "dtype": "float32"}}


def opt_data(size: str, task: str) -> dict:
    qa = task in dpzero.QA_TASKS
    if qa:
        init = {"task": task, "data_dir": dpzero.QA_TASKS[task], "tokenizer": dpzero.OPT_MODELS[size],
                "max_length": 1998}
    else:
        data_format, data_dir = dpzero.OPT_TASKS[task]
        init = {"task": task, "data_dir": data_dir, "data_format": data_format, "prompt": "causal",
                "tokenizer": dpzero.OPT_MODELS[size], "max_length": dpzero.OPT_LENGTHS[task]}
    init |= {"bos_token_id": 0, "num_train": 1000, "num_dev": 500, "num_test": 1000, "batch_size": OPT_BATCH,
             "data_seed": 0}
    return {"class_path": "datamodules.QADataModule" if qa else "datamodules.PromptTextDataModule",
            "init_args": init}


def opt_config(size: str, task: str, method: str, level: str) -> tuple[str, dict]:
    epsilon, qa = EPSILONS[level], task in dpzero.QA_TASKS
    backbone, clip = opt_backbone(size, qa), OPT_CLIP[method][size][task]
    if method == "dpgrape":
        steps = OPT_DPGRAPE["steps"]
        model = dpgrape(backbone, rank=OPT_RANK[size], projection_frequency=OPT_DPGRAPE["projection_frequency"],
                        lr=OPT_DPGRAPE["lr"], clip=clip, epsilon=epsilon, seed=0)
        row, what = f"DP-GRAPE eps={epsilon:g}", f"r = {OPT_RANK[size]}, F = 100, lr = 1e-4, T = 2000"
    else:
        steps = OPT_DPADAM["steps"]
        model = dpadam(backbone, lr=OPT_DPADAM["lr"], clip=clip, epsilon=epsilon, seed=0)
        row, what = f"DP-Adam eps={epsilon:g}", "lr = 1e-5, T = 3000 (full fine-tuning)"
    config = {"seed_everything": 0, "trainer": dpzero.trainer(steps, 500), "model": model,
              "data": opt_data(size, task)}
    table, metric = ("12", "F1") if qa else ("4", "accuracy")
    header = (f"DP-GRAPE paper, Table {table}, row '{row}', column OPT-{size.upper()} {task} ({metric}): the data\n"
              f"and prompts of DPZero's Table {'5' if qa else '4'} configs (MeZO's), 1000 train / 500 dev / 1000 test, B = 8;\n"
              f"{what} (App. C.3); C = {clip:g}, Table 11's choice from {{0.1, 1, 5, 20}}. float32 weights.\n"
              "Paper: mean final test score over three seeds (set data.init_args.data_seed and seed_everything).\n"
              + SILENT
              + ("" if qa else "\nNOT RUNNABLE YET: the classification loss forwards every candidate's row of an example,\n"
                 "which the first-order private modules refuse (per-example gradients could not attribute the rows)."))
    if qa:
        header += ("\nEvaluation as DPZero's Table 5 configs: greedy generation of at most 50 tokens, SQuAD's token F1\n"
                   "(test_f1); max_length 1998 = 2048 less the 50 generated tokens; bos_token_id 0 (<s>, as MeZO).")
    else:
        header += "\nbos_token_id 0: MeZO's OPT rows start with <s>; candidates scored by their length-averaged log-likelihood."
    return header, config


def all_configs() -> dict[Path, str]:
    files = {}
    for task in dpzero.ROBERTA_TASKS:
        for level in EPSILONS:
            files[ROOT / f"table3_roberta-large_{task.lower().replace('-', '')}_dpgrape_{level}.yaml"] = dpzero.render(
                *roberta_config(task, level))
    for method, table, tasks in [(m, t, ts) for m in OPT_CLIP for t, ts in (("table4", dpzero.OPT_TASKS),
                                                                           ("table12", dpzero.QA_TASKS))]:
        for size in OPT_CLIP[method]:
            for task in tasks:
                for level in EPSILONS:
                    name = f"{table}_opt-{size}_{task.lower().replace('-', '')}_{method}_{level}.yaml"
                    files[ROOT / name] = dpzero.render(*opt_config(size, task, method, level))
    return dict(sorted(files.items()))


if __name__ == "__main__":
    for path, text in all_configs().items():
        path.write_text(text)
    print(f"wrote {len(all_configs())} configs to {ROOT}")

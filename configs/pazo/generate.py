"""Writes the PAZO paper's experiment configs (Gong & Li, "Private Zeroth-Order Optimization with Public Data",
NeurIPS 2025): Table 5, prompt fine-tuning RoBERTa-base on MNLI with SNLI as public data. Run from the repo root:

    python configs/pazo/generate.py

The YAML files are committed; ``tests/test_pazo_configs.py`` checks they match this script, so edit here and
regenerate. The three ``quickstart_*.yaml`` files of this folder are hand-written, offline and CPU-sized.

Files: ``table5_roberta-base_mnli_<method>_eps<epsilon>.yaml``, method in ``pazom`` (PAZO-M, Alg. 1), ``pazop``
(PAZO-P, Alg. 2, orthonormalised basis), ``pazop-prime`` (PAZO-P', the column-normalised basis), ``pazos`` (PAZO-S,
Alg. 3) and ``dpzero`` (the DPZero row of Table 5), epsilon in {0.1, 0.5, 1, 2, 3}: 25 files.

Stated by the paper:

* Data (Sec. 5, App. C.1): MeZO's few-shot MNLI, 512 training examples per class (1,536) private; 100 SNLI training
  examples per class (300) as out-of-distribution public data; MeZO's prompt template (LM-BFF's, which MeZO uses for
  RoBERTa), "the same prompt template" for the public examples (here the MNLI template and label words render both:
  ``public_task: SNLI`` shares MNLI's classes and fields, checked by the DataModule); maximum length 256; the test set
  is 1,000 examples of MNLI's dev_matched (the notes' reading of MeZO's ``k-shot-1k-test``). Model: pretrained
  RoBERTa-base, every parameter trained.
* Privacy (App. C.2; Sec. 3): epsilon in {0.1, 0.5, 1, 2, 3}; delta = 1 / #train samples (see the choice below); the
  sum of per-example clipped scalars plus Gaussian noise, divided by b; q (or k + 1) queries at std sqrt(q) C sigma
  compose into one query at sigma; moments accountant over T steps at rate b / n.
* App. C.3: b = 64 for every private method; 100 epochs for PAZO, 200 for DPZero: T = epochs * n / b = 2,400 and
  4,800 steps (n = 1,536). Table 10 (MNLI column): lambda = 1e-3 for DPZero and PAZO-M, 1e-2 for PAZO-P (PAZO-S has
  no lambda). Directions u ~ N(0, I_d) (App. C.2, as MeZO and DPZero; PAZO-M's scaled by d^(-1/4), Alg. 1).
* Table 13 (MNLI column) gives grids, not the chosen values: PAZO-M eta {1e-4, 2e-4, 5e-4, 1e-3, 2e-3}, b' {8, 32},
  alpha {0.25, 0.5, 0.75}, C {10, 20, 50, 100, 150, 200, 250}; PAZO-P eta {5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3},
  b' {8, 16, 32}, k {3, 6, 10}, C as PAZO-M; PAZO-S eta {1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3}, b' {8, 32}, k {3},
  epsilon (exploration) {0.01, 0.001}, C {0.1, 0.5, 1}; DPZero eta {1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5}, C as PAZO-M.

Chosen here where the paper is silent (each also named in the files' headers):

* Grid values (Table 13 reports grids only): the grid's middle value, the lower of the two middle values of a grid
  of even size (as ``configs/dpzero/generate.py`` does): PAZO-M eta 5e-4, b' 8, alpha 0.5, C 100; PAZO-P eta 2e-4,
  b' 16, k 6 (in the reported k in {3, 6}, Sec. 5 "Memory efficiency"), C 100; PAZO-S eta 5e-4, b' 8, k 3,
  exploration 1e-3, C 0.5; DPZero eta 5e-6, C 100. One value for every epsilon (the paper tunes per setting).
* PAZO-P' (Table 5's second "PAZO-P" row, App. C.2 "PAZO-P vs. PAZO-P'"): PAZO-P's values with ``basis:
  normalized`` (Table 10 and 13 name one PAZO-P; the row order P then P' is the notes' reading, [unsure]).
* q (Table 11 tries q in {1, 5}): 5 for DPZero (Table 11's MNLI q = 5 entry, 62.6, is Table 5's DPZero at epsilon 3;
  Table 8's caption: "DPZero needs q=5"), 1 for PAZO-M and PAZO-P (Table 8's caption: "PAZO can take q=1").
* delta: the paper's 1 / n_private = 1/1536 is refused by this library (``PrivacyComponent`` refuses delta >= 1/n:
  a mechanism publishing one random record whole meets it). The configs take delta = 1 / (10 n_private) = 1/15360,
  the library's own rule for a delta "well below 1/n" (its default is min(1e-5, 0.1/n)), keeping the paper's
  dependence on n; the noise is then a little larger than the paper's (sigma grows about as sqrt(log(1/delta))).
* Neighbours and accountant (the authors' code: TF-Privacy's RDP for the subsampled Gaussian, sensitivity C, for every
  method): ``neighbours: add_remove``, ``accountant: rdp``, Poisson batches of expected size b = 64 (the code's
  loaders shuffle, its accountant assumes Poisson; the DataModule samples Poisson so the stated epsilon holds). The
  DPZero row is the PAZO paper's DPZero (sensitivity C, the notes' Eq. 2), not the DPZero paper's replace-one (2C).
* Public batches: one public batch of k b' rows per private batch (``public_in_step: true``, ``public_batch_size``
  b' for PAZO-M, k b' for PAZO-P/S, cut into k parts by the module), fixed-size and reshuffled each pass.
* Seeds: 0 for the model, ``seed_everything`` and the data draw (App. C.2: "the same random seed 0"; the authors'
  code reads MeZO's k-shot data, whose LM-BFF seeds are 13, 21, 42, 87, 100: set ``data_seed`` for those draws).
  The public SNLI draw uses the DataModule's public seed (``data_seed`` + an offset), independent of the private rows.
* Lengths and rendering: DPZero's MNLI settings for the same template (``configs/dpzero/generate.py``): max_length
  256, first_sent_limit 240, LM-BFF's tokens exactly (``faithful: true``), the 1,000 test examples drawn with seed 42.
  The LM head's decoder is its own copy of the word embeddings (MeZO's RoBERTa prompt model, ``untie_word_embeddings``).
* Validation: 512 MNLI dev examples per class (``k_dev``, LM-BFF's dev draw, outside the private set), every 240
  steps (10 PAZO epochs); it only monitors: the last iterate is tested (the code's evaluation). Constant lr, no
  weight decay, no momentum (the code: ``torch.optim.SGD(lr)``).
* The DPZero row reads the same private MNLI draw without the public source (it uses none).

Not written: Tables 2-4 (CIFAR-10 NFResNet18, Tiny-ImageNet ViT, IMDB LSTM with public Amazon Polarity; no DataModule
or backbone for them here, and this machine has no Amazon Polarity to test a loader on), Table 7's MNLI
public-data shifts (MNLI-only and half-half public sets), and the first-order baselines (DP-SGD, DPMD, DOPE-SGD, GEP).
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

from datamodules.text_tasks import get_task

ROOT = Path(__file__).resolve().parent

_spec = importlib.util.spec_from_file_location("configs_dpzero_generate", ROOT.parent / "dpzero" / "generate.py")
dpzero = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dpzero)

EPSILONS = {"eps0.1": 0.1, "eps0.5": 0.5, "eps1": 1.0, "eps2": 2.0, "eps3": 3.0}
#: App. C.1: 512 private MNLI examples per class (3 classes), 100 public SNLI examples per class
K_SHOT, PUBLIC_K_SHOT, NUM_CLASSES = 512, 100, 3
N_PRIVATE = K_SHOT * NUM_CLASSES
#: App. C.3: private batch size, epochs (PAZO 100, DPZero 200)
BATCH_SIZE = 64
EPOCHS = {"pazom": 100, "pazop": 100, "pazop-prime": 100, "pazos": 100, "dpzero": 200}
STEPS_PER_EPOCH = N_PRIVATE // BATCH_SIZE  # 24
#: the paper's delta = 1/n_private is refused (delta >= 1/n); one tenth of it (module docstring)
DELTA = 1.0 / (10 * N_PRIVATE)
PRIVACY = {"delta": DELTA, "neighbours": "add_remove", "accountant": "rdp"}
EVAL_EVERY = 10 * STEPS_PER_EPOCH
SEED = 0

#: Table 13 (MNLI column): the search grids
GRIDS = {
    "pazom": {"lr": [1e-4, 2e-4, 5e-4, 1e-3, 2e-3], "b'": [8, 32], "alpha": [0.25, 0.5, 0.75],
              "clip": [10, 20, 50, 100, 150, 200, 250]},
    "pazop": {"lr": [5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3], "b'": [8, 16, 32], "k": [3, 6, 10],
              "clip": [10, 20, 50, 100, 150, 200, 250]},
    "pazos": {"lr": [1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3], "b'": [8, 32], "k": [3], "exploration": [0.01, 0.001],
              "clip": [0.1, 0.5, 1.0]},
    "dpzero": {"lr": [1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5], "clip": [10, 20, 50, 100, 150, 200, 250]},
}
GRIDS["pazop-prime"] = GRIDS["pazop"]
#: Table 10 (MNLI column); PAZO-S has no lambda
LAMBDA = {"pazom": 1e-3, "pazop": 1e-2, "pazop-prime": 1e-2, "dpzero": 1e-3}
#: Table 11 / Table 8's caption: DPZero q = 5, PAZO q = 1
QUERIES = {"pazom": 1, "pazop": 1, "pazop-prime": 1, "dpzero": 5}
CLASSES = {"pazom": "PAZOM", "pazop": "PAZOP", "pazop-prime": "PAZOP", "pazos": "PAZOS", "dpzero": "DPZero"}
ROWS = {"pazom": "PAZO-M", "pazop": "PAZO-P", "pazop-prime": "PAZO-P'", "pazos": "PAZO-S", "dpzero": "DPZero"}

USAGE = ("# Run: lightning fit --config <this file>   "
         "(data layout: see README, 'Zeroth order with public data: PAZO-M, PAZO-P, PAZO-S')")

SILENT = ("Where the paper is silent (configs/pazo/generate.py): Table 13 gives grids only, so each value is the\n"
          "grid's middle (the lower middle of an even grid), one value for every epsilon; delta = 1/(10 n_private)\n"
          "(the paper's 1/n_private is refused by the library: delta >= 1/n); RDP accounting (the authors' code),\n"
          "add/remove-one neighbours, Poisson batches of expected size b = 64; constant lr, plain SGD; seed 0; dev\n"
          "only monitors and the last iterate is tested.")


def middle(grid: list) -> float:
    """The grid's middle value; of an even grid, the lower of the two middle values."""
    values = sorted(grid)
    return values[(len(values) - 1) // 2]


def chosen(method: str) -> dict:
    """The values a method's configs take: the middle of each Table 13 grid."""
    return {name: middle(grid) for name, grid in GRIDS[method].items()}


def backbone() -> dict:
    return {"class_path": "lit_zodp.backbones.HFPromptClassifier",
            "init_args": {"model_name_or_path": "roberta-base", "label_words": list(get_task("MNLI").label_words),
                          "untie_word_embeddings": True}}


def data(method: str) -> dict:
    max_length, first_sent_limit = dpzero.ROBERTA_LENGTHS["MNLI"]
    init = {"task": "MNLI", "data_dir": "data/original", "prompt": "mlm", "tokenizer": "roberta-base",
            "max_length": max_length, "first_sent_limit": first_sent_limit, "faithful": True, "k_shot": K_SHOT,
            "k_dev": K_SHOT, "num_test": 1000, "test_seed": 42, "batch_size": BATCH_SIZE, "data_seed": SEED}
    if method != "dpzero":
        values = chosen(method)
        init |= {"public_task": "SNLI", "public_data_dir": "data/original", "public_k_shot": PUBLIC_K_SHOT,
                 "public_in_step": True, "public_batch_size": values.get("k", 1) * values["b'"]}
    return {"class_path": "datamodules.PromptTextDataModule", "init_args": init}


def model(method: str, epsilon: float) -> dict:
    values = chosen(method)
    init = {"backbone": backbone(), "lr": values["lr"]}
    if method != "pazos":
        init |= {"lam": LAMBDA[method], "num_directions": QUERIES[method], "directions": "gaussian"}
    if method == "pazom":
        init["alpha"] = values["alpha"]
    if method in ("pazop", "pazop-prime"):
        init |= {"k": values["k"], "basis": "normalized" if method == "pazop-prime" else "orthonormal"}
    if method == "pazos":
        init |= {"k": values["k"], "exploration": values["exploration"]}
    init |= {"clip": float(values["clip"]), "target_epsilon": epsilon, **PRIVACY, "seed": SEED}
    return {"class_path": f"lit_zodp.algorithms.{CLASSES[method]}", "init_args": init}


#: the paper's names of the options
SYMBOLS = {"lr": "eta", "b'": "b'", "alpha": "alpha", "k": "k", "exploration": "epsilon", "clip": "C"}


def grid_text(method: str) -> str:
    names = SYMBOLS
    return ", ".join(f"{names[name]} {{{', '.join(f'{v:g}' for v in grid)}}}" for name, grid in GRIDS[method].items())


def describe(method: str) -> str:
    """The method's values and where they come from, wrapped for the header."""
    v = chosen(method)
    values = ", ".join(f"{SYMBOLS[name]} = {v[name]:g}" for name in GRIDS[method])
    text = f"{values} (Table 13 grids: {grid_text(method)})"
    if method == "pazom":
        text += "; lambda = 1e-3 (Table 10); q = 1 (Table 8's caption: PAZO can take q = 1); u ~ N(0, I)/d^(1/4)."
    elif method in ("pazop", "pazop-prime"):
        basis = ("G orthonormalised (Gram-Schmidt)" if method == "pazop"
                 else "G column-normalised (PAZO-P', App. C.2; the values of PAZO-P)")
        text += f"; lambda = 1e-2 (Table 10); q = 1 (Table 8's caption); {basis}."
    elif method == "pazos":
        text += "; the k losses and the explored one clipped to [-C, C]: k + 1 private loss queries per step."
    else:
        text += ("; lambda = 1e-3 (Table 10); q = 5 (Table 11: Table 5's DPZero at epsilon 3 is its q = 5 entry);"
                 " u ~ N(0, I). Noise: (sum of clipped + N(0, q C^2 sigma^2)) / b per query, sensitivity C: the PAZO"
                 " paper's DPZero, not the DPZero paper's replace-one 2C. No public data.")
    return textwrap.fill(text, width=110, break_on_hyphens=False)


def config(method: str, level: str) -> tuple[str, dict]:
    epsilon = EPSILONS[level]
    epochs = EPOCHS[method]
    steps = epochs * STEPS_PER_EPOCH
    trainer = dpzero.trainer(steps, EVAL_EVERY)
    body = {"seed_everything": SEED, "trainer": trainer, "model": model(method, epsilon), "data": data(method)}
    public = ("" if method == "dpzero" else
              f"Public: {PUBLIC_K_SHOT} SNLI training examples per class (300, out of distribution), rendered with the "
              "MNLI template and label words; one public batch of public_batch_size rows with each private batch "
              "(k b' for PAZO-P/S, cut into k parts); public and private disjoint by construction (private MNLI rows "
              "equal to a public SNLI example leave the private set).")
    header = "\n".join(textwrap.fill(part, width=110, break_on_hyphens=False) for part in [
        f"PAZO paper, Table 5, row '{ROWS[method]}', column epsilon = {epsilon:g}: RoBERTa-base (125M), every "
        "parameter, prompt fine-tuning with MeZO's template (LM-BFF's, label words at <mask>). Private: 512 MNLI "
        "training examples per class (1,536); test: 1,000 MNLI dev_matched examples; max length 256.",
        *([public] if public else []),
        f"b = 64 (Poisson, expected), {epochs} epochs = {steps} steps (App. C.3); epsilon = {epsilon:g}, "
        "delta = 1/(10 * 1536) (paper: 1/1536, refused here).",
        describe(method), "Paper: one run, seed 0 (App. C.2).", SILENT, dpzero.ROBERTA_DATA_HEADER])
    return header, body


def all_configs() -> dict[Path, str]:
    files = {}
    for method in EPOCHS:
        for level in EPSILONS:
            name = f"table5_roberta-base_mnli_{method}_{level}.yaml"
            files[ROOT / name] = dpzero.render(*config(method, level), usage=USAGE)
    return dict(sorted(files.items()))


if __name__ == "__main__":
    for path, text in all_configs().items():
        path.write_text(text)
    print(f"wrote {len(all_configs())} configs to {ROOT}")

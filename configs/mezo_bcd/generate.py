"""Writes the MeZO-BCD paper's Table 2 configs (Park et al., OPT-13B, row 'MeZO-BCD'). Run from the repo root:

    python configs/mezo_bcd/generate.py

The YAML files it writes (``opt-13b_<task>_mezo_bcd.yaml``) are committed; ``tests/test_paper_configs.py`` checks
they match this script, so edit here and regenerate. The other files of ``configs/mezo_bcd/`` (OPT-125M/1.3B on
SST-2, RoBERTa-large, MiniLM, the private variants) are written by hand.

Protocol (App. E.2, Table 7): OPT-13B, 1000 training examples, T = 20000 steps, B = 16, mu (lam) = 1e-3, a constant
lr searched in {1e-5, 5e-6} (we set 1e-5) and the block order in {random, flip_flop} (we set random, Table 4's best
on OPT-1.3B); layer-wise blocks (App. D.1: embeddings, each of the 40 decoder layers, head + final norm: N = 42 here,
OPT's LM head being tied to the embeddings). One seed, 0, for the sampling and the directions ("the overall seed"):
``seed_everything``, ``data_seed`` and the module's ``seed``. The test score is evaluated every 4000 steps and the
best one reported; here the checkpoint of the best dev score (``val_acc``, ``val_f1`` for SQuAD/DROP) is tested.

The paper "strictly adhere[s] to the experimental setup of LoZO", whose code (github.com/optsuite/LOZO,
``large_models/``) is MeZO's (github.com/princeton-nlp/MeZO, ``large_models/``) with a new trainer; so are the data,
prompts and losses (Table 6: "identical to those used in MeZO"):

* Data (MeZO's ``tasks.py``): GLUE's SST-2; the original BoolQ (Hugging Face ``boolq``, no titles in the passages);
  SuperGLUE's RTE, CB, WIC, MultiRC, COPA and WSC (Hugging Face ``super_glue``, WSC as ``wsc.fixed``); SQuAD v1.1;
  DROP. Train from the training split, test from the validation split. ``mezo.sh``'s draws: the first 1000 + 500
  of one NumPy permutation of the training split under the seed, the last 500 of them dev (``num_dev``); CB and
  COPA use 100 dev examples (``DEV=100``). A training split shorter than 1000 + ``num_dev`` keeps its dev set, the
  last ``num_dev`` of the permutation, and trains on the rest: CB (250) on 150, COPA (400) on 300 and WSC (554,
  the default 500 dev) on 54, as ``num_train: 1000`` with that ``num_dev`` does here. The test set: 1000 examples of the
  validation split drawn with the same seed (``num_eval``), all of it when shorter.
* Prompts and candidates (MeZO's ``templates.py``, each task's default template; BoolQ's is ``BoolQTemplateV3``),
  rendered by ``PromptTextDataModule(prompt="causal")``: ``datamodules/text_tasks.py`` (checked against MeZO's strings
  in ``tests/datamodules/test_dm_prompt_tasks.py``). ``max_length`` 2048 (``run.py``'s default), prompts cut from
  the left; SQuAD/DROP 1998 (2048 less the 50 generated tokens).
* Loss (``mezo.sh``): ``--train_as_classification`` for SST-2, RTE, CB, BoolQ, WSC, WIC, MultiRC: cross-entropy over
  the candidates' length-averaged log-likelihoods (``HFCandidateScorer``, ``length_normalize: true``); COPA, SQuAD,
  DROP are trained LM-style on the gold continuation's tokens (``loss: lm``; ``HFAnswerGenerator``). Each example's
  loss is the mean over its own tokens; MeZO's LM-style loss averages over the batch's tokens. Prediction: the
  candidate of the highest mean log-probability (MeZO's default), or greedy generation (SQuAD/DROP, F1).
* ``bos_token_id: 0``: LoZO's ``run_lozo.py``, as MeZO's ``run.py``, loads OPT's slow tokenizer and sets
  ``tokenizer.bos_token_id = 0`` ("HF tokenizer bug fix"), so every row starts with ``<s>`` (0), not OPT's ``</s>``.

* ReCoRD (Table 2's ninth column; MeZO's ``ReCoRDDataset`` reads Hugging Face's ``super_glue`` ``record``: one
  example per query, the passage's distinct entity texts, sorted, as its candidates, the distinct answer texts,
  sorted, as its gold set). ``ReCoRDTemplateGPT3``: the prompt is the passage with ``@highlight\\n`` turned into
  ``- `` followed by ``\\n-``, each candidate `` <query>`` with ``@placeholder`` replaced by one entity, so the
  number of candidates varies per example (``PromptTextDataModule`` pads each to the most of any example with rows
  ``HFCandidateScorer`` scores -inf without running them). ``mezo.sh``: ``--train_as_classification False``, so
  LM-style training on the first gold answer's candidate (``run.py``: ``correct_candidate[0]``), the mean NLL of
  its tokens; prediction the candidate of the highest mean log-probability; accuracy counts any gold answer
  (``metrics.py``: ``predicted_candidate in correct_candidate``). Its splits are long (100,730 / 10,000 queries):
  1000 train + 500 dev, 1000 test. ``max_rows_per_forward: 32`` bounds a forward to the rows of the other tasks'
  batches (16 examples of 2 or 3 candidates), whatever an example's number of entities; scores do not depend on it.
"""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent
MODEL = "facebook/opt-13b"

#: Table 2's classification / multiple-choice columns: (data_dir, data_format, num_dev, loss)
CLASSIFICATION = {
    "SST-2": ("data/glue", "glue", 500, "classification"),
    "RTE": ("data/superglue", "superglue", 500, "classification"),
    "CB": ("data/superglue", "superglue", 100, "classification"),
    "BoolQ": ("data/boolq", "superglue", 500, "classification"),
    "WSC": ("data/superglue", "superglue", 500, "classification"),
    "WIC": ("data/superglue", "superglue", 500, "classification"),
    "MultiRC": ("data/superglue", "superglue", 500, "classification"),
    "COPA": ("data/superglue", "superglue", 100, "lm"),
}
#: training / validation splits shorter than MeZO's draws (1000 + num_dev; num_eval 1000)
SHORT_TRAIN = {"CB": 250, "COPA": 400, "WSC": 554}
SHORT_TEST = {"SST-2": 872, "RTE": 277, "CB": 56, "WSC": 104, "WIC": 638, "COPA": 100}
#: Table 2's generation columns (F1)
GENERATION = {"SQuAD": "data/squad", "DROP": "data/drop"}
#: Table 2's values, row 'MeZO-BCD' (seed 0), for the headers
REPORTED = {"SST-2": 93.0, "RTE": 70.0, "CB": 71.4, "BoolQ": 72.4, "WSC": 63.5, "WIC": 61.9, "MultiRC": 62.8,
            "COPA": 89.0, "ReCoRD": 81.6, "SQuAD": 83.7, "DROP": 31.0}


def trainer(monitor: str) -> dict:
    return {"accelerator": "auto", "devices": 1, "max_steps": 20_000, "val_check_interval": 4000,
            "check_val_every_n_epoch": None, "log_every_n_steps": 50, "enable_checkpointing": True,
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                           "init_args": {"monitor": monitor, "mode": "max", "save_top_k": 1, "save_last": True}}]}


def algorithm(backbone: dict) -> dict:
    return {"class_path": "lit_zodp.algorithms.MeZOBCD",
            "init_args": {"backbone": backbone, "lr": 1.0e-05, "lam": 0.001, "partition": "layer",
                          "layers_per_block": 1, "order": "random", "seed": 0}}


COMMON = ("T = 20000, B = 16, mu (lam) = 1e-3, constant lr, layer-wise blocks (embeddings, 40 layers,\n"
          "head + final norm: N = 42), cyclic random permutation order (App. D.2, Table 4's best).\n")
SELECTION = ("lr: the paper grid-searches {1e-5, 5e-6} for MeZO-BCD and order in {random, flip_flop}. Paper: seed 0.\n"
             "Validation every 4000 steps; the paper reports the best TEST score over those evaluations: here the\n")
BOS = ("bos_token_id 0: LoZO's and MeZO's OPT code sets tokenizer.bos_token_id = 0, so every row starts with <s>,\n"
       "not OPT's </s>.")


def classification_config(task: str) -> tuple[str, dict]:
    data_dir, data_format, num_dev, loss = CLASSIFICATION[task]
    backbone = {"class_path": "lit_zodp.backbones.HFCandidateScorer",
                "init_args": {"model_name_or_path": MODEL, **({"loss": "lm"} if loss == "lm" else {}),
                              "length_normalize": True, "dtype": "float16"}}
    data = {"class_path": "datamodules.PromptTextDataModule", "init_args": {
        "task": task, "data_dir": data_dir, "data_format": data_format, "prompt": "causal", "tokenizer": MODEL,
        "max_length": 2048, "bos_token_id": 0, "num_train": 1000, "num_dev": num_dev, "num_test": 1000,
        "batch_size": 16, "data_seed": 0}}
    config = {"seed_everything": 0, "trainer": trainer("val_acc"), "model": algorithm(backbone), "data": data,
              "test_ckpt": "best"}
    trained = ("trained LM-style on the gold choice's tokens (mean NLL per example; mezo.sh:\n"
               "--train_as_classification False), the choice of higher mean log-probability predicted" if loss == "lm"
               else "candidates scored by their (length-averaged) log-likelihood, trained as\n"
               "classification (cross-entropy over the candidates: mezo.sh's --train_as_classification)")
    sizes = f"num_train 1000 / num_dev {num_dev} / num_test 1000 (mezo.sh" + ("'s DEV=100)" if num_dev == 100 else ")")
    if task in SHORT_TRAIN:
        rows = SHORT_TRAIN[task]
        sizes += (f": the training split ({rows}) is shorter than\n{1000 + num_dev}, so, as MeZO, dev is the last "
                  f"{num_dev} of its permutation and training the first {rows - num_dev}")
    if task in SHORT_TEST:
        sizes += f";\nthe test set is the whole validation split ({SHORT_TEST[task]})"
    header = (f"MeZO-BCD paper (Park et al.), Table 2, row 'MeZO-BCD', column {task} (accuracy; reported\n"
              f"{REPORTED[task]:.1f}): OPT-13B, MeZO's prompt and candidates (templates.py),\n{trained},\n"
              f"{sizes}; max_length 2048 (MeZO's), prompts cut from the left.\n"
              + COMMON + SELECTION + "checkpoint of the best val_acc (the dev examples) is tested.\n" + BOS)
    if task == "BoolQ":
        header += ("\ndata: the original BoolQ (Google's train.jsonl/dev.jsonl, Hugging Face `boolq`), as MeZO;\n"
                   "SuperGLUE's copy prefixes every passage with its title.")
    if task == "WSC":
        header += ("\ndata: MeZO reads Hugging Face's super_glue wsc.fixed (a few span texts corrected): its rows as\n"
                   "train.jsonl / val.jsonl in WSC/ (SuperGLUE's own WSC.zip differs in those spans).")
    if task == "SST-2":
        header += "\ndata: GLUE's SST-2 (train.tsv; dev.tsv is the test set)."
    return header, config


def record_config() -> tuple[str, dict]:
    backbone = {"class_path": "lit_zodp.backbones.HFCandidateScorer",
                "init_args": {"model_name_or_path": MODEL, "loss": "lm", "length_normalize": True,
                              "max_rows_per_forward": 32, "dtype": "float16"}}
    data = {"class_path": "datamodules.PromptTextDataModule", "init_args": {
        "task": "ReCoRD", "data_dir": "data/superglue", "data_format": "superglue", "prompt": "causal",
        "tokenizer": MODEL, "max_length": 2048, "bos_token_id": 0, "num_train": 1000, "num_dev": 500,
        "num_test": 1000, "batch_size": 16, "data_seed": 0}}
    config = {"seed_everything": 0, "trainer": trainer("val_acc"), "model": algorithm(backbone), "data": data,
              "test_ckpt": "best"}
    header = (f"MeZO-BCD paper (Park et al.), Table 2, row 'MeZO-BCD', column ReCoRD (accuracy; reported\n"
              f"{REPORTED['ReCoRD']:.1f}): OPT-13B, MeZO's ReCoRDTemplateGPT3 (templates.py): the passage with\n"
              "'@highlight\\n' turned into '- ', then '\\n-', one candidate per entity of the passage (' ' + the\n"
              "query with @placeholder replaced by it; their number varies per example: absent rows score -inf,\n"
              "unrun);\n"
              "trained LM-style on the first gold answer's candidate (mean NLL of its tokens; mezo.sh:\n"
              "--train_as_classification False), the candidate of higher mean log-probability predicted, right when\n"
              "it is any gold answer (metrics.py); num_train 1000 / num_dev 500 / num_test 1000; max_length 2048,\n"
              "prompts cut from the left; max_rows_per_forward 32 bounds memory (scores do not depend on it).\n"
              + COMMON + SELECTION + "checkpoint of the best val_acc (the dev examples) is tested.\n" + BOS +
              "\ndata: SuperGLUE's ReCoRD train.jsonl / val.jsonl in ReCoRD/ (Hugging Face super_glue record, as\n"
              "MeZO).")
    return header, config


def generation_config(task: str) -> tuple[str, dict]:
    backbone = {"class_path": "lit_zodp.backbones.HFAnswerGenerator",
                "init_args": {"model_name_or_path": MODEL, "max_new_tokens": 50, "dtype": "float16"}}
    data = {"class_path": "datamodules.QADataModule", "init_args": {
        "task": task, "data_dir": GENERATION[task], "tokenizer": MODEL, "max_length": 1998, "num_train": 1000,
        "num_dev": 500, "num_test": 1000, "bos_token_id": 0, "batch_size": 16, "data_seed": 0}}
    config = {"seed_everything": 0, "trainer": trainer("val_f1"), "model": algorithm(backbone), "data": data,
              "test_ckpt": "best"}
    header = (f"MeZO-BCD paper (Park et al.), Table 2, row 'MeZO-BCD', column {task} (F1): OPT-13B, MeZO's generation\n"
              "prompt and target (see configs/dpzero/generate.py, Table 5), 1000 train / 500 dev / 1000 test,\n"
              + COMMON +
              "The loss is each example's mean NLL of its answer tokens; evaluation generates greedily (at most 50\n"
              "tokens, stopping at a newline or </s>) and logs SQuAD's token F1 (test_f1) against every gold answer.\n"
              + SELECTION + "checkpoint of the best val_f1 (the 500 dev examples) is tested.\n" + BOS)
    return header, config


def render(header: str, config: dict, usage: str = "# Run: lightning fit --config <this file>   "
                                                    "(data layout: see README, 'Paper configs')") -> str:
    comment = "\n".join(f"# {line}" if line else "#" for line in header.splitlines())
    return f"{comment}\n{usage}\n" + yaml.safe_dump(config, sort_keys=False)


def file_name(task: str) -> str:
    return f"opt-13b_{task.lower().replace('-', '')}_mezo_bcd.yaml"


def all_configs() -> dict[Path, str]:
    files = {ROOT / file_name(task): render(*classification_config(task)) for task in CLASSIFICATION}
    files[ROOT / file_name("ReCoRD")] = render(*record_config())
    files |= {ROOT / file_name(task): render(*generation_config(task)) for task in GENERATION}
    return files


if __name__ == "__main__":
    for path, text in all_configs().items():
        path.write_text(text)
    print(f"wrote {len(all_configs())} configs to {ROOT}")

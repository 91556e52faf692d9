"""Writes the DPZero paper's experiment configs (Tables 2, 4 and 5, and the synthetic example of Sec. 5.1). Run from the
repo root:

    python configs/dpzero/generate.py

The YAML files are committed; ``tests/test_paper_configs.py`` checks they match this script, so edit
here and regenerate. Hyper-parameters: DPZero paper, App. B.2 Table 8 (RoBERTa) and App. B.3
Table 10 (OPT). The paper searched the clip C (and, for the first-order rows, the lr) per task over a
grid and does not report the chosen value; we set the grid's middle (the lower of the two middle values
of a grid of four, as Table 4's C = 50 of {10, 50, 100, 200}) and name the grid in each file.

Noise, as the reference code injects it: ``std = 2 sigma C / B`` with sigma from Opacus's RDP
accountant (``get_noise_multiplier``) for (epsilon, delta = 1e-5, q = B / n, T steps): the DPZero
rows use ``neighbours: replace_one`` (sensitivity 2C, the factor 2) and ``accountant: rdp``. The
reported epsilon is then the RDP epsilon under replace-one neighbours, as in the paper.

Data, as the authors' code prepares it (github.com/Liang137/DPZero, built on MeZO and LM-BFF):

* Table 2 (``roberta/``): LM-BFF's ``data/original`` with GLUE's SST-2 in place of LM-BFF's own
  (``roberta/data/prepare_datasets.sh`` renames ``GLUE-SST-2``; our loader reads ``GLUE-SST-2``
  itself), k = 512 per class drawn by ``tools/generate_k_shot_data.py --mode k-shot-1k-test`` (NumPy,
  seed = data seed; the 1,000 test examples drawn once with seed 42: ``test_seed: 42``), LM-BFF's
  templates rendered token for token (``faithful: true``: GLUE SST-2's trailing space kept, ``*sent-_0*``
  drops the premise's last character, tail truncation), and ``examples/run_fewshot.sh``'s lengths:
  ``--max_seq_length 128`` (256 for MNLI, SNLI, RTE) and ``--first_sent_limit`` 110 (SST-5, TREC) or
  240 (MNLI, RTE). Validation on the generator's dev set (``k_dev: 512``: the next 512 examples of each
  class, LM-BFF's ``dev.tsv``; MNLI's ``dev_matched.tsv``), never on the test set; the reference
  evaluates dev at the end of training (``--eval_steps`` = T) and tests the last iterate once.
  The model is MeZO's ``RobertaModelForPromptFinetuning`` (``roberta/src/models.py``), which defines no output
  embeddings, so its ``lm_head.decoder`` is loaded as a copy of the word embeddings and never tied to them
  (``--tie_emb`` defaults to off; the class warns "NOT tied"): the ZO step perturbs and updates the two apart
  (``untie_word_embeddings: true``; Hugging Face's ``RobertaForMaskedLM`` would share one tensor and one direction).
  Its unused ``classifier`` layer, which the reference perturbs too, changes no loss and is left out.
* Table 4 (``opt/``): MeZO's ``tasks.py``: GLUE's SST-2 and the original BoolQ (Hugging Face
  ``boolq``: Google's ``train.jsonl`` / ``dev.jsonl``, no titles in the passages), 1,000 train + 500
  dev drawn with ``np.random.permutation`` under the seed, 1,000 test examples with the same seed;
  ``max_length`` 2048 (``run.py``'s default; prompts cut from the left); every row starts with ``<s>``
  (``bos_token_id: 0``: ``run.py`` sets ``tokenizer.bos_token_id = 0`` for OPT on the slow tokenizer, which
  then starts rows with ``<s>`` where OPT's tokenizer puts ``</s>``); the checkpoint of the lowest dev loss is
  tested (``load_best_model_at_end`` with the Hugging Face Trainer's default ``metric_for_best_model``).
* Table 5 (``opt/``, generation): MeZO's SQuAD (v1.1) and DROP with its prompts and draws, as Table 4; the
  target is `` <first gold answer>\n``, the loss each example's mean answer NLL (DPZero's
  ``forward_wrap_with_option_len_dpzero``), ``max_length`` 1998 (2048 less the 50 generated tokens); evaluation
  generates greedily and scores SQuAD's token F1 (``datamodules/qa.py``, ``lit_zodp/backbones/generation.py``).

Sec. 5.1 / App. B.1 (``sec51_quadratic_<pattern>_<method>.yaml``): the synthetic quadratic
``F(x) = (1/2n) sum_i (x - x_i)^T A (x - x_i)``, rows ``x_i ~ N(1, I)``, n = 10,000 to train and 10,000 to
test, A = I, diag(1/sqrt(i)) or diag(1/i), epsilon 2, delta 1e-6, lambda 1e-4, for DPZero (Alg. 2), DPGD-0th
(Alg. 1) and DP-GD (``DPSGD`` without momentum). Every method is full batch, as Alg. 1-2 and the code the example
is based on (Li et al. 2022) are; x_0 = 0 (Li et al.'s code; the paper states none); directions on the
``sqrt(d)`` sphere (Alg. 1-2 line 2); the package's accounting (PRV, add/remove: the paper states none for this
experiment; see ``benchmarks/repro_dpzero_synthetic.py``). T, step size and clip: the best of the reduced grid
of ``benchmarks/repro_dpzero_synthetic.py`` at d = 200 (Table 6 searches T, step size and clip; the chosen values
are not reported). Validation and test log ``val_grad_norm`` / ``test_grad_norm``: the exact
``||A (x - mean_i x_i)||`` over the test rows (Fig. 1 (d)-(f)).

Both tables pad each batch to its longest row (the data modules' default, ``pad_to_max_length:
false``); padding is masked, so the losses and accuracies are those of padding to ``max_length`` as
the references do, at a fraction of the compute (SST-2's prompts are ~25 tokens of 128).

Table 2's first-order rows (``*_adamw``, ``*_dpadamw_eps{6,2}``, ``*_lora``, ``*_dplora_eps{6,2}``). The paper
(App. B.2, "Comparison with first-order methods"; Table 2's caption) gives: the same few-shot data as the DPZero
rows, T = 1000, B = 64, lr in {5e-5, 1e-4, 5e-4, 1e-3} and C in {0.1, 0.5, 1, 10} by grid search, LoRA r = 8 and
alpha = 16 "as in the original paper", AdamW for LoRA too, "all other parameters fixed to their default values",
and the implementation of Li et al. (github.com/lxuechen/private-transformers), whose PrivacyEngine the DPZero
repository does not include (it has no first-order private code). The rest is read from private-transformers
(``private_transformers/privacy_engine.py``, ``accounting/``, ``lora_utils.py``, ``examples/classification/``, whose
LM-BFF prompt model and data pipeline are the ones the DPZero rows use) and DPZero's ``roberta/`` (from MeZO):

* Trained parameters (AdamW rows): all of them. ``run_classification.py`` calls ``model.requires_grad_(True)``
  (``--static_embedding``, ``--static_lm_head`` default ``no``): word, position and token-type embeddings, every
  layer, the LM head. Its ``RobertaForPromptFinetuning``, like MeZO's/DPZero's ``RobertaModelForPromptFinetuning``
  ("By default for RoBERTa models the input embeddings and the output embeddings are NOT tied"), defines no output
  embeddings, so Hugging Face does not tie ``lm_head.decoder`` to the word embeddings: the decoder is loaded as a
  copy and trained as a separate parameter. ``untie_word_embeddings: true`` does that (Hugging Face's
  ``RobertaForMaskedLM`` ties them: one tensor, one gradient, one perturbation). No pooler in either.
* Optimizer: torch's AdamW, betas (0.9, 0.999) (Hugging Face's defaults), ``--adam_epsilon 1e-08``, ``--weight_decay
  0`` (``run_wrapper.py``; Hugging Face's default too): ``DPAdam`` / ``Adam`` with ``weight_decay: 0.0``. The paper's
  "AdamW" is the optimizer class; its decay is 0, so the no-decay groups (biases, LayerNorm weights) do not matter.
* lr schedule (ambiguous): ``run_wrapper.py``, the launcher private-transformers' README points to, passes
  ``--lr_decay yes``, a linear decay to 0 over the run without warm-up; ``run_classification.py``'s own default is
  ``no`` (constant). We take the launcher's, which is also the Hugging Face Trainer's default (``linear``) that
  DPZero's first-order code path uses (``roberta/src/trainer.py``, ``get_scheduler(lr_scheduler_type)``):
  ``LinearLR(start_factor 1, end_factor 0, total_iters 1000)``, lr ``(1 - t / T)`` times the base at step ``t``.
* Noise: ``_create_noisy_clipped_gradient`` adds ``N(0, (noise_multiplier * max_grad_norm)^2)`` to the SUM of the
  per-example gradients clipped to ``max_grad_norm`` over all trainable parameters at once, then divides by the
  batch size (the expected, "lot" size), the step our ``release`` takes. Its accountant (``accounting_mode``
  ``rdp``, the default) is RDP of the Poisson-subsampled Gaussian of sensitivity C (add/remove-one neighbours) at
  orders 1.1, 1.2, ..., 10.9, 12, ..., 63 (Opacus's ``DEFAULT_ALPHAS``), converted to (epsilon, delta) as Opacus's
  ``get_privacy_spent`` does (Canonne, Kamath and Steinke), sigma by bisection to 1e-3: ``neighbours: add_remove``
  (no factor 2, unlike the DPZero rows, whose reference sets ``std = 2 sigma C / B``) and ``accountant: rdp``.
  Our calibration (Opacus's ``get_noise_multiplier``) is within 0.3% of that bisection for every row (checked in
  ``tests/test_paper_configs.py``). q = B / n with n = 512 per class; delta = 1e-5 (Tables 3 and 9; the engine's
  own default would be n^-1.1). The engine calibrates for ``ceil(epochs / q)`` steps from the epochs it is given;
  the paper gives T only, so we calibrate for the T = 1000 steps run. Clipping mode: ghost clipping
  (``run_wrapper.py``'s default ``--clipping_mode ghost``): ``grad_mode: ghost``, which also keeps RoBERTa-large's
  per-example gradients (B x 406M) from ever existing; set ``micro_batch_size`` on a GPU of less memory.
* Sampling: the reference trains on the Hugging Face Trainer's shuffled fixed-size batches and accounts them as
  Poisson at q = B / n, as the DPZero rows' reference does; here batches are Poisson-sampled (expected size 64), so
  the reported epsilon holds. The non-private rows sample the same way (their batch sizes vary around 64).
* Not reproduced: the reference's non-private branch clips the mean batch gradient's global norm to
  ``max_grad_norm`` = 1.0 (Hugging Face's default; ``clip_grad_norm_`` in ``examples/classification/src/
  trainer.py``) before AdamW. ``Adam`` has no such option (its finite ``clip`` clips each example, another
  operation), so the AdamW and LoRA rows run AdamW unclipped.
* LoRA (ambiguous): private-transformers has LoRA for GPT-2 only (``lora_utils.convert_gpt2_attention_to_lora``,
  ``mark_only_lora_as_trainable``). DPZero's own RoBERTa code puts loralib LoRA on ``query`` and ``value`` of every
  self-attention (``roberta/src/modeling_roberta.py``, from MeZO; as the LoRA paper on RoBERTa) with no LoRA dropout,
  A Kaiming-uniform and B zero (peft's default initialisation is the same), scaling alpha / r = 2, and
  ``roberta/run.py`` freezes every ``roberta.*`` parameter but LoRA's, so the LM head (dense, layer norm, its own
  decoder, bias) trains beside the adapters. We follow DPZero's code: ``lora: {r: 8, lora_alpha: 16,
  lora_dropout: 0.0, target_modules: [query, value], modules_to_save: [lm_head]}`` (peft trains a copy of the head,
  the frozen original kept beside it). Drop ``modules_to_save`` for private-transformers' rule (adapters only).
  DPZero's ``modeling_roberta.py`` lost MeZO's ``import loralib as lora``, so ``--apply_lora`` fails there as
  published: the paper's LoRA runs did not use that file as it stands.
* Dropout: train mode, RoBERTa's dropout 0.1, as in both references (the private modules draw the masks from secret
  states). Validation on the dev set every 100 steps; the last iterate is tested.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from datamodules.text_tasks import get_task

ROOT = Path(__file__).resolve().parent

ROBERTA_TASKS = ["SST-2", "SST-5", "SNLI", "MNLI", "RTE", "TREC"]
OPT_MODELS = {"1.3b": "facebook/opt-1.3b", "2.7b": "facebook/opt-2.7b", "6.7b": "facebook/opt-6.7b"}
OPT_TASKS = {"SST-2": ("glue", "data/glue"), "BoolQ": ("superglue", "data/boolq")}
#: run_fewshot.sh: (--max_seq_length, --first_sent_limit) per task
ROBERTA_LENGTHS = {"SST-2": (128, None), "SST-5": (128, 110), "SNLI": (256, None), "MNLI": (256, 240),
                   "RTE": (256, 240), "TREC": (128, 110)}
#: MeZO's run.py: max_length 2048 (BoolQ passages can be long); SST-2 sentences fit in 128
OPT_LENGTHS = {"SST-2": 128, "BoolQ": 2048}
METHODS = {"mezo": None, "dpzero_eps2": 2.0, "dpzero_eps6": 6.0}
#: Table 2's first-order rows (App. B.2, "Comparison with first-order methods"): target epsilon, None = non-private
FIRST_ORDER = {"adamw": None, "dpadamw_eps6": 6.0, "dpadamw_eps2": 2.0,
               "lora": None, "dplora_eps6": 6.0, "dplora_eps2": 2.0}
#: T = 1000, B = 64; lr searched in {5e-5, 1e-4, 5e-4, 1e-3}, C in {0.1, 0.5, 1, 10} (App. B.2): the lower middle value
FIRST_ORDER_STEPS, FIRST_ORDER_LR, FIRST_ORDER_CLIP = 1000, 1.0e-4, 0.5
#: LoRA (Hu et al.) as the authors' RoBERTa code places it: query and value of every self-attention, r = 8,
#: alpha = 16 (App. B.2), no LoRA dropout; the LM head trains beside the adapters (a copy: peft's modules_to_save)
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["query", "value"],
        "modules_to_save": ["lm_head"]}


def algorithm(method: str, backbone: dict, *, lr: float, clip: float, seed: int) -> dict:
    common = {"backbone": backbone, "lr": lr, "lam": 1.0e-3, "directions": "gaussian", "seed": seed}
    if METHODS[method] is None:
        return {"class_path": "lit_zodp.algorithms.MeZO", "init_args": common}
    return {"class_path": "lit_zodp.algorithms.DPZero",
            "init_args": {**common, "clip": clip, "target_epsilon": METHODS[method], "delta": 1.0e-5,
                          "neighbours": "replace_one", "accountant": "rdp"}}


def trainer(steps: int, eval_every: int, *, keep_best: bool = False) -> dict:
    config = {"accelerator": "auto", "devices": 1, "max_steps": steps, "val_check_interval": eval_every,
              "check_val_every_n_epoch": None, "log_every_n_steps": 50, "enable_checkpointing": True}
    if keep_best:  # MeZO/DPZero OPT runs: load_best_model_at_end on the dev set, eval every eval_steps; with no
        # metric_for_best_model the Hugging Face Trainer keeps the lowest dev loss (MeZO's run.py passes none)
        config["callbacks"] = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                "init_args": {"monitor": "val_loss", "mode": "min", "save_top_k": 1,
                                              "save_last": True}}]
    return config


def first_order_algorithm(method: str, backbone: dict, *, seed: int) -> dict:
    """AdamW (torch's, weight decay 0, betas (0.9, 0.999), eps 1e-8) with private-transformers' linear decay of the
    lr to 0 over T; the private rows clip per example (ghost clipping) and add private-transformers' noise."""
    schedule = {"class_path": "torch.optim.lr_scheduler.LinearLR",
                "init_args": {"start_factor": 1.0, "end_factor": 0.0, "total_iters": FIRST_ORDER_STEPS}}
    common = {"backbone": backbone, "lr": FIRST_ORDER_LR, "betas": [0.9, 0.999], "eps": 1.0e-8, "weight_decay": 0.0,
              "lr_scheduler": schedule, "seed": seed}
    epsilon = FIRST_ORDER[method]
    if epsilon is None:
        return {"class_path": "lit_zodp.algorithms.Adam", "init_args": common}
    return {"class_path": "lit_zodp.algorithms.DPAdam",
            "init_args": {**common, "grad_mode": "ghost", "clip": FIRST_ORDER_CLIP, "target_epsilon": epsilon,
                          "delta": 1.0e-5, "neighbours": "add_remove", "accountant": "rdp"}}


def roberta_data(task: str) -> dict:
    max_length, first_sent_limit = ROBERTA_LENGTHS[task]
    lengths = {"max_length": max_length}
    if first_sent_limit is not None:
        lengths["first_sent_limit"] = first_sent_limit
    return {"class_path": "datamodules.PromptTextDataModule", "init_args": {
        "task": task, "data_dir": "data/original", "prompt": "mlm", "tokenizer": "roberta-large", **lengths,
        "faithful": True, "k_shot": 512, "k_dev": 512, "num_test": 1000, "test_seed": 42, "batch_size": 64,
        "data_seed": 42}}


def roberta_backbone(task: str, **options) -> dict:
    return {"class_path": "lit_zodp.backbones.HFPromptClassifier",
            "init_args": {"model_name_or_path": "roberta-large", "label_words": list(get_task(task).label_words),
                          **options}}


ROBERTA_DATA_HEADER = (
    "data: LM-BFF's k-shot draw of data/original (NumPy, seed = data_seed), the 1000 test examples\n"
    "drawn once with seed 42, lengths of DPZero's run_fewshot.sh, LM-BFF's tokens exactly (faithful:\n"
    "trailing spaces kept, tail truncation). Validation: the generator's dev set (k_dev = 512 per\n"
    "class, not in the private training set), never the test set; the last iterate is tested once.\n"
    "Batches are padded to their longest row (pad_to_max_length: false), the outputs unchanged.")
SST2_HEADER = ("\nSST-2 is GLUE's (LM-BFF's data/original/GLUE-SST-2, read automatically), as in MeZO's and\n"
               "DPZero's data scripts, not LM-BFF's own sentence-level SST-2.")


def roberta_config(task: str, method: str) -> tuple[str, dict]:
    if method in FIRST_ORDER:
        return roberta_first_order_config(task, method)
    backbone = roberta_backbone(task, untie_word_embeddings=True)
    data = roberta_data(task)
    config = {"seed_everything": 42, "trainer": trainer(10_000, 1000),
              "model": algorithm(method, backbone, lr=1.0e-6, clip=200.0, seed=42), "data": data}
    row = "MeZO" if METHODS[method] is None else f"DPZero eps={METHODS[method]:g}"
    header = (f"DPZero paper, Table 2, row '{row}', column {task}: RoBERTa-large (355M), prompt-based\n"
              "fine-tuning (LM-BFF template, label words at <mask>), k = 512 per class, 1000 test examples,\n"
              "T = 10000, B = 64, lambda = 1e-3, lr = 1e-6 (App. B.2, Table 8). Paper: mean over data seeds\n"
              "{42, 13, 21} (set data.init_args.data_seed and seed_everything). The LM head's decoder is its\n"
              "own copy of the word embeddings, perturbed apart from them, as in MeZO's and DPZero's model\n"
              "(untie_word_embeddings).\n" + ROBERTA_DATA_HEADER)
    if task == "SST-2":
        header += SST2_HEADER
    if METHODS[method] is not None:
        header += "\nclip: the paper grid-searches C in {50, 100, 150, 200, 250, 300, 400} per task."
    return header, config


def roberta_first_order_config(task: str, method: str) -> tuple[str, dict]:
    lora = "lora" in method
    backbone = roberta_backbone(task, untie_word_embeddings=True, **({"lora": LORA} if lora else {}))
    config = {"seed_everything": 42, "trainer": trainer(FIRST_ORDER_STEPS, 100),
              "model": first_order_algorithm(method, backbone, seed=42), "data": roberta_data(task)}
    epsilon = FIRST_ORDER[method]
    name = "LoRA" if lora else "AdamW"
    row = name if epsilon is None else f"DP-{name} eps={epsilon:g}"
    what = ("LoRA (r = 8, alpha = 16) on query and value, the LM head trained beside it" if lora
            else "full fine-tuning: every parameter, embeddings included")
    header = (f"DPZero paper, Table 2, row '{row}', column {task}: RoBERTa-large (355M), prompt-based\n"
              f"fine-tuning as the DPZero rows; {what}.\n"
              "AdamW, the first-order baselines of private-transformers (Li et al.): T = 1000, B = 64\n"
              "(App. B.2); the lr decays linearly to 0, weight decay 0 (private-transformers' defaults). The LM\n"
              "head's decoder is its own copy of the word embeddings, as in the reference models\n"
              "(untie_word_embeddings). Paper: mean over data seeds {42, 13, 21} (set\n"
              "data.init_args.data_seed and seed_everything). Full protocol: configs/dpzero/generate.py.\n"
              + ROBERTA_DATA_HEADER)
    if task == "SST-2":
        header += SST2_HEADER
    header += "\nlr: the paper grid-searches {5e-5, 1e-4, 5e-4, 1e-3} per task."
    if epsilon is None:
        header += ("\nNot reproduced: the reference clips the batch gradient's norm to 1 (Hugging Face's\n"
                   "max_grad_norm) before AdamW; this module has no such option, so AdamW runs unclipped.")
    else:
        header += ("\nclip: the paper grid-searches C in {0.1, 0.5, 1, 10} per task. Noise as private-transformers:\n"
                   "(sum of clipped gradients + N(0, sigma^2 C^2 I)) / B, sigma from its RDP accountant for\n"
                   "(epsilon, delta = 1e-5, q = B / n, T steps), add/remove-one neighbours; Poisson batches here.")
    return header, config


def opt_config(size: str, task: str, method: str) -> tuple[str, dict]:
    data_format, data_dir = OPT_TASKS[task]
    backbone = {"class_path": "lit_zodp.backbones.HFCandidateScorer",
                "init_args": {"model_name_or_path": OPT_MODELS[size], "length_normalize": True,
                              "dtype": "float16"}}
    data = {"class_path": "datamodules.PromptTextDataModule", "init_args": {
        "task": task, "data_dir": data_dir, "data_format": data_format, "prompt": "causal",
        "tokenizer": OPT_MODELS[size], "max_length": OPT_LENGTHS[task], "bos_token_id": 0,
        "num_train": 1000, "num_dev": 500, "num_test": 1000, "batch_size": 8, "data_seed": 0}}
    config = {"seed_everything": 0, "trainer": trainer(20_000, 4000, keep_best=True),
              "model": algorithm(method, backbone, lr=1.0e-6, clip=50.0, seed=0), "data": data,
              "test_ckpt": "best"}
    row = "MeZO" if METHODS[method] is None else f"DPZero eps={METHODS[method]:g}"
    header = (f"DPZero paper, Table 4, row '{row}', column OPT-{size.upper()} {task}: MeZO's prompts, candidates\n"
              "scored by their (length-averaged) log-likelihood, 1000 train / 500 dev / 1000 test,\n"
              "T = 20000, B = 8, lambda = 1e-3, fp16 weights (App. B.3, Table 10). Paper: mean over seeds\n"
              "{0, 29, 83}. lr: the paper grid-searches {1e-6, 1e-7}.\n"
              "Model selection as the reference (load_best_model_at_end): validation on the 500 dev examples\n"
              "every 4000 steps, the checkpoint of the lowest val_loss is tested (test_ckpt: best; the Hugging\n"
              "Face Trainer's default metric_for_best_model). The dev examples are not in the private training set.\n"
              "bos_token_id 0: MeZO's OPT rows start with <s> (its slow tokenizer after `tokenizer.bos_token_id = 0`),\n"
              "not OPT's </s>.")
    if task == "BoolQ":
        header += ("\ndata: the original BoolQ (Google's train.jsonl/dev.jsonl, Hugging Face `boolq`), as MeZO;\n"
                   "SuperGLUE's copy prefixes every passage with its title. Prompt '<passage> <Question>?\\n' +\n"
                   "'Yes'/'No', up to 2048 tokens (MeZO's max_length), the prompt cut from the left.")
    if METHODS[method] is not None:
        header += "\nclip: the paper grid-searches C in {10, 50, 100, 200}."
    return header, config


#: Table 5 (generation): MeZO's SQuAD (v1.1) and DROP, read from the official JSON files (or Hugging Face's rows)
QA_TASKS = {"SQuAD": "data/squad", "DROP": "data/drop"}


def opt_qa_config(size: str, task: str, method: str) -> tuple[str, dict]:
    backbone = {"class_path": "lit_zodp.backbones.HFAnswerGenerator",
                "init_args": {"model_name_or_path": OPT_MODELS[size], "max_new_tokens": 50, "dtype": "float16"}}
    data = {"class_path": "datamodules.QADataModule", "init_args": {
        "task": task, "data_dir": QA_TASKS[task], "tokenizer": OPT_MODELS[size], "max_length": 1998,
        "num_train": 1000, "num_dev": 500, "num_test": 1000, "bos_token_id": 0, "batch_size": 8, "data_seed": 0}}
    config = {"seed_everything": 0, "trainer": trainer(20_000, 4000, keep_best=True),
              "model": algorithm(method, backbone, lr=1.0e-6, clip=50.0, seed=0), "data": data,
              "test_ckpt": "best"}
    row = "MeZO" if METHODS[method] is None else f"DPZero eps={METHODS[method]:g}"
    prompt = ("'Title: <title>\\nContext: <context>\\nQuestion: <question>\\nAnswer:'" if task == "SQuAD"
              else "'Passage: <passage>\\nQuestion: <question>\\nAnswer:'")
    header = (f"DPZero paper, Table 5, row '{row}', column OPT-{size.upper()} {task} (F1): MeZO's prompt\n"
              f"{prompt} and target ' <first gold answer>\\n'; the loss is each\n"
              "example's mean NLL of its answer tokens (DPZero's per-example reduction), 1000 train / 500 dev /\n"
              "1000 test, T = 20000, B = 8, lambda = 1e-3, fp16 weights (App. B.3, Table 10). Paper: mean over seeds\n"
              "{0, 29, 83}. lr: the paper grid-searches {1e-6, 1e-7}.\n"
              "Evaluation as MeZO: greedy generation of at most 50 tokens, stopping at a newline or </s>, scored by\n"
              "SQuAD's token F1 against every gold answer (test_f1; also test_em). max_length 1998 = MeZO's 2048 less\n"
              "the 50 generated tokens; prompts cut from the left. bos_token_id 0: MeZO's OPT rows start with <s>\n"
              "(its slow tokenizer after `tokenizer.bos_token_id = 0`), not OPT's </s>. The checkpoint of the\n"
              "lowest val_loss (every 4000 steps, the 500 dev examples, not in the private training set) is tested,\n"
              "as the reference's load_best_model_at_end.")
    if task == "DROP":
        header += ("\ndata: the official drop_dataset_{train,dev}.json (or Hugging Face's ucinlp/drop rows); each\n"
                   "answer span is scored on its own, as MeZO (not DROP's multi-span metric).")
    else:
        header += "\ndata: the official train-v1.1.json / dev-v1.1.json (or Hugging Face's squad rows)."
    if METHODS[method] is not None:
        header += "\nclip: the paper grid-searches C in {10, 50, 100, 200}."
    return header, config


#: Sec. 5.1: the dimension of the configs, and the best (T, step size, clip) of the reduced grid there with the
#: train and test gradient norms it reached (benchmarks/results/repro_dpzero_synthetic.md).
SYNTHETIC_DIM = 200
SYNTHETIC_METHODS = {"dpzero": ("lit_zodp.algorithms.DPZero", "DPZero (Alg. 2)"),
                     "dpgd0th": ("lit_zodp.algorithms.DPGD0th", "DPGD-0th (Alg. 1)"),
                     "dpgd": ("lit_zodp.algorithms.DPSGD", "DP-GD (DPSGD, no momentum)")}
SYNTHETIC_HESSIANS = {"identity": "A = I, effective rank d, Fig. 1 (a)/(d)",
                      "sqrt": "A = diag(1/sqrt(i)), effective rank O(sqrt(d)), Fig. 1 (b)/(e)",
                      "log": "A = diag(1/i), effective rank O(log d), Fig. 1 (c)/(f)"}
SYNTHETIC_BEST = {  # (hessian, method): (T, lr, clip, train grad norm, test grad norm) at d = 200
    ("identity", "dpzero"): (2560, 0.01, 10.0, 0.2453, 0.3182),
    ("identity", "dpgd0th"): (2560, 0.003, 100.0, 1.631, 1.621),
    ("identity", "dpgd"): (80, 0.1, 10.0, 0.08625, 0.223),
    ("sqrt", "dpzero"): (2560, 0.1, 1.0, 0.03785, 0.04717),
    ("sqrt", "dpgd0th"): (2560, 0.03, 30.0, 0.3353, 0.3342),
    ("sqrt", "dpgd"): (160, 1.0, 1.0, 0.01645, 0.0351),
    ("log", "dpzero"): (2560, 0.1, 1.0, 0.03145, 0.03434),
    ("log", "dpgd0th"): (2560, 0.1, 10.0, 0.09608, 0.09253),
    ("log", "dpgd"): (640, 1.0, 1.0, 0.01475, 0.02231),
}


def synthetic_config(hessian: str, method: str) -> tuple[str, dict]:
    steps, lr, clip, train, test = SYNTHETIC_BEST[hessian, method]
    class_path, name = SYNTHETIC_METHODS[method]
    backbone = {"class_path": "lit_zodp.backbones.QuadraticLoss",
                "init_args": {"dim": SYNTHETIC_DIM, "hessian": hessian, "init": 0.0, "dtype": "float64"}}
    model = {"backbone": backbone, "lr": lr}
    if method == "dpgd":
        model |= {"momentum": 0.0, "grad_mode": "bookkeeping"}
    else:
        model |= {"lam": 1.0e-4, "directions": "sphere", "perturbation": "chunked"}
    model |= {"seed": 0, "clip": clip, "target_epsilon": 2.0, "delta": 1.0e-6}
    data = {"class_path": "datamodules.QuadraticDataModule", "init_args": {
        "dim": SYNTHETIC_DIM, "n_train": 10_000, "n_test": 10_000, "mean": 1.0, "std": 1.0, "seed": 0,
        "sampling": "full_batch", "epoch_steps": steps, "eval_batch_size": 10_000}}
    trainer_config = {"accelerator": "auto", "devices": 1, "max_steps": steps, "val_check_interval": steps // 4,
                      "log_every_n_steps": 50, "enable_checkpointing": True}
    config = {"seed_everything": 0, "trainer": trainer_config,
              "model": {"class_path": class_path, "init_args": model}, "data": data}
    reached = (f"\nThe benchmark's fit of these values reached a train / test gradient norm of {train:.3g} / "
               f"{test:.3g} (PRV noise, one draw).") if train is not None else ""
    header = (f"DPZero paper, Sec. 5.1 / App. B.1, Fig. 1: {name} on the synthetic quadratic,\n"
              f"{SYNTHETIC_HESSIANS[hessian]}, d = {SYNTHETIC_DIM}. Rows x_i ~ N(1, I), 10000 train / 10000 test,\n"
              "(epsilon, delta) = (2, 1e-6), lambda = 1e-4 (Table 6), full batch (Alg. 1-2), x_0 = 0.\n"
              f"T = {steps}, step size {lr:g}, clip {clip:g}: the best of benchmarks/repro_dpzero_synthetic.py's reduced\n"
              "grid at this d (the paper searches Table 6's grid and reports the best gradient norm, not the values).\n"
              "test_grad_norm (and val_grad_norm: the test rows) is the exact ||A (x - mean x_i)|| (Fig. 1 (d)-(f)).\n"
              "Other dimensions: set model.init_args.backbone.init_args.dim and data.init_args.dim alike."
              + reached)
    return header, config


def render(header: str, config: dict, usage: str = "# Run: lightning fit --config <this file>   "
                                                    "(data layout: see README, 'Paper configs')") -> str:
    comment = "\n".join(f"# {line}" if line else "#" for line in header.splitlines())
    return f"{comment}\n{usage}\n" + yaml.safe_dump(config, sort_keys=False)


def all_configs() -> dict[Path, str]:
    files = {}
    for task in ROBERTA_TASKS:
        for method in [*METHODS, *FIRST_ORDER]:
            name = f"table2_roberta-large_{task.lower().replace('-', '')}_{method}.yaml"
            files[ROOT / name] = render(*roberta_config(task, method))
    for size in OPT_MODELS:
        for task in OPT_TASKS:
            for method in METHODS:
                name = f"table4_opt-{size}_{task.lower().replace('-', '')}_{method}.yaml"
                files[ROOT / name] = render(*opt_config(size, task, method))
    for size in OPT_MODELS:
        for task in QA_TASKS:
            for method in METHODS:
                name = f"table5_opt-{size}_{task.lower()}_{method}.yaml"
                files[ROOT / name] = render(*opt_qa_config(size, task, method))
    for hessian in SYNTHETIC_HESSIANS:
        for method in SYNTHETIC_METHODS:
            files[ROOT / f"sec51_quadratic_{hessian}_{method}.yaml"] = render(
                *synthetic_config(hessian, method),
                usage="# Run: lightning fit --config <this file>   (no data to download: the rows are drawn from seed)")
    return files


if __name__ == "__main__":
    for path, text in all_configs().items():
        path.write_text(text)
    print(f"wrote {len(all_configs())} configs to {ROOT}")

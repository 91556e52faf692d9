"""The PAZO paper's configs (configs/pazo, Table 5: RoBERTa-base on MNLI, public SNLI): generated = committed, values
= the paper's tables (written out here, not read from the generator), the noise = the RDP noise of each budget, and
each runs through the CLI on a tiny RoBERTa with MNLI and SNLI files in LM-BFF's layout, as tests/test_paper_configs.py
does for DPZero's."""

import math
from pathlib import Path

import pytest
import yaml

from datamodules.testing import write_task_files
from datamodules.text_tasks import get_task
from lit_zodp.backbones import save_tiny_pretrained
from lit_zodp.cli import build_cli
from lit_zodp.errors import PrivacyConfigError
from tests.conftest import parametrize_configs
from tests.test_paper_configs import assert_committed_configs_match_the_generator

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "configs" / "pazo"
GENERATED = sorted(FOLDER.glob("table*.yaml"))
TABLE5 = sorted(FOLDER.glob("table5_*.yaml"))

#: Table 5's columns and rows
EPSILONS = {"eps0.1": 0.1, "eps0.5": 0.5, "eps1": 1.0, "eps2": 2.0, "eps3": 3.0}
CLASSES = {"pazom": "lit_zodp.algorithms.PAZOM", "pazop": "lit_zodp.algorithms.PAZOP",
           "pazop-prime": "lit_zodp.algorithms.PAZOP", "pazos": "lit_zodp.algorithms.PAZOS",
           "dpzero": "lit_zodp.algorithms.DPZero"}
#: App. C.1: 512 MNLI per class private (n = 1,536), 100 SNLI per class public; App. C.3: b = 64, epochs
N_PRIVATE, B = 3 * 512, 64
EPOCHS = {"pazom": 100, "pazop": 100, "pazop-prime": 100, "pazos": 100, "dpzero": 200}
#: Table 10, MNLI column (PAZO-S has no lambda; PAZO-P' is Table 10's PAZO-P)
LAMBDA = {"pazom": 1e-3, "pazop": 1e-2, "pazop-prime": 1e-2, "dpzero": 1e-3, "pazos": None}
#: Table 13, MNLI column: the grids
GRID_C = [10, 20, 50, 100, 150, 200, 250]
TABLE13 = {
    "pazom": {"lr": [1e-4, 2e-4, 5e-4, 1e-3, 2e-3], "b'": [8, 32], "alpha": [0.25, 0.5, 0.75], "clip": GRID_C},
    "pazop": {"lr": [5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3], "b'": [8, 16, 32], "k": [3, 6, 10], "clip": GRID_C},
    "pazos": {"lr": [1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3], "b'": [8, 32], "k": [3], "exploration": [0.01, 0.001],
              "clip": [0.1, 0.5, 1.0]},
    "dpzero": {"lr": [1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5], "clip": GRID_C},
}
TABLE13["pazop-prime"] = TABLE13["pazop"]
#: where the paper is silent (configs/pazo/generate.py's docstring): each grid's middle (lower middle if even)
CHOSEN = {"pazom": {"lr": 5e-4, "b'": 8, "alpha": 0.5, "clip": 100},
          "pazop": {"lr": 2e-4, "b'": 16, "k": 6, "clip": 100},
          "pazos": {"lr": 5e-4, "b'": 8, "k": 3, "exploration": 1e-3, "clip": 0.5},
          "dpzero": {"lr": 5e-6, "clip": 100}}
CHOSEN["pazop-prime"] = CHOSEN["pazop"]
#: q: DPZero 5 (Table 11 / Table 8's caption), PAZO-M and PAZO-P 1 (Table 8's caption)
QUERIES = {"pazom": 1, "pazop": 1, "pazop-prime": 1, "dpzero": 5}
#: the paper's delta = 1/n_private is refused by the library (delta >= 1/n); the configs take a tenth of it
DELTA = 1 / (10 * N_PRIVATE)


def method_of(path: Path) -> str:
    return path.stem.split("_")[3]


def expected_rows() -> dict[str, dict]:
    return {f"table5_roberta-base_mnli_{method}_{level}": {"method": method, "epsilon": eps}
            for method in CLASSES for level, eps in EPSILONS.items()}


@pytest.mark.slow  # (~18 s on 2 cores: the default suite's budget, stop 59); run with -m slow
def test_committed_configs_match_the_generator():
    assert_committed_configs_match_the_generator("pazo", GENERATED)


def test_every_cell_of_table5_has_its_config_with_the_paper_values():
    rows = expected_rows()
    assert sorted(rows) == [p.stem for p in TABLE5] and len(rows) == 25
    for path in TABLE5:
        row, config = rows[path.stem], yaml.safe_load(path.read_text())
        method = row["method"]
        model, data = config["model"]["init_args"], config["data"]["init_args"]
        assert config["model"]["class_path"] == CLASSES[method]
        # privacy: Table 5's epsilon; delta below the paper's 1/n_private; the authors' RDP, sensitivity C
        assert (model["target_epsilon"], model["delta"]) == (row["epsilon"], pytest.approx(DELTA, rel=1e-12))
        assert model["delta"] < 1 / N_PRIVATE
        assert (model["neighbours"], model["accountant"]) == ("add_remove", "rdp")
        # App. C.3: b = 64, epochs * n / b steps (PAZO 100 epochs = 2,400; DPZero 200 = 4,800)
        assert data["batch_size"] == B
        assert config["trainer"]["max_steps"] == EPOCHS[method] * N_PRIVATE // B == {100: 2400, 200: 4800}[
            EPOCHS[method]]
        # Table 10: lambda; App. C.2: Gaussian directions; q
        assert model.get("lam") == LAMBDA[method]
        if method != "pazos":
            assert (model["directions"], model["num_directions"]) == ("gaussian", QUERIES[method])
        else:
            assert "num_directions" not in model and "directions" not in model
        # Table 13: every value in its grid, and the generator's choice (the grid's middle)
        grid, chosen = TABLE13[method], CHOSEN[method]
        assert model["lr"] in grid["lr"] and model["clip"] in grid["clip"]
        assert (model["lr"], model["clip"]) == (chosen["lr"], chosen["clip"])
        for name in ("alpha", "k", "exploration"):
            assert model.get(name) == chosen.get(name) and (name not in grid or model[name] in grid[name])
        assert model.get("basis") == {"pazop": "orthonormal", "pazop-prime": "normalized"}.get(method)
        if method in ("pazop", "pazop-prime"):
            assert model["k"] in (3, 6)  # Sec. 5: the reported results use k in {3, 6}
        # App. C.1: MNLI 512 per class private, 1,000 test (dev_matched), max length 256; RoBERTa-base, all of it
        assert (data["task"], data["k_shot"], data["num_test"], data["max_length"]) == ("MNLI", 512, 1000, 256)
        assert data["prompt"] == "mlm" and data["tokenizer"] == "roberta-base"
        backbone = model["backbone"]
        assert backbone["class_path"] == "lit_zodp.backbones.HFPromptClassifier"
        assert backbone["init_args"] == {"model_name_or_path": "roberta-base",
                                         "label_words": list(get_task("MNLI").label_words),
                                         "untie_word_embeddings": True}
        if method == "dpzero":  # no public data
            assert not any(key.startswith("public") for key in data)
        else:  # SNLI 100 per class, out of distribution, one public batch of k b' rows per private batch
            assert (data["public_task"], data["public_k_shot"], data["public_in_step"]) == ("SNLI", 100, True)
            assert data["public_batch_size"] == chosen.get("k", 1) * chosen["b'"]
            assert data.get("public_fraction", 0) == 0  # no MNLI example is public
        # where the paper is silent: constant lr, plain SGD, seed 0, the last iterate tested
        assert "lr_scheduler" not in model and model.get("weight_decay", 0) == 0 and "momentum" not in model
        assert config["seed_everything"] == model["seed"] == data["data_seed"] == 0
        assert "callbacks" not in config["trainer"] and config.get("test_ckpt", "last") == "last"
        # the same private data, template and lengths as DPZero's MNLI configs (MeZO's / LM-BFF's)
        dpzero = yaml.safe_load((ROOT / "configs" / "dpzero" / "table2_roberta-large_mnli_dpzero_eps2.yaml").read_text(
        ))
        theirs = {k: v for k, v in dpzero["data"]["init_args"].items() if k not in ("tokenizer", "data_seed")}
        assert {k: v for k, v in data.items() if k in theirs} == theirs


def test_the_papers_delta_of_one_over_n_is_refused_and_the_configs_is_not():
    """Why the configs' delta is 1/(10 n): the library refuses delta >= 1/n_private (the paper's 1/#train)."""
    from lit_zodp.algorithms import PAZOM
    from lit_zodp.privacy import PoissonSampling
    from tests.conftest import mlp

    def plan(delta):
        module = PAZOM(mlp(), clip=100.0, target_epsilon=1.0, delta=delta, accountant="rdp")
        module.privacy.plan(step_plan=module.step_plan(), sampling=PoissonSampling(N_PRIVATE, B / N_PRIVATE),
                            planned_steps=2400)
        return module

    with pytest.raises(PrivacyConfigError, match="1/n"):
        plan(1 / N_PRIVATE)
    assert plan(DELTA).privacy.delta == pytest.approx(DELTA)


def injected_and_rdp_noise(path: Path) -> tuple[list[float], float, float]:
    """A config's per-release noise stds (over b), the Opacus RDP sigma of its (epsilon, delta, q = b / n, T) and C / b,
    planned as a fit of the config would, on a stand-in MLP."""
    from opacus.accountants.utils import get_noise_multiplier

    from lit_zodp import algorithms
    from lit_zodp.privacy import PoissonSampling
    from tests.conftest import mlp

    config = yaml.safe_load(path.read_text())
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    n = data["k_shot"] * 3
    steps = config["trainer"]["max_steps"]
    cls = getattr(algorithms, config["model"]["class_path"].rsplit(".", 1)[1])
    module = cls(mlp(), **{k: v for k, v in model.items() if k != "backbone"})
    module.privacy.plan(step_plan=module.step_plan(), sampling=PoissonSampling(n, data["batch_size"] / n),
                        planned_steps=steps)
    stds = [module.privacy._noise_std(release) / module.privacy.expected_batch_size for release in module.step_plan()]
    sigma = get_noise_multiplier(target_epsilon=model["target_epsilon"], target_delta=model["delta"],
                                 sample_rate=data["batch_size"] / n, steps=steps)
    return stds, sigma, model["clip"] / data["batch_size"]


#: the noise of every method at one budget by default; the other budgets only change epsilon (slow)
NOISE_DEFAULT = {f"table5_roberta-base_mnli_{m}_eps1" for m in CLASSES} | {"table5_roberta-base_mnli_pazos_eps0.1"}


@pytest.mark.filterwarnings("ignore:Optimal order")
@parametrize_configs(TABLE5, NOISE_DEFAULT)
def test_config_injects_the_rdp_noise_of_its_budget(path):
    """Sec. 3: each of the m queries (q directions; PAZO-S's k + 1 losses) gets ``N(0, m C^2 sigma^2)`` on its
    clipped sum, divided by b, sigma = Opacus get_noise_multiplier(epsilon, delta, q = b / n, T): add/remove-one
    neighbours (sensitivity C, no factor 2), one query at sigma per step."""
    stds, sigma, clip_over_b = injected_and_rdp_noise(path)
    method = method_of(path)
    m = 3 + 1 if method == "pazos" else QUERIES[method]  # PAZO-S: k = 3 candidates + the explored one
    assert stds and all(std == pytest.approx(math.sqrt(m) * sigma * clip_over_b, rel=1e-9) for std in stds)


# ---------------------------------------------------------------------------------------------- tiny CLI runs
@pytest.fixture(scope="module")
def tiny_nli(tmp_path_factory):
    """A tiny RoBERTa (the real from_pretrained path) and LM-BFF-layout MNLI and SNLI folders; SNLI's pairs differ from
    MNLI's (the synthetic writer gives both tasks the same texts), so no private row gives way to a public one."""
    return tiny_nli_files(tmp_path_factory.mktemp("pazo"), per_class=4)


def tiny_nli_files(root: Path, per_class: int) -> tuple[str, Path]:
    """A tiny RoBERTa under ``root`` and MNLI / SNLI files of ``per_class`` examples per class (SNLI's pairs start with
    "Public:"): the model's path and the data folder."""
    words = list(get_task("MNLI").label_words)
    roberta = save_tiny_pretrained(root / "roberta", "roberta", vocab_texts=[" ".join(words * 20), "Public:"])
    write_task_files(root / "original", "MNLI", "glue", per_class=per_class)
    snli = write_task_files(root / "original", "SNLI", "glue", per_class=per_class) / "train.tsv"
    snli.write_text(snli.read_text().replace("\tA ", "\tPublic: A "))
    return roberta, root / "original"


def tiny_overrides(config: dict, roberta: str, data_dir: Path) -> list[str]:
    """The config's model and files pointed at the tiny stand-ins; 2 private examples per class (n = 6), 2 public per
    class, a public batch of k rows (b' = 1), two steps."""
    backbone = "--model.init_args.backbone.init_args"
    args = [f"{backbone}.model_name_or_path", roberta, "--data.init_args.tokenizer", roberta,
            "--data.init_args.data_dir", str(data_dir), "--data.init_args.batch_size", "2",
            "--data.init_args.k_shot", "2", "--data.init_args.k_dev", "2", "--data.init_args.num_test", "2",
            "--data.init_args.max_length", "64", "--trainer.accelerator", "cpu", "--trainer.max_steps", "2",
            "--trainer.logger", "false", "--trainer.val_check_interval", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false"]
    data = config["data"]["init_args"]
    if "public_task" in data:
        k = config["model"]["init_args"].get("k", 1)
        args += ["--data.init_args.public_data_dir", str(data_dir), "--data.init_args.public_k_shot", "2",
                 "--data.init_args.public_batch_size", str(k)]
    return args


#: by default one budget of each PAZO algorithm (PAZO-P at 6 public parts, PAZO-S with its explored candidate); the
#: others differ only in target_epsilon, PAZO-P' in its basis, and DPZero's module runs in tests/test_paper_configs.py
RUN_DEFAULT = {"table5_roberta-base_mnli_pazom_eps0.1", "table5_roberta-base_mnli_pazop_eps1",
               "table5_roberta-base_mnli_pazos_eps2"}


@pytest.mark.filterwarnings("ignore:Optimal order")
@parametrize_configs(TABLE5, RUN_DEFAULT)
def test_table5_config_runs_with_a_tiny_roberta(path, tiny_nli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    roberta, data_dir = tiny_nli
    config = yaml.safe_load(path.read_text())
    cli = build_cli(["fit", "--config", str(path), *tiny_overrides(config, roberta, data_dir)])
    model, dm = cli.model, cli.datamodule
    assert cli.trainer.global_step == model.privacy.steps == 2
    assert model.privacy.target_epsilon == config["model"]["init_args"]["target_epsilon"]
    assert model.privacy.delta == pytest.approx(DELTA)
    assert 0 < model.privacy.ledger.epsilon(model.privacy.delta).upper <= model.privacy.target_epsilon
    assert model.privacy.sampling.n == len(dm.private_indices) == 6  # accounted on the private MNLI rows alone
    lm = model.backbone.model  # MeZO's RoBERTa prompt model: the decoder apart from the word embeddings
    assert lm.get_input_embeddings().weight is not lm.lm_head.decoder.weight
    assert "test_acc" in cli.trainer.callback_metrics
    assert dm.val_dataset is not None and dm.val_dataset is not dm.test_dataset and len(dm.val_dataset) == 6
    method = method_of(path)
    if method == "dpzero":
        assert dm.public_dataset is None or len(dm.public_dataset) == 0
        return
    # the public split: SNLI's training file alone (2 per class here), rendered with MNLI's template and label
    # words, disjoint from the private MNLI rows
    assert model.needs_public_batches and dm.public_in_step
    public_records = dm._load_public()[0].records
    assert len(dm.public_dataset) == 6 and all(r["premise"].startswith("Public: ") for r in public_records)
    private = {tuple(dm.pool_dataset.records[i].values()) for i in dm.private_indices}
    assert not private & {tuple(r.values()) for r in public_records}
    mask = dm.tokenizer.mask_token_id
    assert (dm.public_dataset.inputs["input_ids"] == mask).sum(dim=1).eq(1).all()  # one <mask>: the MNLI prompt
    if method in ("pazop", "pazop-prime"):
        assert (model.k, model.basis) == (6, "orthonormal" if method == "pazop" else "normalized")
    if method == "pazos":
        assert (model.k, model.exploration, model.queries) == (3, 1e-3, 4)
    if method == "pazom":
        assert model.alpha == 0.5

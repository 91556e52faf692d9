"""The PAZO paper's Table 7 configs (public data shifted, epsilon = 1, PAZO-M / P / S): every cell has its file, each
is its method's Table 2 (CIFAR-10) or Table 5 (MNLI) epsilon = 1 config with only the public draw changed, the class
profiles are App. C.1's (written out here), and one config of each task runs through the CLI on fabricated files."""

from collections import Counter

import pytest
import yaml

from tests.conftest import parametrize_configs
from tests.test_pazo_configs import FOLDER

METHODS = ("pazom", "pazop", "pazos")
SETTINGS = {"cifar10": ("slight", "half-half", "big"), "mnli": ("mnli", "half-half", "snli")}
MODELS = {"cifar10": "nfresnet18", "mnli": "roberta-base"}
#: App. C.1: class-size ratios [1 : ... : 0.85] (slight) and [1.0 : 0.9 : ... : 0.1] (big), linear over the 10 classes
SLIGHT = [1.0, 0.983333, 0.966667, 0.95, 0.933333, 0.916667, 0.9, 0.883333, 0.866667, 0.85]
BIG = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]
#: MNLI's public data: 100 examples per class from MNLI, from SNLI, or 50 of each
MNLI_PUBLIC = {"mnli": ("MNLI", 100), "half-half": (["MNLI", "SNLI"], [50, 50]), "snli": ("SNLI", 100)}
GENERATED = sorted(FOLDER.glob("table7_*.yaml"))


def name(task, method, setting):
    return f"table7_{MODELS[task]}_{task}_{method}_public-{setting}_eps1"


def base_config(task, method):
    """The Table 2 / Table 5 epsilon = 1 config the cell shifts."""
    base = (f"table2_nfresnet18_cifar10_{method}_eps1.yaml" if task == "cifar10"
            else f"table5_roberta-base_mnli_{method}_eps1.yaml")
    return FOLDER / base


def test_every_cell_of_table7_has_its_config():
    expected = sorted(name(task, method, setting) for task in SETTINGS for method in METHODS
                      for setting in SETTINGS[task])
    assert [p.stem for p in GENERATED] == expected and len(expected) == 18


@pytest.mark.parametrize("task", SETTINGS)
@pytest.mark.parametrize("method", METHODS)
def test_a_cell_is_its_base_config_with_the_settings_public_draw(task, method):
    base = yaml.safe_load(base_config(task, method).read_text())
    for setting in SETTINGS[task]:
        config = yaml.safe_load((FOLDER / f"{name(task, method, setting)}.yaml").read_text())
        data = config["data"]["init_args"]
        if task == "cifar10":
            changed = {"public_selection", "public_class_weights"}
            assert data["public_selection"] == "per_class" and data["public_fraction"] == 0.04
            weights = {"slight": SLIGHT, "big": BIG}.get(setting)
            if weights is None:  # half of the 2,000 with each profile: their class shares added
                weights = [a / sum(SLIGHT) + b / sum(BIG) for a, b in zip(SLIGHT, BIG)]
            assert data["public_class_weights"] == pytest.approx(weights, abs=1e-6)
        else:
            changed = {"public_task", "public_k_shot"}
            assert (data["public_task"], data["public_k_shot"]) == MNLI_PUBLIC[setting]
        assert config["model"] == base["model"] and config["trainer"] == base["trainer"]
        assert {k: v for k, v in data.items() if k not in changed} == {
            k: v for k, v in base["data"]["init_args"].items() if k not in changed}
        assert config["model"]["init_args"]["target_epsilon"] == 1.0


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory):
    """CIFAR-10 in its real layout, 40 training images with 4 of every class (the profiles draw by class)."""
    from tests.datamodules.test_dm_vision import fake_cifar10

    root = tmp_path_factory.mktemp("table7")
    fake_cifar10(root, n_per_batch=8, n_test=6)
    return root


RUN_DEFAULT = {name("cifar10", "pazom", "big"), name("mnli", "pazos", "half-half")}


@pytest.mark.filterwarnings("ignore:Optimal order")
@pytest.mark.filterwarnings("ignore::UserWarning")
@parametrize_configs(GENERATED, RUN_DEFAULT)
def test_config_runs_on_fabricated_files(path, cifar_root, tmp_path, monkeypatch):
    from lit_zodp.cli import build_cli

    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load(path.read_text())
    task, method = path.stem.split("_")[2:4]
    if task == "cifar10":
        from tests.test_pazo_tables234_configs import tiny_overrides

        overrides = tiny_overrides(base_config(task, method), config, cifar_root)
    else:
        from tests.test_pazo_configs import tiny_nli_files, tiny_overrides

        roberta, data_dir = tiny_nli_files(tmp_path, per_class=6)  # (6: public MNLI rows beside the private ones)
        overrides = tiny_overrides(config, roberta, data_dir)
    cli = build_cli(["fit", "--config", str(path), *overrides])
    model, dm = cli.model, cli.datamodule
    assert cli.trainer.global_step == model.privacy.steps == 2
    assert model.privacy.sampling.n == len(dm.private_indices)  # accounted on the private rows alone
    if task == "cifar10":  # drawn by class: the big profile's first class at least as large as its last
        labels = Counter(int(dm.pool_dataset[i][1]) for i in dm.public_indices)
        assert sum(labels.values()) == len(dm.public_indices) > 0 and labels[0] >= labels[9]
        assert not set(dm.public_indices) & set(dm.private_indices)
    else:  # MNLI, SNLI or half of each (the fabricated SNLI pairs start with "Public:"), no public example private
        from datamodules.prompt_text import record_key

        keys = [record_key(dm.spec, r) for r in dm._load_public()[0].records]
        setting = path.stem.split("_public-")[1].rsplit("_eps", 1)[0]
        snli = {"mnli": 0, "snli": len(keys), "half-half": len(keys) // 2}[setting]
        assert sum(key[0].startswith("Public:") for key in keys) == snli and len(keys) > 0
        pool = [record_key(dm.spec, r) for r in dm.pool_dataset.records]
        assert not {pool[i] for i in dm.private_indices} & set(keys)


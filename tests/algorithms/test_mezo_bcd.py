"""MeZO-BCD (Park et al., Alg. 1-5) and its private variant: blocks, orders, locality, the estimator's law."""

import math
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from torch import nn

from lit_zodp.algorithms import DPMeZOBCD, MeZOBCD
from lit_zodp.errors import PrivacyConfigError
from lit_zodp.privacy import FullBatchSampler
from lit_zodp.zo import PerturbationEngine, central_differences, derive_seed
from lit_zodp.zo.blocks import (
    BlockPerturbation,
    find_layer_stack,
    partition,
    random_permutation,
    softmax_probabilities,
    update_block_idx,
)
from lit_zodp.zo.fused import FusedPerturbation
from tests.conftest import blobs, collate_tensors, mlp, poisson_loader, quiet_trainer
from tests.test_paper_configs import overrides, tiny_world  # noqa: F401 (a fixture)

pytestmark = pytest.mark.filterwarnings("ignore:`(noise|sampling)_seed` is set", "ignore:.*val_dataloader.*")


def deep_mlp(seed=0, embed_width=None):
    """Input layer, a homogeneous stack of three hidden layers, an output layer.

    ``embed_width``: a two-layer input block ``10 -> embed_width -> 8`` (a block larger than a layer).
    """
    torch.manual_seed(seed)

    class Net(nn.Module):
        num_classes = 3

        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(10, 8) if embed_width is None else nn.Sequential(
                nn.Linear(10, embed_width), nn.Tanh(), nn.Linear(embed_width, 8))
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(3))
            self.norm = nn.LayerNorm(8)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            h = torch.tanh(self.embed(x))
            for layer in self.layers:
                h = torch.tanh(layer(h))
            return self.head(self.norm(h))

    return Net()


def params_of(module):
    return [p.detach().clone() for p in module.backbone.parameters()]


class BlockTrace(Callback):
    """Parameters and the active block around every step."""

    def __init__(self):
        self.before, self.after, self.blocks, self.adam = [], [], [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before.append(params_of(module))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after.append(params_of(module))
        self.blocks.append(module.active_block)
        state = module.adam_state
        # the tensor itself, not its id(): a freed state's id can be reused by the next one
        self.adam.append(None if state is None else (state["m"][0], sum(m.numel() for m in state["m"])))


def fit(module, steps, callbacks=(), loader=None):
    trainer = quiet_trainer(max_steps=steps, callbacks=list(callbacks))
    trainer.fit(module, loader or poisson_loader(blobs(), 0.25, seed=1))
    return trainer


def full_batch_loader(steps):
    from torch.utils.data import DataLoader

    data = blobs()
    sampler = FullBatchSampler(len(data), steps_per_epoch=steps)
    return DataLoader(data, batch_sampler=sampler, collate_fn=collate_tensors)


# ------------------------------------------------------------------------------ partitions
def assert_exact_cover(model, blocks):
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    listed = [id(p) for b in blocks for p in b.params]
    assert len(listed) == len(set(listed)) == len(trainable) and set(listed) == trainable


def tiny_hf(kind):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                  max_position_embeddings=40)
    if kind == "bert":
        return transformers.BertForSequenceClassification(transformers.BertConfig(intermediate_size=32, **common))
    if kind == "roberta":
        return transformers.RobertaForSequenceClassification(
            transformers.RobertaConfig(intermediate_size=32, pad_token_id=1, **common))
    if kind == "opt":
        return transformers.OPTForCausalLM(transformers.OPTConfig(ffn_dim=32, word_embed_proj_dim=16, **common))
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=3, n_head=2,
                                                                    n_positions=40))
    raise ValueError(kind)


@pytest.mark.parametrize("kind,stack", [("bert", "bert.encoder.layer"), ("roberta", "roberta.encoder.layer"),
                                        ("opt", "model.decoder.layers"), ("gpt2", "transformer.h")])
def test_layer_wise_blocks_of_hugging_face_models(kind, stack):
    model = tiny_hf(kind)
    assert find_layer_stack(model) == (stack, 3)
    blocks = partition(model)
    assert_exact_cover(model, blocks)
    assert [b.name for b in blocks] == ["embeddings"] + [f"{stack}.{i}" for i in range(3)] + ["head"]
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("embed" in names[id(p)] or "wte" in names[id(p)] or "wpe" in names[id(p)]
               for p in blocks[0].params)
    head = {names[id(p)] for p in blocks[-1].params}
    if kind == "opt":  # registered before the layers, but the output side; lm_head is tied to embed_tokens
        assert {"model.decoder.final_layer_norm.weight", "model.decoder.final_layer_norm.bias"} == head
        assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    if kind == "gpt2":
        assert head == {"transformer.ln_f.weight", "transformer.ln_f.bias"}


@pytest.mark.parametrize("kind", ["bert", "opt", "gpt2"])
def test_linear_wise_and_k_layer_blocks(kind):
    model = tiny_hf(kind)
    linear = partition(model, "linear")
    assert_exact_cover(model, linear)
    per_layer = {"bert": 6, "opt": 6, "gpt2": 4}[kind]  # q,k,v,o,fc1,fc2 / c_attn,c_proj,c_fc,c_proj
    assert len(linear) == 2 + 3 * (per_layer + 1)  # + the norms of each layer as one block
    two = partition(model, "layer", layers_per_block=2)
    assert_exact_cover(model, two)
    assert len(two) == 2 + 2 and len(two[1].params) == 2 * len(two[2].params)  # layers {0,1}, {2}


def test_timm_vit_blocks():
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=3,
                              num_classes=3)
    assert find_layer_stack(model) == ("blocks", 3)
    blocks = partition(model)
    assert_exact_cover(model, blocks)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in blocks[0].params} >= {"cls_token", "pos_embed", "patch_embed.proj.weight"}
    assert {names[id(p)] for p in blocks[-1].params} == {"norm.weight", "norm.bias", "head.weight", "head.bias"}


def test_frozen_parameters_are_skipped_and_tied_ones_counted_once():
    model = deep_mlp()
    model.layers[1].requires_grad_(False)
    tied = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7, bias=False))
    tied[1].weight = tied[0].weight
    for net in (model, tied):
        blocks = partition(net)
        assert_exact_cover(net, blocks)
    assert [b.name for b in partition(model)] == ["embeddings", "layers.0", "layers.2", "head"]
    assert len(partition(tied)) == 1


def test_a_model_without_a_stack_gets_one_block_per_module():
    model = mlp()
    assert find_layer_stack(model) is None
    blocks = partition(model)
    assert [b.name for b in blocks] == ["0", "2"] and all(len(b.params) == 2 for b in blocks)


def test_bad_partitions_are_refused_in_one_line():
    for kwargs, match in [(dict(partition="tensor"), "partition"), (dict(order="zigzag"), "order"),
                          (dict(layers_per_block=0), "layers_per_block"),
                          (dict(partition="linear", layers_per_block=2), "layers_per_block"),
                          (dict(temperature=0.0), "temperature"), (dict(block_optimizer="lion"), "block_optimizer")]:
        with pytest.raises(PrivacyConfigError, match=match) as info:
            MeZOBCD(mlp(), **kwargs)
        assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------ orders (Alg. 3)
def test_ascending_descending_and_flip_flop_orders_exactly():
    n = 4
    sequence = {order: [update_block_idx(order, t, n) for t in range(1, 15)]
                for order in ("ascending", "descending", "flip_flop")}
    assert sequence["ascending"] == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert sequence["descending"] == [4, 3, 2, 1, 4, 3, 2, 1, 4, 3, 2, 1, 4, 3]
    assert sequence["flip_flop"] == [1, 2, 3, 4, 3, 2, 1, 2, 3, 4, 3, 2, 1, 2]  # period 2N - 2 = 6
    for n in (2, 3, 7):
        flip = [update_block_idx("flip_flop", t, n) for t in range(1, 4 * (2 * n - 2) + 1)]
        assert flip[:2 * n - 2] == list(range(1, n + 1)) + list(range(n - 1, 1, -1))
        assert all(flip[t] == flip[t + 2 * n - 2] for t in range(len(flip) - 2 * n + 2))
    assert all(update_block_idx(order, t, 1) == 1 for order in ("ascending", "flip_flop", "random") for t in (1, 5))


def test_random_order_windows_are_permutations_from_the_public_seed():
    n = 5
    order = [update_block_idx("random", t, n, seed=11) for t in range(1, 10 * n)]
    assert sorted(order[:n - 1]) == sorted(random_permutation(11, 0, n)[1:].tolist())  # t = 1..N-1: pi_0[1:]
    for w in range(1, 9):  # the aligned windows t = wN .. wN + N - 1
        window = order[w * n - 1:(w + 1) * n - 1]
        assert sorted(window) == list(range(1, n + 1))
    assert order == [update_block_idx("random", t, n, seed=11) for t in range(1, 10 * n)]  # every rank agrees
    assert order != [update_block_idx("random", t, n, seed=12) for t in range(1, 10 * n)]


def test_the_module_follows_the_order_and_changes_only_the_active_block():
    for perturbation in ("chunked", "fused"):
        trace = BlockTrace()
        module = MeZOBCD(deep_mlp(), lr=0.05, seed=3, order="flip_flop", perturbation=perturbation,
                         weight_decay=0.1)
        fit(module, 12, [trace])
        n = module.num_blocks
        assert n == 5 and trace.blocks == [update_block_idx("flip_flop", t, n) for t in range(1, 13)]
        blocks = module.blocks()
        position = {id(p): i for i, p in enumerate(module.backbone.parameters())}
        for block, before, after in zip(trace.blocks, trace.before, trace.after):
            active = {position[id(p)] for p in blocks[block - 1].params}
            for i, (b, a) in enumerate(zip(before, after)):
                if i in active:
                    assert not torch.equal(a, b), f"{perturbation}: active block {block} did not move"
                else:
                    assert torch.equal(a, b), f"{perturbation}: parameter {i} outside block {block} changed"


def test_fused_block_directions_are_the_full_layouts_restricted():
    """Global offsets: an element's direction does not depend on the block split."""
    module = MeZOBCD(deep_mlp(), lr=0.05, seed=3, perturbation="fused")
    fit(module, 1)
    engine = module.engine
    full = FusedPerturbation(engine.params, backend="reference").direction(1234)
    for j in range(engine.num_blocks):
        engine.activate(j)
        padded = engine.direction(1234)
        for i, (u, z) in enumerate(zip(padded, full)):
            if i in engine.blocks[j]:
                assert torch.equal(u, z)
            else:
                assert not u.any()


# ------------------------------------------------------------------------------ the estimator
def test_on_a_quadratic_the_block_estimate_is_unbiased_with_second_moment_s_plus_2():
    """g = pg u with u ~ N(0, I_s): E[g] = grad_B f and E||g||^2 = (s + 2) ||grad_B f||^2.

    The central difference of a quadratic is exact (pg = u . grad_B f), so only the directions are
    random. Tolerances come from the draws' own standard errors: each coordinate of the mean within
    4.5 standard errors (Bonferroni over s coordinates, ~1e-4 overall), the second moment within 5.
    """
    torch.manual_seed(0)
    sizes = (6, 10)
    params = [nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in sizes]
    d = sum(sizes)
    a = torch.randn(d, d, dtype=torch.float64)
    hessian = a @ a.T / d
    loss = lambda: 0.5 * torch.cat(params) @ hessian @ torch.cat(params)  # noqa: E731
    grad = hessian @ torch.cat([p.detach() for p in params])
    engine = BlockPerturbation(params, [[0], [1]], lambda idx: PerturbationEngine([params[i] for i in idx]))
    draws = 6000
    for j, s in enumerate(sizes):
        engine.activate(j)
        grad_block = grad[sum(sizes[:j]):sum(sizes[:j + 1])]
        estimates = []
        for seed in range(draws):
            pg = central_differences(engine, seed, 1e-3, lambda: loss().reshape(1))
            engine.restore_()
            estimates.append(pg.item() * engine.block_direction(seed)[0].double())
        g = torch.stack(estimates)
        standard_error = g.std(0) / math.sqrt(draws)
        assert ((g.mean(0) - grad_block).abs() / standard_error).max() < 4.5
        squares = g.pow(2).sum(1)
        expected = (s + 2) * grad_block.pow(2).sum()
        assert (squares.mean() - expected).abs() < 5 * squares.std() / math.sqrt(draws)
        assert squares.mean() / expected == pytest.approx(1.0, abs=0.15)


def test_sigma_zero_and_infinite_clip_equal_mezo_bcd_in_every_variant():
    for kwargs in (dict(), dict(block_optimizer="adam", steps_per_block=2), dict(selection="adaptive", warmup_steps=2),
                   dict(partition="linear", order="descending")):
        private = DPMeZOBCD(deep_mlp(), lr=0.05, seed=3, clip=math.inf, noise_multiplier=0.0, delta=1e-5, **kwargs)
        twin = MeZOBCD(deep_mlp(), lr=0.05, seed=3, **kwargs)
        fit(private, 6, loader=full_batch_loader(6))
        fit(twin, 6, loader=full_batch_loader(6))
        for p, q in zip(private.backbone.parameters(), twin.backbone.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-10)
        assert any(not torch.equal(p, q) for p, q in zip(private.backbone.parameters(), deep_mlp().parameters()))


def test_the_private_update_is_parallel_to_the_zero_padded_block_direction():
    """theta_{t+1} - theta_t = -lr * pg~ * e_Bj(u_t): the noise is one scalar, not a vector."""
    trace = BlockTrace()
    module = DPMeZOBCD(deep_mlp(), lr=0.05, seed=3, clip=0.5, noise_multiplier=1.0, delta=1e-5, noise_seed=0)
    fit(module, 6, [trace])
    engine = module.engine
    for step, (block, before, after) in enumerate(zip(trace.blocks, trace.before, trace.after)):
        engine.activate(block - 1)
        u = torch.cat([t.flatten() for t in engine.direction(derive_seed(module.run_seed, step, 0))]).double()
        order = {id(p): i for i, p in enumerate(engine.params)}
        delta = torch.cat([(after[i] - before[i]).flatten() for i in
                           sorted(range(len(before)), key=lambda i: order[id(list(module.backbone.parameters())[i])])])
        cosine = torch.nn.functional.cosine_similarity(delta.double(), u, dim=0).abs().item()
        assert cosine == pytest.approx(1.0, abs=1e-5)
    assert module.privacy.ledger.total_count == 6


def first_block_step(order, block_lr, rate, perturbation):
    """A MeZOBCD (embedding-width 32 MLP) after its first step: on block 1 (ascending) or N (descending)."""
    module = MeZOBCD(deep_mlp(embed_width=32), lr=rate, seed=3, order=order, block_lr=block_lr,
                     perturbation=perturbation, weight_decay=0.1)
    fit(module, 1, loader=full_batch_loader(1))
    return module


@pytest.mark.parametrize("perturbation", ["chunked", "fused"])
def test_size_scaled_block_rates_step_each_block_as_uniform_at_its_own_rate(perturbation):
    """block_lr="size": eta_j = eta min(1, median |B| / |B_j|), bitwise the uniform step at eta_j."""
    lr, sizes = 0.05, [10 * 32 + 32 + 32 * 8 + 8, 88, 88, 88, 8 + 8 + 24 + 3]

    scaled = MeZOBCD(deep_mlp(embed_width=32), lr=lr, block_lr="size")
    assert [b.numel for b in scaled.blocks()] == sizes
    assert scaled.block_lr_factors() == [88 / sizes[0], 1.0, 1.0, 1.0, 1.0]
    module = first_block_step("ascending", "size", lr, perturbation)       # step 1 on the embeddings
    rates = {id(p): g["lr"] for g in module.zo_optimizer.param_groups for p in g["params"]}
    for block, factor in zip(module.blocks(), module.block_lr_factors()):
        assert all(rates[id(p)] == lr * factor for p in block.params)
    assert [id(p) for p in module.engine.params] == [id(p) for p in module.trainable_parameters() if p.ndim >= 2] + \
        [id(p) for p in module.trainable_parameters() if p.ndim < 2]       # the uniform layout's order
    for order, factor in (("ascending", 88 / sizes[0]), ("descending", 1.0)):
        stepped = params_of(first_block_step(order, "size", lr, perturbation))
        same = params_of(first_block_step(order, "uniform", lr * factor, perturbation))
        assert all(torch.equal(a, b) for a, b in zip(stepped, same)), order
    bigger = params_of(first_block_step("ascending", "uniform", lr, perturbation))
    assert not all(torch.equal(a, b) for a, b in zip(params_of(module), bigger))


@pytest.mark.parametrize("perturbation", ["chunked", "fused"])
def test_listed_block_rates_step_each_block_as_uniform_at_its_factor(perturbation):
    """block_lr=[f_1..f_N]: eta_j = eta f_j, bitwise the uniform step at eta f_j, on the first and last block."""
    lr, factors = 0.05, [0.5, 1.0, 2.0, 1.0, 0.25]
    module = first_block_step("descending", factors, lr, perturbation)
    assert module.block_lr_factors() == factors
    rates = {id(p): g["lr"] for g in module.zo_optimizer.param_groups for p in g["params"]}
    for block, factor in zip(module.blocks(), factors):
        assert all(rates[id(p)] == lr * factor for p in block.params)
    for order, factor in (("ascending", factors[0]), ("descending", factors[-1])):
        stepped = params_of(first_block_step(order, factors, lr, perturbation))
        same = params_of(first_block_step(order, "uniform", lr * factor, perturbation))
        assert all(torch.equal(a, b) for a, b in zip(stepped, same)), order
        unscaled = params_of(first_block_step(order, "uniform", lr, perturbation))
        assert not all(torch.equal(a, b) for a, b in zip(stepped, unscaled)), order


@pytest.mark.parametrize("block_lr, message", [
    ("per-layer", "block_lr"), ([1.0, 0.0, 1.0, 1.0, 1.0], "positive factors"), ([], "positive factors"),
    ([1.0, 1.0], r"one factor per block \(5: embeddings"), ([1.0, float("nan"), 1.0, 1.0, 1.0], "positive factors")])
def test_bad_block_lr_is_refused_in_one_line(block_lr, message):
    with pytest.raises(ValueError, match=message) as err:
        MeZOBCD(deep_mlp(embed_width=32), lr=0.05, block_lr=block_lr)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------ Adam (Alg. 5)
def test_adam_state_has_the_active_blocks_size_and_resets_at_each_interval():
    trace = BlockTrace()
    nu, lr = 3, 0.01
    module = MeZOBCD(deep_mlp(), lr=lr, seed=3, order="ascending", block_optimizer="adam", steps_per_block=nu)
    fit(module, 12, [trace])
    sizes = [b.numel for b in module.blocks()]
    assert trace.blocks == [update_block_idx("ascending", (t - 1) // nu + 1, len(sizes)) for t in range(1, 13)]
    for t, (block, (state, numel)) in enumerate(zip(trace.blocks, trace.adam)):
        assert numel == sizes[block - 1]
        if t % nu:
            assert state is trace.adam[t - 1][0]  # the same state within an interval
        else:
            assert t == 0 or state is not trace.adam[t - 1][0]
            # a fresh state: m_hat = g, v_hat = g^2, so every element moves by lr * |g| / (|g| + eps) ~ lr
            moves = torch.cat([(a - b).abs().flatten() for a, b in zip(trace.after[t], trace.before[t])])
            moved = moves[moves > 0]
            assert moved.numel() == sizes[block - 1]
            torch.testing.assert_close(moved, torch.full_like(moved, lr), rtol=1e-3, atol=1e-6)


# ------------------------------------------------------------------------------ adaptive (Alg. 4)
def test_adaptive_selection_warms_up_in_order_and_updates_only_the_active_score():
    scores = []

    class Scores(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            scores.append(list(module.block_scores))

    trace = BlockTrace()
    module = MeZOBCD(deep_mlp(), lr=0.05, seed=3, selection="adaptive", warmup_steps=5, temperature=0.5)
    fit(module, 30, [trace, Scores()])
    assert trace.blocks[:5] == [1, 2, 3, 4, 5]
    previous = [0.0] * module.num_blocks
    for block, current in zip(trace.blocks, scores):
        assert [i for i, (a, b) in enumerate(zip(previous, current)) if a != b] in ([block - 1], [])
        previous = current
    probabilities = module.block_probabilities()
    assert sum(probabilities) == pytest.approx(1.0) and all(p > 0 for p in probabilities)
    assert softmax_probabilities([0.0, math.log(3.0)], 1.0).tolist() == pytest.approx([0.25, 0.75])


def test_block_state_survives_a_checkpoint(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = MeZOBCD(deep_mlp(), lr=0.05, seed=3, selection="adaptive", warmup_steps=2,
                     block_optimizer="adam", steps_per_block=4)
    trainer = quiet_trainer(max_steps=6, enable_checkpointing=True,
                            callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    trainer.fit(module, poisson_loader(blobs(), 0.25, seed=1))
    loaded = MeZOBCD.load_from_checkpoint(tmp_path / "last.ckpt", backbone=deep_mlp())
    assert loaded.block_scores == module.block_scores and loaded.active_block == module.active_block
    assert [m.shape for m in loaded.adam_state["m"]] == [m.shape for m in module.adam_state["m"]]


# ------------------------------------------------------------------------------ configs
CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs" / "mezo_bcd").glob("*.yaml"))


#: Table 2's OPT-13B files (configs/mezo_bcd/generate.py) differ in task, data and loss: SQuAD, DROP (generation) and
#: COPA (LM-style loss, the choices as candidates) by default, the other classification columns slow
TABLE2_DEFAULT = {"opt-13b_copa_mezo_bcd", "opt-13b_squad_mezo_bcd", "opt-13b_drop_mezo_bcd", "opt-13b_record_mezo_bcd"}


@pytest.mark.parametrize("path", [p if not p.stem.startswith("opt-13b_") or p.stem in TABLE2_DEFAULT
                                  else pytest.param(p, marks=pytest.mark.slow)
                                  for p in CONFIGS if "minilm" not in p.stem], ids=lambda p: p.stem)
def test_paper_config_runs_with_a_tiny_model_of_the_same_family(path, tiny_world, tmp_path, monkeypatch):
    """The OPT/RoBERTa configs with the model and data pointed at tiny ones (tests/test_paper_configs.py)."""
    from lit_zodp.cli import build_cli

    monkeypatch.chdir(tmp_path)
    models, data = tiny_world
    config = yaml.safe_load(path.read_text())
    cli = build_cli(["fit", "--config", str(path), *overrides(config, models, data)])
    generative = config["data"]["class_path"] == "datamodules.QADataModule"  # Table 2's SQuAD/DROP: F1
    assert cli.trainer.global_step == 2 and ("test_f1" if generative else "test_acc") in cli.trainer.callback_metrics
    model = cli.model
    assert isinstance(model, MeZOBCD if "dp_" not in path.stem else DPMeZOBCD)
    assert model.num_blocks == len(model.blocks()) > 2 and model.block_names[0] == "embeddings"
    if model.private:
        assert 0 < model.privacy.ledger.epsilon(model.privacy.delta).upper <= model.privacy.target_epsilon


def test_the_record_config_pads_candidates_trains_lm_style_and_counts_any_gold(tiny_world, tmp_path, monkeypatch):
    """Table 2's ReCoRD column on a tiny OPT: every split padded to the most entities of any example, the LM-style
    loss on the first gold's candidate, and test_acc the share of test examples whose prediction is any gold."""
    from lit_zodp.cli import build_cli

    monkeypatch.chdir(tmp_path)
    models, data = tiny_world
    path = next(p for p in CONFIGS if p.stem == "opt-13b_record_mezo_bcd")
    config = yaml.safe_load(path.read_text())
    cli = build_cli(["fit", "--config", str(path), *overrides(config, models, data), "--data.init_args.num_test", "4"])
    model, dm = cli.model, cli.datamodule
    assert cli.trainer.global_step == 2 and model.backbone.loss == "lm"
    assert dm.num_classes == model.num_classes == 5  # the synthetic passages have 2 to 5 entities
    hits, absent_wins = [], 0
    model.eval()
    with torch.no_grad():
        for inputs, targets in dm.test_dataloader():
            predicted = model(inputs).argmax(1)
            hits += inputs["gold_mask"][torch.arange(len(targets)), predicted].bool().tolist()
            absent_wins += int((inputs["candidate_mask"][torch.arange(len(targets)), predicted].sum(-1) == 0).sum())
    assert len(hits) == 4 and absent_wins == 0
    assert float(cli.trainer.callback_metrics["test_acc"]) == pytest.approx(sum(hits) / len(hits))


def test_the_cpu_direction_cache_changes_no_bit_of_the_trajectory():
    """``cache_direction`` (default on for the chunked engine) only saves draws: same parameters, bitwise."""
    cached = MeZOBCD(deep_mlp(), lr=0.05, seed=3, order="random", perturbation="chunked", num_directions=2)
    plain = MeZOBCD(deep_mlp(), lr=0.05, seed=3, order="random", perturbation="chunked", num_directions=2,
                    cache_direction=False)
    fit(cached, 12)
    fit(plain, 12)
    assert cached.engine.engine.cache is not None and plain.engine.engine.cache is None
    assert cached.engine.engine.cache.numel == max(b.numel for b in cached.blocks())
    for p, q in zip(cached.backbone.parameters(), plain.backbone.parameters()):
        assert torch.equal(p, q)
    fused = MeZOBCD(deep_mlp(), lr=0.05, seed=3, perturbation="fused")
    fit(fused, 1)
    assert not hasattr(fused.engine.engine, "cache")  # the fused engine draws u in registers

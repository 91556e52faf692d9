"""LSTMClassifier (PAZO's IMDB model): nn.LSTM's function from Linear gates, padding-blind rows, exact per-example
gradients through the package's engine, and DP-SGD / DPZero / PAZO-M fits on fabricated IMDB files."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from datamodules import IMDBDataModule
from lit_zodp.algorithms import DPSGD, PAZOM, DPZero
from lit_zodp.backbones import LSTMClassifier
from lit_zodp.errors import ConfigError
from tests.conftest import quiet_trainer
from tests.datamodules.imdb_files import write_amazon, write_imdb
from lit_zodp.per_example import PerExampleGradientEngine, samplers
from tests.per_example.helpers import (assert_grads_match, assert_rel_close, engine_per_example,
                                       flat_clipped_sum, loop_reference)

pytestmark = pytest.mark.filterwarnings("ignore:`(noise|sampling)_seed` is set", "ignore:.*Secure RNG.*",
                                        "ignore:.*Optimal order.*", "ignore:.*validation runs on the test set.*")

LENGTHS = [5, 1, 3, 7, 2]


def tiny(seed=0, **kwargs):
    torch.manual_seed(seed)
    return LSTMClassifier(**(dict(vocab_size=40, embedding_dim=6, hidden_size=5, num_layers=2) | kwargs))


def padded_batch(lengths=LENGTHS, width=None, seed=1):
    """Rows of random ids (>= 2) right-padded with 0 to ``width`` (default: the longest row); row ``i``'s ids are the
    same for every ``width`` and number of rows."""
    width = width or max(lengths)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 40, (len(lengths), 16), generator=generator)[:, :width]
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def nn_lstm_like(model):
    """``nn.LSTM`` holding ``model``'s weights (its two biases: ours and 0)."""
    layers = model.layers
    reference = nn.LSTM(model.embedding.embedding_dim, layers[0].hidden_size, num_layers=len(layers), batch_first=True)
    with torch.no_grad():
        for k, layer in enumerate(layers):
            getattr(reference, f"weight_ih_l{k}").copy_(layer.input.weight)
            getattr(reference, f"weight_hh_l{k}").copy_(layer.hidden.weight)
            getattr(reference, f"bias_ih_l{k}").copy_(layer.input.bias)
            getattr(reference, f"bias_hh_l{k}").zero_()
    return reference


def test_it_equals_nn_lstm_on_the_unpadded_sequences():
    model = tiny()
    inputs = padded_batch()
    packed = nn.utils.rnn.pack_padded_sequence(model.embedding(inputs["input_ids"]), torch.tensor(LENGTHS),
                                               batch_first=True, enforce_sorted=False)
    _, (h, _) = nn_lstm_like(model)(packed)
    torch.testing.assert_close(model(inputs), model.head(h[-1]), rtol=1e-6, atol=1e-6)


def test_a_rows_logits_do_not_depend_on_the_padding_of_its_batch(contract):
    model = tiny().eval()
    inputs = padded_batch()
    alone = torch.cat([model({k: v[i:i + 1, :LENGTHS[i]] for k, v in inputs.items()}) for i in range(len(LENGTHS))])
    wider = padded_batch(width=12)  # the same ids, 5 more padding columns
    with_long_mate = padded_batch(LENGTHS + [12], seed=1)
    for batch in (inputs, wider):  # (to rounding: BLAS may sum a batch of 1 and of 5 rows in other orders)
        torch.testing.assert_close(model(batch), alone, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model(with_long_mate)[:-1], model(padded_batch(width=12, seed=1)), rtol=1e-6, atol=1e-7)
    contract(model, inputs, torch.tensor([0, 1, 1, 0, 1]))


@pytest.mark.parametrize("seed", [1000, 1001, 1003, 1024])
@pytest.mark.parametrize("length", [1, 2])
def test_a_rows_logits_are_bitwise_the_same_at_every_padding_width(seed, length):
    """Bit for bit, the engine's premise for width-independent norm bounds (tests/per_example/test_pe_padding_bounds.py).
    Each step's gates are contiguous: CPU ``torch.sigmoid`` rounds by one formula in its vectorised loop and by another
    in its scalar one, which took the strided ``[B, 4H]`` view of a batch two or more tokens wide when ``4 H`` is under
    two vectors; about 1 init in 7 (4 hidden units) moved a row's logits by an ulp between widths 1, 2 and 8."""
    torch.manual_seed(seed)
    model = LSTMClassifier(30, 2, embedding_dim=8, hidden_size=4, num_layers=1).float().eval()
    ids = torch.randint(2, 30, (6, length), generator=torch.Generator().manual_seed(1))
    logits = []
    for width in (length, length + 1, 8):
        batch = torch.zeros(6, width, dtype=torch.long)
        batch[:, :length] = ids
        logits.append(model({"input_ids": batch, "attention_mask": (batch != 0).long()}))
    assert all(torch.equal(other, logits[0]) for other in logits[1:])


def test_a_padded_step_inside_a_row_carries_the_state():
    model = tiny().eval()
    ids = torch.tensor([[5, 7, 9]])
    holed = model({"input_ids": ids, "attention_mask": torch.tensor([[1, 0, 1]])})
    torch.testing.assert_close(holed, model({"input_ids": torch.tensor([[5, 9]])}))
    empty = model({"input_ids": torch.tensor([[3, 4]]), "attention_mask": torch.zeros(1, 2, dtype=torch.long)})
    torch.testing.assert_close(empty, model.head.bias[None])  # no real token: the zero state


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_per_example_gradients_equal_one_backward_per_example(mode):
    torch.set_default_dtype(torch.float64)
    try:
        model = tiny(dropout=0.0)
        inputs = padded_batch()
        targets = torch.tensor([0, 1, 1, 0, 1])
        got = engine_per_example(model, lambda: F.cross_entropy(model(inputs), targets, reduction="none"), mode=mode)
        want = loop_reference(model, lambda i, m, t: F.cross_entropy(model({"input_ids": i, "attention_mask": m}), t,
                                                                     reduction="sum"),
                              inputs["input_ids"], inputs["attention_mask"], targets)
        assert_grads_match(got, want, rtol=1e-9)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bookkeeping"])
def test_clipped_sums_equal_the_reference_and_each_gate_layer_is_one_product(monkeypatch, mode):
    """The clipped sum (the clip binding some examples) equals flat clipping of one backward per example, in float64.
    Each hidden-to-gates ``Linear``'s per-example gradients are products over its calls' positions (stop 64; before,
    one ``bmm`` per step, added up): in "ghost" and "bookkeeping" one per layer, with every step's rows; in "hooks",
    where they are formed during the backward, one per chunk of calls whose rows reach the weight's size."""
    products = []  # (positions, in, out) of each product
    original = samplers.outer_grads
    monkeypatch.setattr(samplers, "outer_grads",
                        lambda a, g: products.append((a.shape[1], a.shape[2], g.shape[2])) or original(a, g))
    torch.set_default_dtype(torch.float64)
    try:
        model, inputs, targets = tiny(dropout=0.0), padded_batch(), torch.tensor([0, 1, 1, 0, 1])
        engine = PerExampleGradientEngine(model, mode=mode)
        result = engine.clipped_sum(lambda: F.cross_entropy(model(inputs), targets, reduction="none"), 0.75)
        want = loop_reference(model, lambda i, m, t: F.cross_entropy(model({"input_ids": i, "attention_mask": m}), t,
                                                                     reduction="sum"),
                              inputs["input_ids"], inputs["attention_mask"], targets)
        sums, norms = flat_clipped_sum(want, engine.names, 0.75)
        assert engine.last_recomputed == {} and bool((norms > 0.75).any() and (norms < 0.75).any())
        for name, got in zip(engine.names, result.grads):
            assert_rel_close(got, sums[name], rtol=1e-9, name=name)
    finally:
        torch.set_default_dtype(torch.float32)
    steps = inputs["input_ids"].shape[1] - 1  # (each layer's hidden Linear runs at steps 1..L-1)
    hidden = [positions for positions, inputs_, outputs in products  # (not the second layer's input Linear)
              if (inputs_, outputs) == (5, 20) and positions != steps + 1]
    if mode == "hooks":  # chunks of 4 calls: 4 x (5 + 20) row elements, the size of the 20 x 5 weight's gradient
        assert hidden == [4, steps - 4] * len(model.layers), products
    else:  # one product per layer (the input Linear and the head by their own rules, implicit)
        assert products == [(steps, 5, 20)] * len(model.layers), products


def test_bad_options_and_tensor_data_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"`hidden_size` to be a positive int.*\n.*`dropout` in \[0, 1\)"):
        LSTMClassifier(hidden_size=0, dropout=1.0)
    message = tiny().data_mismatch(text=False, example_shape=(1, 8, 8))
    assert "LSTMClassifier reads tokenized text" in message and "(1, 8, 8)" in message
    assert tiny().data_mismatch(text=True, example_shape=None) is None
    assert tiny().token_ids_mismatch(40) is None
    assert "set the backbone's `vocab_size` to 41 or more" in tiny().token_ids_mismatch(41)


@pytest.fixture
def imdb(tmp_path):
    write_imdb(tmp_path)
    write_amazon(tmp_path, rows=40)

    def make(**kwargs):
        return IMDBDataModule(**(dict(data_dir=str(tmp_path), public_samples=16, batch_size=3, max_length=12,
                                      sampling_seed=0) | kwargs))
    return make


def lstm_for(dm, **kwargs):
    return tiny(vocab_size=len(dm.tokenizer), **kwargs)


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_dpsgd_fits_and_its_clipped_sum_is_the_one_example_at_a_time_reference(imdb):
    dm = imdb()
    module = DPSGD(lstm_for(dm), lr=0.5, clip=0.05, noise_multiplier=1.0, noise_seed=0, seed=0)
    before = flat(module.backbone)
    trainer = quiet_trainer(max_steps=3, limit_val_batches=0)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 3 and not torch.equal(flat(module.backbone), before)
    inputs, targets = next(iter(dm.test_dataloader()))
    clipped = module.private_gradient(inputs, targets)
    model = module.backbone
    reference = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(len(targets)):
        row = {k: v[i:i + 1] for k, v in inputs.items()}
        grads = torch.autograd.grad(F.cross_entropy(model(row), targets[i:i + 1]), list(model.parameters()))
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        assert norm == pytest.approx(float(clipped.norms[i]), rel=1e-4)
        reference = [r + min(1.0, 0.05 * (1 - 1e-6) / float(norm)) * g for r, g in zip(reference, grads)]
    assert (clipped.norms > 0.05).all()  # every example clipped: the sum's norm is below B C
    for got, want in zip(clipped.grads, reference):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    assert torch.sqrt(sum(g.pow(2).sum() for g in clipped.grads)) <= 0.05 * len(targets)


def test_a_backbone_embedding_fewer_ids_than_the_vocabulary_is_refused_at_setup(imdb):
    dm = imdb()
    ids = len(dm.tokenizer)
    module = DPSGD(tiny(vocab_size=ids - 1), lr=0.1, clip=1.0, noise_multiplier=1.0, seed=0)
    expected = (rf"Model/data mismatch: .* has {ids} token ids but the backbone LSTMClassifier embeds {ids - 1}: "
                rf"set the backbone's `vocab_size` to {ids}")
    with pytest.raises(ConfigError, match=expected):
        quiet_trainer(max_steps=1).fit(module, datamodule=dm)


@pytest.mark.parametrize("algorithm", ["dpzero", "pazo_m"])
def test_zeroth_order_steps_run_forwards_only_on_private_batches(imdb, algorithm):
    """A DPZero step leaves no gradient on the model; PAZO-M's only gradient is its public batch's."""
    dm = imdb(public_in_step=algorithm == "pazo_m", public_batch_size=4)
    model = lstm_for(dm)
    kwargs = dict(lr=0.01, lam=1e-3, clip=1.0, noise_multiplier=1.0, noise_seed=0, seed=0)
    module = DPZero(model, **kwargs) if algorithm == "dpzero" else PAZOM(model, alpha=0.5, **kwargs)
    forwards_with_grad = []
    model.register_forward_hook(lambda m, i, o: forwards_with_grad.append(torch.is_grad_enabled()))
    before = flat(model)
    trainer = quiet_trainer(max_steps=2, limit_val_batches=0)
    trainer.fit(module, datamodule=dm)
    after = flat(model)
    assert trainer.global_step == 2 and torch.isfinite(after).all() and not torch.equal(after, before)
    grad_forwards = sum(forwards_with_grad)
    assert grad_forwards == (0 if algorithm == "dpzero" else 2)  # PAZO-M: one public backward per step


def test_a_pretrained_transformer_backbone_is_refused_at_setup(imdb):
    from lit_zodp.backbones import HFSequenceClassifier
    from lit_zodp.backbones.huggingface import tiny_bert_config

    module = DPSGD(HFSequenceClassifier(config=tiny_bert_config(), num_classes=2), lr=0.1, clip=1.0,
                   noise_multiplier=1.0, seed=0)
    with pytest.raises(ConfigError, match=r"IMDBDataModule gives word ids of its own vocabulary, which the pretrained "
                                          r"HFSequenceClassifier does not read: use LSTMClassifier"):
        quiet_trainer(max_steps=1).fit(module, datamodule=imdb())


def test_a_table_4_shaped_config_runs_through_the_cli(tmp_path, monkeypatch):
    """PAZO-M on IMDB with the Amazon public sample and the LSTM, as a LightningCLI config (shrunk to 2 steps)."""
    import yaml

    from lit_zodp.cli import build_cli

    write_imdb(tmp_path)
    write_amazon(tmp_path, rows=40)
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 2, "logger": False, "enable_checkpointing": False,
                    "enable_progress_bar": False, "enable_model_summary": False},
        "model": {"class_path": "lit_zodp.algorithms.PAZOM", "init_args": {
            "backbone": {"class_path": "lit_zodp.backbones.LSTMClassifier",
                         "init_args": {"vocab_size": 10_002, "embedding_dim": 8, "hidden_size": 4}},
            "lr": 0.01, "clip": 1.0, "alpha": 0.5, "noise_multiplier": 1.0}},
        "data": {"class_path": "datamodules.IMDBDataModule", "init_args": {
            "data_dir": str(tmp_path), "public_source": "amazon_polarity", "public_samples": 16,
            "vocab_source": "public", "max_length": 290, "batch_size": 3, "public_in_step": True,
            "public_batch_size": 4, "max_eval_samples": 2000}},
    }
    path = tmp_path / "imdb.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    cli = build_cli(["fit", "--config", str(path), "--test_after_fit", "false"])
    assert cli.trainer.global_step == 2 and cli.model.privacy.ledger.total_count == 2
    assert cli.datamodule.n_private == 6 and len(cli.datamodule.public_dataset) == 16

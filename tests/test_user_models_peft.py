"""Hugging Face ``peft`` LoRA models passed as the backbone (review 34); skipped without peft."""

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from torch.utils.data import DataLoader  # noqa: E402

from lit_zodp.algorithms import DPSGD, DPZero  # noqa: E402
from lit_zodp.backbones import per_example_loss  # noqa: E402
from lit_zodp.per_example import PerExampleGradientEngine  # noqa: E402
from lit_zodp.privacy import PoissonBatchSampler  # noqa: E402
from tests.conftest import quiet_trainer  # noqa: E402
from tests.per_example.helpers import assert_rel_close, flat_clipped_sum  # noqa: E402

PRIVACY = dict(clip=1.0, noise_multiplier=1.0, delta=1e-5, seed=0)


def lora_bert(lora_dropout=0.0, seed=0, nonzero_b=True):
    """A tiny random BERT classifier with LoRA on its attention and dense maps (peft freezes the rest, and trains a
    copy of the classifier: ``modules_to_save``)."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32, num_labels=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = peft.get_peft_model(transformers.BertForSequenceClassification(config), peft.LoraConfig(
        task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["query", "value", "dense"], lora_dropout=lora_dropout))
    if nonzero_b:  # (B = 0 at init: A's gradients would all be 0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.3)
    return model


def two_word_task(n=256, seed=0):
    """Rows of 3-8 tokens: label 1 from ids 4..26, label 0 from ids 27..49 (0 pads)."""
    g = torch.Generator().manual_seed(seed)
    rows, labels = [], []
    for _ in range(n):
        length, label = int(torch.randint(3, 9, (1,), generator=g)), int(torch.rand(1, generator=g) < 0.5)
        rows.append(torch.randint(4, 27, (length,), generator=g) + (0 if label else 23))
        labels.append(label)
    return rows, torch.tensor(labels)


def padded(rows, labels, index):
    ids = torch.zeros(len(index), max([len(rows[i]) for i in index], default=1), dtype=torch.long)
    for r, i in enumerate(index):
        ids[r, :len(rows[i])] = rows[i]
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}, labels[list(index)]


def loader(rows, labels, q, seed=None):
    return DataLoader(list(range(len(rows))), batch_sampler=PoissonBatchSampler(len(rows), q, seed=seed),
                      collate_fn=lambda index: padded(rows, labels, index))


@pytest.mark.parametrize("lora_dropout", [0.0, 0.3])
@pytest.mark.parametrize("mode", ["hooks", "ghost", "bookkeeping"])
def test_lora_clipped_sums_equal_one_backward_per_example_with_the_same_dropout(mode, lora_dropout):
    model = lora_bert(lora_dropout).double().train()
    inputs, targets = padded(*two_word_task(n=8), range(8))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all("lora_" in n or "modules_to_save" in n for n in names)

    def losses():
        torch.manual_seed(5)  # (the same dropout masks in the engine's forward and the reference's)
        return per_example_loss(model, inputs, targets)

    batch = losses()
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.autograd.grad(batch[i], params, retain_graph=True) for i in range(len(batch))]
    reference = {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(names)}
    clip = float(flat_clipped_sum(reference, names, float("inf"))[1].median())  # (about half the rows clipped)
    sums, norms = flat_clipped_sum(reference, names, clip)
    engine = PerExampleGradientEngine(model, mode=mode)
    assert engine.names == names
    out = engine.clipped_sum(losses, clip=clip)
    assert 0 < int((norms > clip).sum()) < len(norms) and not engine.last_recomputed
    for name, got in zip(names, out.grads):
        assert_rel_close(got, sums[name], 1e-9, name)
    torch.testing.assert_close(out.norms.double(), norms, rtol=1e-6, atol=0)


def test_zeroth_order_steps_perturb_and_move_exactly_the_lora_parameters():
    model = lora_bert()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    module = DPZero(model, lr=0.05, **PRIVACY)
    quiet_trainer(max_steps=2).fit(module, loader(*two_word_task(n=64), 0.25))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert [id(p) for p in module.engine.params] == [id(p) for p in model.parameters() if p.requires_grad]
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]) != (name in trainable), name


def test_a_private_lora_fit_learns():
    rows, labels = two_word_task()
    model = lora_bert(lora_dropout=0.0, nonzero_b=False)  # (dropout is drawn from secret states: not reproducible)
    every = padded(rows, labels, range(len(rows)))

    def mean_loss():
        model.eval()
        with torch.no_grad():
            return float(per_example_loss(model, *every).mean())

    start = mean_loss()
    with pytest.warns(UserWarning, match="noise_seed"):  # (test seeds: the noise and the batches are reproducible)
        quiet_trainer(max_steps=80).fit(DPSGD(model, lr=0.5, noise_seed=0, **PRIVACY), loader(rows, labels, 0.5, seed=0))
    end = mean_loss()
    assert start > 0.69 and end < 0.675, end

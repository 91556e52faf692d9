"""A word-level LSTM classifier trained from scratch: PAZO's IMDB model (Gong & Li, App. C.1 and Table 4; the
authors' code, after adadps: embedding 128, 2 layers of 64 hidden units, the last hidden state to the classes).

The recurrence is written with ``nn.Linear`` gate layers, not ``nn.LSTM``, as Opacus' ``DPLSTM`` is: ``nn.LSTM``'s
fused kernel has no per-example rule, while the package's per-example gradient engine
(:mod:`lit_zodp.per_example`) has one for ``nn.Linear`` and ``nn.Embedding`` and sums the per-example gradients of a
layer over all its calls (the hidden-to-gates layer is called once per time step), so DP-SGD's per-example
gradients are exact. The gates follow PyTorch's ``nn.LSTM`` (order i, f, g, o)::

    i = sigmoid(W_ii x_t + b_i + W_hi h), f = sigmoid(W_if x_t + b_f + W_hf h),
    g = tanh(W_ig x_t + b_g + W_hg h),    o = sigmoid(W_io x_t + b_o + W_ho h),
    c' = f * c + i * g,                   h' = o * tanh(c')

with one bias per gate (``nn.LSTM``'s ``b_ih + b_hh``) on the input layer.

Mask-aware: at a step whose ``attention_mask`` is 0 the state ``(h, c)`` is carried unchanged, and the classifier
reads the last layer's final state, which is therefore the state at each row's last real token. A row's logits do
not depend on its batch-mates' lengths (the padding of its batch), as the privacy contract requires of a forward.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import torch
from torch import Tensor, nn

from lit_zodp.backbones.base import Backbone, text_backbone_mismatch
from lit_zodp.errors import check_positive_int, raise_if_any


class LSTMLayer(nn.Module):
    """One LSTM layer from two ``nn.Linear`` gate layers: ``input`` (``in -> 4H``, with the gates' bias) applied to
    all time steps in one call, ``hidden`` (``H -> 4H``, no bias) once per step."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.input = nn.Linear(input_size, 4 * hidden_size)
        self.hidden = nn.Linear(hidden_size, 4 * hidden_size, bias=False)
        bound = 1.0 / math.sqrt(hidden_size)  # nn.LSTM's initialization
        for parameter in self.parameters():
            nn.init.uniform_(parameter, -bound, bound)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """Hidden states ``[B, L, H]`` of ``x`` ``[B, L, in]``; where ``mask`` ``[B, L]`` is 0 the state is carried.

        Each step's input gates are a contiguous ``[B, 4H]``, whatever ``L``: CPU ``torch.sigmoid`` rounds by one
        formula in its vectorised loop and another in its scalar one, which took the strided step of a batch two or
        more tokens wide where ``4 H`` is under two vectors, so a row's logits moved by an ulp with its batch's padded
        width (the per-example bounds with them; docs/privacy.md, stop 53)."""
        batch, length, _ = x.shape
        gates_of_inputs = self.input(x).transpose(0, 1).contiguous().unbind(0)  # (contiguous: see above)
        keeps = mask.to(torch.bool).unsqueeze(-1).unbind(1)
        h = x.new_zeros(batch, self.hidden_size, dtype=gates_of_inputs[0].dtype if length else x.dtype)
        c = torch.zeros_like(h)
        states = []
        for t in range(length):
            gates = gates_of_inputs[t] if t == 0 else gates_of_inputs[t] + self.hidden(h)
            h_next, c_next = lstm_cell(gates, c)
            h = torch.where(keeps[t], h_next, h)
            c = torch.where(keeps[t], c_next, c)
            states.append(h)
        return torch.stack(states, 1) if states else x.new_zeros(batch, 0, self.hidden_size)


def lstm_cell(gates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``(h', c')`` from the pre-activations ``[B, 4H]`` (PyTorch's order i, f, g, o) and the cell ``c``: one sigmoid
    over all gates (the ``g`` quarter unused) and one tanh of ``g``, fewer kernels per step."""
    size = gates.shape[-1] // 4
    i, f, _, o = torch.sigmoid(gates).chunk(4, dim=-1)
    c_next = f * c + i * torch.tanh(gates[..., 2 * size:3 * size])
    return o * torch.tanh(c_next), c_next


class LSTMClassifier(Backbone):
    """Embedding, a stack of :class:`LSTMLayer`, and a linear head on the last layer's state at each row's last real
    token. Reads ``{"input_ids", "attention_mask"}`` ``[B, L]`` (e.g. :class:`~datamodules.imdb.IMDBDataModule`).

    Args:
        vocab_size: token ids embedded (rows of the embedding table): the data's vocabulary with its special tokens
            (:class:`~datamodules.imdb.IMDBDataModule`: ``vocab_size`` words + ``<pad>``, ``<unk>`` = 10,002);
            a data module with more ids is refused at setup.
        num_classes: classes of the head.
        embedding_dim: size of the word embeddings (App. C.1's code: 128).
        hidden_size: units per LSTM layer (64).
        num_layers: stacked layers (2).
        dropout: dropout on the outputs of every layer but the last (as ``nn.LSTM``'s), in [0, 1).
    """

    def __init__(self, vocab_size: int = 10_002, num_classes: int = 2, embedding_dim: int = 128,
                 hidden_size: int = 64, num_layers: int = 2, dropout: float = 0.0) -> None:
        raise_if_any([
            check_positive_int("vocab_size", vocab_size),
            check_positive_int("num_classes", num_classes),
            check_positive_int("embedding_dim", embedding_dim),
            check_positive_int("hidden_size", hidden_size),
            check_positive_int("num_layers", num_layers),
            None if isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and 0 <= dropout < 1 else
            f"Expected `dropout` in [0, 1), but got {dropout!r}",
        ])
        super().__init__()
        self.vocab_size = vocab_size
        self.num_classes = num_classes
        self.embedding = nn.Embedding(vocab_size, embedding_dim)
        sizes = [embedding_dim] + [hidden_size] * num_layers
        self.layers = nn.ModuleList(LSTMLayer(sizes[k], hidden_size) for k in range(num_layers))
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(hidden_size, num_classes)

    def forward(self, inputs: Mapping[str, Tensor]) -> Tensor:
        """Logits ``[B, num_classes]``."""
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        x = self.embedding(ids)
        for k, layer in enumerate(self.layers):
            x = layer(self.dropout(x) if k > 0 else x, mask)
        last = x[:, -1] if x.shape[1] else x.new_zeros(x.shape[0], self.head.in_features)
        return self.head(last)

    def data_mismatch(self, *, text: bool, example_shape: Optional[tuple[int, ...]]) -> Optional[str]:
        return text_backbone_mismatch(self, text, example_shape)

    def token_ids_mismatch(self, count: int) -> Optional[str]:
        """Why this model cannot embed ``count`` token ids, or ``None`` (read by the data module at setup)."""
        if count <= self.vocab_size:
            return None
        return (f"the data's vocabulary has {count} token ids but the backbone {type(self).__name__} embeds "
                f"{self.vocab_size}: set the backbone's `vocab_size` to {count} or more")


__all__ = ["LSTMClassifier", "LSTMLayer", "lstm_cell"]

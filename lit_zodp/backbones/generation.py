"""Generative question answering with a causal LM: MeZO's SQuAD and DROP setting (DPZero Table 5).

Training scores the gold answer as the single candidate of :class:`~lit_zodp.backbones.HFCandidateScorer`
(``loss="lm"``): each example's loss is the mean negative log-likelihood of its answer tokens
``" <answer>\\n"`` given the prompt. DPZero's code reduces per example this way
(``forward_wrap_with_option_len_dpzero``: the masked token losses summed over the row and divided by its
answer length) before it clips each example's loss difference; MeZO averages over all answer tokens of
the batch, which has no per-example form.

Evaluation generates: greedy decoding from the prompt (the tokens before the answer) for at most
``max_new_tokens`` tokens, stopping at a newline or the end-of-sequence token, and scores the stripped text
against every gold answer with SQuAD's token F1 (the maximum over the golds; :func:`answer_f1`) and exact
match. Both MeZO and DPZero report F1 this way for SQuAD and DROP (DROP's answer spans are scored one by one,
not with DROP's multi-span metric).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor
from torchmetrics import Metric

from lit_zodp.backbones.huggingface import HFCandidateScorer, _text_config
from lit_zodp.backbones.metrics import MeanLoss, MeanScore
from lit_zodp.errors import ConfigError, check_positive_int

#: the inputs key of the gold answers' token ids ``[B, A, La]`` (padded with :data:`NO_TOKEN`), on evaluation batches
ANSWER_IDS = "answer_ids"
NO_TOKEN = -1

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalization (its ``evaluate-v1.1.py``, as MeZO's ``metrics.py``): lower case, punctuation
    removed, the articles a/an/the removed, whitespace collapsed."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD's token F1 of two answers: the harmonic mean of the precision and recall of the normalized
    answers' shared words (a bag: repeated words count as often as both hold them); 0 when none is shared."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(gold).split()
    shared = sum((Counter(predicted) & Counter(expected)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(predicted), shared / len(expected)
    return 2 * precision * recall / (precision + recall)


#: first gold answers that MeZO's F1 scores by exact match instead (its ``metrics.py``: QuAC's and SQuAD 2.0's
#: unanswerable marks)
NO_ANSWER_MARKS = ("CANNOTANSWER", "no answer")


def answer_f1(prediction: str, golds: Sequence[str]) -> float:
    """The best :func:`token_f1` of ``prediction`` over the gold answers (SQuAD and MeZO); as MeZO, when the first
    gold is an unanswerable mark (:data:`NO_ANSWER_MARKS`), 1 if the prediction normalizes to it, else 0."""
    if golds and golds[0] in NO_ANSWER_MARKS:
        return float(normalize_answer(prediction) == normalize_answer(golds[0]))
    return max((token_f1(prediction, gold) for gold in golds), default=0.0)


def answer_exact_match(prediction: str, golds: Sequence[str]) -> float:
    """1 when the normalized prediction equals a normalized gold answer, else 0."""
    predicted = normalize_answer(prediction)
    return float(any(predicted == normalize_answer(gold) for gold in golds))


class HFAnswerGenerator(HFCandidateScorer):
    """A causal LM that answers questions by generating text (MeZO/DPZero's SQuAD and DROP; DPZero Table 5).

    Batches come from :class:`datamodules.QADataModule`: ``input_ids``, ``attention_mask`` and
    ``candidate_mask`` ``[B, 1, L]`` (the prompt followed by the first gold answer, which trains), and on
    evaluation batches also :data:`ANSWER_IDS` ``[B, A, La]``, the token ids of all gold answers.

    * Training: the per-example loss is the mean NLL of the answer's tokens (``loss="lm"``,
      ``length_normalize``; see the module docs).
    * Validation and test log ``loss`` (the same mean NLL), ``f1`` and ``em`` (fractions, the paper's
      percentages / 100) of greedily generated answers.

    Args:
        model_name_or_path: Hub id or local directory of a causal LM.
        max_new_tokens: the most tokens generated per answer (MeZO: 50); the prompt is cut from the left when
            prompt and answer would pass the model's positions.
        stop_at_newline: stop generating at a newline token as well as at the end-of-sequence token (MeZO's
            ``eos_token_id=[newline, eos]``; its prompts end each answer with a newline).
        generation_batch_size: rows generated at once (``None``: the whole evaluation batch).
        **kwargs: :class:`~lit_zodp.backbones.HFCandidateScorer` arguments (``dtype``, ``from_config``,
            ``config``, ``lora``, ``max_rows_per_forward``...).
    """

    def __init__(
        self,
        model_name_or_path: Optional[str] = None,
        max_new_tokens: int = 50,
        stop_at_newline: bool = True,
        generation_batch_size: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        for fixed in ("loss", "num_classes", "length_normalize"):
            if fixed in kwargs:
                raise ConfigError(f"`{fixed}` is fixed for HFAnswerGenerator (the mean NLL of the one gold answer)")
        check = [check_positive_int("max_new_tokens", max_new_tokens)]
        if generation_batch_size is not None:
            check.append(check_positive_int("generation_batch_size", generation_batch_size))
        for error in check:
            if error:
                raise ConfigError(error)
        _refuse_masked_lm(model_name_or_path, kwargs.get("config"), kwargs.get("config_overrides"))
        super().__init__(model_name_or_path, num_classes=1, loss="lm", length_normalize=True, **kwargs)
        self.max_new_tokens = int(max_new_tokens)
        self.stop_at_newline = bool(stop_at_newline)
        self.generation_batch_size = generation_batch_size
        self._tokenizer: Any = None
        room = self._max_positions()
        if room is not None and self.max_new_tokens > room - 2:
            raise ConfigError(f"HFAnswerGenerator `max_new_tokens`: {self.max_new_tokens} leaves no prompt token in the "
                              f"model's {room} positions (the BOS, one prompt token and the answer): at most {room - 2}")

    # ------------------------------------------------------------------------------ evaluation
    def evaluation_metrics(self) -> dict[str, Metric]:
        """``loss`` (mean answer NLL, as training), ``f1`` and ``em`` of the generated answers."""
        return {"loss": MeanLoss(), "f1": MeanScore(), "em": MeanScore()}

    @torch.no_grad()
    def update_evaluation(self, metrics: Mapping[str, Metric], inputs: Mapping[str, Tensor], targets: Tensor) -> None:
        if ANSWER_IDS not in inputs:
            raise ValueError(f"evaluation batches need `{ANSWER_IDS}` (the gold answers): use QADataModule")
        metrics["loss"].update(self.per_example_loss(inputs, targets))
        predictions = self.generate_answers(inputs)
        golds = self.gold_answers(inputs[ANSWER_IDS])
        device = metrics["f1"].total.device
        metrics["f1"].update(torch.tensor([answer_f1(p, g) for p, g in zip(predictions, golds)], device=device))
        metrics["em"].update(torch.tensor([answer_exact_match(p, g) for p, g in zip(predictions, golds)],
                                          device=device))

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (loaded on first use) to decode answers."""
        if self._tokenizer is None:
            self._tokenizer = self.load_tokenizer()
        return self._tokenizer

    def gold_answers(self, answer_ids: Tensor) -> list[list[str]]:
        """The gold answers of each example as text (:data:`ANSWER_IDS` decoded; empty rows skipped)."""
        golds = []
        for example in answer_ids.tolist():
            texts = [self.tokenizer.decode([t for t in row if t != NO_TOKEN], clean_up_tokenization_spaces=False)
                     for row in example]  # (the text as tokenized: a clean-up would turn "do n't" into "don't")
            golds.append([text.strip() for text, row in zip(texts, example) if any(t != NO_TOKEN for t in row)])
        return golds

    def prompts(self, inputs: Mapping[str, Tensor]) -> list[list[int]]:
        """Each example's prompt tokens: its row before the answer (the first candidate token)."""
        ids, candidates = inputs["input_ids"][:, 0], inputs["candidate_mask"][:, 0].bool()
        starts = torch.where(candidates.any(1), candidates.int().argmax(1), candidates.shape[1])
        return [row[:start] for row, start in zip(ids.tolist(), starts.tolist())]

    def generate_answers(self, inputs: Mapping[str, Tensor]) -> list[str]:
        """Greedy answers to each example's prompt, decoded and stripped (MeZO: ``decode(...).strip()``)."""
        prompts = self.prompts(inputs)
        step = self.generation_batch_size or max(len(prompts), 1)
        answers: list[str] = []
        for i in range(0, len(prompts), step):
            answers.extend(self._generate(prompts[i : i + step]))
        return answers

    def _generate(self, prompts: list[list[int]]) -> list[str]:
        room = self._max_positions()
        if room is not None:
            prompts = [p if len(p) + self.max_new_tokens <= room else p[:1] + p[len(p) - room + self.max_new_tokens + 1:]
                       for p in prompts]  # left truncation keeping the first (BOS) token, as MeZO's encoding
        pad = self.model.config.pad_token_id
        width = max(len(p) for p in prompts)
        device = self.model.device
        ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
        mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):  # left padding: generation continues every row at the last column
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long, device=device)
            mask[row, width - len(prompt):] = 1
        stops = self.stop_token_ids()
        was_training = self.model.training
        self.model.eval()
        try:
            output = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=self.max_new_tokens,
                                         do_sample=False, num_beams=1, eos_token_id=stops, pad_token_id=pad)
        finally:
            self.model.train(was_training)
        answers = []
        for row in output[:, width:].tolist():
            cut = next((j for j, token in enumerate(row) if token in stops), len(row))
            answers.append(self.decode_answer(row[:cut]))
        return answers

    def decode_answer(self, tokens: Sequence[int]) -> str:
        """Generated tokens as MeZO's answer: decoded without special tokens, with the tokenization-space clean-up
        that its Transformers (4.28) applied by default (``" 's"`` -> ``"'s"``, ``" ."`` -> ``"."``; Transformers 5
        no longer does, which changes F1 where the model spaces them), and stripped."""
        text = self.tokenizer.decode(list(tokens), skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return self.tokenizer.clean_up_tokenization(text).strip()

    def stop_token_ids(self) -> list[int]:
        """End-of-sequence, and with ``stop_at_newline`` the newline's last token (MeZO's stop tokens)."""
        stops = [] if self.model.config.eos_token_id is None else [int(self.model.config.eos_token_id)]
        if self.stop_at_newline:
            newline = self.tokenizer.encode("\n", add_special_tokens=False)
            if newline:
                stops.append(int(newline[-1]))
        if not stops:
            raise ConfigError("the model has no eos_token_id and stop_at_newline is off: generation would never stop")
        return stops

    def _max_positions(self) -> Optional[int]:
        return getattr(_text_config(self.model.config), "max_position_embeddings", None)


def _refuse_masked_lm(path: Optional[str], config: Any, overrides: Any) -> None:
    """Refuse a masked LM (BERT, RoBERTa) before its weights load: Transformers would load it as a causal LM
    (``BertLMHeadModel``) that generates nothing sensible and, without an end-of-sequence token, fails only at the
    first validation."""
    from lit_zodp.backbones.huggingface import _lm_type

    if _lm_type("auto", path, config, overrides) == "mlm":
        raise ConfigError(f"HFAnswerGenerator `model_name_or_path`: {path or 'the config'} is a masked LM; answers "
                          "are generated by a causal LM (OPT, GPT-2, Llama...)")


__all__ = [
    "ANSWER_IDS",
    "HFAnswerGenerator",
    "NO_ANSWER_MARKS",
    "NO_TOKEN",
    "answer_exact_match",
    "answer_f1",
    "normalize_answer",
    "token_f1",
]

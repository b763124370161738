"""Pooling models: which task a model serves (generate, embed, rerank), how its hidden states become one
vector per prompt, and the pair prompts of rerankers.

The task and the pooling come from the model's own files, the way sentence-transformers reads them:
`modules.json` (a Pooling module, a Normalize module), `1_Pooling/config.json` (mean / CLS / last token),
`sentence_bert_config.json` (the sequence length the model was trained for); from the architecture
(`BertForSequenceClassification` is a cross-encoder, `Qwen3Model` a headless embedder); from a GGUF's
`{arch}.pooling_type`; or from the task given for the model (`--task NAME=embed`). A decoder given the
rerank task scores with its yes/no logits on the last token (Qwen3-Reranker style).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch
import torch.nn.functional as F

from wllm.model.config import ModelConfig
from wllm.model.loader.errors import ModelLoadError
from wllm.pooling_params import PoolingParams

TASKS = ("generate", "embed", "rerank")
Task = Literal["generate", "embed", "rerank"]

# Headless decoders (checkpoints saved from the base model, without an LM head): embedders.
_EMBED_ARCHITECTURES = frozenset(
    {"BertModel", "BertForMaskedLM", "BertForPreTraining", "Qwen2Model", "Qwen3Model", "LlamaModel"}
)
_CLASSIFY_ARCHITECTURES = frozenset({"BertForSequenceClassification"})
_ST_MODULES = "sentence_transformers.models."

# Qwen3-Reranker's published prompt format: the model answers "yes" or "no" after it.
YES_NO_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
    'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
YES_NO_BODY = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
YES_NO_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
YES_NO_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class PoolingConfig(msgspec.Struct, kw_only=True):
    """How a pooling model turns a prompt into its output; crosses the engine-process boundary."""

    task: Literal["embed", "rerank"]
    pooling: Literal["mean", "cls", "last"]
    normalize: bool
    head: Literal["none", "classify", "yes_no"] = "none"
    activation: Literal["sigmoid", "identity"] = "sigmoid"  # of a classify head's single logit
    yes_no_ids: tuple[int, int] | None = None  # (yes, no) token ids of a yes/no reranker
    dimension: int = 0  # size of an embedding
    # Matryoshka: None = `dimensions` not allowed; [] = any size up to `dimension`; else the sizes allowed.
    matryoshka: list[int] | None = None
    max_seq_len: int | None = None  # the length the model was trained for (sentence_bert_config.json)

    @property
    def pairs_as_one_prompt(self) -> bool:
        """Rerank by running query and document together (cross-encoder, yes/no) rather than comparing the
        embeddings of each (an embed model)."""
        return self.task == "rerank"


def task_of(pooling: PoolingConfig | None) -> Task:
    return "generate" if pooling is None else pooling.task


def resolve_pooling(
    config: ModelConfig,
    path: Path | None,
    tokenizer: Any | None,
    task: str = "auto",
) -> PoolingConfig | None:
    """The model's pooling (None: a generative model). `task` "auto" detects it from the files and the
    architecture; "generate", "embed" or "rerank" says it. Raises ModelLoadError for what cannot work."""
    if task not in ("auto", *TASKS):
        raise ModelLoadError(f"unknown task {task!r}; supported: auto, {', '.join(TASKS)}")
    where = path or config.architecture
    arch = config.architecture
    raw = config.raw
    st = _sentence_transformers(path) if path is not None and path.is_dir() else None
    gguf_pooling = raw.get("pooling_type") if isinstance(raw.get("pooling_type"), str) else None
    if task == "auto":
        if arch in _CLASSIFY_ARCHITECTURES:
            task = "rerank"
        elif arch in _EMBED_ARCHITECTURES or st is not None or gguf_pooling in ("mean", "cls", "last"):
            task = "embed"
        elif gguf_pooling == "rank":
            task = "rerank"
        else:
            return None
    if task == "generate":
        if arch in _EMBED_ARCHITECTURES or arch in _CLASSIFY_ARCHITECTURES:
            raise ModelLoadError(
                f"{where}: {arch} has no language-model head, so it cannot generate; "
                "its tasks: embed" + (", rerank" if arch in _CLASSIFY_ARCHITECTURES else "")
            )
        return None
    causal = config.model_type != "bert"
    matryoshka = _matryoshka(raw)
    max_seq = st.get("max_seq_length") if st else None
    if task == "rerank" and arch in _CLASSIFY_ARCHITECTURES:
        labels = _num_labels(raw)
        if labels != 1:
            raise ModelLoadError(f"{where}: a cross-encoder for rerank needs one output label, this one has {labels}")
        return PoolingConfig(
            task="rerank",
            pooling="cls",
            normalize=False,
            head="classify",
            activation=_activation(raw),
            dimension=1,
            max_seq_len=max_seq,
        )
    if task == "rerank":
        if not causal:
            raise ModelLoadError(
                f"{where}: {arch} has no classification head, so it cannot rerank on its own; "
                "serve it as an embed model (rerank and score then compare embeddings)"
            )
        if tokenizer is None:
            raise ModelLoadError(f"{where}: a yes/no reranker needs its tokenizer to find the 'yes' and 'no' tokens")
        ids = [_single_token(tokenizer, word, where) for word in ("yes", "no")]
        return PoolingConfig(
            task="rerank", pooling="last", normalize=False, head="yes_no", yes_no_ids=(ids[0], ids[1]), dimension=1
        )
    if arch in _CLASSIFY_ARCHITECTURES:
        raise ModelLoadError(f"{where}: {arch} is a cross-encoder; its task is rerank, not embed")
    # embed
    if st is not None:
        pooling, normalize = st["pooling"], st["normalize"]
    elif gguf_pooling in ("mean", "cls", "last"):
        pooling, normalize = gguf_pooling, True
    elif causal:
        pooling, normalize = "last", True  # Qwen3-Embedding / gte-Qwen2 style
    else:
        pooling, normalize = "mean", False  # what sentence-transformers does with a plain encoder
    return PoolingConfig(
        task="embed",
        pooling=pooling,
        normalize=normalize,
        dimension=config.hidden_size,
        matryoshka=matryoshka,
        max_seq_len=max_seq,
    )


def _sentence_transformers(folder: Path) -> dict[str, Any] | None:
    """Pooling, normalisation and sequence length from a sentence-transformers folder (None without one)."""
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return None
    modules = _json(modules_path)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_path}: expected a list of modules")
    pooling: str | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).removeprefix(_ST_MODULES) if isinstance(module, dict) else ""
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pooling = _st_pooling(folder / str(module.get("path", "")) / "config.json")
        else:
            raise ModelLoadError(
                f"{modules_path}: sentence-transformers module {kind or module!r} is not supported "
                "(supported: Transformer, Pooling, Normalize)"
            )
    if pooling is None:
        raise ModelLoadError(f"{modules_path}: no Pooling module")
    out: dict[str, Any] = {"pooling": pooling, "normalize": normalize}
    bert_cfg = folder / "sentence_bert_config.json"
    if bert_cfg.is_file():
        length = _json(bert_cfg).get("max_seq_length")
        if isinstance(length, int) and length > 0:
            out["max_seq_length"] = length
    return out


def _st_pooling(path: Path) -> str:
    cfg = _json(path)
    modes = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
    chosen = [mode for key, mode in modes.items() if cfg.get(key)]
    others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in modes]
    if others or len(chosen) != 1:
        raise ModelLoadError(
            f"{path}: pooling {', '.join(others + chosen) or 'none'} is not supported "
            "(exactly one of CLS, mean or last-token pooling)"
        )
    if cfg.get("include_prompt") is False:
        raise ModelLoadError(f"{path}: include_prompt=false (pooling without the instruction) is not supported")
    return chosen[0]


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None


def _num_labels(raw: dict[str, Any]) -> int:
    if isinstance(raw.get("num_labels"), int):
        return raw["num_labels"]
    labels = raw.get("id2label")
    return len(labels) if isinstance(labels, dict) and labels else 2


def _activation(raw: dict[str, Any]) -> Literal["sigmoid", "identity"]:
    # sentence-transformers' CrossEncoder stores its activation in config.json; its default for one label
    # is the sigmoid.
    st = raw.get("sentence_transformers") if isinstance(raw.get("sentence_transformers"), dict) else {}
    name = str(st.get("activation_fn") or raw.get("sbert_ce_default_activation_function") or "Sigmoid")
    return "identity" if name.rsplit(".", 1)[-1] == "Identity" else "sigmoid"


def _matryoshka(raw: dict[str, Any]) -> list[int] | None:
    dims = raw.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims:
        return sorted(int(d) for d in dims)
    return [] if raw.get("is_matryoshka") else None


def _single_token(tokenizer: Any, word: str, where: object) -> int:
    ids = tokenizer.encode(word, add_special_tokens=False)
    if len(ids) != 1:
        raise ModelLoadError(
            f"{where}: {word!r} is not a single token of this tokenizer, so it cannot be a yes/no reranker"
        )
    return int(ids[0])


def check_dimensions(pooling: PoolingConfig, dimensions: int | None) -> str | None:
    """Why `dimensions` cannot be served by this model (None: it can)."""
    if dimensions is None:
        return None
    if pooling.task != "embed":
        return "dimensions applies to embeddings only"
    if pooling.matryoshka is None:
        if dimensions == pooling.dimension:
            return None
        return (
            f"this model does not support matryoshka (truncated) embeddings; its embeddings have "
            f"{pooling.dimension} dimensions"
        )
    allowed = pooling.matryoshka
    if not 1 <= dimensions <= pooling.dimension or (allowed and dimensions not in allowed):
        sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {pooling.dimension}"
        return f"dimensions must be one of {sizes}, got {dimensions}"
    return None


# ------------------------------------------------------------------------------------------------ inputs
def trailing_specials(ids: Sequence[int], special_ids: frozenset[int]) -> int:
    """How many ids at the end are special tokens ([SEP], <|endoftext|>): truncation keeps them."""
    n = 0
    while n < len(ids) and ids[len(ids) - 1 - n] in special_ids:
        n += 1
    return n


def truncate_ids(ids: list[int], limit: int, special_ids: frozenset[int]) -> list[int]:
    """The first `limit` tokens, keeping the trailing special tokens, as a tokenizer's truncation does."""
    if len(ids) <= limit:
        return ids
    keep = min(trailing_specials(ids, special_ids), max(limit - 1, 0))
    return ids[: limit - keep] + (ids[len(ids) - keep :] if keep else [])


def pair_prompt(tokenizer: Any, pooling: PoolingConfig, query: str, document: str) -> tuple[list[int], int]:
    """The token ids of one (query, document) pair for a model that scores pairs, and the index where the
    document's token type starts (-1: no token types)."""
    if pooling.head == "yes_no":
        text = (
            YES_NO_PREFIX
            + YES_NO_BODY.format(instruction=YES_NO_INSTRUCTION, query=query, document=document)
            + YES_NO_SUFFIX
        )
        return tokenizer.encode(text, add_special_tokens=False), -1
    return tokenizer.encode_pair(query, document)


def truncate_pair(ids: list[int], type_start: int, limit: int, special_ids: frozenset[int]) -> list[int]:
    """A pair prompt cut to `limit` tokens from the end of its document (its trailing specials kept)."""
    if len(ids) <= limit:
        return ids
    keep = trailing_specials(ids, special_ids)
    if type_start >= 0 and limit - keep <= type_start:
        raise ValueError(f"the query alone takes {type_start} tokens; it cannot be truncated to {limit}")
    return ids[: limit - keep] + (ids[len(ids) - keep :] if keep else [])


# ------------------------------------------------------------------------------------------------ pooling
@torch.inference_mode()
def pool(
    model: Any,
    pooling: PoolingConfig,
    hidden: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    params: Sequence[PoolingParams],
) -> list[list[float]]:
    """One output per span (start token, length) of `hidden` [T, H]: the embedding, or the relevance score."""
    if not spans:
        return []
    if pooling.pooling == "mean":
        rows = torch.stack([hidden[s : s + n].float().mean(0) for s, n in spans])
    else:
        index = [s if pooling.pooling == "cls" else s + n - 1 for s, n in spans]
        rows = hidden[torch.tensor(index, device=hidden.device)]
    if pooling.head == "classify":
        logits = model.classify(rows.to(hidden.dtype)).float()[:, 0]
        scores = torch.sigmoid(logits) if pooling.activation == "sigmoid" else logits
        return [[v] for v in scores.tolist()]
    if pooling.head == "yes_no":
        assert pooling.yes_no_ids is not None
        logits = model.compute_logits(rows.to(hidden.dtype))[:, list(pooling.yes_no_ids)]
        # P(yes) of the softmax over the two answers.
        return [[v] for v in torch.sigmoid(logits[:, 0] - logits[:, 1]).tolist()]
    rows = rows.float()
    out: list[list[float]] = []
    if all(p.dimensions is None for p in params):
        if pooling.normalize:
            rows = F.normalize(rows, dim=-1)
        return rows.tolist()
    for row, p in zip(rows, params):
        if p.dimensions is not None:
            row = row[: p.dimensions]
        if pooling.normalize:
            row = F.normalize(row, dim=-1)
        out.append(row.tolist())
    return out


class InputTooLongError(ValueError):
    """A pooling input has more tokens than the model takes and no truncation was asked for."""


def _limit(max_len: int, truncate: int | None) -> int:
    if truncate is None or truncate == -1:
        return max_len
    if truncate < 1:
        raise ValueError(f"truncate_prompt_tokens must be -1 (the model's maximum) or at least 1, got {truncate}")
    return min(truncate, max_len)


def _too_long(n: int, max_len: int, what: str) -> InputTooLongError:
    return InputTooLongError(
        f"This model's maximum input length is {max_len} tokens. However, the {what} has "
        f"{n} tokens. Shorten it, or set truncate_prompt_tokens to cut it to the maximum."
    )


def embed_input(
    tokenizer: Any, text: str | Sequence[int], max_len: int, truncate: int | None = None, what: str = "input"
) -> list[int]:
    """The token ids of one input to embed: a text (tokenized with the model's special tokens) or token ids as
    given. Longer than `max_len`: InputTooLongError, unless `truncate` (-1: to `max_len`; N: to N) is given,
    which keeps the first tokens and the trailing special tokens, as sentence-transformers truncates."""
    ids = tokenizer.encode(text, add_special_tokens=True) if isinstance(text, str) else list(text)
    if not ids:
        raise ValueError(f"the {what} is empty")
    limit = _limit(max_len, truncate)
    if len(ids) > limit:
        if truncate is None:
            raise _too_long(len(ids), max_len, what)
        ids = truncate_ids(ids, limit, getattr(tokenizer, "all_special_ids", frozenset()))
    return ids


def pair_input(
    tokenizer: Any,
    pooling: PoolingConfig,
    query: str,
    document: str,
    max_len: int,
    truncate: int | None = None,
    what: str = "query and document",
) -> tuple[list[int], int]:
    """`pair_prompt`, checked against `max_len` (truncated from the document's end when `truncate` is given)."""
    ids, type_start = pair_prompt(tokenizer, pooling, query, document)
    limit = _limit(max_len, truncate)
    if len(ids) > limit:
        if truncate is None:
            raise _too_long(len(ids), max_len, what)
        ids = truncate_pair(ids, type_start, limit, getattr(tokenizer, "all_special_ids", frozenset()))
    return ids, type_start

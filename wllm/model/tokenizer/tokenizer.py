"""The `Tokenizer` wLLM uses: a `tokenizers.Tokenizer` plus the model's special ids and chat template.

Two sources: a Hugging Face folder (tokenizer.json and its companion config files) and a GGUF
file (the embedded vocabulary, rebuilt by `gguf_vocab`). transformers is never imported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Any

import gguf
from tokenizers import AddedToken, models
from tokenizers import Tokenizer as HFTokenizer

from wllm.model.tokenizer.chat_template import ChatTemplateError, render_chat_template
from wllm.model.tokenizer.gguf_vocab import build_gguf_tokenizer, read_gguf_vocab

ChatTemplate = str | dict[str, str]

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class TokenizerLoadError(ValueError):
    """A tokenizer folder or file is missing pieces or has a format wLLM does not read."""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerLoadError(f"cannot read {path}: {e}") from e


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_set(value: Any) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, (list, tuple)):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _named_templates(value: Any, source: Path) -> ChatTemplate | None:
    """tokenizer_config.json's chat_template: a string, or a list of {"name", "template"}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for item in value:
            if not (isinstance(item, Mapping) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise TokenizerLoadError(f"{source}: chat_template list entries need string 'name' and 'template'")
            named[item["name"]] = item["template"]
        return named
    raise TokenizerLoadError(f"{source}: chat_template must be a string or a list of named templates")


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template.

    Build one with `from_hf_folder`, `from_gguf` or `from_path`. `encode` adds BOS/EOS the way
    the model's files say (`add_bos_token` / `add_eos_token`, or the tokenizer.json
    post-processor when the config is silent).
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        chat_template: ChatTemplate | None = None,
        special_tokens_map: Mapping[str, str] | None = None,
        source: str = "<tokenizer>",
    ) -> None:
        """Wrap `backend`.

        When `add_bos_token` and `add_eos_token` are both None, BOS/EOS come from the backend's
        own post-processor; otherwise `encode` adds them itself and bypasses the post-processor.
        `eos_token_id` is the primary EOS (the tokenizer's eos_token); `eos_token_ids` the full
        set that ends generation (it always includes `eos_token_id`).
        """
        # tokenizer.json may switch on padding and truncation (sentence-transformers exports do): an engine
        # must see every token and no padding, and a prompt that is too long is an error, not cut silently.
        backend.no_padding()
        backend.no_truncation()
        self._backend = backend
        self.source = source
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id if eos_token_id is not None else min(eos_token_ids, default=None)
        ids = set(eos_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self._manual_specials = add_bos_token is not None or add_eos_token is not None
        self.add_bos_token = bool(add_bos_token) and bos_token_id is not None
        self.add_eos_token = bool(add_eos_token) and self.eos_token_id is not None
        self._chat_template = chat_template
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self._added_tokens = {i: t.content for i, t in added.items()}
        self._byte_fallback_ids: frozenset[int] | None = None
        if special_tokens_map is None:
            pairs = (("bos_token", bos_token_id), ("eos_token", self.eos_token_id),
                     ("unk_token", unk_token_id), ("pad_token", pad_token_id))
            special_tokens_map = {n: backend.id_to_token(i) for n, i in pairs if i is not None}
        self._special_names = {k: v for k, v in special_tokens_map.items() if v is not None}

    # ----------------------------------------------------------------- constructors

    @classmethod
    def from_path(cls, path: str | PathLike[str]) -> Tokenizer:
        """A folder with tokenizer.json, or a .gguf file."""
        p = Path(path)
        if p.is_dir():
            return cls.from_hf_folder(p)
        if p.is_file() and p.suffix.lower() == ".gguf":
            return cls.from_gguf(p)
        raise TokenizerLoadError(
            f"{p}: not a tokenizer source; pass a folder containing tokenizer.json or a .gguf file"
        )

    @classmethod
    def from_hf_folder(cls, path: str | PathLike[str]) -> Tokenizer:
        """Load a Hugging Face tokenizer folder.

        Reads tokenizer.json (required; its post-processor adds BOS/EOS, and only when it has
        none do tokenizer_config.json's add_bos_token / add_eos_token apply), tokenizer_config.json
        (special tokens, added_tokens_decoder, chat_template), special_tokens_map.json,
        chat_template.jinja / chat_template.json / additional_chat_templates/*.jinja, and
        generation_config.json / config.json for the full set of EOS ids.
        """
        folder = Path(path)
        if not folder.is_dir():
            raise TokenizerLoadError(f"tokenizer folder not found: {folder}")
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            extra = " (it has a sentencepiece tokenizer.model; convert it to tokenizer.json with " \
                    "transformers' AutoTokenizer.save_pretrained)" if (folder / "tokenizer.model").is_file() else ""
            raise TokenizerLoadError(f"{folder}: no tokenizer.json; wLLM reads only fast-tokenizer files{extra}")
        try:
            backend = HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerLoadError(f"{tj}: not a valid tokenizers file: {e}") from e

        def optional(name: str) -> dict[str, Any]:
            p = folder / name
            data = _read_json(p) if p.is_file() else {}
            if not isinstance(data, dict):
                raise TokenizerLoadError(f"{p}: expected a JSON object")
            return data

        config = optional("tokenizer_config.json")
        special_map = optional("special_tokens_map.json")
        gen_config = optional("generation_config.json")
        model_config = optional("config.json")

        # Tokens the config declares but tokenizer.json lacks (transformers adds them too).
        known = {t.content for t in backend.get_added_tokens_decoder().values()}
        declared = config.get("added_tokens_decoder") or {}
        if not isinstance(declared, Mapping):
            raise TokenizerLoadError(f"{folder / 'tokenizer_config.json'}: added_tokens_decoder must be an object")
        for _, spec in sorted(declared.items(), key=lambda kv: int(kv[0])):
            text = _token_text(spec)
            if text is None or text in known:
                continue
            special = bool(spec.get("special", False))
            token = AddedToken(text, special=special, normalized=bool(spec.get("normalized", not special)))
            (backend.add_special_tokens if special else backend.add_tokens)([token])
            known.add(text)
        names: dict[str, str] = {}
        for name in _SPECIAL_NAMES:
            text = _token_text(config.get(name)) or _token_text(special_map.get(name))
            if text is not None:
                names[name] = text
                if text not in known and backend.token_to_id(text) is not None:
                    backend.add_special_tokens([AddedToken(text, special=True, normalized=False)])
                    known.add(text)

        ids = {name: backend.token_to_id(text) for name, text in names.items()}
        eos_ids = _as_id_set(gen_config.get("eos_token_id"))
        if not eos_ids:
            eos_ids = _as_id_set(model_config.get("eos_token_id"))
        bos_id = ids.get("bos_token")
        if bos_id is None:
            bos_id = next(iter(_as_id_set(gen_config.get("bos_token_id"))), None)

        # tokenizer.json's post-processor decides BOS/EOS (transformers 5 ignores the config's
        # add_bos_token/add_eos_token when tokenizer.json exists). Only a file without a
        # post-processor falls back to the flags, so a model that asks for BOS still gets it.
        add_bos = add_eos = None
        if backend.post_processor is None:
            add_bos = bool(config.get("add_bos_token", False))
            add_eos = bool(config.get("add_eos_token", False))

        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=ids.get("eos_token"),
            eos_token_ids=eos_ids,
            pad_token_id=ids.get("pad_token"),
            unk_token_id=ids.get("unk_token"),
            add_bos_token=add_bos,
            add_eos_token=add_eos,
            chat_template=cls._folder_chat_template(folder, config),
            special_tokens_map=names,
            source=str(folder),
        )

    @staticmethod
    def _folder_chat_template(folder: Path, config: Mapping[str, Any]) -> ChatTemplate | None:
        # Newer transformers saves the template beside the config; that file wins.
        template: ChatTemplate | None
        jinja_file = folder / "chat_template.jinja"
        json_file = folder / "chat_template.json"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        elif json_file.is_file():
            data = _read_json(json_file)
            value = data.get("chat_template") if isinstance(data, dict) else None
            template = _named_templates(value, json_file)
        else:
            template = _named_templates(config.get("chat_template"), folder / "tokenizer_config.json")
        extra_dir = folder / "additional_chat_templates"
        if extra_dir.is_dir():
            named = dict(template) if isinstance(template, dict) else ({"default": template} if template else {})
            for f in sorted(extra_dir.glob("*.jinja")):
                named[f.stem] = f.read_text(encoding="utf-8")
            template = named or None
        return template

    @classmethod
    def from_gguf(cls, path_or_reader: str | PathLike[str] | gguf.GGUFReader) -> Tokenizer:
        """Rebuild the tokenizer embedded in a GGUF file (see `gguf_vocab` for what is supported)."""
        vocab = read_gguf_vocab(path_or_reader)
        backend = build_gguf_tokenizer(vocab)
        bos_id, eos_id = vocab.bos_id, vocab.eos_id
        if vocab.model == "bert":
            # WordPiece sequences are framed by [CLS] ... [SEP].
            bos_id = vocab.cls_id if vocab.cls_id is not None else bos_id
            eos_id = vocab.sep_id if vocab.sep_id is not None else eos_id
        valid = lambda i: i if i is not None and 0 <= i < len(vocab.tokens) else None  # noqa: E731
        return cls(
            backend,
            bos_token_id=valid(bos_id),
            eos_token_id=valid(eos_id),
            eos_token_ids=vocab.eog_ids() if vocab.model != "bert" else (),
            pad_token_id=valid(vocab.pad_id),
            unk_token_id=valid(vocab.unk_id),
            add_bos_token=vocab.add_bos,
            add_eos_token=vocab.add_eos,
            chat_template=vocab.chat_template,
            # A path is named absolute, as it was when this went through a GGUFReader's memmap.
            source=vocab.source if isinstance(path_or_reader, gguf.GGUFReader) else os.path.abspath(path_or_reader),
        )

    # ----------------------------------------------------------------- properties

    @property
    def backend(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the embedding may be padded larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self._special_names.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_names.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self._special_names.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self._special_names.get("unk_token")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """bos_token / eos_token / unk_token / pad_token texts that are defined (chat template variables)."""
        return dict(self._special_names)

    @property
    def added_tokens(self) -> dict[int, str]:
        """Every added token (special or not), id -> text."""
        return dict(self._added_tokens)

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` drops."""
        return self._special_ids

    @property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of SentencePiece byte-fallback tokens (<0x00>..<0xFF>); empty for other tokenizers."""
        if self._byte_fallback_ids is None:
            ids: set[int] = set()
            model = self._backend.model
            if isinstance(model, models.BPE) and model.byte_fallback:
                for b in range(256):
                    i = self._backend.token_to_id(f"<0x{b:02X}>")
                    if i is not None:
                        ids.add(i)
            self._byte_fallback_ids = frozenset(ids)
        return self._byte_fallback_ids

    @property
    def chat_template(self) -> str | None:
        """The default chat template (the "default" one when the model names several)."""
        t = self._chat_template
        if isinstance(t, dict):
            return t.get("default")
        return t

    @property
    def chat_templates(self) -> dict[str, str]:
        """All named templates ({"default": ...} for a model with one)."""
        t = self._chat_template
        if isinstance(t, dict):
            return dict(t)
        return {"default": t} if t else {}

    # ----------------------------------------------------------------- encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token texts in it (e.g. <|im_start|>) map to their ids.

        Through `encode_batch_fast`, which computes no character offsets (we never use them): about half
        the time and a fraction of the memory of `encode` on long prompts, and it holds the GIL only to
        convert the result, so the server can tokenize a long prompt in a thread without stalling."""
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_pair(self, first: str, second: str) -> tuple[list[int], int]:
        """Token ids of a text pair as the model's files frame it ([CLS] a [SEP] b [SEP] for BERT), and the
        index where the second text's token type starts (-1 when the framing gives no token types)."""
        if not self._manual_specials:
            enc = self._backend.encode(first, second, add_special_tokens=True)
            types = enc.type_ids
            return enc.ids, types.index(1) if 1 in types else -1
        a = self._backend.encode(first, add_special_tokens=False).ids
        b = self._backend.encode(second, add_special_tokens=False).ids
        return self._frame(a + b), -1

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` for many texts at once (parallel in the Rust backend)."""
        if not self._manual_specials:
            return [e.ids for e in self._backend.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)]
        out = [e.ids for e in self._backend.encode_batch_fast(list(texts), add_special_tokens=False)]
        return [self._frame(ids) for ids in out] if add_special_tokens else out

    def _frame(self, ids: list[int]) -> list[int]:
        if self.add_bos_token:
            ids = [self.bos_token_id, *ids]  # type: ignore[list-item]
        if self.add_eos_token:
            ids = [*ids, self.eos_token_id]  # type: ignore[list-item]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 byte sequences come out as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (byte-level or ▁-spelled), None when out of range."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, None when absent."""
        return self._backend.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        """Vocabulary entry -> id, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    # ----------------------------------------------------------------- chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """Render a conversation with the model's chat template (or `chat_template`).

        `chat_template` may be a template string or the name of one of the model's templates.
        Extra keyword arguments become template variables (e.g. enable_thinking=False).
        Raises `ChatTemplateError` (a ValueError) when there is no template or it fails.
        """
        template = self._select_template(chat_template, tools)
        variables = {**self.special_tokens_map, **extra}
        return render_chat_template(
            template,
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **variables,
        )

    def select_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        """The template `apply_chat_template` would render with (tool-call and reasoning formats are read from
        its text); raises ChatTemplateError when there is none."""
        return self._select_template(chat_template, tools)

    def _select_template(self, chat_template: str | None, tools: Any) -> str:
        named = self.chat_templates
        if chat_template is not None:
            return named.get(chat_template, chat_template)
        if tools and "tool_use" in named:
            return named["tool_use"]
        if "default" in named:
            return named["default"]
        if named:
            raise ChatTemplateError(
                f"{self.source} has several chat templates ({', '.join(sorted(named))}) and none is named "
                "'default'; pick one by name or pass --chat-template"
            )
        raise ChatTemplateError(
            f"{self.source} has no chat template; pass one with --chat-template <file or template string>"
        )

    def __repr__(self) -> str:
        return (f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={sorted(self.eos_token_ids)})")

"""Rebuild a `tokenizers.Tokenizer` from the vocabulary a GGUF file embeds.

A GGUF carries no tokenizer.json: llama.cpp's converter stores the vocabulary, merges, scores,
token types and special ids as `tokenizer.ggml.*` metadata. This module reads those keys (with
the loader's cached header parser, `wllm.model.loader.gguf_file`) and builds the equivalent
fast tokenizer:

- `tokenizer.ggml.model == "gpt2"`: byte-level BPE; the split regex comes from
  `tokenizer.ggml.pre` (see `PRE_TOKENIZER_SPLITS`). An unknown `pre` falls back to the GPT-2
  regex with a warning, as llama.cpp falls back to its default.
- `"llama"`: SentencePiece BPE with byte fallback (`<0xNN>` tokens). GGUF stores scores, not
  merges, so merges are recovered from the scores (a pair merges in order of the score of the
  token it makes, which is how SentencePiece BPE picks its next merge).
- `"bert"`: WordPiece; llama.cpp marks word-initial pieces with U+2581 and drops the `##` of
  continuation pieces, which is undone here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from wllm.model.loader.gguf_file import GGUFFormatError, GGUFHeader, read_gguf_header

logger = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_MODELS = ("gpt2", "llama", "bert")

# Split regexes, as llama.cpp's llama-vocab.cpp applies them for each `tokenizer.ggml.pre` (each
# entry is applied in turn to the pieces the previous one left, keeping matches isolated).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# DeepSeek-LLM's letter class, as code point ranges: written out as characters it would be open
# to Unicode normalization by editors (several of these code points have canonical equivalents).
_DEEPSEEK_LLM_LETTER_RANGES = (
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA), (0x1BC, 0x1BF),
    (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377), (0x37B, 0x37D), (0x37F, 0x37F),
    (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C), (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481),
    (0x48A, 0x52F), (0x531, 0x556), (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA),
    (0x1CBD, 0x1CBF), (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D),
    (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B), (0x1F5D, 0x1F5D),
    (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE), (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC),
    (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102),
    (0x2107, 0x2107), (0x210A, 0x2113), (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126),
    (0x2128, 0x2128), (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149),
    (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE), (0x2CF2, 0x2CF3),
    (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787), (0xA78B, 0xA78E), (0xAB70, 0xABBF),
    (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A), (0xFF41, 0xFF5A), (0x10400, 0x1044F),
    (0x104B0, 0x104D3), (0x104D8, 0x104FB), (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF),
    (0x1E900, 0x1E943),
)
_DEEPSEEK_LLM_LETTERS = r"\s?[" + "".join(
    chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in _DEEPSEEK_LLM_LETTER_RANGES
) + "]+"

# pre name -> (split regexes applied in order, NFC normalizer, BPE ignore_merges).
# An empty regex list means "GPT-2 regex inside ByteLevel"; the "digits" marker puts every digit
# in its own piece first (SmolLM2 / StarCoder).
PRE_TOKENIZER_SPLITS: dict[str, tuple[tuple[str, ...], bool, bool]] = {}
for _name in ("default", "gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe", "gigachat", "exaone4"):
    PRE_TOKENIZER_SPLITS[_name] = ((), False, False)
for _name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"):
    PRE_TOKENIZER_SPLITS[_name] = (("digits",), False, False)
for _name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"):
    PRE_TOKENIZER_SPLITS[_name] = ((_LLAMA3,), False, True)
for _name in ("qwen2", "deepseek-r1-qwen", "megrez"):
    # Qwen2's own tokenizer.json normalizes to NFC before splitting.
    PRE_TOKENIZER_SPLITS[_name] = ((_QWEN2,), True, False)
PRE_TOKENIZER_SPLITS["deepseek-coder"] = ((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"), False, False)
PRE_TOKENIZER_SPLITS["deepseek-llm"] = (
    (r"[\r\n]", _DEEPSEEK_LLM_LETTERS, "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
     r"\s+$", _CJK, r"\p{N}+"),
    False,
    False,
)

# Token texts llama.cpp treats as end of generation when the file names no EOT id itself.
EOG_TOKEN_TEXTS = frozenset(
    {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
     "<|end_of_text|>", "<｜end▁of▁sentence｜>"}
)


class GGUFTokenizerError(ValueError):
    """The GGUF's vocabulary is missing or of a kind wLLM cannot rebuild."""


@dataclass
class GGUFVocab:
    """The `tokenizer.*` metadata of a GGUF file, decoded into Python values."""

    source: str
    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int] | None = None
    scores: list[float] | None = None
    merges: list[str] | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    eot_id: int | None = None
    eom_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    sep_id: int | None = None
    cls_id: int | None = None
    mask_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = True
    chat_template: str | dict[str, str] | None = None
    architecture: str | None = None

    def token(self, token_id: int | None) -> str | None:
        """The text of `token_id`, or None when the id is absent or out of range."""
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]

    def type_of(self, token_id: int) -> int:
        return self.token_types[token_id] if self.token_types else NORMAL

    def eog_ids(self) -> set[int]:
        """Ids that end generation: eos/eot/eom from the file plus the usual end-of-turn texts."""
        ids = {i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None and i < len(self.tokens)}
        # By text, whatever the token's type, as llama.cpp does (it fixes mislabelled types too).
        ids.update(i for i, text in enumerate(self.tokens) if text in EOG_TOKEN_TEXTS)
        return ids


def _field_value(reader: gguf.GGUFReader, key: str) -> Any:
    """A metadata value as a Python object (str, int, float, bool or list), None when absent."""
    f = reader.fields.get(key)
    if f is None or not f.types:
        return None
    main = f.types[0]

    def scalar(part: Any, vtype: gguf.GGUFValueType) -> Any:
        if vtype == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part.tolist()[0]
        return bool(value) if vtype == gguf.GGUFValueType.BOOL else value

    if main == gguf.GGUFValueType.ARRAY:
        sub = f.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
        if sub == gguf.GGUFValueType.ARRAY:
            return None  # nested arrays are not used by any tokenizer key
        values = [v for i in f.data for v in f.parts[i].tolist()]
        return [bool(v) for v in values] if sub == gguf.GGUFValueType.BOOL else values
    return scalar(f.parts[f.data[0]], main)


def _header_value(header: GGUFHeader, key: str) -> Any:
    """Like `_field_value`, from a parsed header (nested arrays are not used by tokenizer keys)."""
    entry = header.fields.get(key)
    if entry is None:
        return None
    if entry[0] == gguf.GGUFValueType.ARRAY and entry[2] and isinstance(entry[2][0], tuple):
        return None
    return header.value(key)


def open_gguf(path_or_reader: str | PathLike[str] | gguf.GGUFReader) -> gguf.GGUFReader:
    """A `GGUFReader` for a path (or the reader itself), with a clear error for bad files."""
    if isinstance(path_or_reader, gguf.GGUFReader):
        return path_or_reader
    path = Path(path_or_reader)
    if not path.is_file():
        raise GGUFTokenizerError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueError/struct errors on foreign files
        raise GGUFTokenizerError(f"{path} is not a readable GGUF file: {e}") from e


def read_gguf_vocab(path_or_reader: str | PathLike[str] | gguf.GGUFReader) -> GGUFVocab:
    """Read the `tokenizer.ggml.*` keys of a GGUF file.

    A path is parsed with the loader's fast header reader, whose per-process cache the model
    loader shares (so loading a GGUF model and its tokenizer parses the file once); a
    `GGUFReader` the caller already has is read through its fields.
    """
    if isinstance(path_or_reader, gguf.GGUFReader):
        reader = path_or_reader
        source = str(getattr(reader.data, "filename", None) or "<GGUFReader>")
        value: Callable[[str], Any] = lambda key: _field_value(reader, key)  # noqa: E731
    else:
        path = Path(path_or_reader)
        source = str(path_or_reader)
        if not path.is_file():
            raise GGUFTokenizerError(f"GGUF file not found: {path}")
        try:
            header = read_gguf_header(path)
        except (OSError, GGUFFormatError) as e:
            raise GGUFTokenizerError(f"{path} is not a readable GGUF file: {e}") from e
        value = lambda key: _header_value(header, key)  # noqa: E731
    get = lambda key: value(f"tokenizer.ggml.{key}")  # noqa: E731
    model = get("model")
    tokens = get("tokens")
    if model is None or tokens is None:
        raise GGUFTokenizerError(
            f"{source} embeds no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing); "
            "pass a Hugging Face tokenizer folder with --tokenizer"
        )
    if model not in SUPPORTED_MODELS:
        raise GGUFTokenizerError(
            f"{source}: tokenizer.ggml.model = {model!r} is not supported; supported: {', '.join(SUPPORTED_MODELS)}"
        )
    # llama.cpp's defaults per vocabulary type, used when the file does not say.
    default_bos = model in ("llama", "bert")
    add_bos = get("add_bos_token")
    add_eos = get("add_eos_token")
    add_space_prefix = get("add_space_prefix")
    template: str | dict[str, str] | None = value("tokenizer.chat_template")
    names = value("tokenizer.chat_templates")
    if names:
        named = {n: value(f"tokenizer.chat_template.{n}") for n in names}
        named = {n: t for n, t in named.items() if isinstance(t, str)}
        if template is not None:
            named["default"] = template
        template = named or template
    return GGUFVocab(
        source=source,
        model=model,
        pre=get("pre"),
        tokens=list(tokens),
        token_types=get("token_type"),
        scores=get("scores"),
        merges=get("merges"),
        bos_id=get("bos_token_id"),
        eos_id=get("eos_token_id"),
        eot_id=get("eot_token_id"),
        eom_id=get("eom_token_id"),
        unk_id=get("unknown_token_id"),
        pad_id=get("padding_token_id"),
        sep_id=get("seperator_token_id"),
        cls_id=get("cls_token_id"),
        mask_id=get("mask_token_id"),
        add_bos=default_bos if add_bos is None else bool(add_bos),
        add_eos=(model == "bert") if add_eos is None else bool(add_eos),
        add_space_prefix=(model == "llama") if add_space_prefix is None else bool(add_space_prefix),
        chat_template=template,
        architecture=value("general.architecture"),
    )


def _unique_tokens(vocab: GGUFVocab) -> list[str]:
    """Token texts made unique: a `tokenizers` vocabulary is a bijection, a GGUF list may not be."""
    seen: set[str] = set()
    out = []
    renamed = []
    for i, text in enumerate(vocab.tokens):
        if not text or text in seen:
            # llama.cpp renames empty tokens the same way; duplicates only occur in unused slots.
            text = f"[EMPTY_{i}]" if not text else f"[DUPLICATE_{i}]"
            renamed.append(i)
        seen.add(text)
        out.append(text)
    if renamed:
        logger.warning("%s: %d empty or duplicated tokens renamed (first: id %d)", vocab.source, len(renamed),
                       renamed[0])
    return out


def _merges_from_scores(tokens: list[str], scores: Sequence[float], skip: set[int]) -> list[tuple[str, str]]:
    """BPE merges implied by SentencePiece scores.

    SentencePiece BPE merges, at each step, the adjacent pair whose concatenation is the vocabulary
    piece with the highest score. Listing every split (left, right) of every piece, ordered by the
    piece's score, gives a BPE merge table that makes the same choices.
    """
    index = {t: i for i, t in enumerate(tokens) if i not in skip}
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for piece, pid in index.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            lid, rid = index.get(left), index.get(right)
            if lid is not None and rid is not None:
                ranked.append((-scores[pid], lid, rid, pid, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _special_tokens(vocab: GGUFVocab, texts: list[str], extra_special: set[int]) -> list[AddedToken]:
    """Control/unknown tokens as special added tokens, user-defined ones as plain added tokens.

    llama.cpp matches all of them whole in the text (never splits them), so they must be added
    tokens here too; only control tokens are dropped by skip_special_tokens.
    """
    added = []
    for i, text in enumerate(texts):
        ttype = vocab.type_of(i)
        if ttype in (CONTROL, UNKNOWN) or i in extra_special:
            added.append(AddedToken(text, special=True, normalized=False))
        elif ttype == USER_DEFINED:
            added.append(AddedToken(text, special=False, normalized=False))
    return added


def _byte_level(vocab: GGUFVocab, texts: list[str]) -> HFTokenizer:
    if vocab.merges is None:
        raise GGUFTokenizerError(f"{vocab.source}: gpt2 tokenizer without tokenizer.ggml.merges")
    merges = []
    for m in vocab.merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise GGUFTokenizerError(f"{vocab.source}: malformed merge {m!r} in tokenizer.ggml.merges")
        merges.append((parts[0], parts[1]))
    pre = vocab.pre or "default"
    if pre not in PRE_TOKENIZER_SPLITS:
        logger.warning(
            "%s: unknown tokenizer.ggml.pre %r; using the GPT-2 split regex (known: %s)",
            vocab.source, pre, ", ".join(sorted(PRE_TOKENIZER_SPLITS)),
        )
    splits, nfc, ignore_merges = PRE_TOKENIZER_SPLITS.get(pre, ((), False, False))
    tok = HFTokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(texts)}, merges=merges, ignore_merges=ignore_merges)
    )
    if nfc:
        tok.normalizer = normalizers.NFC()
    if not splits:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif splits == ("digits",):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(vocab: GGUFVocab, texts: list[str]) -> HFTokenizer:
    scores = vocab.scores
    if scores is None or len(scores) != len(texts):
        raise GGUFTokenizerError(f"{vocab.source}: llama tokenizer needs tokenizer.ggml.scores for every token")
    # Byte tokens and control tokens never take part in merges.
    skip = {i for i in range(len(texts)) if vocab.type_of(i) in (BYTE, CONTROL, UNKNOWN)}
    if vocab.merges:
        merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    else:
        merges = _merges_from_scores(texts, scores, skip)
    unk = vocab.token(vocab.unk_id)
    tok = HFTokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(texts)},
            merges=merges,
            unk_token=texts[vocab.unk_id] if unk is not None else None,  # type: ignore[index]
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # SentencePiece marks spaces with U+2581 and, with add_space_prefix, puts one in front of the
    # text. Done as a normalizer (as Llama-2's own tokenizer.json does), the prefix also goes in
    # front of text that follows a special token, and in front of text that already starts with
    # a space -- which is what llama.cpp and sentencepiece do.
    replace = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace]) if vocab.add_space_prefix else replace
    tok.pre_tokenizer = None
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _wordpiece(vocab: GGUFVocab, texts: list[str]) -> HFTokenizer:
    # Undo llama.cpp's respelling: "▁word" starts a word, a bare "piece" continues one ("##piece").
    respelled = []
    for i, t in enumerate(texts):
        if vocab.type_of(i) in (CONTROL, UNKNOWN, USER_DEFINED) or (t.startswith("[") and t.endswith("]")):
            respelled.append(t)
        elif t.startswith("▁"):
            respelled.append(t[1:] or "▁")
        else:
            respelled.append("##" + t)
    seen: set[str] = set()
    for i, t in enumerate(respelled):
        if t in seen:
            respelled[i] = f"[DUPLICATE_{i}]"
        seen.add(respelled[i])
    unk = vocab.token(vocab.unk_id) or "[UNK]"
    tok = HFTokenizer(models.WordPiece(vocab={t: i for i, t in enumerate(respelled)}, unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    texts[:] = respelled
    return tok


def build_gguf_tokenizer(vocab: GGUFVocab) -> HFTokenizer:
    """The fast tokenizer equivalent to the vocabulary in `vocab`, with its special tokens.

    It has no post-processor: whether BOS/EOS are added (`vocab.add_bos`, `vocab.add_eos`) is
    applied by `wllm.model.tokenizer.Tokenizer.encode`.
    """
    texts = _unique_tokens(vocab)
    if vocab.model == "gpt2":
        tok = _byte_level(vocab, texts)
    elif vocab.model == "llama":
        tok = _sentencepiece(vocab, texts)
    elif vocab.model == "bert":
        tok = _wordpiece(vocab, texts)
    else:  # read_gguf_vocab already rejected it; kept for callers that build a GGUFVocab by hand
        raise GGUFTokenizerError(f"{vocab.source}: unsupported tokenizer.ggml.model {vocab.model!r}")
    named = {i for i in (vocab.bos_id, vocab.eos_id, vocab.unk_id, vocab.pad_id, vocab.eot_id, vocab.eom_id,
                         vocab.sep_id, vocab.cls_id, vocab.mask_id) if i is not None and 0 <= i < len(texts)}
    added = _special_tokens(vocab, texts, named)
    tok.add_special_tokens([t for t in added if t.special])
    tok.add_tokens([t for t in added if not t.special])
    return tok

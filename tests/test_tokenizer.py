"""Tokenizer loading (GGUF vocabularies and Hugging Face folders) against transformers and sentencepiece."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from wllm.model.default_model import default_model_path
from wllm.model.tokenizer import GGUFTokenizerError, Tokenizer, TokenizerLoadError

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  multiple   spaces\t\ttabs\n\n\nnewlines \n",
    "def add(a, b):\n    return a + b  # comment\n\tif x: pass\r\n",
    "日本語のテキスト、中文字符。한국어 텍스트",
    "emoji 😀🎉👨‍👩‍👧 flags 🇫🇷 and ✨",
    "numbers 1234567890 3.14159 1,000,000 2024-01-01",
    "mixed Ελληνικά русский العربية हिन्दी ไทย",
    "don't I'll we've THEY'RE it's",
    "\u00a0nbsp\u200bzero-width and ｆｕｌｌｗｉｄｔｈ",
    "x" * 40 + " " + "ab" * 20,
    "",
    " ",
    "\n",
    "trailing space ",
]
CHAT_TEXTS = [
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>text after",
    "a<|im_start|>b <|im_end|> c",
]
TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. Hello world! How are you doing today?",
    "def add(a, b):\n    return a + b\nfor i in range(10):\n    print(i)",
    "Numbers 12345 and 3.14 and 2024-01-01. 東京は日本の首都です。北京是中国的首都。",
    "Emoji are fun 😀 🎉. Ελληνικά, русский язык, العربية. Don't stop, we're here.",
    "Tabs\tand  double  spaces, newlines\n\nand more text about tokenizers and models.",
]


# --------------------------------------------------------------------------- SmolLM2 (gpt2 / smollm)


@pytest.fixture(scope="module")
def smollm2() -> tuple[Tokenizer, object]:
    path = default_model_path()
    ours = Tokenizer.from_gguf(path)
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, hf


def test_smollm2_encode_matches_transformers(smollm2):
    ours, hf = smollm2
    for text in CORPUS + CHAT_TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), text
    assert ours.encode_batch(CORPUS) == [hf.encode(t) for t in CORPUS]


def test_smollm2_decode_matches_transformers(smollm2):
    ours, hf = smollm2
    for text in CORPUS + CHAT_TEXTS:
        ids = hf.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_smollm2_special_tokens(smollm2):
    ours, hf = smollm2
    assert ours.vocab_size == 49152 == len(hf)
    assert ours.bos_token_id == 1 and ours.eos_token_id == 2 and ours.pad_token_id == 2
    # <|im_end|> is the file's eos; <|endoftext|> also ends generation (llama.cpp's EOG list).
    assert ours.eos_token_ids == {0, 2}
    assert ours.special_tokens_map == hf.special_tokens_map
    assert ours.add_bos_token is False
    assert ours.id_to_token(1) == "<|im_start|>" and ours.token_to_id("<|im_end|>") == 2
    assert ours.id_to_token(216) == "Ġ"
    assert set(range(17)) <= ours.all_special_ids
    assert ours.chat_template is not None and "<|im_start|>" in ours.chat_template


# --------------------------------------------------------------------------- sentencepiece (llama)


def _train_spm(add_dummy_prefix: bool = True) -> spm.SentencePieceProcessor:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN_TEXT * 20), model_writer=model, vocab_size=520, model_type="bpe",
        byte_fallback=True, character_coverage=0.9995, split_digits=True, allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", add_dummy_prefix=add_dummy_prefix,
        user_defined_symbols=["<tool>"], unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _write_gguf(path: Path, fill) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    fill(w)
    w.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _spm_gguf(path: Path, sp: spm.SentencePieceProcessor, add_space_prefix: bool) -> None:
    """Write the vocabulary the way llama.cpp's converter does for a sentencepiece model."""
    n = sp.get_piece_size()
    types = []
    for i in range(n):
        if sp.is_unknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(gguf.TokenType.CONTROL)
        elif sp.is_byte(i):
            types.append(gguf.TokenType.BYTE)
        elif sp.id_to_piece(i) == "<tool>":
            types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list([sp.id_to_piece(i) for i in range(n)])
        w.add_token_scores([sp.get_score(i) for i in range(n)])
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(add_space_prefix)

    _write_gguf(path, fill)


def _spm_reference(sp: spm.SentencePieceProcessor, text: str, specials: dict[str, int]) -> list[int]:
    """llama.cpp's rule: special/user-defined tokens are matched whole, each text run between them
    is encoded by sentencepiece on its own (so it gets its own dummy prefix)."""
    ids: list[int] = []
    rest = text
    while rest:
        hits = [(rest.find(s), s) for s in specials if rest.find(s) >= 0]
        if not hits:
            ids += sp.encode(rest)
            break
        pos, tok = min(hits)
        if pos:
            ids += sp.encode(rest[:pos])
        ids.append(specials[tok])
        rest = rest[pos + len(tok):]
    return ids


SPM_SPECIAL_TEXTS = ["<s>Hello</s> world", "a <tool> b", "x</s>"]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory) -> tuple[Path, spm.SentencePieceProcessor]:
    sp = _train_spm()
    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    _spm_gguf(path, sp, add_space_prefix=True)
    return path, sp


def test_spm_gguf_matches_sentencepiece(spm_gguf):
    path, sp = spm_gguf
    ours = Tokenizer.from_gguf(path)
    assert ours.add_bos_token and ours.bos_token_id == 1 and ours.eos_token_ids == {2}
    specials = {"<s>": 1, "</s>": 2, "<tool>": 3}
    for text in CORPUS + SPM_SPECIAL_TEXTS:
        ref = _spm_reference(sp, text, specials)
        assert ours.encode(text) == [1, *ref], text
        assert ours.encode(text, add_special_tokens=False) == ref
        if not any(s in text for s in specials):
            assert ours.decode(ref) == sp.decode(ref) == text
    # Byte-fallback pieces: a character unseen in training comes out as its UTF-8 bytes.
    ids = ours.encode("🦀", add_special_tokens=False)
    assert [ours.id_to_token(i) for i in ids][-4:] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x80>"]
    assert ours.decode([1, *ids, 2]) == "🦀" and ours.decode([1, *ids], skip_special_tokens=False) == "<s> 🦀"
    # As in llama.cpp, text after a special or user-defined token gets its own space prefix.
    assert ours.decode(ours.encode("a <tool> b")) == "a <tool>  b"


def test_spm_gguf_matches_transformers(spm_gguf):
    """transformers' GGUF tokenizer agrees except where it deliberately differs from sentencepiece:
    it adds no U+2581 prefix to text starting with a space or following a special token."""
    path, _ = spm_gguf
    ours = Tokenizer.from_gguf(path)
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    compared = 0
    for text in CORPUS:
        if text[:1].isspace():
            continue
        ids = hf.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        compared += 1
    assert compared >= 10


def test_spm_gguf_without_space_prefix(tmp_path):
    sp = _train_spm(add_dummy_prefix=False)
    path = tmp_path / "noprefix.gguf"
    _spm_gguf(path, sp, add_space_prefix=False)
    ours = Tokenizer.from_gguf(path)
    for text in CORPUS:
        assert ours.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert ours.decode(sp.encode(text)) == sp.decode(sp.encode(text))


# --------------------------------------------------------------------------- byte-level BPE with other `pre`s


def _train_byte_bpe() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False)
    tok.train_from_iterator(TRAIN_TEXT * 10, trainer)
    return tok


def _byte_bpe_gguf(path: Path, tok: HFTokenizer, pre: str) -> None:
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    types = [gguf.TokenType.CONTROL if i < 3 else gguf.TokenType.NORMAL for i in range(len(tokens))]

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(pre == "llama-bpe")

    _write_gguf(path, fill)


@pytest.fixture(scope="module")
def byte_bpe() -> HFTokenizer:
    return _train_byte_bpe()


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2", "smollm", "default"])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path, byte_bpe, pre):
    path = tmp_path / f"bpe-{pre}.gguf"
    _byte_bpe_gguf(path, byte_bpe, pre)
    ours = Tokenizer.from_gguf(path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert ours.add_bos_token == (pre == "llama-bpe")
    for text in CORPUS + CHAT_TEXTS:
        if pre == "smollm" and any(c.isdigit() for c in text):
            # llama.cpp (and SmolLM's own tokenizer.json) put each digit in its own piece first;
            # transformers' GGUF loader does not. SmolLM2's real vocabulary has no multi-digit
            # tokens, so there the two agree (test_smollm2_encode_matches_transformers).
            continue
        ids = ours.encode(text)
        assert ids == hf.encode(text), (pre, text)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids) == (
            "<|im_start|>" + text if pre == "llama-bpe" else text)


def test_split_rules_per_pre(tmp_path, byte_bpe):
    """The splits llama.cpp documents for each `pre` (checked on the pre-tokenizer itself)."""
    def pieces(pre: str, text: str) -> list[str]:
        path = tmp_path / f"{pre}.gguf"
        _byte_bpe_gguf(path, byte_bpe, pre)
        split = Tokenizer.from_gguf(path).backend.pre_tokenizer.pre_tokenize_str(text)
        return [_unbyte(p).decode() for p, _ in split]

    assert pieces("llama-bpe", "x 12345") == ["x", " ", "123", "45"]
    assert pieces("qwen2", "x 12345") == ["x", " ", "1", "2", "3", "4", "5"]
    assert pieces("smollm", "x 12345") == ["x", " ", "1", "2", "3", "4", "5"]
    assert pieces("gpt-2", "x 12345") == ["x", " 12345"]
    assert pieces("deepseek-coder", "ab12\n中文") == ["ab", "1", "2", "\n", "中文"]
    assert pieces("deepseek-llm", "Hi there 123\n") == ["Hi", " there", " ", "123", "\n"]


def _unbyte(piece: str) -> bytes:
    """Undo the GPT-2 byte-to-unicode spelling."""
    table = {}
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = 0
    for b in range(256):
        if b in visible:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return bytes(table[c] for c in piece)


def test_unknown_pre_falls_back_to_gpt2_with_warning(tmp_path, byte_bpe, caplog):
    path = tmp_path / "odd.gguf"
    _byte_bpe_gguf(path, byte_bpe, "no-such-pre")
    with caplog.at_level(logging.WARNING):
        ours = Tokenizer.from_gguf(path)
    assert "unknown tokenizer.ggml.pre 'no-such-pre'" in caplog.text
    ref = Tokenizer.from_gguf(_written(tmp_path / "gpt2.gguf", byte_bpe, "gpt-2"))
    assert ours.encode(CORPUS[3]) == ref.encode(CORPUS[3])


def _written(path: Path, tok: HFTokenizer, pre: str) -> Path:
    _byte_bpe_gguf(path, tok, pre)
    return path


# --------------------------------------------------------------------------- Hugging Face folders


def _hf_folder(folder: Path, byte_bpe: HFTokenizer, config: dict, post_processor: bool,
               generation_config: dict | None = None) -> None:
    tok = HFTokenizer.from_str(byte_bpe.to_str())
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A", pair="<|im_start|> $A $B", special_tokens=[("<|im_start|>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config), encoding="utf-8")


HF_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<|im_start|>",
    "eos_token": {"content": "<|im_end|>", "special": True, "__type": "AddedToken"},
    "pad_token": "<|endoftext|>",
    "chat_template": "{% for m in messages %}{{ bos_token + m['role'] + ': ' + m['content'] + eos_token }}"
                     "{% endfor %}{% if add_generation_prompt %}{{ bos_token + 'assistant: ' }}{% endif %}",
}


@pytest.mark.parametrize("variant", ["post_processor", "post_processor_and_flags", "plain"])
def test_hf_folder_matches_transformers(tmp_path, byte_bpe, variant):
    config = dict(HF_CONFIG)
    if variant == "post_processor_and_flags":
        # With a tokenizer.json post-processor the flags are ignored (as transformers 5 does).
        config.update(add_bos_token=False, add_eos_token=True)
    _hf_folder(tmp_path, byte_bpe, config, post_processor=variant != "plain",
               generation_config={"eos_token_id": [2, 0], "bos_token_id": 1})
    ours = Tokenizer.from_hf_folder(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in CORPUS + CHAT_TEXTS + ["<think>reasoning</think>"]:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (variant, text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.eos_token_id == 2 and ours.eos_token_ids == {0, 2} and ours.bos_token_id == 1
    assert ours.pad_token_id == 0 and ours.vocab_size == len(hf)
    plain = ours.encode("x", add_special_tokens=False)
    assert ours.encode("x") == (plain if variant == "plain" else [1, *plain])
    msgs = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_hf_folder_flags_without_post_processor(tmp_path, byte_bpe):
    """A tokenizer.json with no post-processor: the config's add_bos_token/add_eos_token apply."""
    extra = {"added_tokens_decoder": {"9999": {"content": "<extra_tok>", "special": True}}}
    _hf_folder(tmp_path, byte_bpe, dict(HF_CONFIG, add_bos_token=True, add_eos_token=True, **extra),
               post_processor=False)
    ours = Tokenizer.from_hf_folder(tmp_path)
    # A token only tokenizer_config.json declares is still matched whole and skipped as special.
    (extra_id,) = ours.encode("<extra_tok>", add_special_tokens=False)
    assert extra_id in ours.all_special_ids and ours.decode([extra_id]) == ""
    plain = ours.encode("Hello world", add_special_tokens=False)
    assert ours.encode("Hello world") == [1, *plain, 2]
    assert ours.encode_batch(["Hello world"]) == [[1, *plain, 2]]
    assert ours.eos_token_ids == {2}  # no generation_config.json: the tokenizer's eos only


def test_hf_folder_template_files(tmp_path, byte_bpe):
    _hf_folder(tmp_path, byte_bpe, dict(HF_CONFIG), post_processor=False)
    (tmp_path / "chat_template.jinja").write_text("JINJA{{ messages[0]['content'] }}", encoding="utf-8")
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "JINJAx"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "JSON{{ 1 + 1 }}"}), encoding="utf-8")
    assert Tokenizer.from_hf_folder(tmp_path).chat_template == "JSON{{ 1 + 1 }}"
    (tmp_path / "chat_template.json").unlink()
    config = dict(HF_CONFIG, chat_template=[{"name": "default", "template": "D"},
                                            {"name": "tool_use", "template": "T{{ tools | length }}"}])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = Tokenizer.from_hf_folder(tmp_path)
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == "D"
    assert tok.apply_chat_template(msgs, tools=[{"type": "function"}]) == "T1"
    assert tok.apply_chat_template(msgs, chat_template="tool_use", tools=[]) == "T0"


def test_load_errors(tmp_path):
    with pytest.raises(TokenizerLoadError, match="no tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(TokenizerLoadError, match="tokenizer.model"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerLoadError, match="not a valid tokenizers file"):
        Tokenizer.from_hf_folder(tmp_path)
    with pytest.raises(TokenizerLoadError, match="not a tokenizer source"):
        Tokenizer.from_path(tmp_path / "tokenizer.model")
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(GGUFTokenizerError, match="not a readable GGUF"):
        Tokenizer.from_gguf(bogus)
    novocab = tmp_path / "novocab.gguf"
    _write_gguf(novocab, lambda w: None)
    with pytest.raises(GGUFTokenizerError, match="embeds no tokenizer"):
        Tokenizer.from_gguf(novocab)
    rwkv = tmp_path / "rwkv.gguf"
    _write_gguf(rwkv, lambda w: (w.add_tokenizer_model("rwkv"), w.add_token_list(["a", "b"])))
    with pytest.raises(GGUFTokenizerError, match="'rwkv' is not supported; supported: gpt2, llama, bert"):
        Tokenizer.from_gguf(rwkv)


# --------------------------------------------------------------------------- WordPiece (bert)


def test_bert_gguf_matches_wordpiece(tmp_path):
    """A BERT vocabulary written the way llama.cpp's converter does (word starts get U+2581, "##"
    is dropped) is rebuilt into the original WordPiece tokenizer."""
    from tokenizers.implementations import BertWordPieceTokenizer

    ref = BertWordPieceTokenizer(lowercase=True)
    ref.train_from_iterator(TRAIN_TEXT * 10, vocab_size=400, show_progress=False)
    vocab = ref.get_vocab()
    ref.post_processor = processors.BertProcessing(("[SEP]", vocab["[SEP]"]), ("[CLS]", vocab["[CLS]"]))
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]

    def phantom(t: str) -> str:
        if t.startswith("[") and t.endswith("]"):
            return t
        return t[2:] if t.startswith("##") else "▁" + t

    types = [gguf.TokenType.CONTROL if t.startswith("[") and t.endswith("]") else gguf.TokenType.NORMAL
             for t in tokens]
    path = tmp_path / "bert.gguf"

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("bert")
        w.add_token_list([phantom(t) for t in tokens])
        w.add_token_types(types)
        w.add_uint32("tokenizer.ggml.cls_token_id", vocab["[CLS]"])
        w.add_sep_token_id(vocab["[SEP]"])
        w.add_unk_token_id(vocab["[UNK]"])
        w.add_pad_token_id(vocab["[PAD]"])
        w.add_mask_token_id(vocab["[MASK]"])

    _write_gguf(path, fill)
    ours = Tokenizer.from_gguf(path)
    assert ours.bos_token_id == vocab["[CLS]"] and ours.eos_token_id == vocab["[SEP]"]
    for text in CORPUS:
        ids = ref.encode(text).ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == ref.decode(ids)
    assert ours.id_to_token(ours.encode("quick")[1]) == "quick"


def test_gguf_metadata_extras(tmp_path, byte_bpe):
    """Named chat templates, EOT ids and a shared GGUFReader."""
    path = tmp_path / "named.gguf"
    data = json.loads(byte_bpe.to_str())
    tokens = [t for t, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])]

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types([gguf.TokenType.CONTROL if i < 3 else gguf.TokenType.NORMAL for i in range(len(tokens))])
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]])
        w.add_bos_token_id(1)
        w.add_eos_token_id(0)
        w.add_eot_token_id(2)
        w.add_chat_template([{"name": "default", "template": "D{{ bos_token }}"},
                             {"name": "tool_use", "template": "T{{ eos_token }}"}])

    _write_gguf(path, fill)
    ours = Tokenizer.from_gguf(gguf.GGUFReader(path))
    assert ours.source == str(path)
    assert ours.eos_token_id == 0 and ours.eos_token_ids == {0, 2} and ours.add_bos_token is False
    assert ours.chat_templates == {"default": "D{{ bos_token }}", "tool_use": "T{{ eos_token }}"}
    msgs = [{"role": "user", "content": "x"}]
    assert ours.apply_chat_template(msgs) == "D<|im_start|>"
    assert ours.apply_chat_template(msgs, tools=[{"type": "function"}]) == "T<|endoftext|>"

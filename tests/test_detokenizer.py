"""IncrementalDetokenizer: streamed text equals the full decode and never splits a character."""

from __future__ import annotations

import io
import random

import pytest

from wllm.model.default_model import default_model_path
from wllm.model.tokenizer import GGUFVocab, IncrementalDetokenizer, Tokenizer, build_gguf_tokenizer

spm = pytest.importorskip("sentencepiece")

TEXTS = [
    "Hello world! Streaming text, one token at a time.",
    "日本語のテキストと中文字符，한국어도 있어요.",
    "emoji 😀🎉👨‍👩‍👧 flags 🇫🇷🇯🇵 and 🦀🦀",
    "code:\n\tdef f(x):\n        return x  # done\n\n",
    "  leading and trailing spaces  ",
]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def spm_tok() -> Tokenizer:
    """A llama-style (SentencePiece BPE, byte fallback) tokenizer trained on a few lines."""
    model = io.BytesIO()
    train = ["The quick brown fox jumps over the lazy dog. Hello world, streaming text!",
             "Sure, here is the answer. 東京は日本の首都です。 spaces  and\ttabs\n"] * 30
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(train), model_writer=model, vocab_size=360, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        normalization_rule_name="identity", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    vocab = GGUFVocab(source="<test spm>", model="llama", pre=None, tokens=[sp.id_to_piece(i) for i in range(n)],
                      token_types=types, scores=[sp.get_score(i) for i in range(n)], bos_id=1, eos_id=2, unk_id=0,
                      add_bos=True, add_space_prefix=True)
    return Tokenizer(build_gguf_tokenizer(vocab), bos_token_id=1, eos_token_id=2, unk_token_id=0,
                     add_bos_token=True, add_eos_token=False)


def _stream(tok: Tokenizer, ids: list[int], skip: bool = True, prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt or (), skip_special_tokens=skip)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    assert detok.token_ids == ids
    return deltas


@pytest.mark.parametrize("which", ["smollm2", "spm_tok"])
def test_stream_equals_full_decode(which, request):
    tok = request.getfixturevalue(which)
    for text in TEXTS:
        ids = tok.encode(text)
        deltas = _stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids)
        assert all("\ufffd" not in d for d in deltas), deltas
        if which == "smollm2":
            assert "".join(deltas) == text


def test_partial_characters_are_held_back(smollm2, spm_tok):
    # SmolLM2 spells this rare emoji as several byte-level tokens that each hold part of it.
    ids = smollm2.encode("🦀", add_special_tokens=False)
    assert len(ids) > 1 and all("\ufffd" in smollm2.decode([i]) for i in ids)
    assert _stream(smollm2, ids)[:-1] == [""] * (len(ids) - 1) + ["🦀"]
    # SentencePiece byte fallback: <0xF0><0x9F><0xA6><0x80>. A run of byte tokens is only
    # final once a non-byte token follows (or at flush), since a later byte could spoil it.
    ids = spm_tok.encode("🦀 done", add_special_tokens=False)
    pieces = [spm_tok.id_to_token(i) for i in ids]
    last_byte = pieces.index("<0x80>")
    assert pieces[last_byte - 3:last_byte + 1] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x80>"]
    deltas = _stream(spm_tok, ids)
    assert deltas[:last_byte + 1] == [""] * (last_byte + 1)
    assert deltas[last_byte + 1].startswith("🦀 ") and "".join(deltas) == "🦀 done"
    assert _stream(spm_tok, ids[:last_byte + 1])[-1] == "🦀"


def test_incomplete_character_at_the_end_is_flushed(smollm2):
    ids = smollm2.encode("ok 🦀", add_special_tokens=False)[:-1]  # drop the emoji's last byte token
    detok = IncrementalDetokenizer(smollm2)
    streamed = "".join(detok.add(i) for i in ids)
    assert streamed == "ok"
    assert streamed + detok.flush() == smollm2.decode(ids) == "ok \ufffd"


def test_sentencepiece_leading_spaces(spm_tok):
    ids = spm_tok.encode("Sure, here is the answer.", add_special_tokens=False)
    assert spm_tok.id_to_token(ids[0]).startswith("▁")
    # Alone, the first piece loses its space like the full decode does...
    assert "".join(_stream(spm_tok, ids)) == spm_tok.decode(ids) == "Sure, here is the answer."
    # ...after a prompt, it keeps it, as the text continues the prompt.
    prompt = spm_tok.encode("Hello world")
    deltas = _stream(spm_tok, ids, prompt=prompt)
    assert deltas[0].startswith(" ") and spm_tok.decode(ids[:1]) == deltas[0].lstrip(" ")
    assert "".join(deltas) == " Sure, here is the answer."
    full = spm_tok.decode(prompt + ids)
    assert full == spm_tok.decode(prompt) + "".join(deltas)


@pytest.mark.parametrize("which", ["smollm2", "spm_tok"])
def test_random_token_streams(which, request):
    """Random ids (partial UTF-8, byte tokens, special tokens anywhere): the stream still equals the decode."""
    tok = request.getfixturevalue(which)
    rng = random.Random(1234)
    specials = sorted(tok.all_special_ids)
    byte_ids = [i for i in range(tok.vocab_size) if (tok.id_to_token(i) or "").startswith("<0x")]
    for _ in range(150):
        n = rng.randrange(1, 40)
        pool = [rng.randrange(tok.vocab_size), rng.choice(specials)] + ([rng.choice(byte_ids)] if byte_ids else [])
        ids = [rng.choice(pool) if rng.random() < 0.3 else rng.randrange(tok.vocab_size) for _ in range(n)]
        for skip in (True, False):
            assert "".join(_stream(tok, ids, skip=skip)) == tok.decode(ids, skip_special_tokens=skip), (ids, skip)


def test_special_tokens_skipped_or_kept(smollm2):
    ids = smollm2.encode("<|im_start|>assistant\nHi!<|im_end|>")
    assert "".join(_stream(smollm2, ids, skip=True)) == "assistant\nHi!"
    assert "".join(_stream(smollm2, ids, skip=False)) == "<|im_start|>assistant\nHi!<|im_end|>"


def test_add_many_matches_single_steps(smollm2):
    ids = smollm2.encode(TEXTS[2] + TEXTS[1])
    rng = random.Random(7)
    detok = IncrementalDetokenizer(smollm2)
    out, i = [], 0
    while i < len(ids):
        k = rng.randrange(1, 5)
        out.append(detok.add_many(ids[i:i + k]))
        i += k
    out.append(detok.flush())
    assert "".join(out) == smollm2.decode(ids)
    assert all("\ufffd" not in d for d in out)
    assert detok.add_many([]) == ""


def test_window_stays_small(smollm2, monkeypatch):
    """Each step decodes a handful of tokens, not the whole sequence."""
    ids = smollm2.encode(" ".join(TEXTS) * 20)
    assert len(ids) > 1000
    sizes: list[int] = []
    real_decode = smollm2.decode

    def counting(token_ids, skip_special_tokens=True):
        sizes.append(len(token_ids))
        return real_decode(token_ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(smollm2, "decode", counting)
    detok = IncrementalDetokenizer(smollm2)
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    monkeypatch.undo()
    assert text == smollm2.decode(ids)
    assert max(sizes) <= 12 and sum(sizes) < 6 * len(ids)


@pytest.mark.parametrize("which", ["smollm2", "spm_tok"])
def test_deferred_text_state_matches_step_by_step(which, request):
    """Final-only requests collect ids and decode once at the end: same text as one decode per token,
    for random streams with partial characters, byte tokens and special tokens, after a prompt."""
    from wllm.engine.stop_checker import TextState
    from wllm.sampling_params import SamplingParams

    tok = request.getfixturevalue(which)
    rng = random.Random(99)
    specials = sorted(tok.all_special_ids)
    for _ in range(60):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            params = SamplingParams(skip_special_tokens=skip)
            step, deferred = TextState(tok, prompt, params), TextState(tok, prompt, params, defer=True)
            for n, i in enumerate(ids, 1):
                step.append(i, n)
                assert deferred.append(i, n) is None
            assert deferred.text == "", "deferred text is decoded only at the end"
            step.flush()
            assert deferred.visible_text(finished=True) == step.visible_text(finished=True), (prompt, ids, skip)
    # Stop strings need the text as it grows: no deferral then.
    stop = TextState(tok, [], SamplingParams(stop=["fox"]), defer=True)
    hits = [stop.append(i, n) for n, i in enumerate(tok.encode("The quick brown fox"), 1)]
    assert "fox" in hits and stop.text == "The quick brown "

"""Dummy-weight models get a synthetic byte-level tokenizer of the model's vocabulary size."""

from __future__ import annotations

import pytest
import torch

from wllm.model.tokenizer.synthetic import synthetic_tokenizer


def test_bytes_round_trip_and_vocab_size() -> None:
    tok = synthetic_tokenizer(1000)
    text = "Hello, wörld! 你好 🙂\n\ttabs"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.vocab_size == 1000
    assert tok.eos_token_ids == frozenset({999})
    assert tok.decode([300, 72, 999]) == "<t300>H"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_too_small_vocabulary_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least 257"):
        synthetic_tokenizer(100)


def test_dummy_engine_serves_text_without_tokenizer_files() -> None:
    from wllm import LLM, SamplingParams

    torch.manual_seed(0)
    llm = LLM("smollm2-135m", load_format="dummy", device="cpu", dtype="float32", max_model_len=256)
    assert llm.get_tokenizer().vocab_size == 49152
    (out,) = llm.generate(["Hi there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert out.prompt_token_ids == list(b"Hi there")
    assert len(out.outputs[0].token_ids) == 4
    assert isinstance(out.outputs[0].text, str)

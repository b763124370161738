"""`--load-format dummy --quantization NAME`: random GGUF blocks in llama.cpp's per-tensor type mix."""

from __future__ import annotations

import pytest
import torch

from wllm.model.loader import ModelLoadError
from wllm.model.loader.dummy import random_quantized
from wllm.model.loader.presets import dummy_quant_type


def test_q4_k_m_mix_follows_llama_cpp() -> None:
    # 32 layers: attn_v / ffn_down get Q6_K in the first and last eighth and every third layer between.
    more = [i for i in range(32) if dummy_quant_type("q4_k_m", "attn_v", i, 32, 4096) == "Q6_K"]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert dummy_quant_type("q4_k_m", "ffn_down", 6, 32, 14336) == "Q6_K"
    assert dummy_quant_type("q4_k_m", "other", 6, 32, 4096) == "Q4_K"
    assert dummy_quant_type("q4_k_m", "output", 0, 32, 4096) == "Q6_K"
    assert dummy_quant_type("q5_k_m", "attn_v", 5, 32, 4096) == "Q5_K"
    assert dummy_quant_type("q8_0", "output", 0, 32, 4096) == "Q8_0"
    # Rows that are not a multiple of 256 values take llama.cpp's 32-value fallbacks.
    assert dummy_quant_type("q4_k_m", "other", 6, 24, 896) == "Q5_0"
    assert dummy_quant_type("q5_k_m", "other", 6, 24, 896) == "Q5_1"
    assert dummy_quant_type("q6_k", "other", 6, 24, 896) == "Q8_0"
    with pytest.raises(ModelLoadError, match="unknown dummy quantization 'q3_xs'.*q4_k_m"):
        dummy_quant_type("q3_xs", "other", 0, 1, 256)


@pytest.mark.parametrize("ggml_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K",
                                       "Q3_K", "IQ4_NL", "IQ4_XS"])
def test_random_blocks_are_centred_with_the_asked_std(ggml_name: str) -> None:
    qt = random_quantized((64, 512), ggml_name, torch.Generator().manual_seed(3), std=0.02)
    assert qt.ggml_type.name == ggml_name and qt.shape == (64, 512)
    values = qt.dequantize()
    assert torch.isfinite(values).all()
    assert abs(float(values.mean())) < 0.003
    assert 0.015 < float(values.std()) < 0.025


def test_dummy_model_holds_quantized_values_and_generates() -> None:
    from wllm import LLM, SamplingParams

    llm = LLM("smollm2-135m", load_format="dummy", quantization="q4_k_m", device="cpu", dtype="float32",
              max_model_len=64, kv_cache_memory=8 << 20)
    try:
        layers = llm.engine.model.model.layers
        # down_proj rows are 1536 values (a multiple of 256): Q4_K in layer 4, so each 32-value group holds at
        # most 16 levels; layer 1 is a "more bits" layer (Q6_K: up to 64 levels per 16 values).
        def most_levels(w: torch.Tensor) -> int:
            return max(len(torch.unique(row)) for row in w.reshape(-1, 32)[:300])

        assert most_levels(layers[4].mlp.down_proj.weight) <= 16
        assert most_levels(layers[1].mlp.down_proj.weight) > 16
        # 576-value rows fall back to Q5_0, whose blocks all share one scale here: 32 levels in the whole tensor.
        assert len(torch.unique(layers[4].self_attn.qkv_proj.weight)) <= 32
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))[0]
        assert len(out.outputs[0].token_ids) == 4
    finally:
        llm.close()


def test_quantization_needs_the_dummy_format(tmp_path) -> None:
    from wllm.model.loader import load_model

    with pytest.raises(ModelLoadError, match="needs load_format='dummy'"):
        load_model(tmp_path, quantization="q4_k_m")

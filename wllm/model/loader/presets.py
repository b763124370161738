"""Quantization presets of `--load-format dummy --quantization NAME` (torch-free: the CLIs list them in --help).

Random GGUF blocks per tensor with llama.cpp's per-tensor type mix for the _M presets: more bits for the output
projection, and for attn_v / ffn_down in some layers.
"""

from __future__ import annotations

from wllm.model.loader.errors import ModelLoadError

DUMMY_QUANTIZATIONS = ("q4_0", "q4_k_m", "q5_k_m", "q6_k", "q8_0")
_BASE_TYPE = {"q4_0": "Q4_0", "q4_k_m": "Q4_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K", "q8_0": "Q8_0"}
_MORE_BITS = {"q4_k_m": "Q6_K", "q5_k_m": "Q6_K"}
_OUTPUT_TYPE = {"q4_0": "Q6_K", "q4_k_m": "Q6_K", "q5_k_m": "Q6_K", "q6_k": "Q6_K", "q8_0": "Q8_0"}
# A K-quant needs rows that are a multiple of 256 values; other rows get a 32-value type, as llama.cpp does.
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _uses_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for which layers' attn_v / ffn_down get more bits in the _M presets."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * eighth or (layer - eighth) % 3 == 2


def dummy_quant_type(quantization: str, role: str, layer: int, n_layers: int, in_features: int) -> str:
    """The GGML type name of one random tensor: `role` is "output", "embed", "attn_v", "ffn_down" or "other"."""
    if quantization not in _BASE_TYPE:
        supported = ", ".join(DUMMY_QUANTIZATIONS)
        raise ModelLoadError(f"unknown dummy quantization {quantization!r}; supported: {supported}")
    name = _BASE_TYPE[quantization]
    if role == "output":
        name = _OUTPUT_TYPE[quantization]
    elif role in ("attn_v", "ffn_down") and quantization in _MORE_BITS and _uses_more_bits(layer, n_layers):
        name = _MORE_BITS[quantization]
    if in_features % 256 and name in _FALLBACK:
        name = _FALLBACK[name]
    if in_features % 32:
        raise ModelLoadError(f"a dummy {quantization} weight needs rows of a multiple of 32 values, got {in_features}")
    return name



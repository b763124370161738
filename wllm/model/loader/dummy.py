"""Real model shapes with random weights (`load_format="dummy"`), for benchmarks and GPU tests
where nothing can be downloaded. The config dicts are the published config.json contents."""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from wllm.model.loader.errors import ModelLoadError
from wllm.model.loader.presets import dummy_quant_type
from wllm.model.models.base import ModelBase

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen2.5-0.5B-Instruct
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "max_window_layers": 21,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "vocab_size": 151936,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # meta-llama/Llama-3.2-1B-Instruct
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
    # meta-llama/Llama-3.1-8B-Instruct
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0},
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
    # Qwen/Qwen3-8B
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 151936,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # HuggingFaceTB/SmolLM2-135M-Instruct (the embedded default model's shape)
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "num_attention_heads": 9,
        "num_hidden_layers": 30,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "vocab_size": 49152,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def dummy_config(name: str) -> dict[str, Any]:
    """A copy of the HF config dict of a named shape (case-insensitive)."""
    key = name.lower()
    if key not in DUMMY_CONFIGS:
        raise ModelLoadError(f"unknown dummy model shape {name!r}; supported: {', '.join(sorted(DUMMY_CONFIGS))}")
    return copy.deepcopy(DUMMY_CONFIGS[key])


@torch.no_grad()
def init_dummy_weights(model: ModelBase, seed: int = 0, std: float = 0.02) -> None:
    """Fill parameters in place on their device: normal(0, std) for matrices, the identity
    scale for norms (1, or 0 where the norm adds 1 itself), zero biases.

    A small std keeps activations and logits finite through dozens of layers in fp16/bf16.
    """
    gen = None
    for module in model.modules():
        for pname, param in module.named_parameters(recurse=False):
            if gen is None or gen.device != param.device:
                gen = torch.Generator(device=param.device).manual_seed(seed)
            if param.ndim >= 2:
                param.normal_(0.0, std, generator=gen)
            elif pname == "weight" and hasattr(module, "weight_offset"):
                param.fill_(1.0 - float(module.weight_offset))
            elif pname == "weight":
                param.fill_(1.0)  # LayerNorm
            else:
                param.zero_()


# --load-format dummy --quantization NAME: the per-tensor types come from presets.dummy_quant_type.


def _scale_fields(ggml_name: str) -> tuple[int, ...]:
    """Byte offsets of a block's fp16 scale (and min) fields."""
    return {
        "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
        "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
    }[ggml_name]


def _with_scales(raw: torch.Tensor, fields: tuple[int, ...], values: tuple[float, ...]) -> torch.Tensor:
    for off, value in zip(fields, values, strict=False):
        raw[:, off : off + 2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8).to(raw.device)
    return raw


@functools.cache
def _block_scales(ggml_name: str, std: float) -> tuple[float, ...]:
    """fp16 (scale, min) for random blocks whose values have mean ~0 and the given std: measured on a sample
    (each type's sub-scales and quants are random bytes), so every type is calibrated the same way."""
    from gguf.constants import GGML_QUANT_SIZES

    from wllm.model.loader.dequant import GGMLType, dequantize

    t = GGMLType[ggml_name]
    block, nbytes = GGML_QUANT_SIZES[t]
    gen = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (512, nbytes), dtype=torch.uint8, generator=gen)
    fields = _scale_fields(ggml_name)
    x = dequantize(_with_scales(raw.clone(), fields, (1.0, 0.0)), t, (512, block)).double()
    if len(fields) == 1:
        return (std / float(x.std()),)
    y = dequantize(_with_scales(raw.clone(), fields, (0.0, 1.0)), t, (512, block)).double()
    ratio = -float(x.mean()) / float(y.mean())  # min per unit scale that centres the values
    scale = std / float((x + ratio * y).std())
    return scale, scale * ratio


def random_quantized(shape: tuple[int, int], ggml_name: str, gen: torch.Generator, std: float = 0.02) -> Any:
    """A QuantizedTensor of `shape` with random blocks of the type (on the generator's device)."""
    from gguf.constants import GGML_QUANT_SIZES

    from wllm.model.loader.dequant import GGMLType
    from wllm.model.loader.quantized import QuantizedTensor

    t = GGMLType[ggml_name]
    block, nbytes = GGML_QUANT_SIZES[t]
    n = shape[0] * shape[1] // block
    raw = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=gen, device=gen.device)
    return QuantizedTensor(_with_scales(raw, _scale_fields(ggml_name), _block_scales(ggml_name, std)), t, shape)


def _role(module_name: str, shard: str | None) -> str:
    if module_name.endswith("lm_head"):
        return "output"
    if shard == "v" or module_name.endswith("v_proj"):
        return "attn_v"
    if module_name.endswith("down_proj") or module_name.endswith("fc2"):
        return "ffn_down"
    return "other"


@torch.no_grad()
def init_dummy_quantized_weights(model: ModelBase, quantization: str, n_layers: int, tied: bool,
                                 seed: int = 0) -> dict[str, int]:
    """Overwrite every linear weight and the embedding with random GGUF blocks of `quantization`'s per-tensor
    types, loaded through the same path as a GGUF file's (dequantized into the parameters today). Returns the
    count of tensors per GGML type."""
    import re

    from wllm.model.layers.embedding import VocabEmbedding
    from wllm.model.layers.linear import Linear, MergedLinear, copy_into

    counts: dict[str, int] = {}
    gen: torch.Generator | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (Linear, VocabEmbedding)):
            continue
        weight = module.weight
        if gen is None or gen.device != weight.device:
            gen = torch.Generator(device=weight.device).manual_seed(seed)
        match = re.search(r"layers\.(\d+)\.", name)
        layer = int(match.group(1)) if match else 0
        if isinstance(module, MergedLinear):
            parts = [(sid, start, size) for sid, (start, size) in module.shard_offsets.items()]
        else:
            parts = [(None, 0, weight.shape[0])]
        for shard, start, size in parts:
            role = "output" if isinstance(module, VocabEmbedding) and tied else _role(name, shard)
            if isinstance(module, VocabEmbedding) and not tied:
                role = "embed"
            ggml_name = dummy_quant_type(quantization, role, layer, n_layers, weight.shape[1])
            copy_into(weight.data.narrow(0, start, size), random_quantized((size, weight.shape[1]), ggml_name, gen))
            counts[ggml_name] = counts.get(ggml_name, 0) + 1
    return counts

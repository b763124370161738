"""Real model shapes with random weights (`load_format="dummy"`), for benchmarks and GPU tests
where nothing can be downloaded. The config dicts are the published config.json contents."""

from __future__ import annotations

import copy
from typing import Any

import torch

from wllm.model.loader.errors import ModelLoadError
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

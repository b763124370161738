"""Which model class serves which HF `architectures` name or GGUF `general.architecture`."""

from __future__ import annotations

import importlib

from wllm.model.models.base import ModelBase

# HF architecture name -> (module in wllm.model.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "BertModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    # Headless decoders (embedding checkpoints saved from the base model).
    "LlamaModel": ("llama", "LlamaModel"),
    "Qwen2Model": ("qwen2", "Qwen2Model"),
    "Qwen3Model": ("qwen3", "Qwen3Model"),
}

# Names used by GGUF's `general.architecture` and HF's `model_type`.
_ALIASES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "bert": "BertModel",
    # HF task heads whose base model we can serve as an encoder.
    "BertForMaskedLM": "BertModel",
    "BertForPreTraining": "BertModel",
}


class UnsupportedArchitectureError(ValueError):
    """No wLLM model class implements this architecture."""


def supported_architectures() -> list[str]:
    """HF architecture names we implement."""
    return sorted(_MODELS)


def resolve_architecture(name: str) -> str:
    """Canonical HF architecture name for an HF or GGUF architecture name."""
    if name in _MODELS:
        return name
    if name in _ALIASES:
        return _ALIASES[name]
    raise UnsupportedArchitectureError(
        f"unsupported model architecture {name!r}; supported: {', '.join(supported_architectures())} "
        f"(GGUF: {', '.join(sorted(k for k in _ALIASES if k.islower()))})"
    )


def get_model_class(name: str) -> type[ModelBase]:
    """The model class for an HF or GGUF architecture name."""
    module, cls = _MODELS[resolve_architecture(name)]
    return getattr(importlib.import_module(f"wllm.model.models.{module}"), cls)

"""Gemma: embeddings scaled by sqrt(hidden), (1 + w) RMSNorm, GeGLU (tanh) MLP, tied head."""

from __future__ import annotations

from wllm.model.models.llama import LlamaForCausalLM


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma (1) decoder-only LM; the activation comes from the config (gelu_pytorch_tanh)."""

    norm_offset = 1.0
    scale_embeddings = True

"""Qwen2 / Qwen2.5: Llama layout with bias on q/k/v (not on o_proj)."""

from __future__ import annotations

from wllm.model.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 decoder-only LM."""

    qkv_bias = True
    o_bias = False


class Qwen2Model(Qwen2ForCausalLM):
    """A headless Qwen2 (an embedding checkpoint, e.g. gte-Qwen2)."""

    headless = True

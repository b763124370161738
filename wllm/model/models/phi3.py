"""Phi-3: Llama layout whose checkpoints already store fused qkv_proj and gate_up_proj."""

from __future__ import annotations

from wllm.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 decoder-only LM (no biases; sliding window from the config on every layer)."""

    qkv_bias = False
    o_bias = False

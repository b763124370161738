"""Qwen3: Llama layout plus RMSNorm over each q and k head before RoPE."""

from __future__ import annotations

from wllm.model.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense) decoder-only LM."""

    qk_norm = True


class Qwen3Model(Qwen3ForCausalLM):
    """A headless Qwen3 (an embedding checkpoint, e.g. Qwen3-Embedding)."""

    headless = True

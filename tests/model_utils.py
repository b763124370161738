"""Tiny random HF transformers models of every architecture we implement, and the checks that
compare wLLM against them (logits on a mixed prefill/decode batch, greedy continuations)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import transformers as tf

from wllm.model.contiguous_attention import ContiguousAttention, greedy_generate
from wllm.model.models.base import ModelBase

VOCAB = 300
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# name -> (config class, model class, config overrides). Sliding windows (8) are shorter than
# the test sequences; Llama 3.1 scaling uses a short original context so every band is hit.
TINY_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3.1": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "tie_word_embeddings": True,
        },
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8, "head_dim": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "tie_word_embeddings": False}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16, "hidden_activation": "gelu_pytorch_tanh"}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            # Small caps so that soft-capping changes the result at these tiny scales.
            "attn_logit_softcapping": 1.0,
            "final_logit_softcapping": 2.0,
            "num_hidden_layers": 3,
        },
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    ),
}


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch single-threaded: these models are small-op bound, and on a shared 2-core machine
    intra-op thread hand-offs cost several times the work itself (measured 7x on SmolLM2 decode)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every parameter random values, so norms, biases and (1 + w) offsets all matter."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        elif name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        else:
            # Norm weights: around 1 for plain norms, around 0 for Gemma's (1 + w) norms.
            base = 0.0 if "gemma" in type(model).__name__.lower() else 1.0
            p.copy_(base + torch.randn(p.shape, generator=gen) * 0.1)


def tiny_hf_model(name: str, **overrides: Any) -> tf.PreTrainedModel:
    """A tiny random HF model of the named family, in float32 eval mode with eager attention."""
    cfg_cls, model_cls, extra = TINY_MODELS[name]
    config = getattr(tf, cfg_cls)(**{**_COMMON, **extra, **overrides}, architectures=[model_cls])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(tf, model_cls)(config).eval()
    randomize(model)
    return model


def tiny_hf_bert() -> tf.BertModel:
    """A tiny random BertModel (no pooler), float32, eager attention."""
    config = tf.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        type_vocab_size=2,
        architectures=["BertModel"],
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.BertModel(config, add_pooling_layer=False).eval()
    randomize(model)
    return model


def prompts(lengths: tuple[int, ...] = (20, 13), seed: int = 1) -> list[list[int]]:
    """Random prompts (token ids 3..VOCAB-1, avoiding pad/bos/eos)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_logits(hf: tf.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """HF float32 logits [len(ids), vocab] for one sequence."""
    return hf(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def batch_logit_diff(ours: ModelBase, hf: tf.PreTrainedModel, seqs: list[list[int]]) -> float:
    """Max |ours - HF| over: one forward prefilling all `seqs` (minus their last token) at once,
    then one forward decoding the last token of every sequence together."""
    ctx = ContiguousAttention()
    worst = 0.0
    heads = [s[:-1] for s in seqs]
    ctx.prepare(list(range(len(seqs))), [len(s) for s in heads])
    ids = torch.tensor([t for s in heads for t in s])
    pos = torch.cat([torch.arange(len(s)) for s in heads])
    logits = ours.compute_logits(ours(ids, pos, ctx))
    start = 0
    for s in heads:
        ref = hf_logits(hf, s)
        worst = max(worst, (logits[start : start + len(s)] - ref).abs().max().item())
        start += len(s)
    ctx.prepare(list(range(len(seqs))), [1] * len(seqs))
    ids = torch.tensor([s[-1] for s in seqs])
    pos = torch.tensor([len(s) - 1 for s in seqs])
    logits = ours.compute_logits(ours(ids, pos, ctx))
    for i, s in enumerate(seqs):
        ref = hf_logits(hf, s)[-1]
        worst = max(worst, (logits[i] - ref).abs().max().item())
    return worst


@torch.no_grad()
def hf_greedy(hf: tf.PreTrainedModel, ids: list[int], n: int) -> list[int]:
    """HF greedy continuation of exactly n tokens: a full forward per step, argmax of the last
    position (no EOS handling, no HF cache, nothing between us and the model)."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(hf_logits(hf, seq)[-1].argmax()))
    return seq[len(ids) :]


def check_greedy(ours: ModelBase, hf: tf.PreTrainedModel, ids: list[int], n: int = 32) -> None:
    """Assert our n-token greedy continuation equals HF's."""
    mine = greedy_generate(ours, ids, n)
    theirs = hf_greedy(hf, ids, n)
    assert mine == theirs, f"greedy continuations differ:\nours {mine}\nHF   {theirs}"


def cuda_gated_mlp(hidden: int, intermediate: int, act: str) -> torch.nn.Module:
    """A bf16 GatedMLP on the GPU with N(0, 1/fan_in) weights (outputs O(1)), drawn from torch's global
    generator (callers seed it), its kernels chosen as the loader chooses them."""
    from wllm.model.layers.linear_method import select_kernels
    from wllm.model.layers.mlp import GatedMLP

    mlp = GatedMLP(hidden, intermediate, act).to("cuda", torch.bfloat16)
    mlp.gate_up_proj.weight.data.normal_(std=hidden**-0.5)
    mlp.down_proj.weight.data.normal_(std=intermediate**-0.5)
    select_kernels(mlp)
    return mlp


async def stream_outputs(engine, prompt_ids, params, rid):
    """A request's cumulative output after each delta it streamed from an AsyncEngine (deltas accumulated,
    as a consumer does)."""
    from wllm.outputs import OutputAccumulator

    acc = OutputAccumulator(rid, list(prompt_ids))
    outs = []
    async for delta in engine.generate(prompt_ids, params, rid):
        acc.add(delta)
        outs.append(acc.output())
    return outs

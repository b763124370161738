"""Build a HF-style `config.json` dict from GGUF metadata, for each supported GGUF architecture."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from wllm.model.loader.errors import ModelLoadError

# GGUF `general.architecture` -> (HF model_type, HF architectures entry, activation).
ARCHITECTURES: dict[str, tuple[str, str, str]] = {
    "llama": ("llama", "LlamaForCausalLM", "silu"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", "silu"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", "silu"),
    "gemma": ("gemma", "GemmaForCausalLM", "gelu_pytorch_tanh"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM", "gelu_pytorch_tanh"),
    "phi3": ("phi3", "Phi3ForCausalLM", "silu"),
    "bert": ("bert", "BertModel", "gelu"),
}

# llama.cpp's enum llama_pooling_type, as stored in `{arch}.pooling_type`.
_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}

# Tensors that hold config rather than weights: the loader reads them into hf_config.
CONFIG_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})


def supported_architectures() -> str:
    """Comma-separated GGUF architecture names wLLM can load, for error messages."""
    return ", ".join(ARCHITECTURES)


def build_hf_config(
    path: str,
    metadata: Mapping[str, Any],
    tensor_shapes: Mapping[str, tuple[int, ...]],
    read_tensor: Callable[[str], torch.Tensor],
) -> dict[str, Any]:
    """The HF `config.json` equivalent of a GGUF's metadata.

    `tensor_shapes` maps GGUF tensor names to HF-order shapes; `read_tensor` returns a small
    GGUF tensor (rope factor tables) as float32. `path` is only used in error messages.
    """
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {supported_architectures()}"
        )
    model_type, hf_arch, act = ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    def need(key: str) -> Any:
        value = get(key)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks required key {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    n_layers = int(need("block_count"))
    n_heads = int(need("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        # Some converters write one count per layer; a uniform list is the same as a scalar.
        if len(set(n_kv)) != 1:
            raise ModelLoadError(f"{path}: per-layer KV head counts {n_kv} are not supported")
        n_kv = n_kv[0]
    head_dim = int(get("attention.key_length") or hidden // n_heads)
    vocab = _vocab_size(path, metadata, tensor_shapes, get)

    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv),
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": vocab,
        "hidden_act": act,
        # HF ties lm_head to the embedding exactly when the checkpoint has no separate output matrix.
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "sliding_window": None,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "query_pre_attn_scalar": None,
        "partial_rotary_factor": 1.0,
        "rope_scaling": None,
    }
    if arch == "bert":
        cfg["layer_norm_eps"] = float(get("attention.layer_norm_epsilon", 1e-12))
    else:
        cfg["rms_norm_eps"] = float(get("attention.layer_norm_rms_epsilon", 1e-6))
        cfg["rope_theta"] = float(get("rope.freq_base", 10000.0))
        rope_dims = get("rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != head_dim:
            cfg["partial_rotary_factor"] = int(rope_dims) / head_dim
        cfg["rope_scaling"] = _rope_scaling(get)
    cfg.update(_token_ids(metadata))
    if arch in ("llama", "qwen2", "qwen3"):
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_shapes
    if "rope_freqs.weight" in tensor_shapes:
        # Llama 3.1-style scaling baked into per-frequency divisors; the model divides by them.
        cfg["rope_freq_factors"] = [float(x) for x in read_tensor("rope_freqs.weight").reshape(-1).tolist()]
    _ARCH_EXTRAS[arch](cfg, get, tensor_shapes, read_tensor)
    if arch != "bert" and get("pooling_type") is not None:
        # A decoder converted as an embedding model (Qwen3-Embedding, gte-Qwen2) says how it pools.
        cfg["pooling_type"] = _POOLING.get(int(get("pooling_type")), "none")
    return cfg


def _vocab_size(
    path: str, metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], get: Callable[..., Any]
) -> int:
    # The embedding's row count is what the weights need; the metadata key and the token list
    # are fallbacks for files that lack it (never the case for a loadable model).
    if "token_embd.weight" in shapes:
        return int(shapes["token_embd.weight"][0])
    if get("vocab_size") is not None:
        return int(get("vocab_size"))
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens:
        return len(tokens)
    raise ModelLoadError(f"{path}: cannot tell the vocabulary size (no token_embd.weight tensor)")


def _rope_scaling(get: Callable[..., Any]) -> dict[str, Any] | None:
    kind = get("rope.scaling.type")
    factor = get("rope.scaling.factor")
    if kind is None and get("rope.scale_linear") is not None:
        # Older GGUFs (before rope.scaling.*) only had a linear scale factor.
        kind, factor = "linear", get("rope.scale_linear")
    if kind in (None, "none") or factor is None or float(factor) == 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind), "type": str(kind), "factor": float(factor)}
    orig = get("rope.scaling.original_context_length")
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    for gguf_key, hf_key in (
        ("rope.scaling.attn_factor", "attention_factor"),
        ("rope.scaling.yarn_beta_fast", "beta_fast"),
        ("rope.scaling.yarn_beta_slow", "beta_slow"),
    ):
        if get(gguf_key) is not None:
            scaling[hf_key] = float(get(gguf_key))
    return scaling


def _token_ids(metadata: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for gguf_key, hf_key in (
        ("bos_token_id", "bos_token_id"),
        ("padding_token_id", "pad_token_id"),
        ("unknown_token_id", "unk_token_id"),
    ):
        value = metadata.get(f"tokenizer.ggml.{gguf_key}")
        out[hf_key] = int(value) if value is not None else None
    # llama.cpp stops at every end-of-generation id (eos, eot, eom); HF expresses that as a list.
    eos = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos:
            eos.append(int(value))
    out["eos_token_id"] = None if not eos else eos[0] if len(eos) == 1 else eos
    return out


_Extras = Callable[
    [dict[str, Any], Callable[..., Any], Mapping[str, tuple[int, ...]], Callable[[str], torch.Tensor]], None
]


def _no_extras(cfg: dict[str, Any], get: Callable[..., Any], shapes: Any, read: Any) -> None:
    return None


def _gemma(cfg: dict[str, Any], get: Callable[..., Any], shapes: Any, read: Any) -> None:
    cfg["hidden_activation"] = cfg["hidden_act"]


def _gemma2(cfg: dict[str, Any], get: Callable[..., Any], shapes: Any, read: Any) -> None:
    _gemma(cfg, get, shapes, read)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = get(key)
        cfg[key] = float(value) if value is not None else None
    window = get("attention.sliding_window")
    cfg["sliding_window"] = int(window) if window is not None else None
    # Gemma 2 alternates local (sliding) and global attention, starting with local.
    cfg["layer_types"] = [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg["num_hidden_layers"])
    ]
    scale = get("attention.scale")
    if scale is not None and float(scale) > 0:
        # The key holds 1/sqrt(scalar) as float32; recover the (integer, in every Gemma 2) scalar.
        scalar = 1.0 / float(scale) ** 2
        cfg["query_pre_attn_scalar"] = round(scalar) if abs(scalar - round(scalar)) < 1e-4 * scalar else scalar
    elif cfg["num_hidden_layers"] == 46:
        # GGUF does not store query_pre_attn_scalar; like llama.cpp, recognise Gemma 2 27B by its
        # depth: it scales queries by hidden_size / num_heads instead of head_dim.
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]


def _phi3(cfg: dict[str, Any], get: Callable[..., Any], shapes: Any, read: Any) -> None:
    window = get("attention.sliding_window")
    cfg["sliding_window"] = int(window) if window is not None else None
    orig = get("rope.scaling.original_context_length")
    if orig is not None:
        cfg["original_max_position_embeddings"] = int(orig)
    if "rope_factors_long.weight" in shapes:
        # LongRoPE (Phi-3 128k): the per-frequency factors live in two tensors.
        cfg["rope_scaling"] = {
            "rope_type": "longrope",
            "type": "longrope",
            "long_factor": [float(x) for x in read("rope_factors_long.weight").reshape(-1).tolist()],
            "short_factor": [float(x) for x in read("rope_factors_short.weight").reshape(-1).tolist()],
        }
        if get("rope.scaling.attn_factor") is not None:
            cfg["rope_scaling"]["attention_factor"] = float(get("rope.scaling.attn_factor"))


def _bert(cfg: dict[str, Any], get: Callable[..., Any], shapes: Any, read: Any) -> None:
    types = shapes.get("token_types.weight")
    cfg["type_vocab_size"] = int(types[0]) if types else 2
    cfg["position_embedding_type"] = "absolute"
    cfg["pooling_type"] = _POOLING.get(int(get("pooling_type", 0)), "none")
    cfg["is_causal"] = bool(get("attention.causal", False))


_ARCH_EXTRAS: dict[str, _Extras] = {
    "llama": _no_extras,
    "qwen2": _no_extras,
    "qwen3": _no_extras,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "phi3": _phi3,
    "bert": _bert,
}

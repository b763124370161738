"""Test helper: write a GGUF from an HF-style config dict and state dict, the way llama.cpp's converter does.

It is the inverse of wllm's GGUF loader, written independently of it: tensor names come from
gguf-py's own `TensorNameMap` (the table llama.cpp's convert_hf_to_gguf.py uses), llama Q/K rows
are permuted like the converter's `LlamaModel.permute`, gemma norm weights get +1, and the config
goes into the `{arch}.*` keys llama.cpp writes. Use it to build tiny GGUF models of every
supported architecture in tests:

    paths = write_gguf(tmp_path / "tiny.gguf", hf_config, model.state_dict(), qtype=GGMLType.Q8_0)

1-D tensors (norms, biases) are always stored as F32, as llama.cpp does. 2-D weights use `qtype`
(F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: what gguf.quants can quantize) unless `qtypes`
overrides it by HF name. A `QuantizedTensor` value is written as its raw blocks, which is how
tests store K-quant types that gguf.quants cannot produce.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.constants import MODEL_ARCH, GGMLQuantizationType

from wllm.model.loader.quantized import QuantizedTensor

GGMLType = GGMLQuantizationType

# HF model_type -> (GGUF architecture name, gguf-py MODEL_ARCH).
ARCH_OF_MODEL_TYPE: dict[str, tuple[str, MODEL_ARCH]] = {
    "llama": ("llama", MODEL_ARCH.LLAMA),
    "mistral": ("llama", MODEL_ARCH.LLAMA),  # llama.cpp converts Mistral to the llama architecture
    "qwen2": ("qwen2", MODEL_ARCH.QWEN2),
    "qwen3": ("qwen3", MODEL_ARCH.QWEN3),
    "gemma": ("gemma", MODEL_ARCH.GEMMA),
    "gemma2": ("gemma2", MODEL_ARCH.GEMMA2),
    "phi3": ("phi3", MODEL_ARCH.PHI3),
    "bert": ("bert", MODEL_ARCH.BERT),
}


def llama_permute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row index of llama.cpp's Q/K permute: stored row r is HF row index[r]."""
    rows = np.arange(n_rows)
    return rows.reshape(n_head, 2, n_rows // n_head // 2).swapaxes(1, 2).reshape(-1)


def _add_value(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        (w.add_uint32 if value >= 0 else w.add_int32)(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, Sequence):
        w.add_array(key, list(value))
    else:
        raise TypeError(f"cannot write metadata {key}={value!r}")


def _metadata(arch: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    # transformers 5 keeps rope settings in `rope_parameters`; older configs use flat keys.
    rope = dict(cfg.get("rope_parameters") or {})
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else {})
    md: dict[str, Any] = {
        f"{arch}.context_length": int(cfg.get("max_position_embeddings", 2048)),
        f"{arch}.embedding_length": int(hidden),
        f"{arch}.feed_forward_length": int(cfg["intermediate_size"]),
        f"{arch}.block_count": int(cfg["num_hidden_layers"]),
        f"{arch}.attention.head_count": int(heads),
        f"{arch}.attention.head_count_kv": int(cfg.get("num_key_value_heads") or heads),
        f"{arch}.vocab_size": int(cfg["vocab_size"]),
        "general.name": "wllm-test-model",
        "general.file_type": 0,
    }
    if arch == "bert":
        md[f"{arch}.attention.layer_norm_epsilon"] = float(cfg.get("layer_norm_eps", 1e-12))
        md[f"{arch}.attention.causal"] = False
        md[f"{arch}.pooling_type"] = {"none": 0, "mean": 1, "cls": 2}[cfg.get("pooling_type", "mean")]
    else:
        md[f"{arch}.attention.layer_norm_rms_epsilon"] = float(cfg.get("rms_norm_eps", 1e-6))
        md[f"{arch}.rope.freq_base"] = float(theta)
        md[f"{arch}.rope.dimension_count"] = int(head_dim * (partial or 1.0))
        if cfg.get("head_dim") is not None:
            md[f"{arch}.attention.key_length"] = int(head_dim)
            md[f"{arch}.attention.value_length"] = int(head_dim)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("linear", "yarn"):
        md[f"{arch}.rope.scaling.type"] = kind
        md[f"{arch}.rope.scaling.factor"] = float(scaling["factor"])
        if "original_max_position_embeddings" in scaling:
            md[f"{arch}.rope.scaling.original_context_length"] = int(scaling["original_max_position_embeddings"])
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key) is not None:
                md[f"{arch}.{key}"] = float(cfg[key])
    if arch in ("gemma2", "phi3") and cfg.get("sliding_window") is not None:
        md[f"{arch}.attention.sliding_window"] = int(cfg["sliding_window"])
    if arch == "phi3" and cfg.get("original_max_position_embeddings") is not None:
        md[f"{arch}.rope.scaling.original_context_length"] = int(cfg["original_max_position_embeddings"])
    for hf_key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        value = cfg.get(hf_key)
        if isinstance(value, list):
            value = value[0]
        if value is not None:
            md[f"tokenizer.ggml.{gguf_key}"] = int(value)
    return md


def _encode(value: np.ndarray, qtype: GGMLType) -> tuple[np.ndarray, GGMLType | None]:
    """(array to hand to GGUFWriter.add_tensor, raw_dtype) for a float32 array stored as `qtype`."""
    if qtype == GGMLType.F32:
        return value.astype(np.float32), None
    if qtype == GGMLType.F16:
        return value.astype(np.float16), None
    return gguf.quants.quantize(value.astype(np.float32), qtype), qtype


def write_gguf(
    path: str | Path,
    hf_config: Mapping[str, Any],
    state_dict: Mapping[str, torch.Tensor | QuantizedTensor],
    qtype: GGMLType = GGMLType.F32,
    qtypes: Mapping[str, GGMLType] | None = None,
    extra_metadata: Mapping[str, Any] | None = None,
    split_max_tensors: int = 0,
) -> list[Path]:
    """Write `state_dict` (HF names) and `hf_config` as a GGUF; return the written file(s).

    `split_max_tensors` > 0 writes a split GGUF (`stem-00001-of-0000N.gguf`, ...) with at most
    that many tensors per part. `extra_metadata` adds or overrides key/values (e.g. the
    tokenizer.ggml.* keys); ints are written as UINT32, floats as FLOAT32, lists as arrays.
    `hf_config["rope_freq_factors"]` becomes a `rope_freqs.weight` tensor (Llama 3.1 style).
    """
    path = Path(path)
    model_type = hf_config["model_type"]
    if model_type not in ARCH_OF_MODEL_TYPE:
        raise ValueError(f"write_gguf: unsupported model_type {model_type!r}")
    arch, arch_enum = ARCH_OF_MODEL_TYPE[model_type]
    n_layers = int(hf_config["num_hidden_layers"])
    name_map = gguf.get_tensor_name_map(arch_enum, n_layers)
    qtypes = dict(qtypes or {})
    tied = bool(hf_config.get("tie_word_embeddings", False))

    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    metadata = _metadata(arch, hf_config)
    metadata.update(extra_metadata or {})
    for key, value in metadata.items():
        _add_value(writer, key, value)

    for hf_name, tensor in state_dict.items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp omits output.weight when the head is tied to the embedding
        if arch == "bert" and hf_name.startswith(("pooler.", "embeddings.position_ids")):
            continue  # llama.cpp's BERT converter drops the pooler (llama.cpp pools itself)
        stem, _, suffix = hf_name.rpartition(".")
        gguf_stem = name_map.get_name(stem)
        if gguf_stem is None:
            raise ValueError(f"write_gguf: no GGUF name for {hf_name} in architecture {arch}")
        gguf_name = f"{gguf_stem}.{suffix}"
        rows = None
        if arch == "llama" and gguf_stem.endswith((".attn_q", ".attn_k")):
            heads = hf_config["num_attention_heads"]
            if gguf_stem.endswith(".attn_k"):
                heads = hf_config.get("num_key_value_heads") or heads
            rows = llama_permute_rows(tensor.shape[0], heads)
        if isinstance(tensor, QuantizedTensor):
            if rows is not None:
                tensor = tensor.index_rows(torch.from_numpy(rows))
            writer.add_tensor(gguf_name, tensor.data.cpu().numpy(), raw_dtype=tensor.ggml_type)
            continue
        value = tensor.detach().to(torch.float32).cpu().numpy()
        if rows is not None:
            value = value[rows]
        if arch in ("gemma", "gemma2") and hf_name.endswith("norm.weight"):
            value = value + np.float32(1.0)
        store = qtypes.get(hf_name, qtype if value.ndim >= 2 else GGMLType.F32)
        data, raw_dtype = _encode(np.ascontiguousarray(value), store)
        writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)

    if hf_config.get("rope_freq_factors") is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(hf_config["rope_freq_factors"], dtype=np.float32))
    scaling = hf_config.get("rope_scaling") or {}
    if arch == "phi3" and scaling.get("rope_type", scaling.get("type")) == "longrope":
        writer.add_tensor("rope_factors_long.weight", np.asarray(scaling["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(scaling["short_factor"], dtype=np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(path)

"""Model shapes for benchmarks: where a shape's config comes from and what it weighs.

A shape is a named dummy shape (`wllm.model.loader.dummy.DUMMY_CONFIGS`: the published
config.json of e.g. Llama-3.1-8B) or an HF folder holding a config.json. Parameter counts come
from building wLLM's own model class on the meta device, so they are exact for every
architecture wLLM runs (tied embeddings counted once, q/k/v biases, q/k norms) and cost no memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from wllm.model.config import ModelConfig, parse_dtype
from wllm.model.loader.dummy import DUMMY_CONFIGS, dummy_config
from wllm.model.loader.errors import ModelLoadError


@dataclass(frozen=True)
class Shape:
    """A benchmark model: `source` is what `LLM(source, load_format="dummy")` takes."""

    name: str
    source: str
    hf_config: dict[str, Any]


@dataclass(frozen=True)
class ShapeStats:
    """Sizes of one shape in one dtype, as the floors need them."""

    name: str
    num_params: int
    dtype_bytes: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @property
    def weight_bytes(self) -> int:
        """Bytes of all parameters, the embedding table included."""
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attn_width(self) -> int:
        """Query heads x head size: the inner dimension of the score and value matmuls."""
        return self.num_q_heads * self.head_dim


def resolve_shape(name_or_path: str) -> Shape:
    """A dummy shape name (case-insensitive) or an HF folder / config.json file path."""
    if name_or_path.lower() in DUMMY_CONFIGS:
        key = name_or_path.lower()
        return Shape(key, key, dummy_config(key))
    path = Path(name_or_path)
    folder = path.parent if path.name == "config.json" else path
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(
            f"{name_or_path}: not a benchmark shape; pass one of {', '.join(sorted(DUMMY_CONFIGS))} "
            "or an HF folder with config.json (and tokenizer.json)"
        )
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_file}: expected a JSON object")
    return Shape(folder.name, str(folder), cfg)


def shape_stats(shape: Shape, dtype: str | torch.dtype = "bfloat16") -> ShapeStats:
    """Parameter count and KV geometry of `shape` in `dtype`."""
    from wllm.model.models.registry import get_model_class

    torch_dtype = parse_dtype(dtype)
    assert torch_dtype is not None
    config = ModelConfig.from_hf(shape.hf_config)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config)
    num_params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    return ShapeStats(
        name=shape.name,
        num_params=num_params,
        dtype_bytes=torch.empty((), dtype=torch_dtype).element_size(),
        num_layers=config.num_hidden_layers,
        num_q_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
    )

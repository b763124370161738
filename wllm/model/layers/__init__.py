"""Building blocks shared by the model architectures in wllm.model.models."""

from wllm.model.layers.embedding import VocabEmbedding, compute_logits
from wllm.model.layers.linear import Linear, MergedLinear, QKVLinear, WeightShapeError, materialize
from wllm.model.layers.mlp import GatedMLP, get_activation
from wllm.model.layers.norm import LayerNorm, RMSNorm
from wllm.model.layers.rotary import RotaryEmbedding

__all__ = [
    "GatedMLP",
    "LayerNorm",
    "Linear",
    "MergedLinear",
    "QKVLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "VocabEmbedding",
    "WeightShapeError",
    "compute_logits",
    "get_activation",
    "materialize",
]

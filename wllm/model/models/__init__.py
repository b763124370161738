"""Model architectures (one module per family) and the registry that picks one."""

from wllm.model.models.base import ModelBase, WeightLoadError
from wllm.model.models.registry import (
    UnsupportedArchitectureError,
    get_model_class,
    resolve_architecture,
    supported_architectures,
)

__all__ = [
    "ModelBase",
    "UnsupportedArchitectureError",
    "WeightLoadError",
    "get_model_class",
    "resolve_architecture",
    "supported_architectures",
]

"""Model loading: HF folders and hub ids (safetensors), GGUF files, and dummy weights.

`load_model` is imported lazily: the model classes import `loader.errors`, and an eager
import here would make that circular.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wllm.model.loader.errors import ModelLoadError

if TYPE_CHECKING:
    from wllm.model.loader.model_loader import LoadedModel, load_model

__all__ = ["LoadedModel", "ModelLoadError", "load_model"]


def __getattr__(name: str) -> Any:
    if name in ("LoadedModel", "load_model"):
        from wllm.model.loader import model_loader

        return getattr(model_loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

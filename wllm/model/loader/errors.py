"""Errors raised while reading model files."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model file could not be read: missing, truncated, corrupt, or of an unsupported kind.

    The message always names the file (when there is one) and what is supported.
    """


class UnsupportedQuantTypeError(ModelLoadError, ValueError):
    """A tensor uses a GGML quantization type that wLLM cannot dequantize."""

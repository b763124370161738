"""wLLM: an LLM inference server with prebuilt CUDA kernels and an OpenAI-compatible API."""

from wllm.version import __version__

__all__ = ["__version__"]

"""wLLM: an LLM inference server with prebuilt CUDA kernels and an OpenAI-compatible API.

`from wllm import LLM, SamplingParams` for offline use; both are imported lazily so that
`import wllm` (and the CLI's --help) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wllm.version import __version__

if TYPE_CHECKING:
    from wllm.entrypoints.llm import LLM
    from wllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from wllm.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from wllm.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'wllm' has no attribute {name!r}")

"""wLLM: an LLM inference server with prebuilt CUDA kernels and an OpenAI-compatible API.

`from wllm import LLM, SamplingParams` (and `BeamSearchParams`) for offline use; they are imported lazily so that
`import wllm` (and the CLI's --help) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wllm.version import __version__

if TYPE_CHECKING:
    from wllm.entrypoints.llm import LLM
    from wllm.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "BeamSearchParams", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from wllm.entrypoints.llm import LLM

        return LLM
    if name in ("SamplingParams", "BeamSearchParams"):
        from wllm import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(f"module 'wllm' has no attribute {name!r}")

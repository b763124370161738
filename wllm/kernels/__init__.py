"""wLLM kernels: the prebuilt CUDA library behind custom ops, with pure-PyTorch references."""

from wllm.kernels._lib import KernelError, KernelLibraryError, available, build_info
from wllm.kernels.ops import fused_add_rms_norm, paged_prefill_attention, rms_norm, rotary_embedding
from wllm.kernels.reference import rotary_cos_sin_cache

__all__ = [
    "KernelError",
    "KernelLibraryError",
    "available",
    "build_info",
    "fused_add_rms_norm",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_cos_sin_cache",
    "rotary_embedding",
]

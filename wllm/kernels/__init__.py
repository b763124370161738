"""wLLM kernels: the prebuilt CUDA library behind custom ops, with pure-PyTorch references."""

from wllm.kernels._lib import (
    KernelError,
    KernelLibraryError,
    available,
    build_info,
    set_decode_mma,
    set_decode_tma,
    set_pdl,
    set_prefill_sm90,
)
from wllm.kernels.gemv import gemv
from wllm.kernels.ops import (
    act_and_mul,
    copy_blocks,
    decode_workspace_size,
    fused_add_rms_norm,
    gelu_tanh_and_mul,
    paged_decode_attention,
    paged_prefill_attention,
    reshape_and_cache,
    rms_norm,
    rotary_and_cache,
    rotary_embedding,
    silu_and_mul,
)
from wllm.kernels.reference import rotary_cos_sin_cache
from wllm.kernels.sampling import apply_token_bitmask, pack_sampling_rows, sample

__all__ = [
    "KernelError",
    "KernelLibraryError",
    "act_and_mul",
    "apply_token_bitmask",
    "available",
    "build_info",
    "copy_blocks",
    "decode_workspace_size",
    "fused_add_rms_norm",
    "gelu_tanh_and_mul",
    "gemv",
    "pack_sampling_rows",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_and_cache",
    "rotary_cos_sin_cache",
    "rotary_embedding",
    "sample",
    "set_decode_mma",
    "set_decode_tma",
    "set_prefill_sm90",
    "set_pdl",
    "silu_and_mul",
]

"""Loads the prebuilt kernel library once and binds its C ABI with ctypes.

The library sits in wllm/_lib/ (libwllm_kernels.so or wllm_kernels.dll) with a build_info.json
describing which SMs each toolkit leg compiled. A secondary leg's entry points carry a suffix
(`wllm_rms_norm__cuda12`); the loader picks, per process, the first leg with code for the GPU.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

LIB_DIR = Path(__file__).resolve().parent.parent / "_lib"
LIB_NAME = "wllm_kernels.dll" if sys.platform == "win32" else "libwllm_kernels.so"
ABI_VERSION = 7

WLLM_OK = 0
WLLM_ERR_NO_KERNEL_IMAGE = 3

DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}

c_int, c_int64, c_float, c_void_p = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p

# name -> argument types (all functions return int status, except wllm_last_error and the wllm_set_* test hooks).
SIGNATURES: dict[str, list] = {
    "wllm_abi_version": [],
    "wllm_device_check": [c_int, ctypes.POINTER(c_int), ctypes.POINTER(c_int)],
    "wllm_rms_norm": [c_void_p, c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int64, c_float, c_float,
                      c_int, c_void_p],
    "wllm_fused_add_rms_norm": [c_void_p, c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int64, c_float,
                                c_float, c_int, c_void_p],
    "wllm_rotary_embedding": [c_void_p, c_void_p, c_void_p, c_void_p, c_int64, c_int, c_int, c_int, c_int,
                              c_int64, c_int64, c_int64, c_int, c_int, c_void_p],
    "wllm_paged_prefill_attention": [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,
                                     c_int64, c_int, c_int, c_int, c_int, c_int, c_int64, c_int64, c_int64,
                                     c_int64, c_int64, c_int64, c_int64, c_int64, c_float, c_int, c_float, c_int,
                                     c_void_p],
    # Decode path: KV write, block copy, decode attention, gated activation, sampling.
    "wllm_reshape_and_cache": [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int64, c_int, c_int, c_int,
                               c_int64, c_int64, c_int64, c_int64, c_int64, c_int64, c_int64, c_int64, c_int,
                               c_void_p],
    "wllm_rotary_and_cache": [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,
                              c_int64, c_int, c_int, c_int, c_int, c_int, c_int64, c_int64, c_int64, c_int64,
                              c_int64, c_int64, c_int64, c_int64, c_int64, c_int64, c_int64, c_int, c_int, c_void_p],
    "wllm_copy_blocks": [c_void_p, c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int64, c_int64, c_int64,
                         c_int64, c_int64, c_int64, c_void_p],
    "wllm_host_mapped": [c_void_p],
    "wllm_stage_copy": [c_void_p, c_void_p, c_int64, c_void_p, c_void_p, c_int, c_void_p, c_int64, c_void_p],
    "wllm_paged_decode_workspace_size": [c_int, c_int, c_int, c_int, c_int64, c_int, ctypes.POINTER(c_int64)],
    "wllm_paged_decode_attention": [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_int, c_int,
                                    c_int, c_int, c_int64, c_int64, c_int64, c_int64, c_int64, c_int64, c_int64,
                                    c_int64, c_int64, c_float, c_int, c_float, c_int, c_void_p, c_int64, c_int,
                                    c_void_p],
    "wllm_act_and_mul": [c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int64, c_int, c_int, c_void_p],
    # Skinny GEMM for decode (gemv.cu).
    "wllm_gemv": [c_void_p, c_void_p, c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int64, c_int64, c_int64,
                  c_int, c_int, c_void_p],
    "wllm_gemv_rotary_cache": [c_void_p, c_void_p, c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int64, c_int64,
                               c_void_p, c_void_p, c_void_p, c_int64, c_int, c_void_p, c_void_p, c_int64, c_int, c_int,
                               c_int, c_int, c_int64, c_int64, c_int64, c_int, c_int, c_void_p],
    # Test hooks (tests/test_kernels_*.py): each returns the previous setting, not a status.
    "wllm_set_pdl": [c_int],
    "wllm_set_decode_mma": [c_int],
    "wllm_set_decode_tma": [c_int],
    "wllm_set_prefill_sm90": [c_int],
    "wllm_sample_workspace_size": [ctypes.POINTER(c_int64)],
    # Grammar masks (grammar.cu).
    "wllm_apply_token_bitmask": [c_void_p, c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int64, c_int, c_void_p],
    "wllm_sample": [c_void_p, c_int64, c_int64, c_int64, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,
                    c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int64, c_void_p, c_int64, c_void_p],
}


class KernelLibraryError(RuntimeError):
    """The kernel library is missing, unloadable or has no code for this GPU."""


class KernelError(RuntimeError):
    """A kernel call returned an error code."""


@dataclass
class Binding:
    """The entry points of one toolkit leg, ready to call."""

    leg: str
    functions: dict[str, ctypes._CFuncPtr]
    last_error: ctypes._CFuncPtr
    binary_sm: int
    ptx_version: int

    def __getattr__(self, name: str) -> ctypes._CFuncPtr:
        try:
            return self.functions[name]
        except KeyError:
            raise AttributeError(name) from None

    def check(self, status: int, what: str) -> None:
        """Raise KernelError carrying the library's message when status != 0."""
        if status != WLLM_OK:
            message = self.last_error().decode("utf-8", "replace")
            raise KernelError(f"{what} failed (status {status}): {message}")


def build_info() -> dict | None:
    """Contents of build_info.json next to the library, or None if absent."""
    path = library_path().parent / "build_info.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def library_path() -> Path:
    override = os.environ.get("WLLM_KERNEL_LIBRARY")
    return Path(override) if override else LIB_DIR / LIB_NAME


_lock = threading.Lock()
_cdll: ctypes.CDLL | None = None
_bindings: dict[int, Binding] = {}


def _load_cdll() -> ctypes.CDLL:
    global _cdll
    if _cdll is None:
        path = library_path()
        if not path.is_file():
            raise KernelLibraryError(
                f"the wLLM CUDA kernel library is not installed ({path} is missing): this is a CPU-only "
                "install (it was built without nvcc). Install a prebuilt wheel (`pip install --force-reinstall "
                "wllm-server`) or rebuild with the CUDA toolkit on PATH."
            )
        try:
            _cdll = ctypes.CDLL(str(path))
        except OSError as exc:
            raise KernelLibraryError(f"could not load the kernel library {path}: {exc}") from exc
    return _cdll


def _bind_leg(cdll: ctypes.CDLL, suffix: str) -> tuple[dict[str, ctypes._CFuncPtr], ctypes._CFuncPtr]:
    functions = {}
    for name, argtypes in SIGNATURES.items():
        fn = getattr(cdll, name + suffix)
        fn.argtypes = argtypes
        fn.restype = c_int
        functions[name] = fn
    last_error = getattr(cdll, "wllm_last_error" + suffix)
    last_error.argtypes = []
    last_error.restype = ctypes.c_char_p
    return functions, last_error


def legs() -> list[tuple[str, str]]:
    """(leg name, symbol suffix) of every toolkit leg in the library, primary first."""
    info = build_info()
    if info is None:
        return [("primary", "")]
    return [(leg["name"], leg["suffix"]) for leg in info["legs"]]


def binding(device: int = 0) -> Binding:
    """The entry points to use on a CUDA device: loads the library once and checks that some leg
    holds code this GPU can run (prebuilt SASS or PTX it can JIT-compile)."""
    cached = _bindings.get(device)
    if cached is not None:
        return cached
    with _lock:
        if device in _bindings:
            return _bindings[device]
        cdll = _load_cdll()
        failures = []
        for leg, suffix in legs():
            try:
                functions, last_error = _bind_leg(cdll, suffix)
            except AttributeError:
                failures.append(f"{leg}: entry points missing")
                continue
            abi = functions["wllm_abi_version"]()
            if abi != ABI_VERSION:
                raise KernelLibraryError(
                    f"kernel library ABI {abi} does not match this wllm ({ABI_VERSION}); reinstall wllm-server"
                )
            sm, ptx = c_int(0), c_int(0)
            status = functions["wllm_device_check"](device, ctypes.byref(sm), ctypes.byref(ptx))
            if status == WLLM_OK:
                _bindings[device] = Binding(leg, functions, last_error, sm.value, ptx.value)
                return _bindings[device]
            failures.append(f"{leg}: {last_error().decode('utf-8', 'replace')}")
        info = build_info() or {}
        built = sorted({sm for leg in info.get("legs", []) for sm in leg["sm"]})
        raise KernelLibraryError(
            f"the kernel library has no code for CUDA device {device} ({'; '.join(failures)}). "
            f"It was built for SM {', '.join(built) or 'unknown'}; install a wheel built for your GPU."
        )


def available(device: int = 0) -> bool:
    """True when kernels can run on this CUDA device (never raises)."""
    try:
        binding(device)
        return True
    except (KernelLibraryError, OSError):
        return False


# Test hooks. Each turns a default kernel choice off (or back on) for launches made from now on, process-wide,
# so that the tests on one GPU also cover the kernels other GPUs run by default; outputs are unchanged. They
# are not settings for users (the engine never calls them) and return the previous setting.


def set_pdl(enabled: bool, device: int = 0) -> bool:
    """Launch with Programmatic Dependent Launch (the default on sm_90+: a decode-path kernel may start its
    independent prologue while the kernel before it finishes) or without it, as older GPUs do. Results are
    bit-identical either way; a CUDA graph keeps the setting it was captured with."""
    return bool(binding(device).wllm_set_pdl(1 if enabled else 0))


def set_decode_mma(enabled: bool, small_batch: bool = False, device: int = 0) -> bool:
    """Run paged decode attention on tensor cores (sm_80+, fp16/bf16, head sizes up to 128) or on the FMA
    kernel that older GPUs, fp32 and head size 256 use. By default (enabled, small_batch=False) small batches
    (a few sequences) stay on the FMA kernel; small_batch=True runs them on the tensor cores' latency variant
    too. Returns whether tensor cores were on before."""
    mode = (1 if small_batch else 2) if enabled else 0
    return bool(binding(device).wllm_set_decode_mma(mode))


def set_decode_tma(mode: str, device: int = 0) -> str:
    """How paged decode attention's tensor-core kernel takes its K/V tiles on SM 9.0 (head sizes 64 and
    128, no sliding window): "persistent" (the default: calls without splits run on a resident grid whose
    CTAs stream unit after unit, the rest one CTA per sequence and KV head), "per-cta" (one CTA per unit
    everywhere) or "off" (per-row bulk copies, as other tensor-core GPUs run it). Returns the previous mode."""
    modes = ("off", "per-cta", "persistent")
    if mode not in modes:
        raise ValueError(f"decode TMA mode must be one of {', '.join(modes)}, got {mode!r}")
    return modes[binding(device).wllm_set_decode_tma(modes.index(mode))]


def set_prefill_sm90(enabled: bool, device: int = 0) -> bool:
    """Run paged prefill attention on SM 9.0 GPUs (fp16/bf16, head sizes 64 and 128) with the Hopper
    warpgroup-MMA kernel (the default) or the mma.sync kernel other tensor-core GPUs use; returns the
    previous setting."""
    return bool(binding(device).wllm_set_prefill_sm90(1 if enabled else 0))

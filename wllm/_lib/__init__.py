"""Holds the prebuilt kernel library (wllm_kernels.so / wllm_kernels.dll) and build_info.json."""

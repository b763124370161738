"""`load_model`: from a folder, hub id, GGUF file or dummy shape name to a ready model.

The model is built on the meta device (no memory, no random init), cast to the target dtype
there, materialised uninitialised on the target device, then filled from the checkpoint, so
an 8B model never exists twice and never pays for an initialisation it would overwrite.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from wllm.model.config import ConfigError, ModelConfig, parse_dtype
from wllm.model.layers.linear_method import select_kernels
from wllm.model.loader.dummy import DUMMY_CONFIGS, dummy_config, init_dummy_quantized_weights, init_dummy_weights
from wllm.model.loader.errors import ModelLoadError
from wllm.model.loader.hf_source import ResolvedSource, resolve_source
from wllm.model.loader.presets import DUMMY_QUANTIZATIONS
from wllm.model.loader.safetensors_loader import (
    count_tensors,
    find_safetensors_files,
    iter_safetensors,
    safetensors_total_bytes,
)
from wllm.model.models import ModelBase, UnsupportedArchitectureError, get_model_class

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# Below this many bytes a progress bar is more noise than help.
_PROGRESS_MIN_BYTES = 256 << 20


@dataclass
class LoadedModel:
    """A loaded model and where it came from."""

    model: ModelBase
    config: ModelConfig
    source: str  # what the caller passed
    load_format: str  # "safetensors", "gguf" or "dummy"
    path: Path | None  # the HF folder or the (first) GGUF file; None for a named dummy shape
    tokenizer_path: Path | None  # HF folder or GGUF file to build the tokenizer from
    dtype: torch.dtype
    device: torch.device
    generation_config: dict[str, Any] = field(default_factory=dict)


def resolve_device(device: str | torch.device) -> torch.device:
    """A concrete device ("cuda" becomes the current CUDA device)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device: torch.device, is_gguf: bool) -> torch.dtype:
    """The dtype to run in: explicit, or "auto" = the checkpoint's dtype (GGUF: float16 on CUDA,
    float32 on the CPU). bfloat16 falls back to float16 on GPUs without bfloat16 support."""
    if dtype != "auto":
        try:
            chosen = parse_dtype(dtype)
        except ConfigError as e:
            raise ModelLoadError(str(e)) from None
        assert chosen is not None
    elif is_gguf:
        chosen = torch.float16 if device.type == "cuda" else torch.float32
    else:
        chosen = config.dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    if chosen == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        chosen = torch.float16
    return chosen


# Called with the model built on the meta device (shapes and dtypes, no storage) before any memory is
# allocated for it; raises ValueError when it cannot fit (wllm.engine.memory_plan).
MemoryCheck = Callable[[ModelBase, ModelConfig, torch.dtype], None]


def build_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                memory_check: MemoryCheck | None = None) -> ModelBase:
    """An uninitialised model of `config`'s architecture on `device` in `dtype`."""
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config)
    model = model.to(dtype=dtype)
    if memory_check is not None:
        memory_check(model, config, dtype)
    model.to_empty(device=device)
    return model.eval()


def load_model(
    source: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    revision: str | None = None,
    quantization: str | None = None,
    memory_check: MemoryCheck | None = None,
) -> LoadedModel:
    """Load a model from an HF folder, an HF hub id, a (split) GGUF file, or a dummy shape.

    `load_format="dummy"` takes a shape name ({shapes}) or any source with a config.json, and
    fills random weights; with `quantization` ({quants}) they are random GGUF blocks of that preset's
    per-tensor types. `memory_check` sees the model's shapes before its memory is allocated (and may refuse).
    Every failure raises ModelLoadError naming the file involved.
    """
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"unknown load_format {load_format!r}; supported: {', '.join(LOAD_FORMATS)}")
    dev = resolve_device(device)
    text = os.fspath(source)
    if quantization is not None and load_format != "dummy":
        raise ModelLoadError(
            f"quantization={quantization!r} makes random quantized weights and needs load_format='dummy'; "
            "a GGUF file's tensors keep the types they were saved with"
        )
    if load_format == "dummy":
        loaded = _load_dummy(text, dtype, dev, revision, quantization, memory_check)
    else:
        resolved = resolve_source(text, revision)
        if load_format == "gguf" and resolved.kind != "gguf":
            raise ModelLoadError(f"{resolved.path}: load_format='gguf' but this is not a GGUF file")
        if load_format == "safetensors" and resolved.kind != "hf":
            raise ModelLoadError(f"{resolved.path}: load_format='safetensors' but this is a GGUF file")
        if resolved.kind == "gguf":
            loaded = _load_gguf(text, resolved.path, dtype, dev, memory_check)
        else:
            loaded = _load_hf(text, resolved, dtype, dev, memory_check)
    # The weights are final and on their device: every layer's linear method picks its kernels now.
    select_kernels(loaded.model)
    return loaded


if load_model.__doc__:
    load_model.__doc__ = load_model.__doc__.replace("{shapes}", ", ".join(sorted(DUMMY_CONFIGS))).replace(
        "{quants}", ", ".join(DUMMY_QUANTIZATIONS)
    )


def read_hf_config(folder: Path) -> dict[str, Any]:
    """config.json of an HF folder as a dict."""
    path = folder / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{folder}: no config.json") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return cfg


def _generation_config(folder: Path) -> dict[str, Any]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _model_config(hf: dict[str, Any], where: object) -> ModelConfig:
    try:
        config = ModelConfig.from_hf(hf)
        get_model_class(config.architecture)
    except (ConfigError, UnsupportedArchitectureError) as e:
        raise ModelLoadError(f"{where}: {e}") from None
    return config


def _construct(config: ModelConfig, dev: torch.device, dtype: torch.dtype, where: object,
               memory_check: MemoryCheck | None = None) -> ModelBase:
    try:
        return build_model(config, dev, dtype, memory_check)
    except torch.OutOfMemoryError:
        raise ModelLoadError(f"{where}: not enough memory on {dev} for the model in {dtype}") from None
    except (ValueError, ConfigError) as e:
        raise ModelLoadError(f"{where}: {e}") from None


def _fill(holder: list[ModelBase], weights: Iterable[tuple[str, Any]], where: object) -> ModelBase:
    """Load weights into the model in `holder` (which is emptied) and return it.

    The model travels in a list so that no caller frame holds it: on failure the error is
    raised outside any `except` block after the last reference is dropped, so neither the
    traceback nor an exception context keeps the half-built model (and its memory) alive.
    """
    model = holder.pop()
    err: ModelLoadError | None = None
    try:
        model.load_weights(weights)
    except ModelLoadError as e:
        msg = str(e)
        err = ModelLoadError(msg if str(where) in msg else f"{where}: {msg}")
    if err is not None:
        del model
        raise err
    return model


def _progress(items: Iterable[tuple[str, Any]], total: int, nbytes: int, desc: str) -> Iterator[tuple[str, Any]]:
    """Wrap with a tqdm bar on a terminal for large models; otherwise pass through."""
    if nbytes < _PROGRESS_MIN_BYTES or not sys.stderr.isatty():
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency, but loading must not depend on a progress bar
        yield from items
        return
    with tqdm(total=total, desc=desc, unit="tensor", leave=False) as bar:
        for item in items:
            yield item
            bar.update(1)


def _load_hf(source: str, resolved: ResolvedSource, dtype: str | torch.dtype, dev: torch.device,
             memory_check: MemoryCheck | None = None) -> LoadedModel:
    folder = resolved.path
    config = _model_config(read_hf_config(folder), folder / "config.json")
    files = find_safetensors_files(folder)
    chosen = resolve_dtype(dtype, config, dev, is_gguf=False)
    holder = [_construct(config, dev, chosen, folder, memory_check)]
    # safetensors reads straight into CUDA memory; the CPU path memory-maps.
    weights = _progress(
        iter_safetensors(files, dev),
        count_tensors(files),
        safetensors_total_bytes(files),
        f"Loading {folder.name}",
    )
    model = _fill(holder, weights, folder)
    return LoadedModel(
        model=model,
        config=config,
        source=source,
        load_format="safetensors",
        path=folder,
        tokenizer_path=folder,
        dtype=chosen,
        device=dev,
        generation_config=_generation_config(folder),
    )


def _load_gguf(source: str, path: Path, dtype: str | torch.dtype, dev: torch.device,
               memory_check: MemoryCheck | None = None) -> LoadedModel:
    from wllm.model.loader.gguf_loader import GGUFModel

    with GGUFModel(path) as gguf:
        config = _model_config(gguf.hf_config, path)
        chosen = resolve_dtype(dtype, config, dev, is_gguf=True)
        holder = [_construct(config, dev, chosen, path, memory_check)]
        nbytes = sum(p.stat().st_size for p in gguf.paths)
        # Quantized weights arrive as packed blocks, moved to `dev` before they are
        # dequantized into the parameter (cheaper than moving float32 values).
        raw = gguf.iter_weights(device=dev if dev.type != "cpu" else None)
        weights = _progress(raw, len(gguf.weight_names()), nbytes, f"Loading {path.name}")
        model = _fill(holder, weights, path)
    return LoadedModel(
        model=model,
        config=config,
        source=source,
        load_format="gguf",
        path=path,
        tokenizer_path=path,
        dtype=chosen,
        device=dev,
    )


def _load_dummy(source: str, dtype: str | torch.dtype, dev: torch.device, revision: str | None,
                quantization: str | None = None, memory_check: MemoryCheck | None = None) -> LoadedModel:
    path: Path | None = None
    if source.lower() in DUMMY_CONFIGS:
        hf = dummy_config(source)
        where: object = f"dummy shape {source!r}"
    else:
        resolved = resolve_source(source, revision)
        if resolved.kind != "hf":
            raise ModelLoadError(
                f"{source}: load_format='dummy' needs a shape name ({', '.join(sorted(DUMMY_CONFIGS))}) "
                "or an HF folder / hub id with config.json"
            )
        path = resolved.path
        hf = read_hf_config(path)
        where = path / "config.json"
    config = _model_config(hf, where)
    chosen = resolve_dtype(dtype, config, dev, is_gguf=False)
    model = _construct(config, dev, chosen, where, memory_check)
    init_dummy_weights(model)
    if quantization is not None:
        init_dummy_quantized_weights(model, quantization, config.num_hidden_layers, config.tie_word_embeddings)
    return LoadedModel(
        model=model,
        config=config,
        source=source,
        load_format="dummy",
        path=path,
        tokenizer_path=path,
        dtype=chosen,
        device=dev,
        generation_config=_generation_config(path) if path else {},
    )

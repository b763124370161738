"""Finding and reading the safetensors files of an HF model folder (single or sharded)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from wllm.model.loader.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def find_safetensors_files(folder: Path) -> list[Path]:
    """The weight files of an HF folder: those named by model.safetensors.index.json, else
    model.safetensors, else every *.safetensors (minus Mistral's duplicate consolidated.*)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files = [folder / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shard(s) that are missing: {', '.join(missing)}")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not files:
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = f" (found {', '.join(others[:3])}: PyTorch pickles are not supported)" if others else ""
        raise ModelLoadError(f"{folder}: no *.safetensors weight files{hint}; supported: safetensors, GGUF")
    return files


def safetensors_total_bytes(files: list[Path]) -> int:
    """Total size of the files on disk (for progress reporting)."""
    return sum(f.stat().st_size for f in files)


def count_tensors(files: list[Path]) -> int:
    """Number of tensors across the files (reads only the headers)."""
    total = 0
    for f in files:
        with _open(f, "cpu") as st:
            total += len(list(st.keys()))
    return total


def _open(path: Path, device: str):  # noqa: ANN202 - safetensors' handle has no public type
    try:
        return safe_open(str(path), framework="pt", device=device)
    except Exception as e:  # safetensors raises its own SafetensorError, OSError, ...
        raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from None


def iter_safetensors(files: list[Path], device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of every file, read lazily (memory-mapped).

    Tensors are read straight onto `device` ("cuda:0" avoids a host copy); a truncated or
    corrupt file raises ModelLoadError naming it.
    """
    dev = str(device)
    for path in files:
        with _open(path, dev) as st:
            for name in st.keys():
                try:
                    tensor = st.get_tensor(name)
                except Exception as e:
                    raise ModelLoadError(f"{path}: cannot read tensor {name!r} ({e})") from None
                yield name, tensor

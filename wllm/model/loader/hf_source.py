"""Turning a model `source` string into local files: a folder, a GGUF, or an HF hub snapshot."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from wllm.model.loader.errors import ModelLoadError

# What we fetch from a hub repo: configs, safetensors weights and tokenizer files; never
# PyTorch pickles, TF/Flax weights or the many GGUFs some repos carry.
HUB_ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "*.jinja",  # chat_template.jinja (newer repos keep the template beside tokenizer_config.json)
    "merges.txt",
    "vocab.txt",
    "vocab.json",
]

_SPLIT_GGUF = re.compile(r"^(?P<stem>.+)-(?P<idx>\d{5})-of-(?P<n>\d{5})\.gguf$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass(frozen=True)
class ResolvedSource:
    """Where a model's files are on disk."""

    kind: str  # "hf" (folder with config.json + safetensors) or "gguf"
    path: Path  # the folder, or the (first) GGUF file
    origin: str  # "local" or "hub"


def _gguf_in_folder(folder: Path) -> Path | None:
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        return None
    firsts = [p for p in ggufs if not _SPLIT_GGUF.match(p.name) or _SPLIT_GGUF.match(p.name)["idx"] == "00001"]
    if len(firsts) != 1:
        raise ModelLoadError(
            f"{folder}: holds several GGUF models ({', '.join(p.name for p in firsts)}); pass the file path"
        )
    return firsts[0]


def resolve_local(path: Path) -> ResolvedSource:
    """Classify an existing local path."""
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: unsupported model file; pass a .gguf file or an HF folder with config.json")
        return ResolvedSource("gguf", path, "local")
    if (path / "config.json").is_file():
        return ResolvedSource("hf", path, "local")
    gguf = _gguf_in_folder(path)
    if gguf is not None:
        return ResolvedSource("gguf", gguf, "local")
    raise ModelLoadError(f"{path}: no config.json and no .gguf file; supported: an HF folder or a GGUF file")


def looks_like_hub_id(source: str) -> bool:
    """True for "org/name" strings that are not local paths."""
    return bool(_HUB_ID.match(source)) and not source.endswith(".gguf")


def resolve_source(source: str | os.PathLike[str], revision: str | None = None) -> ResolvedSource:
    """Local folder / GGUF file, else an HF hub id downloaded (or found in the HF cache).

    Honours HF_HUB_OFFLINE: offline, only the local HF cache is consulted.
    """
    path = Path(source).expanduser()
    if path.exists():
        return resolve_local(path)
    text = str(source)
    if not looks_like_hub_id(text):
        raise ModelLoadError(f"{text}: no such file or folder (and not an HF hub id like 'org/name')")
    return ResolvedSource("hf", download_from_hub(text, revision), "hub")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def download_from_hub(repo_id: str, revision: str | None = None) -> Path:
    """snapshot_download of the files we need; clear errors for offline / missing repos."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency
        raise ModelLoadError(f"{repo_id}: huggingface_hub is needed to download models ({e})") from None
    offline = _offline()
    try:
        folder = snapshot_download(
            repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=offline
        )
    except LocalEntryNotFoundError:
        if offline:
            raise ModelLoadError(
                f"{repo_id}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                "download it once with network access or pass a local folder"
            ) from None
        raise ModelLoadError(f"{repo_id}: could not reach the Hugging Face Hub and the model is not cached") from None
    except GatedRepoError:
        raise ModelLoadError(f"{repo_id}: gated repository; accept its licence and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"{repo_id}: no such model on the Hugging Face Hub (or it is private)") from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"{repo_id}: revision {revision!r} not found") from None
    except OSError as e:
        raise ModelLoadError(f"{repo_id}: download failed ({e})") from None
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{repo_id}: the repository has no config.json; supported: HF transformers models")
    return path

"""Turning a model `source` string into local files: a folder, a GGUF, or an HF hub snapshot."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
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


def parse_hub_ref(text: str) -> tuple[str, str | None] | None:
    """'org/name' -> (repo, None); 'org/name:FILE' -> (repo, FILE), where FILE is a GGUF file in the repo
    or a quantization tag such as Q4_K_M (as Ollama's hf.co/org/name:TAG); None for anything else."""
    repo, sep, selector = text.partition(":")
    if not _HUB_ID.match(repo) or repo.endswith(".gguf") or (sep and not selector):
        return None
    return repo, selector or None


def resolve_source(source: str | os.PathLike[str], revision: str | None = None) -> ResolvedSource:
    """Local folder / GGUF file, else an HF hub repo downloaded (or found in the HF cache): `org/name`
    (its safetensors, or when it has none its GGUF: Q4_K_M when there are several) or `org/name:FILE`.

    Honours HF_HUB_OFFLINE: offline, only the local HF cache is consulted.
    """
    path = Path(source).expanduser()
    if path.exists():
        return resolve_local(path)
    text = str(source)
    ref = parse_hub_ref(text)
    if ref is None:
        raise ModelLoadError(f"{text}: no such file or folder (and not an HF hub id like 'org/name' or "
                             "'org/name:FILE.gguf')")
    repo, selector = ref
    if selector is None:
        try:
            return ResolvedSource("hf", download_from_hub(repo, revision), "hub")
        except NoConfigError:
            pass  # a GGUF-only repository
    return ResolvedSource("gguf", download_gguf(repo, selector, revision), "hub")


class NoConfigError(ModelLoadError):
    """The hub repository has no config.json (it may hold GGUF files instead)."""


DEFAULT_QUANT = "Q4_K_M"  # what `org/name` picks in a repo of several GGUFs (Ollama's default too)


def _gguf_models(files: list[str]) -> dict[str, list[str]]:
    """GGUF model name (the first file of a split set) -> all its files."""
    models: dict[str, list[str]] = {}
    for name in sorted(f for f in files if f.lower().endswith(".gguf")):
        split = _SPLIT_GGUF.match(Path(name).name)
        first = name if not split else str(Path(name).with_name(f"{split['stem']}-00001-of-{split['n']}.gguf"))
        models.setdefault(first.replace("\\", "/"), []).append(name)
    return models


def select_gguf(repo_id: str, files: list[str], selector: str | None) -> list[str]:
    """The files of the one GGUF model that `selector` (a file name, a quantization tag, or None) names."""
    models = _gguf_models(files)
    if not models:
        raise ModelLoadError(f"{repo_id}: no config.json and no .gguf file in the repository; supported: "
                             "HF transformers models (config.json + safetensors) or GGUF files")
    listing = ", ".join(Path(m).name for m in models)
    if selector is not None and selector.lower().endswith(".gguf"):
        for first, parts in models.items():
            if selector in (first, Path(first).name) or selector in parts or selector in [Path(p).name for p in parts]:
                return parts
        raise ModelLoadError(f"{repo_id}: no file {selector!r} in the repository; its GGUF files: {listing}")
    tag = (selector or DEFAULT_QUANT).lower()
    matches = [parts for first, parts in models.items() if tag in Path(first).name.lower()]
    if len(matches) == 1:
        return matches[0]
    if selector is None and len(models) == 1:
        return next(iter(models.values()))
    if not matches:
        what = f"no GGUF file matching {selector!r}" if selector else f"several GGUF files and none is {DEFAULT_QUANT}"
    else:
        what = f"several GGUF files match {tag!r}"
    raise ModelLoadError(f"{repo_id}: {what}; pick one with {repo_id}:FILE, from: {listing}")


def download_gguf(repo_id: str, selector: str | None, revision: str | None = None) -> Path:
    """Download (or find in the HF cache) one GGUF model of a hub repo; returns its (first) file."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    offline = _offline()
    why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
    ref = repo_id + (f":{selector}" if selector else "")
    not_cached = (f"{repo_id}: not in the local Hugging Face cache and {why}; "
                  f"run `wllm pull {ref}` with network access")
    with _hub_errors(repo_id, revision, not_cached):
        if offline:  # what the cache holds of this repo
            folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=["*.gguf"],
                                            local_files_only=True))
            files = [p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf")]
        else:
            files = HfApi().list_repo_files(repo_id, revision=revision)
        parts = select_gguf(repo_id, files, selector)
        # Each file: resumable (a partial download continues), verified and kept in the HF cache.
        paths = [Path(hf_hub_download(repo_id, part, revision=revision, local_files_only=offline)) for part in parts]
    return paths[0]


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None, not_cached: str) -> Iterator[None]:
    """huggingface_hub's failures as ModelLoadErrors naming the repo (`not_cached`: the offline/unreachable one)."""
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except LocalEntryNotFoundError:
        raise ModelLoadError(not_cached) from None
    except GatedRepoError:
        raise ModelLoadError(f"{repo_id}: gated repository; accept its licence and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"{repo_id}: no such model on the Hugging Face Hub (or it is private)") from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"{repo_id}: revision {revision!r} not found") from None
    except OSError as e:
        raise ModelLoadError(f"{repo_id}: download failed ({e})") from None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def download_from_hub(repo_id: str, revision: str | None = None) -> Path:
    """snapshot_download of the files we need; clear errors for offline / missing repos."""
    from huggingface_hub import snapshot_download

    offline = _offline()
    not_cached = (f"{repo_id}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set; download it once "
                  "with network access or pass a local folder" if offline
                  else f"{repo_id}: could not reach the Hugging Face Hub and the model is not cached")
    with _hub_errors(repo_id, revision, not_cached):
        folder = snapshot_download(
            repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=offline
        )
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise NoConfigError(f"{repo_id}: the repository has no config.json; supported: HF transformers models")
    return path

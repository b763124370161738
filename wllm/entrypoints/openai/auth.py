"""API keys: where they come from, how they are checked, and how they appear in logs.

Keys come from `--api-key` flags, the environment (`WLLM_API_KEY`, or a comma-separated
`WLLM_API_KEYS`) and an optional file (one key per line, `#` comments). They are compared in
constant time against every configured key (no early exit that would leak which key almost
matched), and only a short hash of a key (its "key id") is ever logged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from pathlib import Path


class APIKeyError(ValueError):
    """The key file could not be read or held no keys."""


def key_id(key: str) -> str:
    """A stable, non-reversible label for a key, safe to log and to use as a rate-limit bucket."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:10]


def _read_key_file(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise APIKeyError(f"cannot read API key file {path}: {exc.strerror or exc}") from exc
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise APIKeyError(f"API key file {path} holds no keys (one key per line; lines starting with # are comments)")
    return keys


def collect_api_keys(
    flag_keys: Iterable[str] = (),
    key_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """All configured keys (flags, env WLLM_API_KEY / WLLM_API_KEYS, file), de-duplicated in order."""
    env = os.environ if environ is None else environ
    keys: list[str] = [k.strip() for k in flag_keys if k and k.strip()]
    if env.get("WLLM_API_KEY", "").strip():
        keys.append(env["WLLM_API_KEY"].strip())
    keys.extend(k.strip() for k in env.get("WLLM_API_KEYS", "").split(",") if k.strip())
    if key_file is not None:
        keys.extend(_read_key_file(Path(key_file)))
    return list(dict.fromkeys(keys))


class APIKeyChecker:
    """Checks bearer tokens against the configured keys in constant time."""

    def __init__(self, keys: Iterable[str]) -> None:
        # Compare fixed-length digests so the comparison time does not depend on the key length either.
        self._digests = [(hashlib.sha256(k.encode()).digest(), key_id(k)) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, presented: str | None) -> str | None:
        """The key id of a valid key, else None. Every configured key is compared, match or not."""
        if presented is None:
            return None
        digest = hashlib.sha256(presented.encode()).digest()
        found: str | None = None
        for known, kid in self._digests:
            if hmac.compare_digest(digest, known):
                found = kid
        return found


def bearer_token(authorization: str | None, x_api_key: str | None = None) -> str | None:
    """The key a client presented: `Authorization: Bearer <key>`, or an `x-api-key` header."""
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    if x_api_key:
        return x_api_key.strip()
    return None

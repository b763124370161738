"""`wllm service`: run `wllm serve --config FILE` as a system service that starts at boot and restarts
on failure: a systemd unit on Linux (wllm/service/systemd.py), a Windows service through pywin32
(wllm/service/windows.py). Both run the interpreter that installed them, so a virtual environment works.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

DEFAULT_NAME = "wllm"
# What the service manager waits beyond --shutdown-timeout for a stop: the cut requests' last bytes
# (serve_cli.CUT_GRACE_S) and the engine's own shutdown.
STOP_MARGIN_S = 30.0


class ServiceError(RuntimeError):
    """A service command failed; the message says what to do."""


def check_name(name: str) -> str:
    # A name that is a valid systemd unit name and Windows service name, with nothing to quote.
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
        raise ServiceError(f"service name {name!r}: use letters, digits, '-', '_' and '.' (at most 64)")
    return name


def default_config_path(system: bool) -> Path:
    """Where `wllm service install` puts the config file when none is given."""
    if sys.platform == "win32":
        return Path(os.environ.get("PROGRAMDATA", r"C:\ProgramData")) / "wllm" / "config.toml"
    if system:
        return Path("/etc/wllm/config.toml")
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "wllm" / "config.toml"


def prepare_config(config: Path | None, system: bool) -> tuple[Path, float, bool]:
    """The config file a service will run (absolute), checked now so a bad one fails at install and not
    at every restart; a missing one is written with every setting at its default. Returns the path, the
    file's --shutdown-timeout, and whether it was written."""
    from wllm.settings import ConfigError, format_settings, resolve

    path = Path(config).expanduser().resolve() if config is not None else default_config_path(system)
    written = False
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        header = (
            "# wLLM server settings: the keys are the `wllm serve` flags without '--'.\n"
            "# Uncomment and edit; `wllm config show --config THIS_FILE` prints what serve will use.\n\n"
        )
        body = format_settings(resolve({}, None, environ={}))
        # Every line commented: the file holds no setting until the user sets one.
        commented = "\n".join(line if not line or line.startswith("#") else f"# {line}" for line in body.splitlines())
        path.write_text(header + commented + "\n", encoding="utf-8")
        written = True
    try:
        settings = resolve({}, path, environ={})
    except ConfigError as exc:
        raise ServiceError(str(exc)) from None
    return path, float(settings["shutdown_timeout"].value), written

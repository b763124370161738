"""`wllm service` on Linux: a systemd unit running `wllm serve --config FILE`.

A user unit (`systemctl --user`, in ~/.config/systemd/user) by default; `--system` writes one to
/etc/systemd/system (needs root) that runs as the installing user. The unit runs the interpreter that
installed it (`sys.executable`: a virtual environment's python is fine, it needs no activation), stops
with SIGTERM (serve drains in-flight requests, then stops its engine process) and restarts on failure.
"""

from __future__ import annotations

import getpass
import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from wllm.service import STOP_MARGIN_S, ServiceError

Runner = Callable[[Sequence[str]], int]


def run_command(cmd: Sequence[str]) -> int:
    """Run a command with the terminal's stdin/stdout; its exit status (127 when it is not installed)."""
    try:
        return subprocess.run(list(cmd)).returncode
    except FileNotFoundError:
        raise ServiceError(f"{cmd[0]} not found: `wllm service` on Linux needs systemd") from None


def quote(arg: str) -> str:
    """One ExecStart word: systemd splits on spaces, unquotes C-style and expands %-specifiers."""
    arg = arg.replace("%", "%%")
    if arg and not any(c in arg for c in " \t\"'\\;$"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass
class SystemdService:
    name: str
    system: bool = False
    run: Runner = run_command
    unit_dir: Path | None = None  # where the unit file goes (tests); default: systemd's own folder
    home: Path = field(default_factory=Path.home)

    @property
    def unit(self) -> str:
        return f"{self.name}.service"

    @property
    def unit_path(self) -> Path:
        if self.unit_dir is not None:
            return self.unit_dir / self.unit
        if self.system:
            return Path("/etc/systemd/system") / self.unit
        base = os.environ.get("XDG_CONFIG_HOME") or self.home / ".config"
        return Path(base) / "systemd" / "user" / self.unit

    def systemctl(self, *args: str) -> list[str]:
        return ["systemctl", *([] if self.system else ["--user"]), *args]

    def unit_text(self, python: str, config: Path, shutdown_timeout: float, user: str | None = None) -> str:
        exec_start = " ".join(quote(a) for a in (python, "-m", "wllm", "serve", "--config", str(config)))
        lines = [
            "[Unit]",
            f"Description=wLLM inference server ({self.name})",
            "Wants=network-online.target",
            "After=network-online.target",
            "",
            "[Service]",
            "Type=simple",
            f"ExecStart={exec_start}",
            # Relative paths in the config are taken from its folder anyway; this is for anything else.
            f"WorkingDirectory={quote(str(config.parent))}",
            "Environment=PYTHONUNBUFFERED=1",
            # SIGTERM to `wllm serve` alone: it drains requests, then stops its engine process itself.
            # Systemd's default would signal the engine process at the same moment.
            "KillSignal=SIGTERM",
            "KillMode=mixed",
            f"TimeoutStopSec={int(shutdown_timeout + STOP_MARGIN_S)}",
            "Restart=on-failure",
            "RestartSec=5",
            # Exit status 2 is a settings error: restarting cannot fix it.
            "RestartPreventExitStatus=2",
        ]
        if self.system and user:
            lines.append(f"User={user}")
        lines += ["", "[Install]", f"WantedBy={'multi-user.target' if self.system else 'default.target'}", ""]
        return "\n".join(lines)

    def _check(self, *args: str) -> None:
        rc = self.run(self.systemctl(*args))
        if rc != 0:
            raise ServiceError(f"`{' '.join(self.systemctl(*args))}` failed (exit {rc})")

    def install(self, python: str, config: Path, shutdown_timeout: float, user: str | None = None) -> Path:
        """Write the unit, reload systemd and enable it at boot (or login, for a user unit)."""
        if self.system and user is None:
            # Under sudo, run as the user who asked, not root (their venv, their model cache).
            user = os.environ.get("SUDO_USER") or getpass.getuser()
        path = self.unit_path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.unit_text(python, config, shutdown_timeout, user), encoding="utf-8")
        except PermissionError:
            raise ServiceError(f"cannot write {path}: a --system unit needs root (sudo)") from None
        self._check("daemon-reload")
        self._check("enable", self.unit)
        return path

    def start(self) -> None:
        self._check("start", self.unit)

    def stop(self) -> None:
        self._check("stop", self.unit)

    def status(self) -> int:
        return self.run(self.systemctl("status", "--no-pager", self.unit))

    def remove(self) -> None:
        path = self.unit_path
        if not path.exists():
            raise ServiceError(f"no unit {path}: nothing to remove")
        self.run(self.systemctl("disable", "--now", self.unit))
        path.unlink()
        self._check("daemon-reload")

    def logs_command(self, lines: int, follow: bool) -> list[str]:
        return [
            "journalctl",
            *([] if self.system else ["--user"]),
            "-u",
            self.unit,
            "-n",
            str(lines),
            "--no-pager",
            *(["-f"] if follow else []),
        ]

    def logs(self, lines: int = 100, follow: bool = False) -> int:
        return self.run(self.logs_command(lines, follow))

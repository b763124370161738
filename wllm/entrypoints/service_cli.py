"""`wllm service install|start|stop|status|remove|logs`: run `wllm serve --config FILE` as a service
(a systemd unit on Linux, a Windows service through pywin32); see wllm/service/."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    """Add the `service` subcommand to the `wllm` CLI."""
    p = subparsers.add_parser(
        "service",
        help="run `wllm serve --config FILE` as a service (systemd unit, Windows service)",
        description="Install and manage a service that runs `wllm serve --config FILE` with this Python "
        "(a virtual environment works): a systemd user unit on Linux (--system: a system unit), "
        "a Windows service on Windows (from an Administrator terminal).",
    )
    sub = p.add_subparsers(dest="service_command", metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--name", default="wllm", help="service name (several servers: one name each)")
    common.add_argument(
        "--system",
        action="store_true",
        help="Linux: a system unit in /etc/systemd/system (root) instead of a user unit; "
        "Windows services are always system-wide",
    )
    install = sub.add_parser("install", parents=[common], help="install (and enable at boot) the service")
    install.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="the serve config file (written with every setting commented out when missing; "
        "default: ~/.config/wllm/config.toml, /etc/wllm/config.toml with --system, "
        r"%%PROGRAMDATA%%\wllm\config.toml on Windows)",
    )
    install.add_argument("--start", action="store_true", help="start it now too")
    for name, text in (
        ("start", "start the service"),
        ("stop", "stop it (in-flight requests drain first)"),
        ("status", "show whether it runs"),
        ("remove", "stop and uninstall it"),
    ):
        sub.add_parser(name, parents=[common], help=text)
    logs = sub.add_parser("logs", parents=[common], help="print the service's log")
    logs.add_argument("-n", "--lines", type=int, default=100, help="how many of the last lines")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.set_defaults(func=run_service)


class WindowsBackend:
    """The pywin32 service functions behind the same methods as SystemdService."""

    def __init__(self, name: str) -> None:
        from wllm.service import windows

        self.name, self.windows = name, windows

    def install(self, python: str, config: Path, shutdown_timeout: float) -> Path:
        log_file = self.windows.install(self.name, config, shutdown_timeout)
        print(f"log file: {log_file} (and the Windows Event Log, Application, source {self.name})")
        return Path("the Windows service manager")

    def start(self) -> None:
        self.windows.start(self.name)

    def stop(self) -> None:
        self.windows.stop(self.name)

    def status(self) -> int:
        state, details = self.windows.status(self.name)
        print(f"{self.name}: {state}")
        for key, value in details.items():
            print(f"  {key}: {value}")
        return 0 if state == "RUNNING" else 3

    def remove(self) -> None:
        self.windows.remove(self.name)

    def logs(self, lines: int, follow: bool) -> int:
        self.windows.tail(self.windows.log_file_of(self.name), lines, follow)
        return 0


def backend(name: str, system: bool, platform: str = sys.platform) -> Any:
    from wllm.service import ServiceError
    from wllm.service.systemd import SystemdService

    if platform == "win32":
        return WindowsBackend(name)
    if platform.startswith("linux"):
        return SystemdService(name, system=system)
    raise ServiceError(f"`wllm service` supports Linux (systemd) and Windows, not {platform}")


def run_service(args: argparse.Namespace) -> int:
    from wllm.service import ServiceError, check_name, prepare_config

    try:
        service = backend(check_name(args.name), args.system)
        action = args.service_command
        if action == "install":
            config, shutdown_timeout, written = prepare_config(args.config, args.system)
            if written:
                print(f"wrote {config} (every setting at its default; edit it, then restart the service)")
            where = service.install(sys.executable, config, shutdown_timeout)
            print(f"installed service {args.name}: {sys.executable} -m wllm serve --config {config} ({where})")
            if args.start:
                service.start()
                print(f"started {args.name}")
            elif sys.platform.startswith("linux") and not args.system:
                print(
                    f"start it: wllm service start --name {args.name}; to run it at boot without a login: "
                    "loginctl enable-linger"
                )
            return 0
        if action == "status":
            return int(service.status())
        if action == "logs":
            return int(service.logs(args.lines, args.follow))
        getattr(service, action)()
        print(f"{action}: {args.name} done")
        return 0
    except ServiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

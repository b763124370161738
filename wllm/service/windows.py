"""`wllm service` on Windows: a service (pywin32) that runs `wllm serve --config FILE` in-process.

How the known pywin32 service pitfalls are handled (docs/windows.md says more):

- pythonservice.exe is not used. From a virtual environment it cannot find python3X.dll and
  pywintypes3X.dll (they are not beside it, and a service does not see the user's PATH), and a venv's
  Scripts\\python.exe is only a launcher that starts the base interpreter as a second process, which the
  service manager would not know. The service's program is the base interpreter itself, `python.exe -S
  ...\\wllm\\service\\win_host.py`, which puts the environment's site-packages first on sys.path with
  site.addsitedir: that runs pywin32's .pth file, which adds pywin32_system32 to the DLL search path.
- SERVICE_RUNNING is reported before the model loads (that can take longer than the manager's start
  timeout); a stop that comes while loading takes effect once the model is loaded.
- A stop drains like SIGTERM (ServeControl); the stop wait hint covers --shutdown-timeout.
- A failure (serve exits 1 or raises) raises out of SvcRun, so pywin32 does not report SERVICE_STOPPED
  and the manager runs the recovery actions set at install (restart). A settings error (exit 2) is logged
  and stops the service without a restart loop.
- A service has no console: stdout and stderr go to a rotating log file, and the service's own messages
  and every warning or error also go to the Windows Event Log (Application, source = service name).
"""

from __future__ import annotations

import io
import logging
import logging.handlers
import os
import site
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from wllm.service import DEFAULT_NAME, STOP_MARGIN_S, ServiceError

logger = logging.getLogger("wllm.service")
LOG_BYTES = 10 << 20
LOG_BACKUPS = 5
# Recovery: restart after 5 s, 5 s, then 60 s; the failure count resets after a day without failures.
RESTART_DELAYS_MS = (5_000, 5_000, 60_000)
RESET_PERIOD_S = 86_400
STATES = {
    1: "STOPPED",
    2: "START_PENDING",
    3: "STOP_PENDING",
    4: "RUNNING",
    5: "CONTINUE_PENDING",
    6: "PAUSE_PENDING",
    7: "PAUSED",
}


def win32() -> SimpleNamespace:
    """The pywin32 modules (imported here so this module imports anywhere; tests inject fakes)."""
    try:
        import servicemanager
        import win32service
        import win32serviceutil
    except ImportError as exc:
        raise ServiceError(f"`wllm service` on Windows needs pywin32 (pip install pywin32): {exc}") from None
    return SimpleNamespace(win32service=win32service, win32serviceutil=win32serviceutil, servicemanager=servicemanager)


def default_log_file(name: str) -> Path:
    return Path(os.environ.get("PROGRAMDATA", r"C:\ProgramData")) / "wllm" / "logs" / f"{name}.log"


def base_interpreter(
    executable: str = sys.executable, prefix: str = sys.prefix, base_prefix: str = sys.base_prefix
) -> Path:
    """The real python.exe: in a venv, the base installation's (Scripts\\python.exe is a launcher)."""
    if "WindowsApps" in Path(base_prefix).parts:
        raise ServiceError(
            "the Microsoft Store Python cannot host a service (its files are not readable by "
            "the service account); install Python from python.org and recreate the venv"
        )
    if prefix == base_prefix:
        return Path(executable)
    exe = Path(base_prefix) / "python.exe"
    if not exe.is_file():
        raise ServiceError(f"the base interpreter of this virtual environment is not at {exe}")
    return exe


def site_dirs() -> list[str]:
    """This environment's site-packages folders (the venv's, and the user site when it is on)."""
    dirs = list(site.getsitepackages())
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if user and Path(user).is_dir():
        dirs.append(user)
    return dirs


def host_command(
    name: str,
    config: Path,
    log_file: Path,
    python: str = sys.executable,
    base: Path | None = None,
    sites: Sequence[str] | None = None,
) -> tuple[str, list[str]]:
    """The service's program and its arguments."""
    host = Path(__file__).resolve().parent / "win_host.py"
    args = ["-S", str(host), "--name", name, "--config", str(config), "--log-file", str(log_file), "--python", python]
    for d in sites if sites is not None else site_dirs():
        args += ["--site", d]
    return str(base or base_interpreter()), args


def install(
    name: str,
    config: Path,
    shutdown_timeout: float,
    log_file: Path | None = None,
    w: SimpleNamespace | None = None,
    command: tuple[str, list[str]] | None = None,
) -> Path:
    """Register the service (automatic start, recovery: restart) and remember its config and log file."""
    w = w or win32()
    ws, wsu = w.win32service, w.win32serviceutil
    log_file = log_file or default_log_file(name)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    exe, args = command or host_command(name, config, log_file)
    try:
        wsu.InstallService(
            None,
            name,
            f"wLLM inference server ({name})",
            startType=ws.SERVICE_AUTO_START,
            exeName=exe,
            exeArgs=subprocess.list2cmdline(args),
            description=f"wllm serve --config {config}",
        )
        wsu.SetServiceCustomOption(name, "config", str(config))
        wsu.SetServiceCustomOption(name, "log_file", str(log_file))
        wsu.SetServiceCustomOption(name, "stop_wait_s", int(shutdown_timeout + STOP_MARGIN_S))
        scm = ws.OpenSCManager(None, None, ws.SC_MANAGER_ALL_ACCESS)
        try:
            handle = ws.OpenService(scm, name, ws.SERVICE_ALL_ACCESS)
            try:
                actions = [(ws.SC_ACTION_RESTART, delay) for delay in RESTART_DELAYS_MS]
                ws.ChangeServiceConfig2(
                    handle,
                    ws.SERVICE_CONFIG_FAILURE_ACTIONS,
                    {"ResetPeriod": RESET_PERIOD_S, "RebootMsg": "", "Command": "", "Actions": actions},
                )
                # Also when the service stops itself with a non-zero exit code, not only when it crashes.
                ws.ChangeServiceConfig2(handle, ws.SERVICE_CONFIG_FAILURE_ACTIONS_FLAG, True)
            finally:
                ws.CloseServiceHandle(handle)
        finally:
            ws.CloseServiceHandle(scm)
    except ws.error as exc:
        raise ServiceError(_explain(exc, f"installing service {name}")) from None
    return log_file


def _explain(exc: Any, doing: str) -> str:
    code = getattr(exc, "winerror", None)
    text = getattr(exc, "strerror", None) or str(exc)
    hint = " (run the terminal as Administrator)" if code == 5 else ""
    return f"{doing}: {text}{hint}"


def _option(w: SimpleNamespace, name: str, option: str) -> Any:
    return w.win32serviceutil.GetServiceCustomOption(name, option)


def start(name: str, w: SimpleNamespace | None = None) -> None:
    w = w or win32()
    try:
        w.win32serviceutil.StartService(name)
    except w.win32service.error as exc:
        raise ServiceError(_explain(exc, f"starting service {name}")) from None


def stop(name: str, w: SimpleNamespace | None = None) -> None:
    """Ask the service to stop and wait until it has drained and stopped."""
    w = w or win32()
    try:
        w.win32serviceutil.StopService(name)
        wait = int(_option(w, name, "stop_wait_s") or 60)
        w.win32serviceutil.WaitForServiceStatus(name, w.win32service.SERVICE_STOPPED, wait)
    except w.win32service.error as exc:
        raise ServiceError(_explain(exc, f"stopping service {name}")) from None


def status(name: str, w: SimpleNamespace | None = None) -> tuple[str, dict[str, Any]]:
    w = w or win32()
    try:
        state = w.win32serviceutil.QueryServiceStatus(name)
    except w.win32service.error as exc:
        raise ServiceError(_explain(exc, f"querying service {name}")) from None
    return STATES.get(state[1], str(state[1])), {
        "config": _option(w, name, "config"),
        "log file": _option(w, name, "log_file"),
    }


def remove(name: str, w: SimpleNamespace | None = None) -> None:
    w = w or win32()
    try:
        if w.win32serviceutil.QueryServiceStatus(name)[1] != w.win32service.SERVICE_STOPPED:
            stop(name, w)
        w.win32serviceutil.RemoveService(name)  # also removes its Event Log source
    except w.win32service.error as exc:
        raise ServiceError(_explain(exc, f"removing service {name}")) from None


def log_file_of(name: str, w: SimpleNamespace | None = None) -> Path:
    w = w or win32()
    value = _option(w, name, "log_file")
    if not value:
        raise ServiceError(f"service {name} is not installed by `wllm service install` (no log file recorded)")
    return Path(value)


def tail(
    path: Path,
    lines: int,
    follow: bool,
    out: Any = None,
    poll_s: float = 0.5,
    until: Callable[[], bool] = lambda: False,
) -> None:
    """Print the last `lines` lines of the log file, then (follow) what is appended to it."""
    out = out or sys.stdout
    if not path.is_file():
        raise ServiceError(f"no log file at {path} yet (has the service started?)")
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for line in f.readlines()[-lines:]:
            out.write(line)
        while follow and not until():
            chunk = f.read()
            if chunk:
                out.write(chunk)
                out.flush()
            else:
                time.sleep(poll_s)


# --------------------------------------------------------------------------------------------
# The service process
# --------------------------------------------------------------------------------------------


class LogStream(io.TextIOBase):
    """sys.stdout / sys.stderr of the service: whole lines into the rotating log file."""

    def __init__(self, handler: logging.Handler) -> None:
        self._handler = handler
        self._buffer = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            self._buffer += text
            *lines, self._buffer = self._buffer.split("\n")
        for line in lines:
            self._handler.handle(logging.makeLogRecord({"msg": line, "levelno": logging.INFO, "levelname": "INFO"}))
        return len(text)

    def flush(self) -> None:
        self._handler.flush()


def _for_event_log(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or record.name == logger.name


def setup_service_logging(name: str, log_file: Path) -> tuple[logging.Handler, ...]:
    """Console output to the rotating file; returns the Event Log handler for wLLM's loggers."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    rotating = logging.handlers.RotatingFileHandler(
        log_file, maxBytes=LOG_BYTES, backupCount=LOG_BACKUPS, encoding="utf-8"
    )
    rotating.setFormatter(logging.Formatter("%(message)s"))
    sys.stdout = sys.stderr = LogStream(rotating)
    event_log = logging.handlers.NTEventLogHandler(name)  # registers the source on first use
    event_log.setLevel(logging.INFO)
    event_log.addFilter(_for_event_log)
    event_log.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    return (event_log,)


class ServiceFailed(RuntimeError):
    """Raised out of SvcRun so that the service manager runs the recovery actions."""


def serve_config(config: Path, control: Any) -> int:
    """`wllm serve --config FILE` in this process, stopped through `control`."""
    from wllm.cli import build_parser
    from wllm.entrypoints.serve_cli import run_serve

    argv = ["serve", "--config", str(config)]
    args = build_parser().parse_args(argv)
    args.argv = argv
    return run_serve(args, control)


def service_class(w: SimpleNamespace, serve: Callable[[Path, Any], int] = serve_config) -> type:
    """The pywin32 service class (a function: its base class exists only where pywin32 is imported)."""
    from wllm.entrypoints.serve_cli import ServeControl

    ws = w.win32service

    class WllmService(w.win32serviceutil.ServiceFramework):  # type: ignore[misc, name-defined]
        _svc_name_ = DEFAULT_NAME
        _svc_display_name_ = "wLLM inference server"
        config = Path("config.toml")
        stop_wait_s = 60.0
        log_handlers: tuple[logging.Handler, ...] = ()

        def __init__(self, args: Sequence[str]) -> None:
            super().__init__(args)
            self.control = ServeControl(self.log_handlers)

        def SvcDoRun(self) -> None:  # noqa: N802 - pywin32's name
            # RUNNING before the model loads: a load can outlast the manager's start timeout.
            self.ReportServiceStatus(ws.SERVICE_RUNNING)
            logger.info("service %s started: wllm serve --config %s", self._svc_name_, self.config)
            try:
                rc = serve(self.config, self.control)
            except BaseException:
                logger.exception("service %s: wllm serve failed", self._svc_name_)
                raise
            if rc == 0:
                logger.info("service %s stopped", self._svc_name_)
            elif rc == 2:
                logger.error(
                    "service %s: bad settings in %s (see the log file); not restarting", self._svc_name_, self.config
                )
            else:
                logger.error(
                    "service %s: wllm serve exited with status %d; the service manager restarts it", self._svc_name_, rc
                )
                raise ServiceFailed(f"wllm serve exited with status {rc}")

        def SvcStop(self) -> None:  # noqa: N802
            self.ReportServiceStatus(ws.SERVICE_STOP_PENDING, waitHint=int(self.stop_wait_s * 1000))
            logger.info("service %s: stop requested; draining in-flight requests", self._svc_name_)
            self.control.stop()

        def SvcShutdown(self) -> None:  # noqa: N802 - Windows is shutting down
            self.SvcStop()

    return WllmService


def host_main(argv: Sequence[str], w: SimpleNamespace | None = None) -> int:
    """The service process (started by the service manager through win_host.py)."""
    import argparse
    import multiprocessing

    parser = argparse.ArgumentParser(prog="win_host.py")
    parser.add_argument("--name", default=DEFAULT_NAME)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--log-file", type=Path, required=True)
    parser.add_argument("--python", default=None)
    parser.add_argument("--site", action="append", default=[])
    args = parser.parse_args(argv)
    w = w or win32()
    handlers = setup_service_logging(args.name, args.log_file)
    from wllm.observability.logs import setup_logging

    setup_logging("text", "INFO", extra_handlers=handlers)
    if args.python and Path(args.python) != Path(sys.executable):
        # The engine process (spawned on CUDA) starts from the venv's own interpreter, like a normal run.
        multiprocessing.set_executable(args.python)
    os.chdir(args.config.parent)
    cls = service_class(w)
    cls._svc_name_ = args.name
    cls.config = args.config
    cls.log_handlers = handlers
    from wllm.settings import ConfigError, resolve

    try:
        cls.stop_wait_s = float(resolve({}, args.config, environ={})["shutdown_timeout"].value) + STOP_MARGIN_S
    except ConfigError as exc:
        logger.error("service %s: %s", args.name, exc)  # serve reports it again and exits 2
    w.servicemanager.Initialize()
    w.servicemanager.PrepareToHostSingle(cls)
    try:
        w.servicemanager.StartServiceCtrlDispatcher()
    except w.win32service.error as exc:
        if getattr(exc, "winerror", None) == 1063:  # ERROR_FAILED_SERVICE_CONTROLLER_CONNECT
            if sys.__stderr__ is not None:
                sys.__stderr__.write("this program is run by the Windows service manager: use `wllm service start`\n")
            return 1
        raise
    return 0

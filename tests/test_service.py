"""`wllm service`: the systemd unit and its systemctl commands, and the Windows service logic with
pywin32 faked (tests/fake_win32.py), plus the in-thread graceful stop both rely on."""

from __future__ import annotations

import argparse
import importlib.util
import io
import logging
import logging.handlers
import shlex
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fake_win32  # noqa: E402

from wllm.cli import main  # noqa: E402
from wllm.service import ServiceError, prepare_config  # noqa: E402
from wllm.service import windows as win  # noqa: E402
from wllm.service.systemd import SystemdService, quote  # noqa: E402
from wllm.settings import load_file  # noqa: E402


class Recorder:
    def __init__(self, rc: int = 0) -> None:
        self.commands: list[list[str]] = []
        self.rc = rc

    def __call__(self, cmd: Any) -> int:
        self.commands.append(list(cmd))
        return self.rc


def exec_start(unit: str) -> list[str]:
    line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart=").replace("%%", "%"))


# ---------------------------------------------------------------- systemd


def test_user_unit_runs_this_python_with_the_config(tmp_path: Path) -> None:
    config = tmp_path / "my dir" / "wllm 100%.toml"
    unit = SystemdService("wllm").unit_text("/opt/venv one/bin/python", config, shutdown_timeout=30.0)
    assert exec_start(unit) == ["/opt/venv one/bin/python", "-m", "wllm", "serve", "--config", str(config)]
    assert "100%%" in unit  # a literal % would be a systemd specifier
    lines = unit.splitlines()
    for expected in (
        "Restart=on-failure",
        "KillSignal=SIGTERM",
        "KillMode=mixed",
        "TimeoutStopSec=60",
        "RestartPreventExitStatus=2",
        "WantedBy=default.target",
        "Type=simple",
    ):
        assert expected in lines, expected
    assert not any(line.startswith("User=") for line in lines)
    system = SystemdService("wllm", system=True).unit_text("/usr/bin/python3", Path("/etc/wllm/c.toml"), 5, "ann")
    assert "User=ann" in system.splitlines() and "WantedBy=multi-user.target" in system.splitlines()
    assert quote("plain/path") == "plain/path" and quote('a"b') == '"a\\"b"'


def test_the_unit_command_line_really_starts_wllm_serve_with_the_file(tmp_path: Path) -> None:
    config = tmp_path / "with space.toml"
    config.write_text("max-num-seq = 1\n")
    unit = SystemdService("wllm").unit_text(sys.executable, config, 30)
    proc = subprocess.run(exec_start(unit), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    # The file reached serve: its (deliberate) typo is reported, and exit 2 is the unit's no-restart status.
    assert proc.returncode == 2 and "unknown key 'max-num-seq'" in proc.stderr


def test_systemctl_commands(tmp_path: Path) -> None:
    run = Recorder()
    user = SystemdService("wllm", run=run, unit_dir=tmp_path)
    path = user.install("/venv/bin/python", tmp_path / "c.toml", 30)
    assert path == tmp_path / "wllm.service" and "ExecStart=/venv/bin/python -m wllm serve" in path.read_text()
    user.start()
    user.stop()
    user.status()
    user.logs(50, follow=True)
    user.remove()
    assert not path.exists()
    assert run.commands == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "wllm.service"],
        ["systemctl", "--user", "start", "wllm.service"],
        ["systemctl", "--user", "stop", "wllm.service"],
        ["systemctl", "--user", "status", "--no-pager", "wllm.service"],
        ["journalctl", "--user", "-u", "wllm.service", "-n", "50", "--no-pager", "-f"],
        ["systemctl", "--user", "disable", "--now", "wllm.service"],
        ["systemctl", "--user", "daemon-reload"],
    ]
    system = SystemdService("llm2", system=True, run=Recorder(), unit_dir=tmp_path)
    assert system.systemctl("start", system.unit) == ["systemctl", "start", "llm2.service"]
    assert system.logs_command(10, False) == ["journalctl", "-u", "llm2.service", "-n", "10", "--no-pager"]
    assert SystemdService("x", home=Path("/home/ann")).unit_path.name == "x.service"
    failing = SystemdService("wllm", run=Recorder(rc=1), unit_dir=tmp_path)
    with pytest.raises(ServiceError, match="systemctl --user start wllm.service` failed"):
        failing.start()


def test_install_cli_checks_and_writes_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from wllm.entrypoints import service_cli

    run = Recorder()
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(
        service_cli, "backend", lambda name, system: SystemdService(name, system, run=run, unit_dir=tmp_path / "units")
    )
    config = tmp_path / "new" / "wllm.toml"
    assert main(["service", "install", "--config", str(config), "--start"]) == 0
    assert load_file(config) == {}  # written with every setting commented out, and it loads
    unit = (tmp_path / "units" / "wllm.service").read_text()
    assert exec_start(unit)[-2:] == ["--config", str(config)] and exec_start(unit)[0] == sys.executable
    assert run.commands[-1] == ["systemctl", "--user", "start", "wllm.service"]
    config.write_text("shutdown-timeout = 100\n")
    assert prepare_config(config, False)[1:] == (100.0, False)
    config.write_text("shutdown-timeout = 'long'\n")
    assert main(["service", "install", "--config", str(config)]) == 1
    assert "key 'shutdown-timeout' must be a number" in capsys.readouterr().err
    assert main(["service", "status", "--name", "bad name"]) == 1
    assert "service name 'bad name'" in capsys.readouterr().err


# ---------------------------------------------------------------- the graceful stop, in a thread


def test_serve_control_drains_a_server_running_in_another_thread() -> None:
    import httpx
    from fake_engine import ScriptedEngine

    from wllm.entrypoints.openai.app import create_app
    from wllm.entrypoints.openai.config import ServerConfig
    from wllm.entrypoints.serve_cli import ServeControl, _make_server

    app = create_app(
        ScriptedEngine(max_model_len=4096, step_delay=0.01, replies=("tick " * 40,)),
        ServerConfig(served_model_names=["tiny"]),
    )
    ready = threading.Event()
    where: list[str] = []
    server = _make_server(
        app,
        argparse.Namespace(host="127.0.0.1", port=0, shutdown_timeout=30),
        lambda h, p: (where.append(f"http://{h}:{p}"), ready.set()),
    )
    control = ServeControl()
    control.attach(server)
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        assert ready.wait(30)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{where[0]}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            control.stop()  # what the Windows service's SvcStop does
            rest = list(lines)
        assert "data: [DONE]" in rest and not any("server_shutdown" in line for line in rest)
        thread.join(30)
        assert not thread.is_alive() and control.stopping
    finally:
        server.should_exit = True
        thread.join(30)
    late = ServeControl()
    late.stop()
    late.attach(server := SimpleNamespace(should_exit=False))
    assert server.should_exit  # a stop during the model load takes effect when the server exists


# ---------------------------------------------------------------- Windows, pywin32 faked


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    f = fake_win32.make()
    fake_win32.install_modules(monkeypatch, f)
    return f


def test_windows_install_registers_the_base_interpreter_and_recovery(tmp_path: Path, fake: SimpleNamespace) -> None:
    config = tmp_path / "c.toml"
    command = win.host_command(
        "wllm",
        config,
        tmp_path / "wllm.log",
        python=r"C:\venv\Scripts\python.exe",
        base=Path(r"C:\Python312\python.exe"),
        sites=[r"C:\venv", r"C:\venv\Lib\site-packages"],
    )
    exe, args = command
    assert exe == r"C:\Python312\python.exe" and args[0] == "-S" and args[1].endswith("win_host.py")
    assert args[args.index("--config") + 1] == str(config)
    assert [args[i + 1] for i, a in enumerate(args) if a == "--site"] == [r"C:\venv", r"C:\venv\Lib\site-packages"]
    win.install("wllm", config, 30.0, tmp_path / "wllm.log", w=fake, command=command)
    (_, positional, kwargs), *rest = [c for c in fake.calls if c[0] == "InstallService"]
    assert positional[:2] == (None, "wllm") and kwargs["exeName"] == exe
    assert kwargs["startType"] == fake.win32service.SERVICE_AUTO_START
    assert kwargs["exeArgs"] == subprocess.list2cmdline(args)
    config2 = [c for c in fake.calls if c[0] == "ChangeServiceConfig2"]
    actions = config2[0][3]
    assert config2[0][2] == fake.win32service.SERVICE_CONFIG_FAILURE_ACTIONS
    assert [a[0] for a in actions["Actions"]] == [fake.win32service.SC_ACTION_RESTART] * 3
    assert config2[1][2:] == (fake.win32service.SERVICE_CONFIG_FAILURE_ACTIONS_FLAG, True)
    assert fake.options[("wllm", "config")] == str(config) and fake.options[("wllm", "stop_wait_s")] == 60
    win.start("wllm", fake)
    assert win.status("wllm", fake)[0] == "RUNNING"
    win.stop("wllm", fake)
    assert ("WaitForServiceStatus", "wllm", 1, 60) in fake.calls
    win.remove("wllm", fake)
    assert ("RemoveService", "wllm") in fake.calls


def test_windows_errors_are_explained(fake: SimpleNamespace) -> None:
    def denied(*a: Any, **k: Any) -> None:
        raise fake.win32service.error(5, "OpenSCManager", "Access is denied.")

    fake.win32serviceutil.StartService = denied
    with pytest.raises(ServiceError, match=r"Access is denied.*Administrator"):
        win.start("wllm", fake)


def test_base_interpreter_of_a_venv(tmp_path: Path) -> None:
    (tmp_path / "python.exe").write_bytes(b"")
    assert win.base_interpreter(r"C:\venv\Scripts\python.exe", r"C:\venv", str(tmp_path)) == tmp_path / "python.exe"
    assert win.base_interpreter("/usr/bin/python3", "/usr", "/usr") == Path("/usr/bin/python3")
    with pytest.raises(ServiceError, match="not at"):
        win.base_interpreter("x", "/venv", str(tmp_path / "gone"))
    with pytest.raises(ServiceError, match="Microsoft Store"):
        win.base_interpreter("x", "/venv", "/Program Files/WindowsApps/Python")


def test_the_service_reports_running_before_serving_and_stops_gracefully(fake: SimpleNamespace) -> None:
    seen: dict[str, Any] = {}

    def serve(config: Path, control: Any) -> int:
        seen["reported"] = list(service.reported)  # what the manager had been told when the model load began
        seen["config"] = config
        service.SvcStop()  # the manager's stop request arrives while serving
        seen["stopping"] = control.stopping
        return 0

    cls = win.service_class(fake, serve=serve)
    cls.config, cls.stop_wait_s = Path("c.toml"), 45.0
    service = cls(["wllm"])
    service.SvcDoRun()
    assert seen["reported"] == [(fake.win32service.SERVICE_RUNNING, 5000)]
    assert seen["config"] == Path("c.toml") and seen["stopping"]
    assert (fake.win32service.SERVICE_STOP_PENDING, 45000) in service.reported
    assert hasattr(cls, "SvcShutdown")  # pywin32 then accepts the system's shutdown control too


def test_a_failing_serve_raises_so_the_manager_restarts_it(
    fake: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    failing = win.service_class(fake, serve=lambda config, control: 1)(["wllm"])
    with pytest.raises(win.ServiceFailed, match="status 1"):
        failing.SvcDoRun()
    bad_settings = win.service_class(fake, serve=lambda config, control: 2)(["wllm"])
    with caplog.at_level(logging.ERROR, logger="wllm.service"):
        bad_settings.SvcDoRun()  # returns: SERVICE_STOPPED, no restart loop on a config error
    assert "bad settings" in caplog.text


def test_host_main_logs_to_a_rotating_file_and_the_event_log(
    tmp_path: Path, fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    import multiprocessing
    import os

    config = tmp_path / "c.toml"
    config.write_text("shutdown-timeout = 10\n")
    chdirs: list[Any] = []
    executables: list[str] = []
    monkeypatch.setattr(os, "chdir", chdirs.append)
    monkeypatch.setattr(multiprocessing, "set_executable", executables.append)
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    saved = {n: list(logging.getLogger(n).handlers) for n in ("wllm", "uvicorn", "uvicorn.error")}
    try:
        log_file = tmp_path / "logs" / "wllm.log"
        rc = win.host_main(
            ["--name", "llm", "--config", str(config), "--log-file", str(log_file), "--python", "/venv/python"], w=fake
        )
        assert rc == 0
        ((_, cls),) = [c for c in fake.calls if c[0] == "PrepareToHostSingle"]
        assert cls._svc_name_ == "llm" and cls.config == config and cls.stop_wait_s == 40.0
        assert ("StartServiceCtrlDispatcher",) in fake.calls and chdirs == [tmp_path]
        assert executables == ["/venv/python"]
        print("wLLM ready: serving x")  # serve's ready line, printed to the redirected stdout
        logging.getLogger("wllm.service").info("service llm started")
        logging.getLogger("wllm.engine").info("an info line: file only")
        logging.getLogger("wllm.engine").warning("a warning: file and Event Log")
        sys.stdout.flush()
        text = log_file.read_text()
        assert "wLLM ready: serving x" in text and "an info line" in text and "a warning" in text
        assert [e[2] for e in fake.events] == [
            "wllm.service: service llm started",
            "wllm.engine: a warning: file and Event Log",
        ]
    finally:
        for name, handlers in saved.items():
            logging.getLogger(name).handlers[:] = handlers


def test_log_stream_and_tail(tmp_path: Path) -> None:
    handler = logging.handlers.RotatingFileHandler(tmp_path / "s.log", maxBytes=200, backupCount=2)
    stream = win.LogStream(handler)
    for i in range(30):
        stream.write(f"line {i}\npart")
        stream.write("ial\n")
    handler.close()
    assert (tmp_path / "s.log.1").exists()  # rotated
    out = io.StringIO()
    win.tail(tmp_path / "s.log", 2, follow=False, out=out)
    assert out.getvalue() == "line 29\npartial\n"
    with pytest.raises(ServiceError, match="no log file"):
        win.tail(tmp_path / "none.log", 2, False)


def test_win_host_puts_the_venv_first_and_runs_its_pth_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site_dir = tmp_path / "site-packages"
    (site_dir / "extra").mkdir(parents=True)
    (site_dir / "dlls.pth").write_text("extra\n")  # like pywin32.pth, which makes pywin32_system32 findable
    host = Path(win.__file__).with_name("win_host.py")
    spec = importlib.util.spec_from_file_location("win_host_under_test", host)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    monkeypatch.setattr(sys, "path", [str(host.parent), *sys.path])
    module._bootstrap(["--name", "x", "--site", str(site_dir)])
    assert sys.path[:2] == [str(site_dir), str(site_dir / "extra")]
    assert str(host.parent) not in sys.path

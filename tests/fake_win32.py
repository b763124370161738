"""Stand-ins for the pywin32 modules `wllm service` uses, recording every call (tests run on Linux)."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any


class Win32Error(Exception):
    def __init__(self, winerror: int, funcname: str, strerror: str) -> None:
        super().__init__(winerror, funcname, strerror)
        self.winerror, self.funcname, self.strerror = winerror, funcname, strerror


def make() -> SimpleNamespace:
    calls: list[tuple[Any, ...]] = []
    options: dict[tuple[str, str], Any] = {}
    state = {"status": 1}

    ws = ModuleType("win32service")
    consts = dict(
        SERVICE_STOPPED=1,
        SERVICE_START_PENDING=2,
        SERVICE_STOP_PENDING=3,
        SERVICE_RUNNING=4,
        SERVICE_AUTO_START=2,
        SC_MANAGER_ALL_ACCESS=0xF003F,
        SERVICE_ALL_ACCESS=0xF01FF,
        SC_ACTION_RESTART=1,
        SERVICE_CONFIG_FAILURE_ACTIONS=2,
        SERVICE_CONFIG_FAILURE_ACTIONS_FLAG=4,
        SERVICE_ACCEPT_STOP=1,
        SERVICE_ACCEPT_SHUTDOWN=4,
    )
    vars(ws).update(consts)
    ws.error = Win32Error
    ws.OpenSCManager = lambda *a: calls.append(("OpenSCManager", *a)) or "scm"
    ws.OpenService = lambda *a: calls.append(("OpenService", *a)) or "svc"
    ws.ChangeServiceConfig2 = lambda *a: calls.append(("ChangeServiceConfig2", *a))
    ws.CloseServiceHandle = lambda h: calls.append(("CloseServiceHandle", h))

    wsu = ModuleType("win32serviceutil")

    def install_service(*args: Any, **kwargs: Any) -> None:
        calls.append(("InstallService", args, kwargs))

    def status(name: str) -> tuple[int, ...]:
        return (16, state["status"], 1, 0, 0, 0, 0)

    wsu.InstallService = install_service
    wsu.SetServiceCustomOption = lambda name, option, value: options.__setitem__((name, option), value)
    wsu.GetServiceCustomOption = lambda name, option, default=None: options.get((name, option), default)
    wsu.StartService = lambda name, *a: calls.append(("StartService", name)) or state.update(status=4)
    wsu.StopService = lambda name, *a: calls.append(("StopService", name)) or state.update(status=1)
    wsu.WaitForServiceStatus = lambda name, st, secs, *a: calls.append(("WaitForServiceStatus", name, st, secs))
    wsu.QueryServiceStatus = status
    wsu.RemoveService = lambda name: calls.append(("RemoveService", name))

    class ServiceFramework:
        """Records ReportServiceStatus; the real one talks to the service manager."""

        def __init__(self, args: Any) -> None:
            self.reported: list[tuple[int, int]] = []

        def ReportServiceStatus(
            self,
            status: int,
            waitHint: int = 5000,
            win32ExitCode: int = 0,  # noqa: N802, N803
            svcExitCode: int = 0,
        ) -> None:  # noqa: N803
            self.reported.append((status, waitHint))

    wsu.ServiceFramework = ServiceFramework

    sm = ModuleType("servicemanager")
    sm.Initialize = lambda *a: calls.append(("Initialize",))
    sm.PrepareToHostSingle = lambda cls: calls.append(("PrepareToHostSingle", cls))
    sm.StartServiceCtrlDispatcher = lambda: calls.append(("StartServiceCtrlDispatcher",))

    # What logging.handlers.NTEventLogHandler imports.
    evtlogutil = ModuleType("win32evtlogutil")
    evtlogutil.__file__ = "/site-packages/win32/lib/win32evtlogutil.py"
    events: list[tuple[Any, ...]] = []
    evtlogutil.AddSourceToRegistry = lambda *a, **k: calls.append(("AddSourceToRegistry", *a))
    evtlogutil.ReportEvent = lambda appname, eid, cat, etype, msgs, *a: events.append((appname, etype, msgs[0]))
    evtlog = ModuleType("win32evtlog")
    vars(evtlog).update(EVENTLOG_ERROR_TYPE=1, EVENTLOG_WARNING_TYPE=2, EVENTLOG_INFORMATION_TYPE=4)
    return SimpleNamespace(
        win32service=ws,
        win32serviceutil=wsu,
        servicemanager=sm,
        win32evtlogutil=evtlogutil,
        win32evtlog=evtlog,
        calls=calls,
        options=options,
        state=state,
        events=events,
    )


def install_modules(monkeypatch: Any, fake: SimpleNamespace) -> None:
    for name in ("win32service", "win32serviceutil", "servicemanager", "win32evtlogutil", "win32evtlog"):
        monkeypatch.setitem(sys.modules, name, getattr(fake, name))

"""Windows readiness, checked here: no POSIX-only Python without a Windows branch, nothing in csrc/ or
the build flags that MSVC rejects (build_tools/windows_readiness.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "build_tools"))
import windows_readiness as wr  # noqa: E402


def test_the_package_has_no_unguarded_posix_only_code() -> None:
    assert [str(f) for f in wr.scan_package()] == []


def test_csrc_has_nothing_msvc_rejects() -> None:
    assert [str(f) for f in wr.scan_csrc()] == []


def test_the_windows_build_flags_are_msvc_flags() -> None:
    assert [str(f) for f in wr.scan_build_flags()] == []


@pytest.mark.parametrize(
    "code, what",
    [
        ("import os\nos.fork()\n", "os.fork"),
        ("import fcntl\n", "fcntl"),
        ("from resource import getrlimit\n", "resource"),
        ("import uvloop\n", "uvloop"),
        ("import os\nuid = os.getuid()\n", "os.getuid"),
        ("import signal\nsignal.signal(signal.SIGHUP, f)\n", "signal.SIGHUP"),
        ("import signal\nsignal.alarm(3)\n", "signal.alarm"),
        ("path = folder + '/' + name\n", "glued with '/'"),
        ("path = f'{folder}/{name}.gguf'\n", "glued with '/'"),
    ],
)
def test_posix_only_python_is_found(code: str, what: str) -> None:
    (finding,) = wr.scan_python_source(code, "x.py")
    assert what in finding.what and finding.line == code.count("\n")


@pytest.mark.parametrize(
    "code",
    [
        "import sys\nif sys.platform != 'win32':\n    import fcntl\n",
        "import os\nuid = os.getuid() if hasattr(os, 'getuid') else 0\n",
        "try:\n    import uvloop\nexcept ImportError:\n    uvloop = None\n",
        "import os, signal\nif os.name == 'nt':\n    s = signal.SIGBREAK\nelse:\n    s = signal.SIGHUP\n",
        "import signal\nsignal.signal(signal.SIGTERM, f)\nsignal.signal(signal.SIGINT, f)\n",
        "url = f'http://{host}:{port}/v1'\nroute = f'/v1/models/{name}'\n",
    ],
)
def test_guarded_or_portable_python_passes(code: str) -> None:
    assert wr.scan_python_source(code, "x.py") == []


def test_gcc_only_c_is_found() -> None:
    code = "\n".join(
        [
            "static int f(int n) __attribute__((noinline));",  # 1: unguarded attribute
            '#define API __attribute__((visibility("default")))',  # 2: in a macro: fine
            "#if defined(__GNUC__)",
            "#define LIKELY(x) __builtin_expect(x, 1)",
            "static inline int g(int x) { return __builtin_clz(x); }",  # 5: guarded
            "#endif",
            "int h(int x) { return __builtin_popcount(x); }",  # 7: unguarded builtin
            "template <int N> __global__ void k(int n) {",
            "  float fixed[N];",  # 9: template parameter: fine
            "  const int kLevels = 3;",
            "  int levels[kLevels];",  # 11: constant: fine
            "  float scratch[n];",  # 12: VLA
            "  return table[n];",  # 13: not a declaration
            "}",
        ]
    )
    assert [(f.line, f.what.split()[0]) for f in wr.scan_c_source(code, "k.cu")] == [
        (1, "__attribute__"),
        (7, "__builtin_popcount"),
        (12, "array"),
    ]


def test_gcc_flags_for_msvc_are_found() -> None:
    bad = wr.check_windows_flags(["-O3", "-Xcompiler", "/O2,-fPIC"], ["-shared", "-Xlinker", "--exclude-libs,ALL"])
    assert [f.what for f in bad] == [
        "GCC option -fPIC passed to MSVC",
        "GNU ld option --exclude-libs passed to link.exe",
    ]
    assert wr.check_windows_flags(["-Xcompiler", "/O2,/EHsc"], ["-shared", "-cudart", "static"]) == []

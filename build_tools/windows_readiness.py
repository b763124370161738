"""Checks, on any OS, that the package and the kernel sources keep working on Windows.

    python build_tools/windows_readiness.py      # prints each finding, exits 1 if there is one

1. The Python package: POSIX-only calls and modules with no Windows branch (os.fork, signals other than
   SIGINT/SIGTERM/SIGBREAK, fcntl, pwd, grp, resource, termios, os.getuid & co, uvloop), and paths built
   by gluing '/' onto strings. A use counts as having a Windows branch when it sits under an `if` (or a
   conditional expression) that tests sys.platform, os.name, a *WINDOWS* flag or hasattr, or in a `try`
   that catches ImportError / AttributeError.
2. csrc/: what MSVC (the host compiler nvcc uses on Windows) rejects: `__attribute__` and `__builtin_*`
   outside a macro definition or a compiler/platform #if, and variable-length arrays.
3. The build flags (build_tools/kernel_build.py) as computed for Windows: no GCC-style -f/-W/-static
   options reach MSVC through -Xcompiler, and no GNU linker options through -Xlinker.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POSIX_MODULES = {"fcntl", "pwd", "grp", "resource", "termios", "tty", "pty", "uvloop", "posix"}
POSIX_OS_CALLS = {
    "fork",
    "forkpty",
    "getuid",
    "geteuid",
    "getgid",
    "getegid",
    "getpwnam",
    "setsid",
    "killpg",
    "getpgid",
    "setpgid",
    "setuid",
    "setgid",
    "getppid_posix",
    "wait3",
    "wait4",
    "nice",
    "sync",
}
PORTABLE_SIGNALS = {
    "SIGINT",
    "SIGTERM",
    "SIGBREAK",
    "SIG_DFL",
    "SIG_IGN",
    "Signals",
    "Handlers",
    "signal",
    "getsignal",
    "default_int_handler",
    "strsignal",
    "valid_signals",
    "raise_signal",
    "CTRL_C_EVENT",
    "CTRL_BREAK_EVENT",
    "SIGABRT",
    "SIGFPE",
    "SIGILL",
    "SIGSEGV",
}
PLATFORM_WORDS = ("sys.platform", "os.name", "WINDOWS", "win32", "hasattr(", "platform.system")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _is_platform_test(node: ast.AST) -> bool:
    return any(word in ast.unparse(node) for word in PLATFORM_WORDS)


def _guarded(stack: list[ast.AST]) -> bool:
    for parent in stack:
        if isinstance(parent, (ast.If, ast.IfExp, ast.While)) and _is_platform_test(parent.test):
            return True
        if isinstance(parent, ast.Try):
            for handler in parent.handlers:
                caught = ast.unparse(handler.type) if handler.type is not None else "BaseException"
                if any(name in caught for name in ("ImportError", "ModuleNotFoundError", "AttributeError")):
                    return True
        if isinstance(parent, ast.BoolOp) and any(_is_platform_test(v) for v in parent.values):
            return True
    return False


def _slash_join(node: ast.AST) -> bool:
    """'a' + '/' + b, or f"{folder}/{name}" (URLs and other '://' strings are not paths)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        for side in (node.left, node.right):
            if isinstance(side, ast.Constant) and isinstance(side.value, str) and side.value in ("/", "\\"):
                return True
    if isinstance(node, ast.JoinedStr):
        parts = node.values
        text = "".join(p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str))
        first = parts[0] if parts else None
        route = isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("/")
        if "://" in text or route or " " in text:
            return False
        for before, after in zip(parts, parts[1:]):
            if (
                isinstance(before, ast.FormattedValue)
                and isinstance(after, ast.Constant)
                and isinstance(after.value, str)
                and after.value.startswith("/")
            ):
                return True
    return False


def scan_python_source(source: str, name: str) -> list[Finding]:
    tree = ast.parse(source, filename=name)
    findings: list[Finding] = []

    def visit(node: ast.AST, stack: list[ast.AST]) -> None:
        problem = None
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            bad = [m for m in modules if m.split(".")[0] in POSIX_MODULES]
            if bad:
                problem = f"imports POSIX-only {bad[0]}"
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "os" and node.attr in POSIX_OS_CALLS:
                problem = f"os.{node.attr} does not exist on Windows"
            elif (
                node.value.id == "signal"
                and node.attr.startswith(("SIG", "set", "alarm", "pause", "sig"))
                and node.attr not in PORTABLE_SIGNALS
            ):
                problem = f"signal.{node.attr} is POSIX-only (Windows has SIGINT, SIGTERM, SIGBREAK)"
        elif _slash_join(node):
            problem = "a path glued with '/': use pathlib or os.path.join"
        if problem and not _guarded(stack):
            findings.append(Finding(name, getattr(node, "lineno", 0), problem))
        for child in ast.iter_child_nodes(node):
            visit(child, [*stack, node])

    visit(tree, [])
    return findings


def scan_package(package: Path = ROOT / "wllm") -> list[Finding]:
    findings: list[Finding] = []
    for path in sorted(package.rglob("*.py")):
        findings += scan_python_source(path.read_text(encoding="utf-8"), str(path.relative_to(package.parent)))
    return findings


_GUARD = re.compile(r"_WIN32|_MSC_VER|__GNUC__|__clang__|__linux__|_WIN64")
_ARRAY = re.compile(
    r"^\s*(?:(?:const|static|volatile|unsigned|signed|__shared__|alignas\(\d+\))\s+)*"
    r"[A-Za-z_][\w:<>, ]*?\s+\**(\w+)\s*\[([^\]]+)\]\s*(?:;|=)"
)


def _constant_names(text: str) -> set[str]:
    """Names that are compile-time constants: macros, constexpr, template parameters, ALL_CAPS."""
    names = set(re.findall(r"#define\s+(\w+)", text))
    names |= set(re.findall(r"constexpr\s+[\w:<>]+\s+(\w+)\s*=", text))
    names |= set(re.findall(r"const\s+(?:int|unsigned|size_t|uint32_t|int32_t)\s+(\w+)\s*=\s*\d+\s*;", text))
    for params in re.findall(
        r"template\s*<([^;{]*?)>\s*(?:__global__|__device__|static|inline|struct|class|void|"
        r"[\w:<>]+\s+\w+\s*\()",
        text,
    ):
        names |= set(re.findall(r"(\w+)\s*(?:=[^,]*)?(?:,|$)", params))
    names |= set(re.findall(r"\b[A-Z_][A-Z0-9_]+\b", text))
    return names


def scan_c_source(text: str, name: str) -> list[Finding]:
    findings: list[Finding] = []
    conditions: list[str] = []
    constants = _constant_names(text)
    continued_define = False
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        in_define = continued_define or stripped.startswith("#define")
        continued_define = in_define and stripped.endswith("\\")
        if stripped.startswith(("#if", "#ifdef", "#ifndef")):
            conditions.append(stripped)
            continue
        if stripped.startswith(("#elif", "#else")) and conditions:
            conditions[-1] += " " + stripped  # the branch is still about the same condition
            continue
        if stripped.startswith("#endif") and conditions:
            conditions.pop()
            continue
        code = line.split("//", 1)[0]
        guarded = in_define or any(_GUARD.search(c) for c in conditions)
        if "__attribute__" in code and not guarded:
            findings.append(Finding(name, number, "__attribute__ outside a macro or a compiler #if (MSVC: __declspec)"))
        builtin = re.search(r"\b(__builtin_\w+)", code)
        if builtin and not guarded:
            findings.append(Finding(name, number, f"{builtin.group(1)} outside a compiler #if (MSVC has none)"))
        array = _ARRAY.match(code)
        statement = code.split()[0] if code.split() else ""
        if (
            array
            and not in_define
            and statement not in ("return", "delete", "case", "throw", "extern")
            and "(" not in array.group(2)
        ):
            size = array.group(2)
            variables = [w for w in re.findall(r"\b[A-Za-z_]\w*\b", size) if w not in constants and w != "sizeof"]
            if variables:
                findings.append(
                    Finding(
                        name,
                        number,
                        f"array {array.group(1)}[{size}] sized by a run-time value "
                        f"({', '.join(variables)}): a VLA, which MSVC rejects",
                    )
                )
    return findings


def scan_csrc(csrc: Path = ROOT / "csrc") -> list[Finding]:
    findings: list[Finding] = []
    for path in sorted([*csrc.glob("*.cu"), *csrc.glob("*.cuh"), *csrc.glob("*.h")]):
        findings += scan_c_source(path.read_text(encoding="utf-8"), str(path.relative_to(csrc.parent)))
    return findings


def _host_options(flags: list[str], through: str) -> Iterator[str]:
    for flag, value in zip(flags, flags[1:]):
        if flag == through:
            yield from value.split(",")


def check_windows_flags(compile_flags: list[str], link_flags: list[str]) -> list[Finding]:
    findings = []
    for option in _host_options(compile_flags + link_flags, "-Xcompiler"):
        if re.match(r"-(f|W|static|m|O\d|g$|pthread)", option):
            findings.append(Finding("build_tools/kernel_build.py", 0, f"GCC option {option} passed to MSVC"))
    for option in _host_options(link_flags, "-Xlinker"):
        if option.startswith(("--", "-z", "-soname", "-rpath")):
            findings.append(Finding("build_tools/kernel_build.py", 0, f"GNU ld option {option} passed to link.exe"))
    return findings


def scan_build_flags() -> list[Finding]:
    sys.path.insert(0, str(ROOT / "build_tools"))
    import kernel_build

    leg = kernel_build.LegPlan(kernel_build.load_matrix().toolkits[0], Path("nvcc"), "13.0", ["9.0"], "12.0")
    saved = kernel_build.IS_WINDOWS
    kernel_build.IS_WINDOWS = True
    try:
        return check_windows_flags(kernel_build._compile_flags(leg), kernel_build._link_flags())
    finally:
        kernel_build.IS_WINDOWS = saved


def main() -> int:
    findings = scan_package() + scan_csrc() + scan_build_flags()
    for finding in findings:
        print(finding)
    print(f"{len(findings)} Windows-readiness finding(s)")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())

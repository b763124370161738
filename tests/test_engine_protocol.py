"""Every implementation of the two engine seams has every member of its protocol, with a compatible signature.

`EngineCore` (wllm.engine.protocol: what AsyncEngine drives): LLMEngine, EngineProcess and the test double
FloodEngine. `EngineClient` (wllm.entrypoints.openai.engine_client: what the server drives): AsyncEngine
and the test double ScriptedEngine. Compatible means what a type checker would accept for a caller of the
protocol: each protocol parameter exists with the same name, kind and position (a keyword-only one may be
positional-or-keyword in the implementation), has a default where the protocol's has one, and its
annotation's union members are among the implementation's; any extra parameter has a default; return
annotations agree unless the protocol's says Any. Data members are checked on instances. Where mypy is
installed, it checks the same assignments statically too (`test_mypy_agrees`; skipped without it).
"""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_engine import FloodEngine, ScriptedEngine

from wllm.engine.async_engine import AsyncEngine
from wllm.engine.engine_process import EngineProcess
from wllm.engine.llm_engine import LLMEngine
from wllm.engine.protocol import EngineCore
from wllm.entrypoints.openai.engine_client import EngineClient

P = inspect.Parameter


def _members(protocol: type) -> tuple[dict[str, Any], set[str]]:
    """The protocol's methods (name -> function) and data members (attributes and properties)."""
    methods, data = {}, set(getattr(protocol, "__annotations__", {}))
    for name, value in vars(protocol).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            data.add(name)
        elif inspect.isfunction(value):
            methods[name] = value
    return methods, data


def _union(annotation: Any) -> set[str]:
    if annotation is P.empty:
        return set()
    return {part.strip() for part in str(annotation).split("|")}


def signature_problems(protocol: type, impl: type) -> list[str]:
    methods, _ = _members(protocol)
    problems = []
    for name, proto_fn in methods.items():
        fn = inspect.getattr_static(impl, name, None)
        if fn is None:
            problems.append(f"{impl.__name__} has no {name}")
            continue
        if not inspect.isfunction(fn):
            problems.append(f"{impl.__name__}.{name} is not a method")
            continue
        if inspect.iscoroutinefunction(proto_fn) != inspect.iscoroutinefunction(fn):
            problems.append(f"{impl.__name__}.{name}: coroutine or not, unlike the protocol")
        if inspect.isasyncgenfunction(fn) and "AsyncIterator" not in str(inspect.signature(proto_fn).return_annotation):
            problems.append(f"{impl.__name__}.{name}: an async generator where the protocol wants no iterator")
        want = list(inspect.signature(proto_fn).parameters.values())[1:]
        have = list(inspect.signature(fn).parameters.values())[1:]
        by_name = {p.name: p for p in have}
        positional = [p.name for p in have if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        for pos, w in enumerate(want):
            h = by_name.get(w.name)
            where = f"{impl.__name__}.{name}({w.name})"
            if h is None:
                problems.append(f"{where}: missing")
                continue
            if w.kind is P.POSITIONAL_OR_KEYWORD and (h.kind is not P.POSITIONAL_OR_KEYWORD
                                                      or positional.index(h.name) != pos):
                problems.append(f"{where}: not positional at {pos}")
            if w.kind is P.KEYWORD_ONLY and h.kind not in (P.KEYWORD_ONLY, P.POSITIONAL_OR_KEYWORD):
                problems.append(f"{where}: not a keyword")
            if w.default is not P.empty and h.default is P.empty:
                problems.append(f"{where}: no default")
            if h.annotation is not P.empty and "Any" not in str(h.annotation) \
                    and not _union(w.annotation) <= _union(h.annotation):
                problems.append(f"{where}: {h.annotation} does not take {w.annotation}")
        wanted = {w.name for w in want}
        for h in have:
            if h.name not in wanted and h.default is P.empty and h.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
                problems.append(f"{impl.__name__}.{name}({h.name}): extra parameter without a default")
        ret_w = inspect.signature(proto_fn).return_annotation
        ret_h = inspect.signature(fn).return_annotation
        if "Any" not in str(ret_w) and ret_h is not P.empty and str(ret_h) != str(ret_w):
            problems.append(f"{impl.__name__}.{name} returns {ret_h}, the protocol {ret_w}")
    return problems


@pytest.mark.parametrize("impl", [LLMEngine, EngineProcess, FloodEngine], ids=lambda c: c.__name__)
def test_engine_core_implementations(impl: type) -> None:
    assert signature_problems(EngineCore, impl) == []


@pytest.mark.parametrize("impl", [AsyncEngine, ScriptedEngine], ids=lambda c: c.__name__)
def test_engine_client_implementations(impl: type) -> None:
    assert signature_problems(EngineClient, impl) == []


def test_the_check_catches_what_it_should() -> None:
    class Missing:
        pass

    class Incompatible(FloodEngine):
        def add_request(self, request_id: str, prompt: list[int], params: Any, *, priority: int) -> None:  # type: ignore[override]
            pass

        def abort_delta(self, request_id: str, force: bool) -> None:  # type: ignore[override]
            pass

    assert any("has no step_deltas" in p for p in signature_problems(EngineCore, Missing))
    problems = signature_problems(EngineCore, Incompatible)
    assert any("add_request(priority): no default" in p for p in problems)
    assert any("add_request(cache_salt): missing" in p for p in problems)
    assert any("add_request(prompt)" in p and "does not take" in p for p in problems)
    assert any("abort_delta(force): extra parameter" in p for p in problems)
    assert any("abort_delta returns None" in p for p in problems)


def test_data_members(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The protocols' attributes and properties exist on real instances (most are set in __init__)."""
    from test_engine import tiny

    torch.manual_seed(0)
    model, _ = tiny("llama", tmp_path_factory)
    from wllm.engine.config import CacheConfig, EngineConfig

    engine = LLMEngine(model, None, EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=0)))
    process = EngineProcess("flood", engine_factory=FloodEngine.create)
    try:
        _, core_data = _members(EngineCore)
        _, client_data = _members(EngineClient)
        assert core_data == {"num_failed_steps", "tokenizer", "max_model_len", "pooling"}
        for instance in (engine, process, FloodEngine()):
            assert [name for name in core_data if not hasattr(instance, name)] == []
            assert isinstance(instance.max_model_len, int) and isinstance(instance.num_failed_steps, int)
        for instance in (AsyncEngine(FloodEngine()), ScriptedEngine()):
            assert [name for name in client_data if not hasattr(instance, name)] == []
        assert process.is_alive() and engine.is_alive()
    finally:
        process.close()
        engine.close()
    assert not process.is_alive() and not engine.is_alive()


# Third-party packages mypy would otherwise read through (torch alone takes most of a minute): their types
# are Any here, which is all this check needs; wllm's own modules are read, silently.
_SKIPPED = ["torch", "numpy", "transformers", "litestar", "opentelemetry", "prometheus_client", "jinja2",
            "tokenizers", "sentencepiece", "safetensors", "gguf", "huggingface_hub", "uvicorn", "httpx"]


def test_mypy_agrees(tmp_path: Path) -> None:
    """mypy accepts each implementation where its protocol is expected, and rejects a class that lacks
    members (so the check is not vacuous)."""
    api = pytest.importorskip("mypy.api")
    root = Path(__file__).resolve().parent.parent
    (tmp_path / "mypy.ini").write_text(textwrap.dedent(f"""\
        [mypy]
        mypy_path = {root}, {root / "tests"}
        follow_imports = silent
        ignore_missing_imports = True
        cache_dir = {tmp_path / "cache"}
        [mypy-{",".join(m + ".*" for m in _SKIPPED)}]
        follow_imports = skip
        """))
    (tmp_path / "conformance.py").write_text(textwrap.dedent("""\
        from fake_engine import FloodEngine, ScriptedEngine

        from wllm.engine.async_engine import AsyncEngine
        from wllm.engine.engine_process import EngineProcess
        from wllm.engine.llm_engine import LLMEngine
        from wllm.engine.protocol import EngineCore
        from wllm.entrypoints.openai.engine_client import EngineClient


        class Lacking:
            def step_deltas(self) -> list[int]:
                return []


        def core(a: LLMEngine, b: EngineProcess, c: FloodEngine) -> list[EngineCore]:
            return [a, b, c]


        def client(a: AsyncEngine, b: ScriptedEngine) -> list[EngineClient]:
            return [a, b]


        def lacking(a: Lacking) -> EngineCore:
            return a  # line 24: the one error
        """))
    out, err, status = api.run(["--config-file", str(tmp_path / "mypy.ini"), "--no-error-summary",
                                "--hide-error-context", str(tmp_path / "conformance.py")])
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "conformance.py:24:" in errors[0], out + err

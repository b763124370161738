"""Chat templates: Jinja2 in a sandbox, rendering the way Hugging Face transformers does.

Model templates come from the Hub (or a GGUF) and are untrusted code, so they run in
`ImmutableSandboxedEnvironment` and only ever see plain JSON-like data. The environment matches
transformers' `apply_chat_template`: trim_blocks + lstrip_blocks, the loopcontrols extension,
`raise_exception`, `strftime_now`, a `tojson` filter with ensure_ascii=False and indent support,
and a `{% generation %}` block tag (rendered as its plain content).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from os import PathLike
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, or failed on this conversation.

    The message is the template's own (from raise_exception) or Jinja's, so the API can return it
    as a 400 error.
    """


# Names a message's reasoning may come under; templates read `reasoning_content` (or `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it
    only renders its body, so templates that use it still work."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same signature trick as Jinja's
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


def _make_dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    return dict(*args, **kwargs)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _make_dict
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e.message} (line {e.lineno})") from e


def compile_chat_template(template: str) -> jinja2.Template:
    """Compile (and cache) a template; raises ChatTemplateError on a syntax error."""
    return _compile(template)


def _plain(value: Any) -> Any:
    """Rebuild `value` from JSON types only, so the sandboxed template never sees live objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    struct_fields = getattr(type(value), "__struct_fields__", None)  # msgspec.Struct
    if struct_fields is not None:
        return {name: _plain(getattr(value, name)) for name in struct_fields}
    dump = getattr(value, "model_dump", None)  # pydantic models (e.g. the openai SDK's)
    if callable(dump):
        return _plain(dump())
    return f"<{type(value).__name__}>"


def _prepare_message(message: Any, index: int) -> dict[str, Any]:
    msg = _plain(message)
    if not isinstance(msg, dict):
        raise ChatTemplateError(f"message {index} must be an object with 'role' and 'content', got {msg!r}")
    # OpenAI clients send content=None / tool_calls=None; templates handle a missing key, not None.
    msg = {k: v for k, v in msg.items() if v is not None}
    # ...except content: an assistant turn with tool_calls has `content: null` (valid OpenAI history),
    # and many templates concatenate message['content'] unconditionally, which fails on a missing key
    # as on None. The empty string renders as "no text" in every template.
    msg.setdefault("content", "")
    reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
    if reasoning is not None:
        msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    # OpenAI sends tool-call arguments as a JSON string; templates (Llama 3.1, Qwen2.5, ...)
    # expect the object and serialize it themselves.
    calls = msg.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    parsed = json.loads(fn["arguments"])
                except ValueError:
                    continue
                if isinstance(parsed, dict):
                    fn["arguments"] = parsed
    return msg


def render_chat_template(
    template: str,
    messages: Sequence[Any],
    *,
    tools: Sequence[Any] | None = None,
    documents: Sequence[Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    **variables: Any,
) -> str:
    """Render one conversation.

    `variables` are extra template variables (bos_token, eos_token, enable_thinking, ...).
    With `continue_final_message`, the text ends inside the last message (for prefilling an
    assistant reply) instead of after it. Raises ChatTemplateError on any template failure.
    """
    if not messages:
        raise ChatTemplateError("the conversation is empty; send at least one message")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
    compiled = _compile(template)
    chat = [_prepare_message(m, i) for i, m in enumerate(messages)]
    final = None
    if continue_final_message:
        final = chat[-1].get("content")
        if not isinstance(final, str):
            raise ChatTemplateError("continue_final_message needs a final message with string content")
        chat[-1]["content"] = final + _CONTINUE_TAG
    try:
        rendered = compiled.render(
            messages=chat,
            tools=_plain(list(tools)) if tools is not None else None,
            documents=_plain(list(documents)) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
            **_plain(variables),
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e.message or e}") from e
    except Exception as e:  # a template can fail in Python code too (e.g. str + None)
        raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from e
    if final is not None:
        tag = rendered.rfind(_CONTINUE_TAG.strip())
        if tag < 0 or final.strip() not in rendered:
            raise ChatTemplateError("continue_final_message: the template dropped the final message's text")
        # Keep the message's own trailing spaces only when the template kept them too.
        kept = rendered[tag: tag + len(_CONTINUE_TAG)] == _CONTINUE_TAG
        rendered = rendered[:tag] if kept else rendered[:tag].rstrip()
    return rendered


def load_chat_template(path_or_string: str | PathLike[str]) -> str:
    """A template from a file (.jinja / .j2 / .txt, or a .json holding "chat_template") or a literal string.

    A string containing Jinja markup ("{{" or "{%") is the template itself; anything else is a
    path, and a missing file is an error naming it.
    """
    text = str(path_or_string)
    if isinstance(path_or_string, str) and ("{{" in text or "{%" in text):
        compile_chat_template(text)
        return text
    path = Path(path_or_string)
    if not path.is_file():
        raise ChatTemplateError(
            f"chat template file not found: {path} (pass a file path or the template text itself)"
        )
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"cannot read chat template {path}: {e}") from e
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(content)
        except ValueError as e:
            raise ChatTemplateError(f"{path}: not valid JSON: {e}") from e
        content = data.get("chat_template") if isinstance(data, dict) else data
        if not isinstance(content, str):
            raise ChatTemplateError(f"{path}: expected a string or an object with a string 'chat_template'")
    compile_chat_template(content)
    return content

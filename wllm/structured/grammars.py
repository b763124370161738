"""Request fields -> llguidance grammar strings, one function per kind of constraint.

Each returns the serialised top-level grammar `llguidance.LLMatcher` takes (what `SamplingParams.grammar`
holds) and raises `GrammarError` for input that is malformed before any compilation (a schema that is not a
JSON object, an empty choice list). Whether the grammar compiles (a bad regex, an unknown schema keyword)
is found out by `GrammarCompiler`, off the engine loop.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

# JSON is generated compactly with fixed separators: with no free whitespace a model cannot loop on
# spaces or newlines inside a JSON value (applied as overrides, so a schema's `x-guidance` cannot undo it).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint that cannot be turned into a grammar; the message says why (a 400 at the API)."""


def json_schema_grammar(schema: dict[str, Any] | bool | str) -> str:
    """Output that is one JSON value valid under `schema` (a JSON Schema object, `true`, or its JSON text).
    Unsupported keywords are refused when the grammar is compiled, never ignored."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
    return json_schema_grammar({"type": "object"})


def regex_grammar(pattern: str) -> str:
    """Output that matches `pattern` as a whole (Rust `regex` syntax, as llguidance reads it)."""
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError("the regex must be a non-empty string")
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: list[str]) -> str:
    """Output that is exactly one of `choices`."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choices must be a non-empty list of non-empty strings")
    return llguidance.grammar_from("choice", json.dumps(choices))


def lark_grammar(text: str) -> str:
    """Output in the language of a Lark grammar (llguidance's dialect, `start` is the start rule)."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("the grammar must be a non-empty string")
    return llguidance.LLMatcher.grammar_from_lark(text)


def gbnf_grammar(text: str) -> str:
    """A grammar as llama.cpp users write it (GBNF, `root ::= ...`), or Lark: llguidance's converter tells
    them apart and turns GBNF into Lark."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("the grammar must be a non-empty string")
    try:
        return llguidance.grammar_from("grammar", text)
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def response_format_grammar(response_format: dict[str, Any]) -> str | None:
    """OpenAI's `response_format`: None for `text`, else the grammar of `json_object` or `json_schema`
    (`{"json_schema": {"name", "schema", "strict"}}`; output is constrained whether or not `strict` is set)."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarError("response_format json_schema needs a `json_schema` object with a `schema`")
        unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
        if unknown:
            raise GrammarError(f"unknown field(s) in response_format.json_schema: {', '.join(unknown)}")
        if "schema" not in spec:
            raise GrammarError("response_format.json_schema needs a `schema`")
        if "strict" in spec and not isinstance(spec["strict"], bool | None):
            raise GrammarError("response_format.json_schema.strict must be a boolean")
        return json_schema_grammar(spec["schema"])
    raise GrammarError(f"response_format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'")

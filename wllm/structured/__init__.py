"""Structured output: request fields -> llguidance grammars (`grammars`), their compilation and cache
(`compiler`), and the per-step token masks of constrained rows (`masks`).

The engine sees only `SamplingParams.grammar`, a serialised llguidance grammar; everything that turns a
request into one lives in `grammars`. See docs/structured_output.md.
"""

from wllm.structured.compiler import CompiledGrammar, GrammarCompiler
from wllm.structured.grammars import (
    GrammarError,
    choice_grammar,
    gbnf_grammar,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "choice_grammar",
    "gbnf_grammar",
    "json_object_grammar",
    "json_schema_grammar",
    "lark_grammar",
    "regex_grammar",
]

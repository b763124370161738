"""Tool-call grammars under llguidance itself: an LLMatcher on SmolLM2's tokenizer takes valid calls token by
token and refuses invalid ones, in every format and tool_choice mode.

The `[TOOL_CALLS]` / `<|python_tag|>` cases use a copy of the tokenizer with those added as special tokens,
as in Mistral's and Llama's vocabularies, so the grammars' special-token references are exercised.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance
import pytest
from tokenizers import AddedToken

from wllm.entrypoints.openai.chat_tools import token_ref_for
from wllm.entrypoints.openai.tool_parsers import FORMATS, PARSERS, ContentDelta, ToolArgsDelta, ToolCallStart
from wllm.model.default_model import default_model_path
from wllm.model.tokenizer import Tokenizer
from wllm.structured.tools import FunctionSpec, ReasoningSpec, tool_grammar

WEATHER = FunctionSpec(
    "get_weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"$ref": "#/$defs/unit"},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city"],
        "additionalProperties": False,
        "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}},
    },
)
TIME = FunctionSpec("get_time")  # no parameters: exactly {}
FUNCTIONS = [WEATHER, TIME]
SPECIALS = ["[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"]


@functools.lru_cache(maxsize=1)
def tokenizers() -> tuple[Tokenizer, llguidance.LLTokenizer]:
    base = Tokenizer.from_gguf(default_model_path())
    backend = type(base.backend).from_str(base.backend.to_str())
    backend.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok = Tokenizer(
        backend, bos_token_id=base.bos_token_id, eos_token_ids=base.eos_token_ids, eos_token_id=base.eos_token_id
    )
    return tok, llguidance.LLTokenizer(backend.to_str(), eos_token=sorted(tok.eos_token_ids))


def matcher(grammar: str) -> llguidance.LLMatcher:
    _, lt = tokenizers()
    m = llguidance.LLMatcher(lt, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(grammar: str, text: str) -> bool:
    """The whole text, token by token, is allowed and leaves the grammar complete (EOS allowed)."""
    tok, _ = tokenizers()
    m = matcher(grammar)
    ids = tok.encode(text, add_special_tokens=False)
    for token in ids:
        if not m.consume_token(token):
            return False
    return m.is_accepting()


def grammar(fmt: str, mode: str, **kw: Any) -> str:
    tok, _ = tokenizers()
    g = tool_grammar(FORMATS[fmt], FUNCTIONS, mode, token_ref=token_ref_for(tok), **kw)  # type: ignore[arg-type]
    assert g is not None
    assert llguidance.LLMatcher.validate_grammar(g, tokenizers()[1]) == ""
    return g


def call(fmt: str, name: str, args: dict[str, Any]) -> str:
    key = FORMATS[fmt].args_key
    return json.dumps({"name": name, key: args})


W = {"city": "Paris", "unit": "celsius", "days": 3}


def wrap(fmt: str, *calls: str) -> str:
    if fmt == "hermes":
        return "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)
    if fmt == "mistral":
        return "[TOOL_CALLS][" + ", ".join(calls) + "]"
    if fmt == "mistral_v11":
        return "".join(
            f"[TOOL_CALLS]{json.loads(c)['name']}[ARGS]{json.dumps(json.loads(c)['arguments'])}" for c in calls
        )
    return FORMATS[fmt].separator.join(calls)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "mistral_v11", "generic"])
def test_required_takes_schema_valid_calls_only(fmt: str) -> None:
    g = grammar(fmt, "required")
    one, two = call(fmt, "get_weather", W), call(fmt, "get_time", {})
    assert accepts(g, wrap(fmt, one))
    assert accepts(g, wrap(fmt, one, two))  # parallel calls
    assert not accepts(g, "The weather is nice.")  # a call is required
    assert not accepts(g, wrap(fmt, call(fmt, "get_weather", {"unit": "celsius"})))  # required field missing
    assert not accepts(g, wrap(fmt, call(fmt, "get_weather", {"city": "Paris", "unit": "kelvin"})))  # $ref enum
    assert not accepts(g, wrap(fmt, call(fmt, "get_weather", {"city": "Paris", "days": 9})))  # bound
    assert not accepts(g, wrap(fmt, call(fmt, "get_weather", {"city": "Paris", "wind": 1})))  # no extra keys
    assert not accepts(g, wrap(fmt, call(fmt, "get_time", {"x": 1})))  # parameterless: exactly {}
    assert not accepts(g, wrap(fmt, call(fmt, "launch_rocket", {})))  # unknown function
    assert not accepts(g, wrap(fmt, one).replace(": ", ":  "))  # no runaway whitespace
    single = grammar(fmt, "required", parallel=False)
    assert accepts(single, wrap(fmt, one)) and not accepts(single, wrap(fmt, one, two))


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "mistral_v11", "generic"])
def test_auto_is_free_text_until_the_trigger(fmt: str) -> None:
    g = grammar(fmt, "auto")
    calls = wrap(fmt, call(fmt, "get_weather", W))
    assert accepts(g, "It is sunny in Paris today.")
    assert accepts(g, calls)
    bad = wrap(fmt, call(fmt, "get_weather", {"town": "Paris"}))
    assert not accepts(g, bad)  # once the trigger is out, the call must validate
    if fmt in ("hermes", "mistral", "mistral_v11"):
        assert accepts(g, "Let me check. " + calls)  # text before the call
        assert not accepts(g, "Let me check. " + bad)


def test_none_masks_the_trigger() -> None:
    for fmt, triggered in [
        ("hermes", "<tool_call>\n"),
        ("mistral", "[TOOL_CALLS]["),
        ("llama3_json", '{"name": '),
        ("mistral_v11", "[TOOL_CALLS]get_time"),
    ]:
        g = grammar(fmt, "none")
        assert accepts(g, "Plain text, no call.")
        assert not accepts(g, triggered), fmt
    tok, _ = tokenizers()
    assert tool_grammar(FORMATS["generic"], FUNCTIONS, "none", token_ref=token_ref_for(tok)) is None


def test_special_token_triggers_are_single_tokens() -> None:
    tok, _ = tokenizers()
    ref = token_ref_for(tok)
    assert ref("[TOOL_CALLS]") == f"<[{tok.token_to_id('[TOOL_CALLS]')}]>"
    assert ref("<tool_call>") == '"<tool_call>"'  # not a special token of this vocabulary: text
    m = matcher(grammar("mistral", "required"))
    spelled = tok.encode("[", add_special_tokens=False)  # the literal text "[TOOL_CALLS]" is not the token
    assert m.validate_tokens(spelled) == 0
    assert m.consume_token(tok.token_to_id("[TOOL_CALLS]"))
    g = grammar("llama3_json", "auto")
    assert accepts(g, "<|python_tag|>" + call("llama3_json", "get_time", {}))


def test_reasoning_runs_free_before_the_calls() -> None:
    one = wrap("hermes", call("hermes", "get_weather", W))
    # the model opens the block itself (Qwen3)
    g = grammar("hermes", "required", reasoning=ReasoningSpec())
    assert accepts(g, '<think>\nMaybe {"name": broken JSON here, or <tool_call> text.\n</think>\n\n' + one)
    assert not accepts(g, one)  # the thinking comes first
    assert not accepts(g, "<think>ok</think>\n\nno call")
    # the prompt opened it (DeepSeek-R1)
    g = grammar("generic", "required", reasoning=ReasoningSpec(open_in_prompt=True))
    assert accepts(g, "2 + 2 ... </think>\n" + call("generic", "get_time", {}))


def test_constrained_output_parses_to_the_same_calls() -> None:
    # What the grammar lets through, the format's parser reads back as the calls that were written.
    for fmt in ("hermes", "llama3_json", "mistral", "mistral_v11", "generic"):
        text = wrap(fmt, call(fmt, "get_weather", W), call(fmt, "get_time", {}))
        assert accepts(grammar(fmt, "required"), text)
        parser = PARSERS[fmt](["get_weather", "get_time"])
        events = parser.feed(text) + parser.finish()
        assert not [e for e in events if isinstance(e, ContentDelta)]
        names = [e.name for e in events if isinstance(e, ToolCallStart)]
        args: dict[int, str] = {}
        for e in events:
            if isinstance(e, ToolArgsDelta):
                args[e.index] = args.get(e.index, "") + e.text
        assert names == ["get_weather", "get_time"]
        assert [json.loads(args[0]), json.loads(args[1])] == [W, {}]

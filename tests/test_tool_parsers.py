"""Tool-call and reasoning parsers on recorded model outputs (well-formed and malformed), whole and streamed.

Every case is parsed twice: fed in one piece (a non-streamed reply) and one character at a time (the worst
streaming split); both must give the same content, calls and argument text.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from wllm.entrypoints.openai.chat_tools import ReplyParser, assemble, delta_messages
from wllm.entrypoints.openai.reasoning import (
    ReasoningFormat,
    ReasoningParser,
    detect_reasoning,
    prompt_closes_reasoning,
    prompt_opens_reasoning,
)
from wllm.entrypoints.openai.tool_parsers import PARSERS, ContentDelta, ToolArgsDelta, ToolCallStart, detect_tool_format

TOOLS = ("get_weather", "get_time")


def parse(name: str, text: str, pieces: int | None = None) -> tuple[str, list[tuple[str, str]]]:
    parser = PARSERS[name](TOOLS)
    events = []
    if pieces is None:
        events += parser.feed(text)
    else:
        for i in range(0, len(text), pieces):
            events += parser.feed(text[i : i + pieces])
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[list[str]] = []
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index == len(calls)
            calls.append([e.name, ""])
        elif isinstance(e, ToolArgsDelta):
            calls[e.index][1] += e.text
    return content, [(n, a) for n, a in calls]


W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
T = '{"name": "get_time", "arguments": {}}'
WARGS = '{"city": "Paris", "unit": "celsius"}'

CASES: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    # hermes / qwen
    ("hermes", f"<tool_call>\n{W}\n</tool_call>", "", [("get_weather", WARGS)]),
    (
        "hermes",
        f"Let me look that up.\n\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>",
        "Let me look that up.",
        [("get_weather", WARGS), ("get_time", "{}")],
    ),
    ("hermes", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("hermes", "a < b and <tool", "a < b and <tool", []),  # a held-back trigger prefix that never completed
    ("hermes", f"<tool_call>\n{W}\n</tool_call>\nDone, see above.", "Done, see above.", [("get_weather", WARGS)]),
    # unknown name: not a call, the text stays content
    (
        "hermes",
        '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',
        [],
    ),
    # truncated before the name is complete: text; truncated inside the arguments: the call with what came
    ("hermes", '<tool_call>\n{"name": "get_wea', '<tool_call>\n{"name": "get_wea', []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', "", [("get_weather", '{"city": "Pa')]),
    ("hermes", "<tool_call>\nnot json at all", "<tool_call>\nnot json at all", []),
    ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>', "", [("get_time", "{}")]),  # no arguments
    (
        "hermes",
        '<tool_call>\n{"arguments": {"city": "Rome"}, "name": "get_weather"}\n</tool_call>',
        "",
        [("get_weather", '{"city": "Rome"}')],
    ),  # arguments before the name
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>',
        "",
        [("get_weather", '{"city": "Oslo"}')],
    ),  # arguments as a JSON string
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"q": "}\\" {[</tool_call>"}}\n</tool_call>',
        "",
        [("get_weather", '{"q": "}\\" {[</tool_call>"}')],
    ),  # brackets, quotes and the end tag inside a string
    # llama 3.x json
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        "",
        [("get_weather", WARGS)],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"type": "function", "name": "get_time", "parameters": {}}',
        "",
        [("get_time", "{}")],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "arguments": {}}',
        "",
        [("get_weather", WARGS), ("get_time", "{}")],
    ),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ("llama3_json", "Sure {not json} here", "Sure {not json} here", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par', "", [("get_weather", '{"city": "Par')]),
    # mistral
    ("mistral", f"[TOOL_CALLS][{W}, {T}]", "", [("get_weather", WARGS), ("get_time", "{}")]),
    ("mistral", f"Checking. [TOOL_CALLS] [{T}]", "Checking.", [("get_time", "{}")]),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "nope", "arguments": {}}]',
        '[TOOL_CALLS][{"name": "nope", "arguments": {}}]',
        [],
    ),
    ("mistral", "[TOOL_CALLS]oops", "[TOOL_CALLS]oops", []),
    ("mistral", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    # mistral v11
    (
        "mistral_v11",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        [("get_weather", WARGS), ("get_time", "{}")],
    ),
    ("mistral_v11", "Checking.[TOOL_CALLS]get_time[ARGS]", "Checking.", [("get_time", "{}")]),
    ("mistral_v11", "[TOOL_CALLS]launch_rocket[ARGS]{}", "[TOOL_CALLS]launch_rocket[ARGS]{}", []),
    ("mistral_v11", "[TOOL_CALLS] hello there", "[TOOL_CALLS] hello there", []),
    ("mistral_v11", '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', "", [("get_weather", '{"city": "Pa')]),
    # generic
    ("generic", f"{W}\n{T}", "", [("get_weather", WARGS), ("get_time", "{}")]),
    ("generic", "  A plain answer, with {braces} inside.", "  A plain answer, with {braces} inside.", []),
    ("generic", f"{W} and some text after", "and some text after", [("get_weather", WARGS)]),
    ("generic", '{"name": "get_weather", "arguments": {"city": "Oslo"}', "", [("get_weather", '{"city": "Oslo"}')]),
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_recorded_outputs(name: str, text: str, content: str, calls: list[tuple[str, str]]) -> None:
    assert parse(name, text) == (content, calls)
    for pieces in (1, 2, 7):
        assert parse(name, text, pieces) == (content, calls), pieces


def test_complete_calls_parse_and_ids_are_openai_style() -> None:
    parser = PARSERS["hermes"](TOOLS)
    events = parser.feed(f"<tool_call>\n{W}\n</tool_call>") + parser.finish()
    start = next(e for e in events if isinstance(e, ToolCallStart))
    assert start.id.startswith("call_") and len(start.id) > 12
    assert json.loads(parse("hermes", f"<tool_call>\n{W}\n</tool_call>")[1][0][1]) == {
        "city": "Paris",
        "unit": "celsius",
    }
    mistral = PARSERS["mistral"](TOOLS)
    (start,) = [e for e in mistral.feed(f"[TOOL_CALLS][{T}]") + mistral.finish() if isinstance(e, ToolCallStart)]
    assert len(start.id) == 9 and start.id.isalnum()  # what Mistral's templates insist on


def test_arguments_stream_as_raw_fragments() -> None:
    parser = PARSERS["hermes"](TOOLS)
    events = []
    for ch in f"<tool_call>\n{W}\n</tool_call>":
        events += parser.feed(ch)
    args = [e.text for e in events if isinstance(e, ToolArgsDelta)]
    assert len(args) > 10 and "".join(args) == WARGS  # many pieces, exactly the model's text
    starts = [i for i, e in enumerate(events) if isinstance(e, ToolCallStart)]
    assert starts == [0]  # nothing before the call's start, and the name comes first


def test_trigger_prefix_is_held_back() -> None:
    parser = PARSERS["hermes"](TOOLS)
    assert parser.feed("Hello <tool") == [ContentDelta("Hello")]  # the space and "<tool" wait
    assert parser.feed(" box>") == [ContentDelta(" <tool box>")]


def test_template_detection() -> None:
    from tool_templates import (
        LLAMA3_TEMPLATE,
        MISTRAL_TEMPLATE,
        MISTRAL_V11_TEMPLATE,
        QWEN3_TEMPLATE,
        QWEN25_TEMPLATE,
        SMOLLM2_TEMPLATE,
    )

    assert detect_tool_format(QWEN25_TEMPLATE) == "hermes"
    assert detect_tool_format(QWEN3_TEMPLATE) == "hermes"
    assert detect_tool_format(LLAMA3_TEMPLATE) == "llama3_json"
    assert detect_tool_format(MISTRAL_TEMPLATE) == "mistral"
    assert detect_tool_format(MISTRAL_V11_TEMPLATE) == "mistral_v11"
    assert detect_tool_format(SMOLLM2_TEMPLATE) == "generic"
    assert detect_tool_format(None) == "generic"
    assert detect_reasoning(QWEN3_TEMPLATE) is not None
    assert detect_reasoning(QWEN25_TEMPLATE) is None


# ------------------------------------------------------------------ reasoning


def split(
    text: str, in_reasoning: bool = False, allow_start: bool = True, pieces: int | None = None, tools: bool = False
) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    reasoning = ReasoningParser(ReasoningFormat(), in_reasoning=in_reasoning, allow_start=allow_start)
    parser = ReplyParser(reasoning, PARSERS["hermes"](TOOLS) if tools else None)
    events = []
    step = pieces or max(1, len(text))
    for i in range(0, len(text), step):
        events += parser.feed(text[i : i + step])
    events += parser.finish()
    msg = assemble(events)
    return msg.reasoning_content, msg.content, [(c.function.name, c.function.arguments) for c in msg.tool_calls]


REASONING_CASES = [
    # Qwen3: the model opens the block itself
    ("<think>\nThe user greets me.\n</think>\n\nHello!", False, True, ("The user greets me.", "Hello!")),
    ("<think>\n\n</think>\n\nHello!", False, True, (None, "Hello!")),  # an empty block: no reasoning
    ("Hello, no thinking.", False, True, (None, "Hello, no thinking.")),
    ("<thinking is a word>", False, True, (None, "<thinking is a word>")),
    # DeepSeek-R1 / QwQ: the prompt opened the block
    ("Let me think: 2 + 2 = 4.\n</think>\n\nIt is 4.", True, True, ("Let me think: 2 + 2 = 4.", "It is 4.")),
    ("Still thinking when the budget ran out", True, True, ("Still thinking when the budget ran out", None)),
    # thinking switched off in the prompt: a <think> the model writes is content
    ("<think>x</think>y", False, False, (None, "<think>x</think>y")),
]


@pytest.mark.parametrize(("text", "in_reasoning", "allow_start", "expected"), REASONING_CASES)
def test_reasoning_split(text: str, in_reasoning: bool, allow_start: bool, expected: tuple[str | None, str]) -> None:
    for pieces in (None, 1, 3):
        got = split(text, in_reasoning, allow_start, pieces)
        assert got[:2] == expected, pieces


def test_tool_call_after_reasoning_and_never_inside_it() -> None:
    text = (
        f"<think>\nShould I write <tool_call>\n{T}\n</tool_call>? No, the weather.\n</think>\n\n"
        f"<tool_call>\n{W}\n</tool_call>"
    )
    for pieces in (None, 1, 5):
        reasoning, content, calls = split(text, pieces=pieces, tools=True)
        assert reasoning is not None and reasoning.startswith("Should I write <tool_call>")
        assert content is None and calls == [("get_weather", WARGS)]


def test_prompt_state() -> None:
    fmt = ReasoningFormat()
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n", fmt)
    assert not prompt_opens_reasoning("<think>a</think>b<|im_start|>assistant\n", fmt)
    assert prompt_closes_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", fmt)
    assert not prompt_closes_reasoning("<think>a</think> and later <|im_start|>assistant\n", fmt)


def test_stream_deltas_group_by_kind() -> None:
    events = [
        ContentDelta("a"),
        ContentDelta("b"),
        ToolCallStart(0, "call_x", "get_time"),
        ToolArgsDelta(0, "{"),
        ToolArgsDelta(0, "}"),
    ]
    deltas = delta_messages(events)
    assert [d.content for d in deltas[:1]] == ["ab"]
    assert deltas[1].tool_calls[0].function.name == "get_time" and deltas[1].tool_calls[0].function.arguments == ""
    assert deltas[2].tool_calls[0].function.arguments == "{}" and deltas[2].tool_calls[0].id is msgspec.UNSET

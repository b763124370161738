# ruff: noqa: E501  (the model templates below are kept line for line as published)
"""Chat templates render exactly as transformers' apply_chat_template, inside a sandbox."""

from __future__ import annotations

import json
from datetime import datetime

import msgspec
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from wllm.model.default_model import default_model_path
from wllm.model.tokenizer import ChatTemplateError, Tokenizer, load_chat_template, render_chat_template

transformers = pytest.importorskip("transformers")

# Llama 3.1/3.2 Instruct's template as Meta publishes it (tools in the first user message,
# JSON tool calls, ipython tool results, strftime_now for the date).
LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Qwen2.5 Instruct's template (tools in the system prompt, <tool_call> blocks, grouped tool responses).
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city — in °C, <with> \"quotes\" & ampersands",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "城市 name"},
                           "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Now", "parameters": {}}}

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "日本語で 😀 <b>bold</b>"}],
    [{"role": "user", "content": "  padded  \n"}, {"role": "assistant", "content": "ok"},
     {"role": "user", "content": "again"}],
]
TOOL_CONVERSATION = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21, \"sky\": \"clear\"}"},
    {"role": "user", "content": "Thanks"},
]


def _hf_tokenizer(bos: str, eos: str):
    """A transformers tokenizer whose only job is rendering templates with these special tokens."""
    backend = HFTokenizer(models.WordLevel({"<unk>": 0, bos: 1, eos: 2}, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos,
                                                unk_token="<unk>")


def _ours(template: str, bos: str, eos: str) -> Tokenizer:
    backend = HFTokenizer(models.WordLevel({"<unk>": 0, bos: 1, eos: 2}, unk_token="<unk>"))
    return Tokenizer(backend, bos_token_id=1, eos_token_id=2, unk_token_id=0, chat_template=template)


@pytest.fixture(scope="module")
def smollm2():
    path = default_model_path()
    return Tokenizer.from_gguf(path), transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_smollm2_template_matches_transformers(smollm2):
    ours, hf = smollm2
    for conv in CONVERSATIONS:
        for gen in (True, False):
            expected = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(conv, add_generation_prompt=gen) == expected
    assert ours.apply_chat_template(CONVERSATIONS[0]).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n")
    # The rendered prompt tokenizes as transformers does, special tokens included.
    text = ours.apply_chat_template(CONVERSATIONS[1])
    assert ours.encode(text) == hf.apply_chat_template(CONVERSATIONS[1], tokenize=True, add_generation_prompt=True,
                                                       return_dict=False)


@pytest.mark.parametrize("name,template,bos,eos", [
    ("llama3", LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>"),
    ("qwen2.5", QWEN25_TEMPLATE, "<|endoftext|>", "<|im_end|>"),
])
def test_tool_templates_match_transformers(name, template, bos, eos):
    ours = _ours(template, bos, eos)
    hf = _hf_tokenizer(bos, eos)
    cases = [(c, None) for c in CONVERSATIONS] + [
        (CONVERSATIONS[0], [WEATHER_TOOL, TIME_TOOL]),
        (TOOL_CONVERSATION, [WEATHER_TOOL]),
    ]
    if name == "qwen2.5":  # several calls in one turn and consecutive tool results
        multi = [*TOOL_CONVERSATION[:2],
                 {"role": "assistant", "content": "Checking.", "tool_calls": [
                     {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                     {"type": "function", "function": {"name": "get_time", "arguments": {}}}]},
                 {"role": "tool", "content": "21C"}, {"role": "tool", "content": "12:00"}]
        cases.append((multi, [WEATHER_TOOL, TIME_TOOL]))
    for conv, tools in cases:
        for gen in (True, False):
            extra = {"date_string": "01 Jan 2025"} if name == "llama3" else {}
            expected = hf.apply_chat_template(conv, tools=tools, chat_template=template, tokenize=False,
                                              add_generation_prompt=gen, **extra)
            got = ours.apply_chat_template(conv, tools=tools, add_generation_prompt=gen, **extra)
            assert got == expected, (name, conv, tools)
    if name == "llama3":
        # Meta's template dates the prompt with strftime_now.
        today = datetime.now().strftime("%d %b %Y")
        assert f"Today Date: {today}\n" in ours.apply_chat_template(CONVERSATIONS[0])


def test_openai_style_messages():
    """None fields are dropped, string tool-call arguments become objects, msgspec Structs work."""
    ours = _ours(QWEN25_TEMPLATE, "<|endoftext|>", "<|im_end|>")

    class Function(msgspec.Struct):
        name: str
        arguments: str

    class ToolCall(msgspec.Struct):
        id: str
        function: Function
        type: str = "function"

    class Message(msgspec.Struct):
        role: str
        content: str | None = None
        tool_calls: list[ToolCall] | None = None

    msgs = [Message("user", "Weather?"),
            Message("assistant", None, [ToolCall("c1", Function("get_weather", '{"city": "Paris"}'))])]
    as_dicts = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": {"city": "Paris"}}}]}]
    got = ours.apply_chat_template(msgs, tools=[WEATHER_TOOL], add_generation_prompt=False)
    assert got == _hf_tokenizer("<|endoftext|>", "<|im_end|>").apply_chat_template(
        as_dicts, tools=[WEATHER_TOOL], chat_template=QWEN25_TEMPLATE, tokenize=False)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in got
    assert "None" not in got


def test_continue_final_message_matches_transformers(smollm2):
    ours, hf = smollm2
    conv = [{"role": "user", "content": "Write a haiku"}, {"role": "assistant", "content": "Autumn moon "}]
    expected = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=False,
                                      continue_final_message=True)
    got = ours.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True)
    assert got == expected and got.endswith("<|im_start|>assistant\nAutumn moon ")
    with pytest.raises(ChatTemplateError, match="cannot both be set"):
        ours.apply_chat_template(conv, add_generation_prompt=True, continue_final_message=True)


def test_environment_features():
    render = lambda t, **kw: render_chat_template(t, [{"role": "user", "content": "é<>&"}], **kw)  # noqa: E731
    # tojson: no HTML escaping, non-ASCII kept, indent and sort_keys supported.
    assert render("{{ messages[0] | tojson }}") == '{"role": "user", "content": "é<>&"}'
    assert render("{{ {'b': 1, 'a': [1]} | tojson(indent=2) }}") == '{\n  "b": 1,\n  "a": [\n    1\n  ]\n}'
    assert render("{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}") == '{"a": 2, "b": 1}'
    # trim_blocks + lstrip_blocks: block tags leave no newline or indentation behind.
    assert render("{% if true %}\n    x\n{% endif %}\n") == "    x\n"
    assert render("  {% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}") == "01"
    assert render("{% for i in range(3) %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}{% endfor %}") == "02"
    assert render("{% generation %}kept{% endgeneration %}") == "kept"
    assert render("{{ bos_token }}|{{ add_generation_prompt }}", bos_token="<s>") == "<s>|True"
    assert render("{% set ns = namespace(n=0) %}{% set ns.n = ns.n + 2 %}{{ ns.n }}") == "2"
    assert render("{{ strftime_now('%Y') }}") == str(datetime.now().year)
    assert render("{{ dict(a=1) | tojson }}") == '{"a": 1}'


def test_errors_are_value_errors():
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="^chat template error: Roles must alternate$"):
        render_chat_template("{{ raise_exception('Roles must alternate') }}", msgs)
    with pytest.raises(ValueError, match="does not compile"):
        render_chat_template("{% if %}", msgs)
    with pytest.raises(ValueError, match="chat template error"):
        render_chat_template("{{ messages[0].content + none }}", msgs)
    with pytest.raises(ValueError, match="empty"):
        render_chat_template("x", [])
    # The sandbox blocks reaching Python internals.
    with pytest.raises(ChatTemplateError, match="unsafe|not safely"):
        render_chat_template("{{ ''.__class__.__mro__ }}", msgs)
    with pytest.raises(ChatTemplateError, match="underscore"):
        render_chat_template("{% set ns = namespace(_x=1) %}", msgs)
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.append(1) }}", msgs)  # immutable sandbox
    # A model without a template: the error says how to pass one.
    tok = _ours(None, "<s>", "</s>")  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError, match="--chat-template"):
        tok.apply_chat_template(msgs)
    # Several templates without a default.
    tok = _ours({"a": "A", "b": "B"}, "<s>", "</s>")  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError, match="a, b"):
        tok.apply_chat_template(msgs)
    assert tok.apply_chat_template(msgs, chat_template="b") == "B"


def test_load_chat_template(tmp_path):
    literal = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert load_chat_template(literal) == literal
    f = tmp_path / "t.jinja"
    f.write_text(literal, encoding="utf-8")
    assert load_chat_template(f) == literal
    assert load_chat_template(str(f)) == literal
    j = tmp_path / "t.json"
    j.write_text(json.dumps({"chat_template": literal}), encoding="utf-8")
    assert load_chat_template(j) == literal
    with pytest.raises(ChatTemplateError, match="not found: .*missing.jinja"):
        load_chat_template(tmp_path / "missing.jinja")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        load_chat_template("{% for x in %}")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"template": 1}), encoding="utf-8")
    with pytest.raises(ChatTemplateError, match="chat_template"):
        load_chat_template(bad)
    # A loaded template renders through Tokenizer.apply_chat_template's chat_template argument.
    tok = _ours(None, "<s>", "</s>")  # type: ignore[arg-type]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=load_chat_template(f)) == "hi"

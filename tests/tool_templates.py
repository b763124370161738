"""Chat templates of real model families for the tool-calling tests (no downloads).

Llama 3.1 and Qwen2.5 are the ones tests/test_chat_template.py carries; the Mistral and Qwen3 ones here are
cut down to what tools and reasoning need, keeping each family's markers and rules: Mistral's
[AVAILABLE_TOOLS] / [TOOL_CALLS] / [TOOL_RESULTS] and its 9-character call ids, Qwen3's <tool_call> blocks
and <think> handling (enable_thinking=False writes an empty block into the prompt). `TemplateTokenizer` is the
scripted engine's character tokenizer rendering one of them.
"""

from __future__ import annotations

from typing import Any

from fake_engine import CharTokenizer
from test_api_hostile import SMOLLM2_TEMPLATE
from test_chat_template import LLAMA3_TEMPLATE, QWEN25_TEMPLATE

from wllm.model.tokenizer.chat_template import render_chat_template

MISTRAL_TEMPLATE = r"""{{- bos_token }}
{%- set user_messages = messages | selectattr('role', 'equalto', 'user') | list %}
{%- for message in messages %}
    {%- if message.role == 'user' or message.role == 'system' %}
        {%- if tools and message == user_messages[-1] %}
            {{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST] ' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '[TOOL_CALLS] [' }}
        {%- for call in message.tool_calls %}
            {%- if call.id is not defined or call.id | length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- '{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) }}
            {{- ', "id": "' + call.id + '"}' }}
            {%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']' + eos_token }}
    {%- elif message.role == 'assistant' %}
        {{- ' ' + message.content + eos_token }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS] {"content": ' + (message.content | tojson) + ', "call_id": "' + message.tool_call_id }}
        {{- '"}[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""

# Mistral's v11 templates (Mistral Small 3.2, Devstral, Magistral): one [TOOL_CALLS]name[ARGS]{...} per call.
MISTRAL_V11_TEMPLATE = r"""{{- bos_token }}
{%- if tools %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or message.role == 'system' %}
        {{- '[INST]' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' %}
        {{- message.content }}
        {%- for call in message.tool_calls or [] %}
            {{- '[TOOL_CALLS]' + call.function.name + '[ARGS]' + (call.function.arguments | tojson) }}
        {%- endfor %}
        {{- eos_token }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""

QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>" }}
    {%- for tool in tools %}{{- "\n" + (tool | tojson) }}{%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
        {{- '<|im_start|>assistant\n' + content }}
        {%- for tool_call in message.tool_calls or [] %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.function.name + '", "arguments": ' }}
            {{- (tool_call.function.arguments | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

# DeepSeek-R1 style: the generation prompt opens the thinking block itself.
R1_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'user' %}{{- '<|User|>' + message.content }}
    {%- elif message.role == 'assistant' %}{{- '<|Assistant|>' + message.content.split('</think>')[-1] + eos_token }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|Assistant|><think>\n' }}{%- endif %}
"""


class TemplateTokenizer(CharTokenizer):
    """The character tokenizer with a real chat template (one token per character, no special tokens)."""

    def __init__(self, template: str) -> None:
        self.template = template

    def select_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        return chat_template or self.template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        kwargs.pop("chat_template", None)
        return render_chat_template(
            self.template,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token="<s>",
            eos_token="</s>",
            **kwargs,
        )


__all__ = [
    "LLAMA3_TEMPLATE",
    "MISTRAL_TEMPLATE",
    "MISTRAL_V11_TEMPLATE",
    "QWEN25_TEMPLATE",
    "QWEN3_TEMPLATE",
    "R1_TEMPLATE",
    "SMOLLM2_TEMPLATE",
    "TemplateTokenizer",
]

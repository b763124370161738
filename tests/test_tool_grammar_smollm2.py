"""The tool grammars steer the real SmolLM2 into calls that parse and validate.

The engine's own grammar enforcement is built elsewhere; this test masks the logits itself, with llguidance's
torch helpers, in a plain greedy loop over the model, so the grammar, the generic format's prompt and the
parser are checked together on a real model now: under tool_choice required / named, the 135M model's reply
is always a call whose arguments validate against the function's schema.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema
import llguidance
import llguidance.torch
import msgspec
import pytest
import torch
from model_utils import one_thread

from wllm.entrypoints.openai.chat_tools import assemble, plan_tools, token_ref_for
from wllm.entrypoints.openai.protocol import ChatCompletionRequest
from wllm.entrypoints.openai.serving_chat import template_messages
from wllm.model.contiguous_attention import ContiguousAttention
from wllm.model.default_model import default_model_path
from wllm.model.loader import LoadedModel, load_model
from wllm.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": PARAMS},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The current time"}},
]


@functools.lru_cache(maxsize=1)
def model() -> tuple[LoadedModel, Tokenizer, llguidance.LLTokenizer]:
    with one_thread():
        loaded = load_model(default_model_path(), dtype="float32")
    tok = Tokenizer.from_gguf(default_model_path())
    return loaded, tok, llguidance.LLTokenizer(tok.backend.to_str(), eos_token=sorted(tok.eos_token_ids))


def constrained_greedy(prompt_ids: list[int], grammar: str, max_tokens: int) -> tuple[list[int], bool]:
    """Greedy decoding with each step's logits masked by the grammar; (tokens, ended by EOS)."""
    loaded, tok, lt = model()
    m = llguidance.LLMatcher(lt, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    eos = set(tok.eos_token_ids)
    mask: torch.Tensor | None = None
    ctx = ContiguousAttention()
    ctx.prepare([0], [len(prompt_ids)])
    tokens, positions = torch.tensor(prompt_ids), torch.arange(len(prompt_ids))
    out: list[int] = []
    with one_thread(), torch.no_grad():
        while len(out) < max_tokens:
            logits = loaded.model.compute_logits(loaded.model(tokens, positions, ctx)[-1:]).float()
            if mask is None:
                mask = llguidance.torch.allocate_token_bitmask(1, logits.shape[-1])
            llguidance.torch.fill_next_token_bitmask(m, mask)
            llguidance.torch.apply_token_bitmask_inplace(logits, mask)
            nxt = int(logits.argmax(-1).item())
            if nxt in eos:
                return out, True
            assert m.consume_token(nxt), m.get_error()
            out.append(nxt)
            if m.is_stopped():
                return out, True
            ctx.prepare([0], [1])
            tokens, positions = torch.tensor([nxt]), torch.tensor([len(prompt_ids) + len(out) - 1])
    return out, False


def reply(question: str, **request: Any) -> tuple[Any, bool]:
    _, tok, _ = model()
    req = msgspec.convert(
        {"messages": [{"role": "user", "content": question}], "tools": TOOLS, **request}, ChatCompletionRequest
    )
    plan = plan_tools(req, tok.chat_template, "auto", "auto")
    assert plan.generic  # SmolLM2's template knows no tools
    messages = plan.template_messages(template_messages(req.messages))
    prompt = tok.apply_chat_template(messages, tools=plan.template_tools)
    plan.finish_prompt(prompt, token_ref_for(tok))
    assert plan.grammar is not None
    ids, ended = constrained_greedy(tok.encode(prompt, add_special_tokens=False), plan.grammar, 48)
    parser = plan.reply_parser()
    return assemble(parser.feed(tok.decode(ids)) + parser.finish()), ended


def test_required_yields_a_call_even_for_a_chat_question() -> None:
    # parallel_tool_calls=False: with parallel calls allowed, a model this small repeats its call until the
    # budget runs out (each one valid); one call keeps the test short.
    message, ended = reply("Tell me a joke about cats.", tool_choice="required", parallel_tool_calls=False)
    assert ended and message.content is None
    for call in message.tool_calls:
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            jsonschema.validate(args, PARAMS)
        else:
            assert call.function.name == "get_time" and args == {}


def test_named_tool_with_one_call() -> None:
    message, ended = reply(
        "Hello there!", tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False
    )
    assert ended
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)

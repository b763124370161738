"""Settings of the HTTP layer (what `wllm serve` flags fill in besides the engine's own)."""

from __future__ import annotations

import msgspec

MiB = 1 << 20


class ServerConfig(msgspec.Struct, kw_only=True):
    """Everything the OpenAI app needs to know besides the engine.

    `served_model_names[0]` is the name reported in responses; any of them is accepted in
    requests. Bounds (`max_n`, `max_stop`, ...) reject abusive requests with a 400 before they
    reach the engine.
    """

    served_model_names: list[str] = msgspec.field(default_factory=lambda: ["default"])
    model_root: str | None = None  # the model source the server was started with (shown in /v1/models)
    chat_template: str | None = None  # a template string (or template name) overriding the model's own
    api_keys: list[str] = msgspec.field(default_factory=list)
    rate_limit_rpm: float | None = None
    rate_limit_tpm: float | None = None
    cors_origins: list[str] = msgspec.field(default_factory=list)
    metrics_auth: bool = False  # whether GET /metrics and /v1/engine/stats need an API key (when keys are set)
    ui: bool = True  # serve the web UI at / (wllm/entrypoints/ui)
    max_body_bytes: int = 16 * MiB
    # Most characters in one prompt (a rendered chat, or one completion prompt), refused before it is
    # tokenized; None: 16 characters per token of the model's context (offload.DEFAULT_CHARS_PER_TOKEN).
    max_prompt_chars: int | None = None
    max_n: int = 16
    max_stop: int = 16
    max_stop_chars: int = 1024
    max_logit_bias: int = 1024
    max_logprobs: int = 20
    grammar_timeout_s: float = 10.0  # deadline for compiling a request's grammar (structured output)
    retry_after_s: int = 1  # Retry-After sent with 503 when the queue is full or the engine is down
    tool_call_parser: str = "auto"  # tool-call format: auto (from the chat template) or a name in tool_parsers
    reasoning_parser: str = "auto"  # <think> reasoning: auto (from the chat template), none, qwen3, deepseek_r1

    def __repr__(self) -> str:
        # API keys must never appear in logs or tracebacks.
        fields = {f: getattr(self, f) for f in self.__struct_fields__ if f != "api_keys"}
        fields["api_keys"] = f"<{len(self.api_keys)} keys>"
        return "ServerConfig(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"

    def validate(self) -> None:
        if not self.served_model_names or any(not n for n in self.served_model_names):
            raise ValueError("served model names must be non-empty strings")
        for name in ("max_body_bytes", "max_n", "max_stop", "max_stop_chars", "max_logit_bias", "max_logprobs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.grammar_timeout_s > 0:
            raise ValueError(f"grammar_timeout_s must be positive, got {self.grammar_timeout_s}")
        from wllm.entrypoints.openai.reasoning import REASONING_PARSER_CHOICES
        from wllm.entrypoints.openai.tool_parsers import TOOL_PARSER_CHOICES

        if self.tool_call_parser not in TOOL_PARSER_CHOICES:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSER_CHOICES)}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser not in REASONING_PARSER_CHOICES:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSER_CHOICES)}, "
                             f"got {self.reasoning_parser!r}")
        for name in ("rate_limit_rpm", "rate_limit_tpm", "max_prompt_chars"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")

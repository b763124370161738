"""A stand-in engine for EngineProcess tests, importable in the spawned child (tests/ is on its sys.path)."""

from __future__ import annotations

import time
from typing import Any

from wllm.outputs import CompletionOutput, RequestMetrics, RequestOutput


class FloodEngine:
    """Echoes every request's (long) prompt in its first output and gives one token per step until
    `max_tokens`; `step_delay` seconds per step. No model, no tokenizer."""

    tokenizer = None
    model_source = "stub"

    def __init__(self, step_delay: float = 0.0, fail_at_step: int | None = None) -> None:
        self.max_model_len = 1 << 20
        self.num_failed_steps = 0
        self.step_delay = step_delay
        self.fail_at_step = fail_at_step
        self.steps = 0
        self.running: dict[str, tuple[list[int], list[int], int, float]] = {}

    @classmethod
    def create(cls, model: str, **kwargs: Any) -> FloodEngine:
        if model != "flood":
            raise ValueError(f"{model}: the stub only serves 'flood'")
        return cls(**kwargs)

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self.running), "num_waiting": 0, "kv_cache_usage": 0.0}

    def add_request(self, request_id: str, prompt: list[int], params: Any, *, priority: int = 0,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        if request_id in self.running:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.max_tokens is None or params.max_tokens > 1000:
            raise ValueError("the stub gives at most 1000 tokens")
        self.running[request_id] = (list(prompt), [], params.max_tokens, time.monotonic())

    def abort(self, request_id: str) -> RequestOutput | None:
        entry = self.running.pop(request_id, None)
        return None if entry is None else self._output(request_id, entry, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("the stub engine broke")
        time.sleep(self.step_delay)
        outs = []
        for rid, entry in list(self.running.items()):
            entry[1].append(len(entry[1]) + 7)
            done = len(entry[1]) >= entry[2]
            outs.append(self._output(rid, entry, "length" if done else None))
            if done:
                del self.running[rid]
        return outs

    @staticmethod
    def _output(rid: str, entry: tuple[list[int], list[int], int, float], reason: str | None) -> RequestOutput:
        prompt, tokens, _, arrival = entry
        return RequestOutput(request_id=rid, prompt_token_ids=prompt,
                             outputs=[CompletionOutput(0, "t" * len(tokens), list(tokens), finish_reason=reason)],
                             finished=reason is not None, metrics=RequestMetrics(arrival_time=arrival))

    def close(self) -> None:
        pass

"""Model-free test doubles for the two engine seams (tests and benchmarks/frontend_cpu.py; not shipped).

`ScriptedEngine` stands in for AsyncEngine (the HTTP layer's `EngineClient`), to test the server without a
model. The tokenizer is character-level (token id = code point + 3; 0, 1, 2 are BOS, EOS, PAD). The
engine "generates" a fixed script per choice, one character per step, honouring max_tokens,
stop strings, stop token ids, n, seed, logprobs and prompt_logprobs; it simulates prefix
caching (blocks of 4 tokens), a bounded queue, aborts and an unhealthy state. It streams `RequestDelta`s
as AsyncEngine does (taken from the cumulative state by the engine's own `DeltaEncoder`).

`FloodEngine` stands in for LLMEngine one level below (an `EngineCore`, under the real AsyncEngine or in
an EngineProcess's child).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from wllm.entrypoints.openai.engine_client import QueueFullError
from wllm.model.pooling import PoolingConfig
from wllm.outputs import (
    CompletionDelta,
    CompletionOutput,
    DeltaEncoder,
    RequestDelta,
    RequestMetrics,
    RequestOutput,
    StepLogprobs,
    TokenLogprob,
)
from wllm.pooling_params import PoolingParams
from wllm.sampling_params import SamplingParams

BOS, EOS, PAD = 0, 1, 2
SPECIAL = {BOS: "<s>", EOS: "</s>", PAD: "<pad>"}
CACHE_BLOCK = 4


def _visible(seq: CompletionOutput, stop: list[str]) -> str:
    """Text without a trailing partial stop string (the engine never shows one that may still match)."""
    if seq.finish_reason is not None:
        return seq.text
    longest = max((len(s) for s in stop), default=0)
    for cut in range(max(0, len(seq.text) - longest), len(seq.text)):  # longest tail first
        tail = seq.text[cut:]
        if any(s.startswith(tail) for s in stop):
            return seq.text[:cut]
    return seq.text


class CharTokenizer:
    """One token per character; a tiny chat template that fails on two user turns in a row."""

    vocab_size = 0x110000 + 3
    eos_token_id = EOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + [ord(c) + 3 for c in text]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = []
        for t in token_ids:
            if t in SPECIAL:
                if not skip_special_tokens:
                    out.append(SPECIAL[t])
            else:
                out.append(chr(t - 3))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        parts = ["<s>"]
        previous = None
        for m in messages:
            if m["role"] == "user" and previous == "user":
                raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")
            previous = m["role"]
            parts.append(f"<|{m['role']}|>{m.get('content') or ''}\n")
        if add_generation_prompt:
            parts.append("<|assistant|>")
        return "".join(parts)


class ScriptedEngine:
    """Satisfies EngineClient. `script(i, seed)` gives choice i's full reply (default: a fixed text)."""

    def __init__(self, *, max_model_len: int = 256, max_waiting: int = 0, step_delay: float = 0.0,
                 replies: Sequence[str] = ("Hello! I am a scripted reply.",)) -> None:
        self.tokenizer = CharTokenizer()
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting  # 0 = unbounded
        self.step_delay = step_delay
        self.replies = list(replies)
        self.healthy = True
        self.gate: asyncio.Event | None = None  # when set to an Event, generation waits on it after token 1
        self.at_gate: asyncio.Event | None = None  # set by the engine once a request waits at the gate
        self.active: dict[str, SamplingParams] = {}
        self.aborted: list[str] = []
        self.finished_ids: list[str] = []
        self.seen_prompts: list[list[int]] = []
        self.preemptions = 0
        self.calls: list[tuple[list[int], SamplingParams, str, int, str | None]] = []

    # -- EngineClient

    def is_healthy(self) -> bool:
        return self.healthy

    def stats(self) -> dict[str, float]:
        return {"num_waiting": 0, "num_running": len(self.active), "kv_cache_usage": 0.01 * len(self.active),
                "prefix_cache_hit_rate": 0.0, "num_preemptions": self.preemptions}

    async def abort(self, request_id: str) -> None:
        if self.active.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def reply_for(self, index: int, seed: int | None, temperature: float) -> str:
        base = self.replies[index % len(self.replies)]
        if temperature == 0.0:
            return base
        # A sampled reply: a seeded shuffle of the words, different run to run without a seed.
        rng = random.Random(seed) if seed is not None else random.Random()
        words = base.split(" ")
        rng.shuffle(words)
        return " ".join(words)

    def _cached(self, prompt: list[int]) -> int:
        best = 0
        for old in self.seen_prompts:
            n = 0
            for a, b in zip(old, prompt):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        best = min(best, len(prompt) - 1)  # a hit never covers the last prompt token
        return best - best % CACHE_BLOCK

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestDelta]:
        if not self.healthy:
            raise RuntimeError("engine is dead")
        if self.max_waiting and len(self.active) >= self.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.max_waiting} requests)")
        self.calls.append((list(prompt_token_ids), params, request_id, priority, cache_salt))
        self.active[request_id] = params
        arrival = time.monotonic()
        cached = self._cached(prompt_token_ids)
        self.seen_prompts.append(list(prompt_token_ids))
        prompt_lps: list[StepLogprobs | None] | None = None
        if params.prompt_logprobs is not None:
            prompt_lps = [None] + [self._step(t, k, params.prompt_logprobs) for k, t in
                                   enumerate(prompt_token_ids[1:])]
        replies = [self.reply_for(i, None if params.seed is None else params.seed + i, params.temperature)
                   for i in range(params.n)]
        seqs = [CompletionOutput(index=i, text="", token_ids=[], logprobs=[] if params.logprobs is not None else None)
                for i in range(params.n)]
        metrics = RequestMetrics(arrival_time=arrival, first_scheduled_time=time.monotonic())
        encoder = DeltaEncoder()
        step = 0
        try:
            while any(s.finish_reason is None for s in seqs):
                await asyncio.sleep(self.step_delay)
                if request_id not in self.active:
                    return  # aborted: the stream just ends, as the real engine's does
                if step == 1 and self.gate is not None:
                    if self.at_gate is not None:
                        self.at_gate.set()
                    await self.gate.wait()
                for seq, reply in zip(seqs, replies):
                    if seq.finish_reason is None:
                        self._advance(seq, reply, params)
                step += 1
                if metrics.first_token_time is None:
                    metrics.first_token_time = time.monotonic()
                done = all(s.finish_reason is not None for s in seqs)
                if done:
                    metrics.finished_time = time.monotonic()
                    self.active.pop(request_id, None)
                    self.finished_ids.append(request_id)
                yield encoder.encode(RequestOutput(
                    request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                    outputs=[CompletionOutput(index=s.index, text=_visible(s, params.stop), token_ids=list(s.token_ids),
                                              logprobs=None if s.logprobs is None else list(s.logprobs),
                                              finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                             for s in seqs],
                    finished=done, num_cached_tokens=cached, prompt_logprobs=prompt_lps, metrics=metrics))
        finally:
            # A consumer that stops iterating early aborts the request, as with the real AsyncEngine.
            if self.active.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    # -- internals

    @staticmethod
    def _step(token_id: int, position: int, top_n: int) -> StepLogprobs:
        logprob = -0.25 * (position % 4 + 1)
        top = [TokenLogprob(token_id, logprob)] + [TokenLogprob(ord("a") + 3 + j, logprob - 1.0 - j)
                                                   for j in range(max(0, top_n - 1))]
        return StepLogprobs(token_id=token_id, logprob=logprob, rank=1, top=top[:top_n])

    def _advance(self, seq: CompletionOutput, reply: str, params: SamplingParams) -> None:
        position = len(seq.token_ids)
        at_end = position >= len(reply)
        token = EOS if at_end else ord(reply[position]) + 3
        if token == EOS and not params.ignore_eos and position >= params.min_tokens:
            seq.finish_reason, seq.stop_reason = "stop", None
            return
        if at_end:
            token = ord(".") + 3
        seq.token_ids.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(self._step(token, position, params.logprobs or 0))
        seq.text += self.tokenizer.decode([token])
        if token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            return
        for s in params.stop:
            cut = seq.text.find(s)
            if cut >= 0:
                seq.text = seq.text[:cut + len(s)] if params.include_stop_str_in_output else seq.text[:cut]
                seq.finish_reason, seq.stop_reason = "stop", s
                return
        if params.max_tokens is not None and len(seq.token_ids) >= params.max_tokens:
            seq.finish_reason = "length"


class FloodEngine:
    """An `EngineCore` (what AsyncEngine drives) with no model: every running request gets one token per step
    (id 7, 8, ...; text "t" each) until `max_tokens`, its prompt's "logprobs" (each prompt token, logprob 0)
    in its first delta when it asks for prompt logprobs; `step_delay` seconds per step, slept (no GIL held,
    like a GPU step); a step from `fail_at_step` on raises. Engine-process tests and
    benchmarks/frontend_cpu.py."""

    model_source = "flood"

    def __init__(self, step_delay: float = 0.0, fail_at_step: int | None = None) -> None:
        self.tokenizer = CharTokenizer()
        self.max_model_len = 1 << 20
        self.pooling: PoolingConfig | None = None
        self.num_failed_steps = 0
        self.step_delay = step_delay
        self.fail_at_step = fail_at_step
        self.steps = 0
        self.closed = False
        # id -> (tokens so far, max_tokens, arrival, prompt logprobs still to send)
        self.running: dict[str, tuple[int, int, float, list[StepLogprobs | None] | None]] = {}

    @classmethod
    def create(cls, model: str, **kwargs: Any) -> FloodEngine:
        """`EngineProcess`'s engine factory (called in the child)."""
        if model != "flood":
            raise ValueError(f"{model}: the stub only serves 'flood'")
        return cls(**kwargs)

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self.running), "num_waiting": 0, "kv_cache_usage": 0.0}

    def add_request(self, request_id: str, prompt: Iterable[int],
                    params: SamplingParams | PoolingParams | None = None, *, priority: int = 0,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.running:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.max_tokens is None or params.max_tokens > 1000:
            raise ValueError("the stub gives at most 1000 tokens")
        prompt_lps: list[StepLogprobs | None] | None = None
        if params.prompt_logprobs is not None:
            ids = list(prompt)
            prompt_lps = [None] + [StepLogprobs(t, 0.0, 1, []) for t in ids[1:]]
        self.running[request_id] = (0, params.max_tokens, time.monotonic(), prompt_lps)

    def abort_delta(self, request_id: str) -> RequestDelta | None:
        entry = self.running.pop(request_id, None)
        if entry is None:
            return None
        return RequestDelta(request_id, [CompletionDelta(0, "", [], finish_reason="abort")], finished=True,
                            metrics=RequestMetrics(arrival_time=entry[2]))

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step_deltas(self) -> list[RequestDelta]:
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("the stub engine broke")
        time.sleep(self.step_delay)
        outs = []
        for rid, (done_tokens, max_tokens, arrival, prompt_lps) in list(self.running.items()):
            token = done_tokens + 7
            done = done_tokens + 1 >= max_tokens
            outs.append(RequestDelta(rid, [CompletionDelta(0, "t", [token], finish_reason="length" if done else None)],
                                     finished=done, prompt_logprobs=prompt_lps,
                                     metrics=RequestMetrics(arrival_time=arrival)))
            if done:
                del self.running[rid]
            else:
                self.running[rid] = (done_tokens + 1, max_tokens, arrival, None)
        return outs

    def take_rejected(self) -> list[tuple[str, BaseException]]:
        return []

    def is_alive(self) -> bool:
        return not self.closed

    def close(self) -> None:
        self.closed = True

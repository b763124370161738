"""`LLMEngine`: the synchronous engine. Add requests, call `step()` until nothing is left.

One step = schedule -> run the model -> append sampled tokens -> detokenize and check stop
strings -> cumulative `RequestOutput`s for every request that changed.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Sequence as Seq
from typing import Any

import msgspec
import torch
from torch import nn

from wllm.engine.config import EngineConfig, default_batched_tokens, engine_config_from_kwargs
from wllm.engine.model_runner import ModelRunner, model_device
from wllm.engine.request import RequestGroup, Sequence
from wllm.engine.scheduler import Scheduler
from wllm.engine.stop_checker import TextState
from wllm.outputs import CompletionOutput, RequestOutput
from wllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching engine over one model on one device.

    `tokenizer` needs `decode(ids, skip_special_tokens)` (and `encode(text)` for text prompts);
    without one the engine works on token ids only and outputs have empty text.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any | None = None,
        config: EngineConfig | None = None,
        *,
        eos_token_ids: Seq[int] | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.config.validate()
        self.model = model
        self.tokenizer = tokenizer
        model_config = getattr(model, "config", None)
        if eos_token_ids is None:
            eos_token_ids = getattr(tokenizer, "eos_token_ids", None) or getattr(model_config, "eos_token_ids", [])
        self.eos_token_ids = list(eos_token_ids or [])
        dtype = None
        if self.config.dtype != "auto":
            from wllm.model.config import parse_dtype

            dtype = parse_dtype(self.config.dtype)
        sched = self.config.scheduler
        if sched.max_num_batched_tokens is None:
            # Resolved on a copy: the caller's config object may serve engines on other devices.
            sched = msgspec.structs.replace(
                sched, max_num_batched_tokens=default_batched_tokens(model_device(model).type))
            self.config = msgspec.structs.replace(self.config, scheduler=sched)
        max_len = sched.max_model_len or getattr(model_config, "max_position_embeddings", None) or 2048
        self.runner = ModelRunner(model, self.config.cache, sched.max_num_batched_tokens, dtype,
                                  max_num_seqs=sched.max_num_seqs, max_model_len=max_len,
                                  enforce_eager=self.config.enforce_eager)
        self.scheduler = Scheduler(sched, self.config.cache, self.runner.num_gpu_blocks,
                                   self.runner.num_cpu_blocks, max_len, self.eos_token_ids)
        self._rng = random.Random(self.config.seed)
        self.num_steps = 0
        self.model_source: str | None = None
        self.num_failed_steps = 0

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike[str],
        *,
        tokenizer: str | os.PathLike[str] | None = None,
        load_format: str = "auto",
        revision: str | None = None,
        **engine_args: Any,
    ) -> LLMEngine:
        """Load a model (HF folder or hub id, GGUF file, or dummy shape) and its tokenizer and
        build an engine. `engine_args` are EngineConfig fields (block_size, max_num_seqs, device,
        dtype, ...); device "auto" picks CUDA when available."""
        from wllm.model.loader import load_model
        from wllm.model.tokenizer.synthetic import synthetic_tokenizer
        from wllm.model.tokenizer.tokenizer import Tokenizer

        config = engine_config_from_kwargs(**engine_args)
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        loaded = load_model(model, dtype=config.dtype, device=device, load_format=load_format,
                            revision=revision)
        tok_source = tokenizer or loaded.tokenizer_path
        if tok_source is not None:
            tok = Tokenizer.from_path(tok_source)
        elif load_format == "dummy":
            tok = synthetic_tokenizer(loaded.config.vocab_size)
        else:
            tok = None
        eos: set[int] = set(getattr(tok, "eos_token_ids", ()) or ())
        gen_eos = loaded.generation_config.get("eos_token_id")
        if gen_eos is not None:
            eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        if not eos:
            eos.update(loaded.config.eos_token_ids)
        engine = cls(loaded.model, tok, config, eos_token_ids=sorted(eos))
        engine.model_source = str(model)
        return engine

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    # ------------------------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises ValueError for bad input and QueueFullError when the waiting
        queue is at its bound."""
        params = params or SamplingParams()
        params.validate()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass prompt token ids instead of text")
            prompt_ids = list(self.tokenizer.encode(prompt))
        else:
            prompt_ids = [int(t) for t in prompt]
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if vocab is not None:
            bad = [t for t in prompt_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {vocab})")
        group = RequestGroup(request_id, prompt_ids, params, priority=priority, cache_salt=cache_salt,
                             arrival_time=arrival_time, seed=self._rng.getrandbits(63))
        self.scheduler.add_group(group)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now (its blocks are freed at once); returns its final output."""
        group = self.scheduler.abort(request_id)
        if group is None:
            return None
        self.scheduler.pop_finished_group(request_id)
        return self._make_output(group)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs of every request that changed."""
        outputs: list[RequestOutput] = []
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return outputs
        self.num_steps += 1
        try:
            results = self.runner.execute(sched_out)
        except Exception as e:  # fail the requests of this step, keep serving the others
            logger.exception("engine step failed")
            self.num_failed_steps += 1
            message = f"{type(e).__name__}: {e}"
            for group in self.scheduler.fail_step(sched_out, message):
                self.scheduler.pop_finished_group(group.request_id)
                outputs.append(self._make_output(group))
            return outputs
        changed = self.scheduler.update_from_output(sched_out, results)
        if self.tokenizer is not None:
            for seq in changed:
                self._process_text(seq)
        # One output per request, in the order its first changed sequence came (dict keeps order).
        groups = {id(seq.group): seq.group for seq in changed}
        for group in groups.values():
            out = self._make_output(group)
            outputs.append(out)
            if out.finished:
                self.scheduler.pop_finished_group(group.request_id)
        return outputs

    def _process_text(self, seq: Sequence) -> None:
        if self.tokenizer is None:
            return
        if seq.text_state is None:
            seq.text_state = TextState(self.tokenizer, seq.prompt_token_ids, seq.params)
        token = seq.output_token_ids[-1]
        stopped_by_token = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
        hit = seq.text_state.append(token, len(seq.output_token_ids), decode_token=not stopped_by_token)
        if hit is not None:
            # A stop string beats "length" when the same token completes both.
            self.scheduler.finish_seq(seq, "stop", hit)
        elif seq.is_finished:
            seq.text_state.flush()

    def _make_output(self, group: RequestGroup) -> RequestOutput:
        finished = group.is_finished
        if finished and group.metrics.finished_time is None:
            group.metrics.finished_time = time.monotonic()
        want_lp = group.params.logprobs is not None
        outs = []
        for seq in group.seqs:
            state = seq.text_state
            outs.append(CompletionOutput(
                index=seq.index,
                text=state.visible_text(seq.is_finished) if state is not None else "",
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if want_lp else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            ))
        first = group.seqs[0]
        return RequestOutput(
            request_id=group.request_id,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outs,
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            prompt_logprobs=list(group.prompt_logprobs) if group.prompt_logprobs is not None else None,
            metrics=group.metrics,
            error=group.error,
        )

    # --------------------------------------------------------------------------------------- stats
    def stats(self) -> dict[str, float | int]:
        """Gauges and counters: queue lengths, KV usage, prefix cache, preemptions, tokens."""
        s = self.scheduler.stats()
        queries = s["prefix_cache_queries"]
        s["prefix_cache_hit_rate"] = s["prefix_cache_hits"] / queries if queries else 0.0
        s["num_preemptions"] = s["num_preemptions_swap"] + s["num_preemptions_recompute"]
        s["num_steps"] = self.num_steps
        s["num_failed_steps"] = self.num_failed_steps
        return s

    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run prompts to completion (convenience for tests and the offline API), in input order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        base = f"gen-{self._rng.getrandbits(32):08x}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]


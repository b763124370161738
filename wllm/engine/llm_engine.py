"""`LLMEngine`: the synchronous engine. Add requests, call `step()` until nothing is left.

One step = plan (`Scheduler.schedule` -> `StepPlan`) -> run it (`Worker.launch` / `collect`) -> append
the sampled tokens and decide stops (`StopChecker`: EOS, stop tokens, length, stop strings) -> cumulative
`RequestOutput`s for every request that changed.

Async scheduling (`EngineConfig.async_scheduling`, kernel path only). The host work of a step (wait for
the tokens, append them, detokenize, check stops, build outputs, plan, stage the inputs, launch the
forward) is a large part of a decode step's GPU time; done in sequence, the GPU idles through all of it.
So `step()` works one step ahead:

    launch N (or find it in flight) -> plan and launch N+1 with N in flight -> wait for N -> apply N

N+1 comes from the same `schedule()`, called with N in flight: N's tokens count as computed and its
samples are placeholders whose values stay on the device; each row that decodes one is fed it in stream
order before N+1's forward, and its sampling row counts it (the random stream is keyed by the output
position, so seeded results are the same as in turn). When N+1 needs a value only the host will have,
`schedule()` says so (None) and the step runs in turn instead: launch, wait, apply, plan the next call.
Constrained rows (`SamplingParams.grammar`): the engine compiles each grammar off its loop (a request waits,
unscheduled, until its grammar is compiled; one that does not compile is refused), gives each sequence its own
matcher, and before each launch starts filling the step's token masks in a worker thread, which the runner
waits for only when it samples. A grammar row's mask needs its previous token on the host, so a step planned
ahead leaves out the grammar rows whose token is in flight; they run in the step after (see
docs/structured_output.md).

Sequences that N ends by value (EOS, a stop token or string) or that are aborted while N+1 runs simply
have N+1's result ignored, and their blocks are freed at once. Freeing early is safe: there is one
stream, so whatever a later step writes into a freed block lands after N and N+1 are done with it; and
N+1 writes only slots past what N computed, in blocks the prefix cache does not hold (a block is offered
to the cache only once every slot of it is computed), so they are private and nobody else reads them. If
N+1's launch fails, or N fails on the device after N+1 was launched, the requests N+1 admitted go back to
the front of the queue (`Scheduler.cancel`) and are scheduled afresh. The CUDA runner keeps two host
result buffers, alternating between consecutive steps, and waits for a step's uploads (logit rows
included) before rewriting the pinned staging buffers for the step after it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import random
import sys
import time
import weakref
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from operator import index
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from torch import nn

from wllm.engine.config import EngineConfig, default_batched_tokens, engine_config_from_kwargs
from wllm.engine.memory_plan import loader_check
from wllm.engine.request import RequestGroup, SequenceStatus
from wllm.engine.scheduler import Scheduler
from wllm.engine.step_plan import StepPlan
from wllm.engine.worker import StepHandle, Worker, model_device
from wllm.model.pooling import PoolingConfig, resolve_pooling, task_of
from wllm.outputs import CompletionOutput, DeltaEncoder, ListPrefix, RequestDelta, RequestOutput
from wllm.pooling_params import PoolingParams
from wllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from wllm.structured.compiler import CompiledGrammar, GrammarCompiler
    from wllm.structured.masks import MaskFiller

logger = logging.getLogger(__name__)


class EngineClosedError(RuntimeError):
    """The engine was closed (`LLMEngine.close`); it takes no more requests or steps."""


# Engines not yet closed: `close` moves frozen objects back under the collector (to reach cycles through the
# closed engine) and freezes again only while some other engine still runs.
_open_engines: weakref.WeakSet[LLMEngine] = weakref.WeakSet()


def freeze_startup_objects() -> None:
    """Move every object alive now (imported libraries, the model's modules, graphs: the ~0.25-1M
    objects of a loaded engine) out of the cyclic garbage collector's reach. A full collection scans
    every tracked object, so with them each one is a long stall the GPU waits through (an offline batch
    of a few hundred requests triggers several; RESULTS.md has the numbers). Frozen objects are
    still freed by reference counting; garbage cycles are collected first so that none is pinned."""
    gc.collect()
    gc.freeze()


# Python 3.14's collector is incremental: it has no full-heap generation-2 pause to move.
_GENERATIONAL_GC = sys.version_info < (3, 14)


def collect_garbage_if_due() -> bool:
    """Run the cyclic GC's next full (generation-2) collection now if the collector is about to run it
    anyway; returns whether it ran. Called where the device has the most queued work (right after a
    step was launched ahead, before waiting for the one before it), so that the pause overlaps GPU work.

    Why: after `freeze_startup_objects`, a full collection still walks every live container the running
    requests hold: in an offline batch, mostly the token-id lists. The engine keeps prompts in tuples and
    frees finished requests without the collector (see wllm.engine.request), which leaves few references
    of its own (plus the caller's prompt lists), but a pass still takes milliseconds. Left to the allocation
    counter, a collection lands anywhere in the step, e.g. while the host processes step N with only N+1
    queued, and the GPU idles for the rest of it. Here it overlaps the rest of step N plus all of N+1.

    Due means: generation 1 has been collected `threshold2` times since the last full collection, so one
    of the next few allocation-triggered collections is the full one (CPython collects generation 2 at a
    trigger where that count exceeds the threshold). A count beyond threshold2 + 1 means CPython skipped
    full collections (it waits while few objects were promoted relative to the long-lived heap); those
    are left to its policy, so this never collects more often than it would."""
    if not _GENERATIONAL_GC or not gc.isenabled():
        return False
    _, _, threshold2 = gc.get_threshold()
    _, _, count2 = gc.get_count()
    if threshold2 <= 0 or not threshold2 <= count2 <= threshold2 + 1:
        return False
    gc.collect(2)
    return True


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
            device = model_device(model)
            sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
            sched = msgspec.structs.replace(sched, max_num_batched_tokens=default_batched_tokens(device.type, sms))
            self.config = msgspec.structs.replace(self.config, scheduler=sched)
        # A pooling model (embed, rerank: wllm.model.pooling) runs each prompt once, whole, in one step.
        self.pooling: PoolingConfig | None = getattr(model, "pooling", None)
        max_len = sched.max_model_len or getattr(model_config, "max_position_embeddings", None) or 2048
        if self.pooling is not None:
            max_len = self._pooling_setup(model_config, sched.max_model_len)
            sched = self.config.scheduler
        self.worker = Worker(model, self.config.cache, sched.max_num_batched_tokens, dtype,
                             max_num_seqs=sched.max_num_seqs, max_model_len=max_len,
                             enforce_eager=self.config.enforce_eager,
                             require_max_model_len=sched.max_model_len is not None)
        capacity = self.worker.num_gpu_blocks * self.config.cache.block_size
        if capacity < max_len:
            logger.warning("max_model_len is %d, not the model's %d: that is all the KV cache holds "
                           "(set max_model_len, or give the cache more memory)", capacity, max_len)
        self.scheduler = Scheduler(sched, self.config.cache, self.worker.num_gpu_blocks,
                                   self.worker.num_cpu_blocks, max_len, self.eos_token_ids, tokenizer)
        self._rng = random.Random(self.config.seed)
        self.num_steps = 0
        self.model_source: str | None = None
        self.num_failed_steps = 0
        self.num_lookahead_steps = 0
        # The step launched with one in flight by the last `step()`, processed by the next one.
        self._inflight: tuple[StepPlan, StepHandle] | None = None
        # Requests whose grammar is still compiling (not yet in the scheduler), and those whose grammar
        # failed there, for `take_rejected`.
        self._compiling: dict[str, tuple[RequestGroup, Future[CompiledGrammar]]] = {}
        self._rejected: list[tuple[str, BaseException]] = []
        self._grammar_compiler: GrammarCompiler | None = None
        if tokenizer is not None:
            from wllm.structured.compiler import GrammarCompiler

            # A backstop deadline: the server compiles every grammar under its own (shorter) one first.
            vocab = getattr(model_config, "vocab_size", None)
            self._grammar_compiler = GrammarCompiler(tokenizer, vocab, self.eos_token_ids, timeout_s=60.0)
        self._mask_filler: MaskFiller | None = None
        self.closed = False
        _open_engines.add(self)
        freeze_startup_objects()

    def _pooling_setup(self, model_config: Any, max_model_len: int | None) -> int:
        """A pooling engine's limits: the context is the length the model was trained for (or the one given,
        up to its position table); the step budget holds at least one whole prompt; the KV cache holds one
        step (every sequence ends in the step that runs it, so nothing is ever preempted or swapped); no
        prefix cache (an encoder's keys depend on the tokens after them, mean pooling needs every token)."""
        assert self.pooling is not None
        positions = getattr(model_config, "max_position_embeddings", None) or 2048
        max_len = max_model_len or self.pooling.max_seq_len or positions
        if getattr(model_config, "model_type", "") == "bert" and max_len > positions:
            raise ValueError(f"max_model_len {max_len} is more than this model's {positions} positions")
        sched, cache = self.config.scheduler, self.config.cache
        budget = max(sched.max_num_batched_tokens or 0, max_len)
        blocks = cache.num_gpu_blocks or -(-budget // cache.block_size) + sched.max_num_seqs
        self.config = msgspec.structs.replace(
            self.config, scheduler=msgspec.structs.replace(sched, max_num_batched_tokens=budget, max_model_len=max_len),
            cache=msgspec.structs.replace(cache, num_gpu_blocks=blocks, num_cpu_blocks=0, enable_prefix_caching=False))
        return max_len

    @property
    def task(self) -> str:
        """What this engine serves: "generate", "embed" or "rerank"."""
        return task_of(self.pooling)

    def close(self) -> None:
        """Free the model, the KV cache and swap space, the CUDA graphs and their memory pool now, not
        whenever the garbage collector reaches them. Requests still queued or running are aborted
        (their outputs are dropped). The engine takes no more requests or steps; closing again does
        nothing.

        Why: the engine start freezes every live object out of the cyclic collector (see
        `freeze_startup_objects`), so an engine caught in a reference cycle formed later (a callback
        stored on it that refers back to it, say) would keep its GPU memory until the process ends.
        Here the engine drops its own references and cycles through it are collected."""
        if self.closed:
            return
        for request_id in list(self.scheduler.groups):
            self.scheduler.abort(request_id)
            self.scheduler.pop_finished_group(request_id)
        self._inflight = None
        self._compiling.clear()
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()
        if self._mask_filler is not None:
            self._mask_filler.close()
        self.closed = True
        _open_engines.discard(self)
        self.model = None
        self.worker.close()
        # Frozen objects are out of the collector's reach: unfreeze so that cycles through this engine's
        # objects are found, then, while another engine runs, freeze again everything alive (as an engine
        # start does; this also undoes a freeze of the application's own when the last engine closes).
        gc.unfreeze()
        gc.collect()
        if _open_engines:
            gc.freeze()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("the engine is closed (LLMEngine.close / LLM.close); make a new one")

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike[str],
        *,
        tokenizer: str | os.PathLike[str] | None = None,
        load_format: str = "auto",
        revision: str | None = None,
        quantization: str | None = None,
        task: str = "auto",
        **engine_args: Any,
    ) -> LLMEngine:
        """Load a model (HF folder or hub id, GGUF file, or dummy shape; `quantization` makes a dummy shape's
        random weights GGUF blocks of that preset, e.g. "q4_k_m") and its tokenizer and build an engine.
        `task`: "auto" (from the model's files), "generate", "embed" or "rerank" (wllm.model.pooling).
        `engine_args` are EngineConfig fields (block_size, max_num_seqs, device, dtype, ...); device "auto"
        picks CUDA when available."""
        from wllm.model.loader import load_model
        from wllm.model.tokenizer.synthetic import synthetic_tokenizer
        from wllm.model.tokenizer.tokenizer import Tokenizer

        config = engine_config_from_kwargs(**engine_args)
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        memory_check = loader_check(config, torch.device(device)) if torch.device(device).type == "cuda" else None
        loaded = load_model(model, dtype=config.dtype, device=device, load_format=load_format,
                            revision=revision, quantization=quantization, memory_check=memory_check)
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
        loaded.model.pooling = resolve_pooling(loaded.config, loaded.path, tok, task)
        engine = cls(loaded.model, tok, config, eos_token_ids=sorted(eos))
        engine.model_source = str(model)
        return engine

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    # ----------------------------------------------------------------------------------- grammars
    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler and cache (made on first use: it needs the tokenizer)."""
        if self._grammar_compiler is None:
            from wllm.structured.grammars import GrammarError

            raise GrammarError("structured output needs a tokenizer; this engine has none")
        return self._grammar_compiler

    def _attach_grammar(self, group: RequestGroup, compiled: CompiledGrammar) -> None:
        if self._mask_filler is None:
            from wllm.structured.masks import MaskFiller

            self._mask_filler = MaskFiller(self.grammar_compiler.ll_tokenizer.vocab_size,
                                           pin_memory=self.worker.device.type == "cuda")
        group.seqs[0].matcher = compiled.new_matcher()

    def _admit_compiled(self) -> None:
        """Move requests whose grammar has compiled into the scheduler; refuse those whose grammar failed.
        With nothing else to run, wait a little for one to finish instead of spinning."""
        if not self.scheduler.has_unfinished():
            wait_futures([f for _, f in self._compiling.values()], timeout=0.02, return_when=FIRST_COMPLETED)
        for request_id, (group, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                self._attach_grammar(group, future.result())
                self.scheduler.add_group(group)
            except Exception as e:  # GrammarError, QueueFullError, ...: the request's own error
                self._rejected.append((request_id, e))

    def _start_masks(self, plan: StepPlan) -> None:
        """Start filling the masks of `plan`'s grammar rows (its runner waits for them when it samples)."""
        seqs = self.scheduler.seqs
        assert self._mask_filler is not None
        plan.masks = self._mask_filler.start([seqs[row.seq_id].matcher for row in plan.grammar_rows])

    # ------------------------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Iterable[int],
        params: SamplingParams | PoolingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        final_only: bool = False,
    ) -> None:
        """Queue a request. Raises ValueError for bad input and QueueFullError when the waiting
        queue is at its bound. `final_only`: `step()` returns this request's output only when it
        finishes, and text without stop strings is decoded once at the end rather than per token
        (offline batches: at a few hundred sequences that per-step host work is what the GPU waits on)."""
        self._check_open()
        pooling: PoolingParams | None = None
        if isinstance(params, PoolingParams):
            if self.pooling is None:
                raise ValueError("this model generates text; embeddings and scores need an embed or rerank model")
            pooling, params = params, SamplingParams(max_tokens=1)
            pooling.validate()
        elif self.pooling is not None:
            raise ValueError(f"this is a{'n' if self.task == 'embed' else ''} {self.task} model; it does not "
                             "generate text")
        params = params or SamplingParams()
        params.validate()
        if priority and self.scheduler.config.policy != "priority":
            # Refused rather than ignored: first come, first served has no use for it.
            raise ValueError(f"priority {priority} needs the priority scheduling policy (`wllm serve "
                             "--scheduling-policy priority`); this engine serves first come, first served")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass prompt token ids instead of text")
            prompt_ids = list(self.tokenizer.encode(prompt))
        else:
            # operator.index: ints (numpy's too) only; a float or a digit string is an error, not truncated.
            try:
                prompt_ids = list(map(index, prompt))
            except TypeError as e:
                raise ValueError(f"prompt token ids must be integers: {e}") from None
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if vocab is not None and prompt_ids and (min(prompt_ids) < 0 or max(prompt_ids) >= vocab):
            bad = [t for t in prompt_ids if not 0 <= t < vocab]
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {vocab})")
        group = RequestGroup(request_id, prompt_ids, params, priority=priority, cache_salt=cache_salt,
                             arrival_time=arrival_time, seed=self._rng.getrandbits(63), final_only=final_only,
                             pooling=pooling)
        if params.grammar is not None:
            # A GrammarError is a ValueError: bad input, refused like any other.
            future = self.grammar_compiler.submit(params.grammar)
            if not future.done():  # compiling off the loop: scheduled once it is done (`_admit_compiled`)
                if request_id in self.scheduler.groups or request_id in self._compiling:
                    raise ValueError(f"request id {request_id!r} is already in use")
                self._compiling[request_id] = (group, future)
                return
            self._attach_grammar(group, future.result())
        self.scheduler.add_group(group)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now (its blocks are freed at once); returns its final output."""
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None:
            group = compiling[0]
            seq = group.seqs[0]
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            out = self._make_output(group)
            group.release()
            return out
        group = self.scheduler.abort(request_id)
        if group is None:
            return None
        out = self._make_output(group)
        self.scheduler.pop_finished_group(request_id)
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling)

    # ---------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs of every request that changed.

        With async scheduling the step this call processes may have been launched by the call
        before (planned with a step in flight); this call may in turn launch the next one before it waits.
        """
        self._check_open()
        outputs: list[RequestOutput] = []
        if self._compiling:
            self._admit_compiled()
        inflight, self._inflight = self._inflight, None
        if inflight is not None and not self._has_live_seqs(inflight[0]):
            # Every sequence of it ended (EOS, stop, abort) since it was launched: drop it unseen.
            self.worker.release(inflight[1])
            inflight = None
        handle: StepHandle | None = None
        if inflight is None:
            plan = self.scheduler.schedule()
            assert plan is not None  # nothing in flight: never a wait
            if plan.is_empty:
                return outputs
            self.num_steps += 1
        else:
            plan, handle = inflight
        ahead: tuple[StepPlan, StepHandle] | None = None
        try:
            if handle is None:
                if plan.grammar_rows:
                    self._start_masks(plan)
                handle = self.worker.launch(plan)
            if self.config.async_scheduling and self.worker.supports_in_flight:
                ahead = self._launch_ahead(plan, handle)
                if ahead is not None:
                    # Two steps are queued on the device now: the best moment for a GC pause.
                    collect_garbage_if_due()
            results = self.worker.collect(handle)
        except Exception as e:  # fail the requests of this step, keep serving the others
            logger.exception("engine step failed")
            # Nothing launched may still be reading host buffers when the next step writes them.
            # The next step's sequences that are this step's fail below; those it admitted go back
            # to the waiting queue, to be scheduled afresh.
            for launched in (handle, ahead[1] if ahead is not None else None):
                if launched is not None:
                    with contextlib.suppress(Exception):
                        self.worker.release(launched)
            if ahead is not None:
                self.scheduler.cancel(ahead[0])
            self.num_failed_steps += 1
            message = f"{type(e).__name__}: {e}"
            for group in self.scheduler.fail_step(plan, message):
                outputs.append(self._make_output(group))
                self.scheduler.pop_finished_group(group.request_id)
            return outputs
        self._inflight = ahead
        changed = self.scheduler.update_from_output(plan, results)
        # One output per request, in the order its first changed sequence came (dict keeps order).
        groups = {id(seq.group): seq.group for seq in changed}
        for group in groups.values():
            # A beam search has no output before its end: which beams survive changes every step.
            if (group.final_only or group.beam is not None) and not group.is_finished:
                continue
            out = self._make_output(group)
            outputs.append(out)
            if out.finished:
                self.scheduler.pop_finished_group(group.request_id)
        return outputs

    def _launch_ahead(self, plan: StepPlan, handle: StepHandle) -> tuple[StepPlan, StepHandle] | None:
        """Plan and launch the step after `plan` (launched, not yet applied), if it can be planned now;
        see the module docstring."""
        next_plan = self.scheduler.schedule(in_flight=plan)
        if next_plan is None:
            return None
        try:
            if next_plan.grammar_rows:
                self._start_masks(next_plan)
            ahead = self.worker.launch(next_plan, handle)
        except Exception:
            # The step runs again from `schedule()` after this one: if it fails there too, it fails
            # its requests the usual way, with this step's tokens already delivered. Whatever part
            # of it was queued must finish before the host rewrites the buffers it reads.
            logger.warning("launching a step ahead failed; it will run in turn", exc_info=True)
            self.worker.synchronize()
            self.scheduler.cancel(next_plan)
            return None
        self.num_steps += 1
        self.num_lookahead_steps += 1
        return next_plan, ahead

    def _has_live_seqs(self, plan: StepPlan) -> bool:
        """Whether any sequence of a launched step still runs (and is the one it was launched for)."""
        seqs = self.scheduler.seqs
        for row in plan.rows:
            seq = seqs.get(row.seq_id)
            if seq is not None and seq.status is SequenceStatus.RUNNING and seq.sampling_row is row.sampling:
                return True
        return False

    def _make_output(self, group: RequestGroup) -> RequestOutput:
        finished = group.is_finished
        if finished and group.metrics.finished_time is None:
            group.metrics.finished_time = time.monotonic()
        if group.beam is not None:
            return self._beam_output(group, finished)
        want_lp = group.params.logprobs is not None
        # Running: views of the append-only lists (O(1) per stream per step); finished: lists, copied once.
        snap = list if finished else ListPrefix
        outs = []
        for seq in group.seqs:
            state = seq.text_state
            outs.append(CompletionOutput(
                index=seq.index,
                text=state.visible_text(seq.is_finished) if state is not None else "",
                token_ids=snap(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if want_lp else None,
                logprobs=snap(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            ))
        first = group.seqs[0]
        return RequestOutput(
            request_id=group.request_id,
            prompt_token_ids=group.prompt_list(),
            outputs=outs,
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            prompt_logprobs=snap(group.prompt_logprobs) if group.prompt_logprobs is not None else None,
            metrics=group.metrics,
            error=group.error,
            pooled=group.pooled,
        )

    def _beam_output(self, group: RequestGroup, finished: bool) -> RequestOutput:
        """A beam search's output: its best `n` hypotheses, best first, once it is over; the running beams (with
        their finish reason, "abort" or "error") if it was stopped before."""
        beam = group.beam
        assert beam is not None
        p = group.params
        if beam.done:
            found = [(h.token_ids, h.cumulative_logprob, h.finish_reason) for h in beam.results(p.n)]
        else:
            found = [(list(s.output_token_ids), s.cumulative_logprob, s.finish_reason) for s in group.seqs[:p.n]]
        tok = self.tokenizer
        skip = p.skip_special_tokens
        outs = [CompletionOutput(index=i, text=tok.decode(ids, skip_special_tokens=skip) if tok is not None else "",
                                 token_ids=ids, cumulative_logprob=cum, finish_reason=reason)
                for i, (ids, cum, reason) in enumerate(found)]
        if finished and group.metrics.finished_time is None:
            group.metrics.finished_time = time.monotonic()
        return RequestOutput(request_id=group.request_id, prompt_token_ids=group.prompt_list(), outputs=outs,
                             finished=finished, num_cached_tokens=max(group.seqs[0].num_cached_tokens, 0) if group.seqs
                             else 0, metrics=group.metrics, error=group.error)

    # --------------------------------------------------------------------------------------- stats
    def stats(self) -> dict[str, float | int]:
        """Gauges and counters: queue lengths, KV usage, prefix cache, preemptions, tokens."""
        s = self.scheduler.stats()
        queries = s["prefix_cache_queries"]
        s["prefix_cache_hit_rate"] = s["prefix_cache_hits"] / queries if queries else 0.0
        s["num_preemptions"] = s["num_preemptions_swap"] + s["num_preemptions_recompute"]
        s["num_steps"] = self.num_steps
        s["num_failed_steps"] = self.num_failed_steps
        s["num_lookahead_steps"] = self.num_lookahead_steps
        return s

    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run prompts to completion (convenience for tests and the offline API), in input order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        for grammar in {p.grammar for p in params if p.grammar is not None}:
            self.grammar_compiler.compile(grammar)  # a bad grammar raises here, before anything is queued
        base = f"gen-{self._rng.getrandbits(32):08x}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params):
            self.add_request(rid, prompt, p, final_only=True)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    # ------------------------------------------------- the EngineCore protocol (wllm.engine.protocol)
    # What AsyncEngine drives, here and (through the same methods) in an engine process's child. A caller
    # uses either these or `step` / `abort` on one engine, not both: the deltas are taken against what
    # `step_deltas` returned before.
    @functools.cached_property
    def _delta_encoder(self) -> DeltaEncoder:
        return DeltaEncoder()

    def step_deltas(self) -> list[RequestDelta]:
        """`step()` for a streaming consumer: the new tokens, text and logprobs of every request that changed."""
        encode = self._delta_encoder.encode
        return [encode(out) for out in self.step()]

    def abort_delta(self, request_id: str) -> RequestDelta | None:
        """`abort()` for a streaming consumer: the request's last delta, None if it is not running."""
        out = self.abort(request_id)
        return None if out is None else self._delta_encoder.encode(out)

    def take_rejected(self) -> list[tuple[str, BaseException]]:
        """Requests refused after `add_request` returned: those whose grammar failed to compile (every other
        refusal raises in `add_request`)."""
        out, self._rejected = self._rejected, []
        return out

    def is_alive(self) -> bool:
        return not self.closed

"""The one-budget scheduler: which tokens of which sequences run in the next step.

Each step has `max_num_batched_tokens` tokens to hand out. Running sequences come first (a
decode token each, or the next chunk of a prompt), then swapped-out ones are brought back, then
waiting ones are admitted (FCFS or by priority), each taking a chunk of its prompt that fits the
budget. When the KV pool runs dry, the least important running sequence is preempted: swapped to
the CPU pool in one batched copy if that pool has room, otherwise freed to be recomputed later.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from typing import Any

from wllm.engine.beam_search import BeamSearch
from wllm.engine.config import CacheConfig, SchedulerConfig
from wllm.engine.kv_cache_manager import KVCacheManager, cdiv
from wllm.engine.request import QueueFullError, RequestGroup, Sequence, SequenceStatus
from wllm.engine.sampler import SampledToken, SamplingRow
from wllm.engine.step_plan import RowResult, StepPlan, StepRow
from wllm.engine.stop_checker import StopChecker


class WaitingQueue:
    """FCFS deque, or a heap on (priority, arrival); preempted sequences go back to the front."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Sequence] = deque()
        self._heap: list[tuple[int, float, int, Sequence]] = []
        self._count = itertools.count()

    def __len__(self) -> int:
        return len(self._fifo) + len(self._heap)

    def push(self, seq: Sequence, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (seq.priority, seq.arrival_time, next(self._count), seq))
        elif front:
            self._fifo.appendleft(seq)
        else:
            self._fifo.append(seq)

    def peek(self) -> Sequence:
        return self._heap[0][3] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, seq: Sequence) -> None:
        if self.policy == "priority":
            self._heap = [e for e in self._heap if e[3] is not seq]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(seq)

    def __iter__(self):
        if self.policy == "priority":
            return iter([e[3] for e in sorted(self._heap)])
        return iter(self._fifo)

    def first(self, n: int) -> list[Sequence]:
        """The next `n` sequences `pop` would return, in that order."""
        if self.policy == "priority":
            return [e[3] for e in heapq.nsmallest(n, self._heap)]
        return list(itertools.islice(self._fifo, n))


class Scheduler:
    """Owns sequence state, the KV cache manager and the CPU swap pool's block ids."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        max_model_len: int,
        eos_token_ids: list[int],
        tokenizer: Any | None = None,
    ) -> None:
        """`tokenizer` (optional: without one no text is decoded) lets stop strings end sequences."""
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_gpu_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        # A sequence can never need more blocks than the pool has, so a lone sequence always fits.
        self.max_model_len = min(max_model_len, num_gpu_blocks * cache_config.block_size)
        self.eos_token_ids = list(eos_token_ids)
        self.stops = StopChecker(self.eos_token_ids, self.max_model_len, tokenizer)
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))  # pop() yields 0, 1, ...
        self.waiting = WaitingQueue(scheduler_config.policy)
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.groups: dict[str, RequestGroup] = {}
        self.seqs: dict[str, Sequence] = {}
        self._pending_copies: list[tuple[int, int]] = []
        # The last step planned with a step in flight and the waiting sequences it admitted (with their
        # prefix-cache hits), so that `cancel` can put them back if that step never runs.
        self._ahead: tuple[StepPlan, list[tuple[Sequence, int]]] | None = None
        # Why the last `schedule(in_flight)` that returned None had to wait (diagnostics, e.g.
        # benchmarks/host_throughput.py); set only then, so the planned path pays nothing.
        self.wait_reason = ""
        self.num_preemptions_swap = 0
        self.num_preemptions_recompute = 0
        self.num_prompt_tokens = 0  # prompt tokens computed (recomputation included)
        self.num_generation_tokens = 0

    # ----------------------------------------------------------------------------------- requests
    def add_group(self, group: RequestGroup) -> None:
        if group.request_id in self.groups:
            raise ValueError(f"request id {group.request_id!r} is already in use")
        if not group.prompt_token_ids:
            raise ValueError("the prompt is empty; at least one token is required")
        if group.pooling is not None:
            # A pooling prompt runs whole in one step and generates nothing: it may fill the context.
            limit = min(self.max_model_len, self.config.max_num_batched_tokens or self.max_model_len)
            if len(group.prompt_token_ids) > limit:
                raise ValueError(f"the input has {len(group.prompt_token_ids)} tokens, but this model takes at most "
                                 f"{limit} tokens per input")
        elif len(group.prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(group.prompt_token_ids)} tokens, but this engine allows at most "
                f"{self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len}, including "
                "at least one generated token)"
            )
        width = group.params.beam_width
        if width:
            # The beams advance in lockstep: all of them must be able to run at once.
            if width > self.config.max_num_seqs:
                raise ValueError(f"the beam width {width} exceeds this engine's max_num_seqs "
                                 f"({self.config.max_num_seqs})")
            max_new = self.max_model_len - len(group.prompt_token_ids)
            if group.params.max_tokens is not None:
                max_new = min(max_new, group.params.max_tokens)
            group.beam = BeamSearch(group.params, max_new, self.eos_token_ids)
        if self.config.max_waiting and len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"the waiting queue is full ({self.config.max_waiting} requests); retry later"
            )
        self.groups[group.request_id] = group
        seq = group.seqs[0]
        self.seqs[seq.seq_id] = seq
        self.waiting.push(seq)

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    def finish_seq(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Stop a sequence now and free its KV blocks (GPU and CPU)."""
        if seq.status == SequenceStatus.FINISHED:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        self.kv.free(seq)
        self.cpu_free.extend(reversed(seq.swapped_cpu_blocks))
        seq.swapped_cpu_blocks = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.seqs.pop(seq.seq_id, None)

    def abort(self, request_id: str, reason: str = "abort") -> RequestGroup | None:
        """Finish every sequence of a request; returns the group, or None if unknown."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        group.num_pending_forks = 0
        for seq in group.seqs:
            if not seq.is_finished:
                self.finish_seq(seq, reason)
        return group

    def pop_finished_group(self, request_id: str) -> None:
        """Forget a finished request whose final output is made (make it before: this empties
        `group.seqs`). See `RequestGroup.release`."""
        group = self.groups.pop(request_id, None)
        if group is not None:
            group.release()

    # ----------------------------------------------------------------------------------- schedule
    def _victim(self) -> Sequence:
        idle = self._idle_beam()
        if idle is not None:
            return idle
        if self.config.policy == "priority":
            return max(self.running, key=lambda s: (s.priority, s.arrival_time))
        return self.running[-1]

    def _idle_beam(self) -> Sequence | None:
        """The last running beam that has its candidates and waits for its siblings': it needs no blocks until
        the beam search step, so it is the first to give them up."""
        for seq in reversed(self.running):
            if seq.group.beam is not None and seq.num_computed_tokens >= seq.num_tokens:
                return seq
        return None

    def _preempt(self, seq: Sequence, swap_out: list[tuple[int, int]] | None) -> None:
        """Swap `seq` out to the CPU pool if the pool has room (and `swap_out`, the step's copies, is given), else
        free it to be recomputed. An idle beam (`_idle_beam`) queues behind the others: it needs to run only after its
        siblings have (at the front it would be admitted again at once, in place of what it made room for)."""
        self.running.remove(seq)
        n = cdiv(seq.num_computed_tokens, self.block_size)
        idle = seq.group.beam is not None and seq.num_computed_tokens >= seq.num_tokens
        if swap_out is not None and 0 < n <= len(self.cpu_free):
            cpu_ids = [self.cpu_free.pop() for _ in range(n)]
            swap_out.extend(zip([b.block_id for b in seq.blocks[:n]], cpu_ids))
            self.kv.free(seq)
            seq.swapped_cpu_blocks = cpu_ids
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self.num_preemptions_swap += 1
        else:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.push(seq, front=not idle)
            self.num_preemptions_recompute += 1

    def schedule(self, in_flight: StepPlan | None = None) -> StepPlan | None:
        """`_schedule`, plus the way out of one stall of beam search: a beam that has its candidates waits for
        its siblings' while holding its blocks, so beams that wait for blocks (swapped out or queued) could wait
        on them forever. When a step would be empty while sequences wait, such idle beams give their blocks back
        one by one (to be recomputed, mostly from the prefix cache; their candidates are kept) until something
        can run."""
        plan = self._schedule(in_flight)
        while in_flight is None and plan is not None and plan.is_empty and (self.swapped or len(self.waiting)):
            idle = self._idle_beam()
            if idle is None:
                break
            self._preempt(idle, None)  # recomputed, not swapped: the step that would copy it out is empty
            plan = self._schedule()
        return plan

    def _schedule(self, in_flight: StepPlan | None = None) -> StepPlan | None:
        """The next step under one token budget: running sequences first (a decode token each, or the
        next chunk of a prompt), preempting the least important when the pool runs dry, then swapped-out
        ones, then waiting ones (`_admit_waiting`).

        `in_flight`: a step launched whose results are not on the host yet (async scheduling). Its tokens count
        as computed, and each of its samples is a placeholder token: the row that decodes it is fed the value on
        the device (`StepRow.feed`) and its sampling row counts it as an output. Sequences its token ends by
        length are left out (their blocks freed now, as applying it would free them); those it ends by value
        (EOS, a stop token or string) or that are aborted meanwhile are planned, and their result is dropped
        when applied. The blocks it completes are offered to the prefix cache before admission, as applying it
        would. A sequence under a grammar whose token is in flight is left out (its next mask needs that token's
        value): it runs in the step after. Returns None when the step needs what only the host will know once
        `in_flight` is applied (`wait_reason` says what): block copies pending or sequences swapped out, a fork
        in flight, a sequence that would need preempting, penalties on a placeholder (their counts need its
        value), prompt logprobs (which positions a chunk reports depends on what the step in flight reported),
        or a waiting request that reuses the id of one in flight (an aborted request's id, taken again). The
        engine then plans again once `in_flight` is applied. Without `in_flight` it never returns None.
        """
        ahead = in_flight is not None
        feeds: dict[str, tuple[int, StepRow]] = {}
        ended: set[str] = set()
        if in_flight is not None:
            if self._pending_copies or self.swapped or not self.running:
                return self._wait("block copies pending" if self._pending_copies else
                                  "sequences swapped out" if self.swapped else "nothing running")
            reason = self._placeholders(in_flight, feeds, ended)
            if reason:
                return self._wait(reason)
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, tuple[Sequence, int, int, int]] = {}  # seq_id -> (sequence, start, tokens, feed)
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        copies: list[tuple[int, int]] = []
        if not ahead:
            copies, self._pending_copies = self._pending_copies, []

        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            start, total, feed = seq.num_computed_tokens, seq.num_tokens, -1
            if ahead:
                found = feeds.get(seq.seq_id)
                if found is not None:
                    r, row = found
                    start += len(row.token_ids)
                    if row.num_samples:
                        if seq.seq_id in ended or seq.matcher is not None:
                            # A grammar row's next mask needs the token in flight on the host: it sits this
                            # step out and runs in the next one, planned with its token (the others go ahead).
                            i += 1
                            continue
                        total += 1
                        feed = r
            num_new = min(total - start, budget)
            if num_new <= 0:
                i += 1
                continue
            if ahead:
                if feed < 0:
                    if seq.group.prompt_logprobs is not None and start < seq.num_prompt_tokens:
                        return self._wait("prompt logprobs")
                elif seq.group.params.has_penalties:
                    return self._wait("penalties")
            # Slots up to `start` may be in flight already: allocate through this step's tokens.
            while not self.kv.allocate_slots(seq, start - seq.num_computed_tokens + num_new):
                if ahead:
                    # Preempting needs the step in flight applied. The slots given so far are the ones
                    # the plan made after it gives too.
                    return self._wait("allocation failed (would preempt)")
                victim = self._victim()
                vi = running.index(victim)
                if victim.seq_id in scheduled:  # priority policy: undo its share of this step
                    budget += scheduled.pop(victim.seq_id)[2]
                self._preempt(victim, swap_out)
                if victim is seq:
                    break
                if vi < i:
                    i -= 1
            else:
                scheduled[seq.seq_id] = (seq, start, num_new, feed)
                budget -= num_new
                i += 1

        if not ahead and not swap_out:
            while self.swapped and len(running) < self.config.max_num_seqs:
                seq = self.swapped[0]
                if len(seq.swapped_cpu_blocks) > self.kv.num_free_blocks:
                    break
                self.swapped.popleft()
                seq.blocks = self.kv.pool.get_new_blocks(len(seq.swapped_cpu_blocks))
                swap_in.extend(zip(seq.swapped_cpu_blocks, [b.block_id for b in seq.blocks]))
                # The copy-in reads these CPU blocks at the start of this step; no swap-out is
                # scheduled in this step, so nothing can overwrite them first.
                self.cpu_free.extend(reversed(seq.swapped_cpu_blocks))
                seq.swapped_cpu_blocks = []
                seq.status = SequenceStatus.RUNNING
                running.append(seq)
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if num_new > 0 and self.kv.allocate_slots(seq, num_new):
                    scheduled[seq.seq_id] = (seq, seq.num_computed_tokens, num_new, -1)
                    budget -= num_new

        admitted: list[tuple[Sequence, int, int]] = []
        if not swap_out and not self.swapped:
            num_running = len(running) - len(ended)
            if ahead and budget > 0 and num_running < self.config.max_num_seqs and len(self.waiting):
                # Every sequence the admission below could take (each takes at least one token).
                for seq in self.waiting.first(min(self.config.max_num_seqs - num_running, budget)):
                    if seq.seq_id in feeds or seq.group.prompt_logprobs is not None:
                        return self._wait("a waiting id is in flight, or prompt logprobs")
            admitted, budget = self._admit_waiting(budget, num_running)
            for seq, num_new, _ in admitted:
                scheduled[seq.seq_id] = (seq, seq.num_computed_tokens, num_new, -1)

        rows = [self._row(seq, start, n, feed) for seq, start, n, feed in scheduled.values()]
        if ahead and not rows:
            return self._wait("nothing left to run")
        plan = StepPlan.build(rows, copies, swap_out, swap_in, self.config.max_num_batched_tokens - budget,
                              in_flight=ahead)
        if ahead:
            self._ahead = (plan, [(seq, num_hit) for seq, _, num_hit in admitted])
        return plan

    def _placeholders(self, in_flight: StepPlan, feeds: dict[str, tuple[int, StepRow]], ended: set[str]) -> str:
        """Fill `feeds` (seq_id -> (its sampling row in `in_flight`, its row there)) and `ended` (sequences
        that the step in flight ends by length), and do to the pool what applying that step will: in its row
        order, as `update_from_output` does, offer the blocks it completes to the prefix cache (their token
        ids are on the host) and free the blocks of the sequences it ends. Safe before it has run: one
        stream orders its writes before any later step's reads. The blocks of sequences that go on are
        offered only when a waiting request may be admitted (applying the step offers them anyway, before
        any later admission). Returns why the next step must wait instead ("" when it need not); then
        nothing has been changed."""
        seqs = self.seqs
        live: list[tuple[Sequence, StepRow]] = []
        r = 0
        for row in in_flight.rows:
            feeds[row.seq_id] = (r, row)
            k = row.num_samples
            r += k
            seq = seqs.get(row.seq_id)
            if k and seq is not None and seq.group.beam is not None:
                return "beam search in flight"  # which beams go on is decided once the step is applied
            if seq is None or seq.status is not SequenceStatus.RUNNING or \
                    (row.sampling is not None and seq.sampling_row is not row.sampling):
                if k and seq is not None and seq.status is SequenceStatus.RUNNING:
                    return "a fork in flight"  # the id is another sequence's now: only applying tells
                continue
            if k > 1:
                return "a fork in flight"  # its children exist only once the step is applied
            live.append((seq, row))
            if k and self.stops.ends_by_length(seq.group.params, len(seq.output_token_ids) + 1, seq.num_tokens + 1):
                ended.add(row.seq_id)
        # Offering every live row's blocks costs a call per row on the host, in every step planned ahead: only
        # when the admission after the running rows can take a waiting sequence.
        register = self.kv.enable_caching and len(self.waiting) > 0 and \
            len(self.running) - len(ended) < self.config.max_num_seqs
        if register or ended:
            for seq, row in live:
                end = row.seq_id in ended
                if register or end:
                    self.kv.cache_computed_blocks(seq, seq.num_computed_tokens + len(row.token_ids))
                if end:
                    self.kv.free(seq)
        return ""

    def _wait(self, reason: str) -> None:
        """`schedule`'s answer when the next step must wait for the step in flight: records why
        (`wait_reason`, for diagnostics) and returns None."""
        self.wait_reason = reason

    def _admit_waiting(self, budget: int, num_running: int) -> tuple[list[tuple[Sequence, int, int]], int]:
        """Admit waiting sequences in queue order while the budget, `max_num_seqs` (`num_running`
        sequences run already) and the pool allow, each with a chunk of its prompt that fits the
        budget after its prefix-cache hits. Returns [(sequence, tokens this step, hit tokens)] and
        the budget left."""
        admitted: list[tuple[Sequence, int, int]] = []
        while len(self.waiting) and budget > 0 and num_running < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if seq.group.pooling is not None:
                # Whole prompts only (an encoder attends both ways: a chunk would see half its context), and
                # no prefix cache (mean pooling needs every token's hidden state).
                hits, num_hit, num_new = [], 0, seq.num_tokens
                if num_new > budget or not self.kv.allocate_slots(seq, num_new, hits):
                    break
            else:
                hits, num_hit = self.kv.get_computed_blocks(seq)
                num_new = min(seq.num_tokens - num_hit, budget)
                if not self.kv.allocate_slots(seq, num_new, hits):
                    break
            self.waiting.pop()
            self.kv.record_lookup(seq.num_tokens, num_hit)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_hit
            if seq.group.metrics.first_scheduled_time is None:
                seq.group.metrics.first_scheduled_time = time.monotonic()
            seq.num_computed_tokens = num_hit
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_running += 1
            admitted.append((seq, num_new, num_hit))
            budget -= num_new
        return admitted, budget

    def cancel(self, plan: StepPlan) -> None:
        """A step planned with a step in flight will not run (its launch failed, or the step before it
        failed): put the sequences it admitted back at the front of the waiting queue, as if never
        admitted. The slots it gave running sequences stay theirs; `schedule()` finds them allocated."""
        if self._ahead is None or self._ahead[0] is not plan:
            return
        _, admitted = self._ahead
        self._ahead = None
        for seq, num_hit in reversed(admitted):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # failed or aborted with its request since
            self.running.remove(seq)
            self.kv.free(seq)
            self.kv.record_lookup(-seq.num_tokens, -num_hit)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.push(seq, front=True)

    def _row(self, seq: Sequence, start: int, num_new: int, feed: int = -1) -> StepRow:
        """`num_new` tokens of `seq` from position `start`; `feed` >= 0: one token, the placeholder sampled
        by that row of the step in flight."""
        if feed >= 0:
            # Token 0 stands in for the placeholder: the runner overwrites it on the device.
            return StepRow(seq.seq_id, [0], start, seq.block_ids, 1, seq.sampling_row, feed=feed)
        end = start + num_new
        num_samples = 0
        if seq.group.pooling is not None:
            pooling = seq.group.pooling
            return StepRow(seq.seq_id, seq.token_ids(start, end), start, seq.block_ids, 0, None,
                           pool=pooling, token_type_start=pooling.token_type_start)
        if end == seq.num_tokens:
            forking = seq.index == 0 and seq.group.num_pending_forks > 0
            num_samples = 1 + seq.group.num_pending_forks if forking else 1
        group = seq.group
        top: int | None = None
        targets: list[int] = []
        first = 0
        if seq.index == 0 and group.prompt_logprobs is not None:
            # Row j predicts token j + 1; positions already reported (before a recompute) are skipped.
            first = max(start, len(group.prompt_logprobs) - 1)
            last = min(end, seq.num_prompt_tokens - 1)
            if first < last:
                top = group.params.prompt_logprobs
                targets = list(seq.prompt_token_ids[first + 1:last + 1])
        sampling = None
        if num_samples:
            sampling = seq.sampling_row
            if sampling is None:
                params = group.params if group.beam is None else group.beam.sampling_params
                sampling = seq.sampling_row = SamplingRow(params, group.seed, seq.index, seq.prompt_token_ids,
                                                          seq.output_token_ids, self.eos_token_ids)
        return StepRow(seq.seq_id, seq.token_ids(start, end), start, seq.block_ids,
                       num_samples, sampling, top, targets, first)

    # ------------------------------------------------------------------------------------ update
    def update_from_output(self, out: StepPlan, results: dict[str, RowResult]) -> list[Sequence]:
        """Advance sequences by the step's results; returns sequences that got a new token."""
        changed: list[Sequence] = []
        now = time.monotonic()
        if self._ahead is not None and self._ahead[0] is out:
            self._ahead = None
        for sched in out.rows:
            seq = self.seqs.get(sched.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            if sched.sampling is not None and seq.sampling_row is not sched.sampling:
                continue  # aborted while the step ran, and its request id already reused
            was_prompt = seq.is_prefilling
            seq.num_computed_tokens += len(sched.token_ids)
            if was_prompt:  # a decode chunk starts past the prompt: no prompt tokens in it
                prompt_part = max(0, min(seq.num_computed_tokens, seq.num_prompt_tokens) - sched.start_pos)
                self.num_prompt_tokens += prompt_part
            result = results[sched.seq_id]
            group = seq.group
            if sched.pool is not None:
                group.pooled = result.pooled
                if group.metrics.first_token_time is None:
                    group.metrics.first_token_time = now
                self.finish_seq(seq, "stop")
                changed.append(seq)
                continue
            self.kv.cache_computed_blocks(seq)
            if group.prompt_logprobs is not None and result.prompt_logprobs:
                group.prompt_logprobs.extend(result.prompt_logprobs)
            if not sched.num_samples:
                continue
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            sampled = result.sampled
            if group.beam is not None:
                changed.extend(self._beam_sampled(seq, sched, sampled[0]))
            elif len(sampled) > 1 and was_prompt:
                # Fork before the parent's own token: that token may finish it and free its blocks.
                children = self._fork(seq, sampled[1:])
                self._append(seq, sampled[0])
                changed.append(seq)
                changed.extend(children)
            else:
                self._append(seq, sampled[0])
                changed.append(seq)
        return changed

    def _append(self, seq: Sequence, tok: SampledToken) -> None:
        matcher = seq.matcher
        if matcher is not None and not matcher.consume_token(tok.token_id):
            # The mask allowed only tokens the grammar accepts: this is a bug, not the request's fault.
            seq.group.error = f"the sampled token {tok.token_id} broke the grammar: {matcher.get_error()}"
            seq.append_token(tok.token_id)
            self.finish_seq(seq, "error")
            return
        seq.append_token(tok.token_id)
        seq.cumulative_logprob += tok.logprob
        if seq.logprobs is not None and tok.logprobs is not None:
            seq.logprobs.append(tok.logprobs)
        self.num_generation_tokens += 1
        stop = self.stops.check(seq)
        if stop is not None:
            self.finish_seq(seq, *stop)

    def _fork(self, parent: Sequence, tokens: list[SampledToken]) -> list[Sequence]:
        group = parent.group
        children = []
        for tok in tokens:
            child = Sequence(group, len(group.seqs))
            if parent.matcher is not None:  # the parent's has consumed nothing yet: each child starts fresh
                child.matcher = parent.matcher.deep_copy()
            group.seqs.append(child)
            group.num_pending_forks -= 1
            self._place_child(parent, child, on_device=True)
            self._append(child, tok)
            children.append(child)
        return children

    def _place_child(self, parent: Sequence, child: Sequence, on_device: bool) -> None:
        """A new fork (n > 1 or a beam) shares its parent's blocks, with a private copy of the partial last
        block; with no block free for that copy (or the parent not on the device) it recomputes instead."""
        self.seqs[child.seq_id] = child
        copy = self.kv.fork(parent, child) if on_device else False
        if copy is False:
            child.status = SequenceStatus.WAITING
            self.waiting.push(child, front=True)
        else:
            if copy is not None:
                self._pending_copies.append(copy)
            child.status = SequenceStatus.RUNNING
            self.running.append(child)

    # ------------------------------------------------------------------------------- beam search
    def _beam_sampled(self, seq: Sequence, row: StepRow, tok: SampledToken) -> list[Sequence]:
        """A beam's candidates came; once every running beam of its request has its own, take the beam search step
        (`_beam_step`). Returns the sequences that changed."""
        if row.start_pos + len(row.token_ids) != seq.num_tokens:
            return []  # a recomputed beam's result for a position it has moved past meanwhile
        group = seq.group
        beam = group.beam
        assert beam is not None and tok.logprobs is not None
        beam.pending[seq.seq_id] = tok.logprobs.top
        live = group.seqs
        if any(s.seq_id not in beam.pending for s in live):
            return []  # the others run in a later step (the budget split them, or one was preempted)
        return self._beam_step(group)

    def _beam_step(self, group: RequestGroup) -> list[Sequence]:
        """Apply one beam search step to the request's running beams (`group.seqs`, best first): a beam chosen
        once continues in place, one chosen again is forked (its full blocks shared, its partial last block
        copied), one not chosen is dropped and its blocks freed. When the search is over every beam is finished
        (the results are the search's hypotheses)."""
        beam = group.beam
        assert beam is not None
        live = list(group.seqs)
        pending, beam.pending = beam.pending, {}
        chosen = beam.step([(s.cumulative_logprob, s.output_token_ids, pending[s.seq_id]) for s in live])
        if not chosen:
            for s in live:
                self.finish_seq(s, "stop")
            return live
        children: dict[int, list[int]] = {}
        for j, (b, _, _) in enumerate(chosen):
            children.setdefault(b, []).append(j)
        for b, s in enumerate(live):
            if b not in children:  # dropped first, so that its blocks can serve the forks below
                self.finish_seq(s, "abort")
        new: list[Sequence | None] = [None] * len(chosen)
        for b, js in children.items():
            parent = live[b]
            for j in js[1:]:  # forks before the parent's own token: they copy its KV as it is now
                child = Sequence(group, beam.next_index, parent.output_token_ids)
                beam.next_index += 1
                child.num_cached_tokens = parent.num_cached_tokens
                self._place_child(parent, child, on_device=parent.status is SequenceStatus.RUNNING)
                new[j] = child
            new[js[0]] = parent
        for j, (_, token, score) in enumerate(chosen):
            s = new[j]
            assert s is not None
            s.append_token(token)
            s.cumulative_logprob = score
            self.num_generation_tokens += 1
        group.seqs = new  # type: ignore[assignment]
        return list(group.seqs)

    def fail_step(self, out: StepPlan, message: str) -> list[RequestGroup]:
        """A step raised: finish every request it touched with an error and drop their cached
        blocks, whose content may be partial."""
        failed: dict[str, RequestGroup] = {}
        bs = self.block_size
        for sched in out.rows:
            # The blocks the step wrote, by id: a sequence the step ends by length may have given
            # them back already (`schedule` with it in flight), registered in the prefix cache.
            self.kv.uncache_ids(sched.block_ids[sched.start_pos // bs:cdiv(sched.start_pos + len(sched.token_ids), bs)])
            seq = self.seqs.get(sched.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING or \
                    (sched.sampling is not None and seq.sampling_row is not sched.sampling):
                continue  # gone, or its id already reused by a new request
            failed[seq.group.request_id] = seq.group
        for group in failed.values():
            group.error = message
            for seq in group.seqs:
                self.kv.uncache(seq)
            self.abort(group.request_id, reason="error")
        return list(failed.values())

    # ------------------------------------------------------------------------------------- stats
    def stats(self) -> dict[str, float | int]:
        return {
            "num_waiting": len(self.waiting),
            "num_running": len(self.running),
            "num_swapped": len(self.swapped),
            "kv_cache_usage": self.kv.usage,
            "num_free_blocks": self.kv.num_free_blocks,
            "num_gpu_blocks": self.kv.pool.num_blocks,
            "num_cached_blocks": len(self.kv.pool.cached),  # holding prefix-cache content, in use or free
            "num_free_cpu_blocks": len(self.cpu_free),
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "prefix_cache_evictions": self.kv.pool.num_evictions,
            "num_preemptions_swap": self.num_preemptions_swap,
            "num_preemptions_recompute": self.num_preemptions_recompute,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
        }

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
import os
import time
from collections import deque
from collections.abc import Sequence as Seq

import msgspec

from wllm.engine.config import CacheConfig, SchedulerConfig
from wllm.engine.kv_cache_manager import KVCacheManager, cdiv
from wllm.engine.request import QueueFullError, RequestGroup, Sequence, SequenceStatus
from wllm.engine.sampler import SampledToken, SamplingRow
from wllm.outputs import StepLogprobs

# WLLM_MIXED_LOOKAHEAD=0 plans ahead only pure decode steps that admit nothing (as before mixed steps ran
# ahead), for A/B runs of `schedule_lookahead`.
MIXED_LOOKAHEAD = os.environ.get("WLLM_MIXED_LOOKAHEAD", "1") != "0"


class ScheduledSeq(msgspec.Struct):
    """One sequence's share of a step, as the model runner needs it."""

    seq_id: str
    token_ids: Seq[int]  # the tokens to compute this step: a tuple where it holds prompt tokens, else a list
    start_pos: int  # position of token_ids[0] (= tokens already in the KV cache)
    block_ids: list[int]  # the sequence's block table
    num_samples: int  # tokens to sample after this chunk: 0 (mid-prompt), 1, or n at a fork
    sampling: SamplingRow | None
    prompt_logprobs: int | None = None  # top-N for prompt positions of this chunk
    prompt_logprob_targets: list[int] = msgspec.field(default_factory=list)  # next token per position
    prompt_logprob_start: int = 0  # position whose logits predict prompt_logprob_targets[0]


class SchedulerOutput(msgspec.Struct):
    seqs: list[ScheduledSeq]
    blocks_to_copy: list[tuple[int, int]]  # (src, dst) GPU blocks, done first
    blocks_to_swap_out: list[tuple[int, int]]  # (GPU block, CPU block), done second
    blocks_to_swap_in: list[tuple[int, int]]  # (CPU block, GPU block), done third
    num_batched_tokens: int
    # A lookahead step (`Scheduler.schedule_lookahead`), launched before the previous step's results
    # reached the host: per sequence, the sampling row of the previous step (rows numbered in
    # `decode_first` order) whose token, still on the device, is this sequence's one input token, or
    # -1 where the input tokens are in `token_ids`. None: a step planned after the previous one.
    prev_rows: list[int] | None = None

    @property
    def is_empty(self) -> bool:
        return not (self.seqs or self.blocks_to_copy or self.blocks_to_swap_out or self.blocks_to_swap_in)


def decode_first_order(seqs: list[ScheduledSeq]) -> list[int] | None:
    """The order in which the runner lays out a step's sequences (and so numbers its sampling rows):
    single-token sequences first, then prompt chunks, each group in scheduled order, so attention
    sends the first group to the decode kernel. None when that is the scheduled order already."""
    single = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
    if not single or len(single) == len(seqs):
        return None
    return single + [i for i, s in enumerate(seqs) if len(s.token_ids) != 1]


class SeqResult(msgspec.Struct):
    """What the runner produced for one scheduled sequence."""

    sampled: list[SampledToken]
    prompt_logprobs: list[StepLogprobs] = msgspec.field(default_factory=list)


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
    ) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_gpu_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        # A sequence can never need more blocks than the pool has, so a lone sequence always fits.
        self.max_model_len = min(max_model_len, num_gpu_blocks * cache_config.block_size)
        self.eos_token_ids = list(eos_token_ids)
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))  # pop() yields 0, 1, ...
        self.waiting = WaitingQueue(scheduler_config.policy)
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.groups: dict[str, RequestGroup] = {}
        self.seqs: dict[str, Sequence] = {}
        self._pending_copies: list[tuple[int, int]] = []
        # The last lookahead step and the waiting sequences it admitted (with their prefix-cache
        # hits), so that `cancel_lookahead` can put them back if that step never runs.
        self._ahead: tuple[SchedulerOutput, list[tuple[Sequence, int]]] | None = None
        # Why the last `schedule_lookahead` call that returned None refused (diagnostics, e.g.
        # benchmarks/host_throughput.py); set only on refusals, so the planned path pays nothing.
        self.lookahead_refusal = ""
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
        if len(group.prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(group.prompt_token_ids)} tokens, but this engine allows at most "
                f"{self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len}, including "
                "at least one generated token)"
            )
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
        if self.config.policy == "priority":
            return max(self.running, key=lambda s: (s.priority, s.arrival_time))
        return self.running[-1]

    def _preempt(self, seq: Sequence, swap_out: list[tuple[int, int]]) -> None:
        self.running.remove(seq)
        n = cdiv(seq.num_computed_tokens, self.block_size)
        if 0 < n <= len(self.cpu_free):
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
            self.waiting.push(seq, front=True)
            self.num_preemptions_recompute += 1

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, tuple[Sequence, int]] = {}
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        copies, self._pending_copies = self._pending_copies, []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(seq, num_new):
                victim = self._victim()
                vi = self.running.index(victim)
                if victim.seq_id in scheduled:  # priority policy: undo its share of this step
                    budget += scheduled.pop(victim.seq_id)[1]
                self._preempt(victim, swap_out)
                if victim is seq:
                    break
                if vi < i:
                    i -= 1
            else:
                scheduled[seq.seq_id] = (seq, num_new)
                budget -= num_new
                i += 1

        if not swap_out:
            while self.swapped and len(self.running) < self.config.max_num_seqs:
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
                self.running.append(seq)
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if num_new > 0 and self.kv.allocate_slots(seq, num_new):
                    scheduled[seq.seq_id] = (seq, num_new)
                    budget -= num_new

        if not swap_out and not self.swapped:
            admitted, budget = self._admit_waiting(budget, len(self.running))
            for seq, num_new, _ in admitted:
                scheduled[seq.seq_id] = (seq, num_new)

        out = [self._scheduled_seq(seq, n) for seq, n in scheduled.values()]
        return SchedulerOutput(out, copies, swap_out, swap_in, self.config.max_num_batched_tokens - budget)

    def _admit_waiting(self, budget: int, num_running: int) -> tuple[list[tuple[Sequence, int, int]], int]:
        """Admit waiting sequences in queue order while the budget, `max_num_seqs` (`num_running`
        sequences run already) and the pool allow, each with a chunk of its prompt that fits the
        budget after its prefix-cache hits. Returns [(sequence, tokens this step, hit tokens)] and
        the budget left."""
        admitted: list[tuple[Sequence, int, int]] = []
        while len(self.waiting) and budget > 0 and num_running < self.config.max_num_seqs:
            seq = self.waiting.peek()
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

    def schedule_lookahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The step that `schedule()` would return once `prev` (launched, not yet applied) is
        applied, if it is known without prev's sampled token values; else None.

        Every sequence is taken to go on after prev: one that prev samples for (a decode row, or a
        prompt prev completes) decodes one token, its input token being prev's sample, still on the
        device (`prev_rows`); one whose prompt prev only partly computed takes its next chunk; then
        waiting sequences are admitted exactly as `schedule()` admits them. Sequences that prev's
        token ends by length are left out (their blocks are freed now, as applying prev would free
        them); those that prev ends by value (EOS, stop token or string) or that are aborted
        meanwhile are in it, and their result is dropped. The blocks prev completes are offered to
        the prefix cache now, as applying prev would, so admissions see the same hits.

        None (the step is planned by `schedule()` after prev is applied) when that cannot be exact
        or safe: block copies pending or sequences swapped out, prev forks a sequence (n > 1), a
        sequence would need preempting, a decode row wants penalties (their counts need prev's token
        value on the host), a sequence wants prompt logprobs, or a waiting sequence that could be
        admitted reuses the id of one in prev (an aborted request's id, taken again).
        """
        if self._pending_copies or self.swapped or not self.running:
            return self._refuse("block copies pending" if self._pending_copies else
                                "sequences swapped out" if self.swapped else "nothing running")
        # prev's sequences, and their sampling rows numbered as the runner lays them out
        # (`decode_first_order`: single-token sequences first, then the others, each in order).
        in_prev: dict[str, tuple[int, ScheduledSeq]] = {}
        chunks: list[ScheduledSeq] = []
        row = 0
        for sched in prev.seqs:
            if len(sched.token_ids) == 1:
                in_prev[sched.seq_id] = (row, sched)
                row += sched.num_samples
            else:
                chunks.append(sched)
        if not MIXED_LOOKAHEAD and (chunks or self.waiting):
            return self._refuse("mixed lookahead off")
        for sched in chunks:
            in_prev[sched.seq_id] = (row, sched)
            row += sched.num_samples
        # Plan without changing anything: (sequence, computed tokens once prev is applied, tokens
        # this step, prev's row of its input token or -1), in `schedule()`'s order.
        budget = self.config.max_num_batched_tokens
        max_seqs = self.config.max_num_seqs
        max_len = self.max_model_len
        num_running = 0
        ended: set[str] = set()
        plan: list[tuple[Sequence, int, int, int]] = []
        for seq in self.running:
            computed, total, prev_row = seq.num_computed_tokens, seq.num_tokens, -1
            p = seq.group.params
            found = in_prev.get(seq.seq_id)
            if found is not None:
                r, sched = found
                computed += len(sched.token_ids)
                if sched.num_samples:
                    if sched.num_samples > 1 or sched.sampling is not seq.sampling_row:
                        # a fork: its children exist only once prev is applied
                        return self._refuse("prev forks a sequence")
                    if (p.max_tokens is not None and len(seq.output_token_ids) + 1 >= p.max_tokens) or \
                            total + 1 >= max_len:
                        ended.add(seq.seq_id)  # prev's token ends it ("length")
                        continue
                    total += 1
                    prev_row = r
            num_running += 1
            if budget <= 0:
                continue
            num_new = min(total - computed, budget)
            if num_new <= 0:
                continue
            if prev_row < 0:
                if seq.group.prompt_logprobs is not None and computed < seq.num_prompt_tokens:
                    # which positions it reports depends on prev's prompt logprobs
                    return self._refuse("prompt logprobs")
            elif p.has_penalties:
                return self._refuse("penalties")  # their counts need prev's token on the host
            plan.append((seq, computed, num_new, prev_row))
            budget -= num_new
        may_admit = budget > 0 and num_running < max_seqs and len(self.waiting) > 0
        if may_admit:
            # Every sequence the admission below could take (each takes at least one token).
            for seq in self.waiting.first(min(max_seqs - num_running, budget)):
                if seq.seq_id in in_prev or seq.group.prompt_logprobs is not None:
                    return self._refuse("a waiting id is in prev, or prompt logprobs")

        # Apply what applying prev does to the pool, in prev's order: register the blocks it
        # completes (only admissions look them up; applying prev registers them otherwise, but not
        # for a sequence whose blocks are freed here), free the blocks of the sequences its token
        # ends by length. Safe before prev has run: one stream orders prev's reads and writes of
        # those blocks before any later step's.
        register = may_admit and self.kv.enable_caching
        if register or ended:
            seqs = self.seqs
            for sched in prev.seqs:
                seq = seqs.get(sched.seq_id)
                if seq is None or seq.status is not SequenceStatus.RUNNING or \
                        (sched.sampling is not None and seq.sampling_row is not sched.sampling):
                    continue
                end = sched.seq_id in ended
                if register or end:
                    self.kv.cache_computed_blocks(seq, seq.num_computed_tokens + len(sched.token_ids))
                if end:
                    self.kv.free(seq)
        out: list[ScheduledSeq] = []
        prev_rows: list[int] = []
        allocate = self.kv.allocate_slots
        for seq, computed, num_new, prev_row in plan:
            if not allocate(seq, computed - seq.num_computed_tokens + num_new):
                # schedule() would preempt. The slots given so far are the ones it gives too.
                return self._refuse("allocation failed (would preempt)")
            if prev_row >= 0:
                # Token 0 stands in for prev's sample: the runner overwrites it on the device.
                out.append(ScheduledSeq(seq.seq_id, [0], computed, seq.block_ids, 1, seq.sampling_row))
            else:
                out.append(self._scheduled_seq(seq, num_new, computed))
            prev_rows.append(prev_row)
        admitted: list[tuple[Sequence, int, int]] = []
        if budget > 0:
            admitted, budget = self._admit_waiting(budget, num_running)
        for seq, num_new, _ in admitted:
            out.append(self._scheduled_seq(seq, num_new))
            prev_rows.append(-1)
        if not out:
            return self._refuse("nothing left to run")
        next_out = SchedulerOutput(out, [], [], [], self.config.max_num_batched_tokens - budget,
                                   prev_rows=prev_rows)
        self._ahead = (next_out, [(seq, num_hit) for seq, _, num_hit in admitted])
        return next_out

    def _refuse(self, reason: str) -> None:
        """`schedule_lookahead`'s refusal: records why (`lookahead_refusal`) and returns None."""
        self.lookahead_refusal = reason

    def cancel_lookahead(self, out: SchedulerOutput) -> None:
        """A lookahead step will not run (its launch failed, or the step before it failed): put the
        sequences it admitted back at the front of the waiting queue, as if never admitted. The
        slots it gave running sequences stay theirs; `schedule()` finds them allocated."""
        if self._ahead is None or self._ahead[0] is not out:
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

    def _scheduled_seq(self, seq: Sequence, num_new: int, start: int | None = None) -> ScheduledSeq:
        """`num_new` tokens of `seq` from position `start` (default: its computed tokens)."""
        if start is None:
            start = seq.num_computed_tokens
        end = start + num_new
        num_samples = 0
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
                sampling = seq.sampling_row = SamplingRow(group.params, group.seed, seq.index, seq.prompt_token_ids,
                                                          seq.output_token_ids, self.eos_token_ids)
        return ScheduledSeq(seq.seq_id, seq.token_ids(start, end), start, seq.block_ids,
                            num_samples, sampling, top, targets, first)

    # ------------------------------------------------------------------------------------ update
    def update_from_output(self, out: SchedulerOutput, results: dict[str, SeqResult]) -> list[Sequence]:
        """Advance sequences by the step's results; returns sequences that got a new token."""
        changed: list[Sequence] = []
        now = time.monotonic()
        if self._ahead is not None and self._ahead[0] is out:
            self._ahead = None
        for sched in out.seqs:
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
            self.kv.cache_computed_blocks(seq)
            result = results[sched.seq_id]
            group = seq.group
            if group.prompt_logprobs is not None and result.prompt_logprobs:
                group.prompt_logprobs.extend(result.prompt_logprobs)
            if not sched.num_samples:
                continue
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            sampled = result.sampled
            if len(sampled) > 1 and was_prompt:
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
        seq.append_token(tok.token_id)
        seq.cumulative_logprob += tok.logprob
        if seq.logprobs is not None and tok.logprobs is not None:
            seq.logprobs.append(tok.logprobs)
        self.num_generation_tokens += 1
        self._check_stop(seq)

    def _fork(self, parent: Sequence, tokens: list[SampledToken]) -> list[Sequence]:
        group = parent.group
        children = []
        for tok in tokens:
            child = Sequence(group, len(group.seqs))
            group.seqs.append(child)
            group.num_pending_forks -= 1
            self.seqs[child.seq_id] = child
            copy = self.kv.fork(parent, child)
            if copy is False:
                # No block for the private copy of the last block: recompute this child instead.
                child.status = SequenceStatus.WAITING
                self.waiting.push(child, front=True)
            else:
                if copy is not None:
                    self._pending_copies.append(copy)
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
            self._append(child, tok)
            children.append(child)
        return children

    def _check_stop(self, seq: Sequence) -> None:
        p = seq.params
        token = seq.output_token_ids[-1]
        n_out = len(seq.output_token_ids)
        if not p.ignore_eos and token in self.eos_token_ids and n_out >= p.min_tokens:
            self.finish_seq(seq, "stop", None)
        elif token in p.stop_token_ids:
            self.finish_seq(seq, "stop", token)
        elif (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            self.finish_seq(seq, "length")

    def fail_step(self, out: SchedulerOutput, message: str) -> list[RequestGroup]:
        """A step raised: finish every request it touched with an error and drop their cached
        blocks, whose content may be partial."""
        failed: dict[str, RequestGroup] = {}
        bs = self.block_size
        for sched in out.seqs:
            # The blocks the step wrote, by id: a sequence the step ends by length may have given
            # them back already (`schedule_lookahead`), registered in the prefix cache.
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
            "num_free_cpu_blocks": len(self.cpu_free),
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "prefix_cache_evictions": self.kv.pool.num_evictions,
            "num_preemptions_swap": self.num_preemptions_swap,
            "num_preemptions_recompute": self.num_preemptions_recompute,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
        }

"""The CUDA step: persistent inputs, kernel attention, GPU sampling, CUDA-graph decode, one sync.

Every input of a step (token ids, positions, slot mapping, block tables, context lengths, query
offsets, rows to compute logits for, sampling parameters) is written into pinned host buffers
allocated once, and copied to device buffers allocated once with asynchronous copies. A step
that only decodes (one new token and one sample per sequence, at most the largest captured batch)
replays a CUDA graph of the forward pass plus the sampling kernel, and so does a prefill or mixed step
of up to 512 tokens (no prompt logprobs; a prompt forking n sequences takes n sampling rows); any other
step runs eagerly through the same kernels. The decode graphs, and the prefill graphs of at most as
many sequences, write their logits into one shared buffer, so the logprob matrices of requests that ask
for logprobs are computed from it after the replay. The sampled token ids and their logprobs (plus the
logprob matrices when a request asked for them) come back in one device-to-host sync. Steps with grammar
rows run eagerly: their masks (filled on the host while the forward is queued) are uploaded and applied
to a copy of the logits by the `apply_token_bitmask` kernel before the sampling kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import numpy as np
import torch
from torch import nn

from wllm.engine.cuda_attention import CudaAttentionContext, layer_caches, mixed_split
from wllm.engine.cuda_graphs import (
    DecodeGraphs,
    GraphOutputs,
    PrefillGraphs,
    graph_batch_sizes,
    prefill_graph_shapes,
)
from wllm.engine.gpu_sampler import SamplingBuffers, StagedBuffer, logprob_matrix, step_logprobs_from_row
from wllm.engine.sampler import SampledToken, SamplingRow
from wllm.engine.step_plan import RowResult, StepPlan, StepRow
from wllm.kernels import apply_token_bitmask, decode_workspace_size, sample
from wllm.kernels.ops import host_mapped, stage_copy

logger = logging.getLogger(__name__)


_NP_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
# Steps whose staged inputs are at most this many bytes (decode batches up to ~48 sequences at a 4k
# context) upload them with `kernels.stage_copy` when pinned memory is mapped; larger ones keep the copy
# engine, which moves bulk bytes faster.
STAGE_KERNEL_MAX_BYTES = 64 << 10


class StageLayout:
    """A step's input arrays laid out back to back in a `PackedStage`: numpy views of the pinned
    host bytes to write, device views of the same offsets to read, and the one copy between them."""

    def __init__(self, stage: PackedStage, fields: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]) -> None:
        self.np: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        off = 0
        total = stage.host_np.shape[0]
        for name, dtype, shape in fields:
            if off + int(np.prod(shape)) * dtype.itemsize > total:
                raise RuntimeError(f"a step with {name} of shape {shape} does not fit the runner's staging "
                                   f"buffer of {total} bytes")
            nbytes = int(np.prod(shape)) * dtype.itemsize
            self.np[name] = stage.host_np[off:off + nbytes].view(_NP_DTYPES[dtype]).reshape(shape)
            self.dev[name] = stage.dev[off:off + nbytes].view(dtype).view(shape)
            off += -(-nbytes // 16) * 16  # 16-byte aligned starts
        self.nbytes = off
        self._host = stage.host[:off]
        self._dev = stage.dev[:off]

    def upload(self) -> None:
        """Start the step's single host-to-device copy (asynchronous from pinned memory)."""
        self._dev.copy_(self._host, non_blocking=True)

    def stage(self, prev_tokens: torch.Tensor | None = None, pairs: torch.Tensor | None = None, n: int = 0) -> None:
        """The upload as one small kernel reading the pinned bytes in place (`kernels.stage_copy`), which
        then also writes a lookahead step's input ids from `prev_tokens` (the previous step's samples on
        the device): input_ids[pairs[i]] = prev_tokens[pairs[n + i]] for i < n ((i, i) when pairs is None;
        pairs are the staged `feeds`, already written into the host bytes)."""
        prev = prev_tokens.contiguous() if n and prev_tokens is not None else None
        stage_copy(self._dev, self._host, self.dev["input_ids"], prev, pairs, n)


class PackedStage:
    """One pinned host byte buffer and its device twin: a step writes all its inputs into the host
    bytes and sends them with ONE copy (each copy costs the host a launch on CUDA). Layouts are cached
    per shape, so the device views a CUDA graph captured stay the ones later steps of its size fill."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._layouts: dict[tuple[int, int, int], StageLayout] = {}

    def layout(self, key: tuple[int, int, int], fields: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
               ) -> StageLayout:
        found = self._layouts.get(key)
        if found is None:
            if len(self._layouts) >= 1024:  # eager steps come in many shapes; keep the cache bounded
                self._layouts.clear()
            found = self._layouts[key] = StageLayout(self, fields)
        return found


class StepInputs:
    """Persistent staged inputs for a step of up to `max_tokens` tokens (and as many sequences),
    plus the per-row sampling parameters of up to `max_rows` rows, all uploaded in one copy."""

    def __init__(self, max_tokens: int, max_blocks: int, max_rows: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.max_blocks = max_blocks
        self.max_rows = max_rows
        nbytes = sum(-(-int(np.prod(shape)) * dtype.itemsize // 16) * 16
                     for _, dtype, shape in self._fields(max_tokens, max_tokens, max_rows))
        self.stage = PackedStage(nbytes, device)
        self.logit_rows = StagedBuffer((2 * max_tokens,), torch.int64, device)
        # The layout `_fill_tables` wrote last and, per row, (the block_ids list it wrote, its length then).
        self._table_layout: StageLayout | None = None
        self._table_rows: list[tuple[list[int], int]] = []

    def _fields(self, tokens: int, seqs: int, rows: int) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
        return (("input_ids", torch.int64, (tokens,)), ("positions", torch.int64, (tokens,)),
                ("slots", torch.int64, (tokens,)), ("seq_lens", torch.int32, (seqs,)),
                ("query_start", torch.int32, (seqs + 1,)), ("params_f32", torch.float32, (rows, 6)),
                ("params_i64", torch.int64, (rows, 3)), ("block_tables", torch.int32, (seqs, self.max_blocks)),
                ("feeds", torch.int64, (2 * seqs,)))

    def layout(self, tokens: int, seqs: int, rows: int) -> StageLayout:
        """The layout of a step of `tokens` tokens, `seqs` sequences and `rows` staged sampling rows."""
        key = (tokens, seqs, rows)
        return self.stage.layout(key, self._fields(*key))

    def fill(self, layout: StageLayout, plan: StepPlan | None, block_size: int, padded_seqs: int,
             padded_tokens: int) -> int:
        """Write the step's sequences plus padding rows into `layout`; returns the longest context.
        Padding tokens write to slot -1 and padding sequences have no context. The caller uploads."""
        v = layout.np
        ids, pos, slots = v["input_ids"], v["positions"], v["slots"]
        lens, starts = v["seq_lens"], v["query_start"]
        seqs = plan.rows if plan is not None else []
        num_seqs = len(seqs)
        self._fill_tables(layout, seqs)
        starts[0] = 0
        t = 0
        longest = 0
        for i, s in enumerate(seqs):
            n, start, blocks = len(s.token_ids), s.start_pos, s.block_ids
            end = start + n
            lens[i] = end
            if end > longest:
                longest = end
            if n == 1:
                ids[t] = s.token_ids[0]
                pos[t] = start
                slots[t] = blocks[start // block_size] * block_size + start % block_size
            else:
                p = np.arange(start, end)
                ids[t:t + n] = s.token_ids
                pos[t:t + n] = p
                slots[t:t + n] = np.asarray(blocks, dtype=np.int64)[p // block_size] * block_size + p % block_size
            t += n
            starts[i + 1] = t
        if t < padded_tokens:
            ids[t:padded_tokens] = 0
            pos[t:padded_tokens] = 0
            slots[t:padded_tokens] = -1
        if num_seqs < padded_seqs:
            lens[num_seqs:padded_seqs] = 0
            starts[num_seqs + 1:padded_seqs + 1] = t
        return longest

    def _fill_tables(self, layout: StageLayout, seqs: Seq[StepRow]) -> None:
        """Write the sequences' block tables into `layout`'s rows. A sequence's `block_ids` list only grows in
        place (a new block table is a new list), so a row that holds the same list as when this layout was
        last filled only gets its new entries: a decode step rewrites a handful of ids, not every table.
        The host bytes are shared by all layouts, so a fill of any other layout starts over. The rows keep
        strong references to the lists: a list's identity is not reused while held."""
        tables = layout.np["block_tables"]
        max_blocks = self.max_blocks
        before = self._table_rows if self._table_layout is layout else ()
        self._table_layout = None  # until every row is written (a raise below leaves no record to trust)
        rows: list[tuple[list[int], int]] = []
        for i, s in enumerate(seqs):
            blocks = s.block_ids
            n = len(blocks)
            if n > max_blocks:
                raise RuntimeError(f"sequence {s.seq_id} has {n} KV blocks; the runner's block tables "
                                   f"hold {max_blocks} (max_model_len)")
            if i < len(before):
                same, done = before[i]
                if same is blocks and done <= n:
                    if done < n:
                        tables[i, done:n] = blocks[done:]
                    rows.append((blocks, n))
                    continue
            tables[i, :n] = blocks
            tables[i, n:] = 0  # the bytes are shared with other layouts: no stray block ids
            rows.append((blocks, n))
        self._table_layout, self._table_rows = layout, rows

    def sampling_stage(self, layout: StageLayout) -> tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor]:
        """`layout`'s per-row sampling parameters (host f32, host i64, their device views) for
        `SamplingBuffers.pack(stage=...)`. Writing them writes the shared host bytes: unless `layout` is the
        one whose block tables `_fill_tables` recorded, that record is dropped (a pack into a graph's
        layout can be followed by an eager fill of another, e.g. when the pack overflows its buffers)."""
        if layout is not self._table_layout:
            self._table_layout, self._table_rows = None, []
        return layout.np["params_f32"], layout.np["params_i64"], layout.dev["params_f32"], layout.dev["params_i64"]


class PendingStep:
    """A launched step whose results are not on the host yet (see `CudaStepRunner.launch`)."""

    __slots__ = ("plan", "want_logprobs", "host_packed", "host_tokens", "host_logprobs",
                 "host_prompt", "host_sample", "device_tokens", "inputs_done", "done")

    def __init__(self, plan: StepPlan, want_logprobs: list[int]) -> None:
        self.plan = plan
        self.want_logprobs = want_logprobs
        self.host_packed: torch.Tensor | None = None  # graph step: fp64 [2, padded] ids and logprobs
        self.host_tokens: torch.Tensor | None = None  # eager step: ids, logprobs, logprob matrices
        self.host_logprobs: torch.Tensor | None = None
        self.host_prompt: torch.Tensor | None = None
        self.host_sample: torch.Tensor | None = None
        self.device_tokens: torch.Tensor | None = None  # sampled ids on the device, one per row
        self.inputs_done: torch.cuda.Event | None = None  # CUDA: the step's uploads have run
        self.done: torch.cuda.Event | None = None  # CUDA: its results are on the host


class CudaStepRunner:
    """Executes steps on CUDA with the kernel library; owns the graphs and the staged buffers."""

    supports_in_flight = True  # `launch` only queues device work: the next step can be planned meanwhile

    def __init__(self, model: nn.Module, kv_cache: torch.Tensor, *, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, enforce_eager: bool = False) -> None:
        config = model.config
        self.model = model
        self.device = kv_cache.device
        self.block_size = kv_cache.shape[3]
        self.caches = layer_caches(kv_cache)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        max_blocks = -(-max_model_len // self.block_size)
        self.max_seq_len = max_blocks * self.block_size
        on_cuda = self.device.type == "cuda"
        # Off CUDA (tests of this path on the CPU, through the kernels' PyTorch references) there
        # are no graphs and no pinned memory.
        sizes = [] if enforce_eager or not on_cuda else graph_batch_sizes(max_num_seqs)
        self.graphs = DecodeGraphs(sizes, self.device)
        shapes = prefill_graph_shapes(max_num_batched_tokens, max_num_seqs)
        self.prefill_graphs = PrefillGraphs(shapes if sizes else [], self.device)
        # Room for the largest graph shapes even when graphs are off (tests swap in stand-in graphs).
        capacity = max(max_num_batched_tokens, graph_batch_sizes(max_num_seqs)[-1], max_num_seqs,
                       max(key[0] for key in shapes))
        self.inputs = StepInputs(capacity, max_blocks, 2 * capacity, self.device)
        self.sampling = SamplingBuffers(2 * capacity, config.vocab_size, self.device)
        pin = on_cuda
        # Two of each result buffer (and of each event), alternating between consecutive steps.
        self.host_tokens = [torch.zeros(2 * capacity, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.host_logprobs = [torch.zeros(2 * capacity, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self._events = [(torch.cuda.Event(), torch.cuda.Event()) for _ in range(2)] if on_cuda else []
        self._parity = 0
        index = self.device.index or 0
        # Decode attention runs in the decode graphs and, over all their sequences, in the mixed prefill graphs.
        batches = set(sizes) | {s for _, s, mixed in self.prefill_graphs.keys if mixed}
        need = max([decode_workspace_size(b, self.num_heads, self.num_kv_heads, self.head_dim, self.max_seq_len,
                                          device=index) for b in batches] + [0])
        # Zero-filled once: decode attention keeps its split-merge tickets there and leaves them zero.
        self.workspace = torch.zeros((need + 3) // 4, dtype=torch.float32, device=self.device) if need else None
        # pinned fp64 [2, B] per (size, parity), and whether the result kernel may write it in place
        self._host_graph_out: dict[tuple[int, int], tuple[torch.Tensor, bool]] = {}
        # Decode-sized steps move their inputs and sampled ids with a small kernel instead of copy-engine
        # transfers (each leaves the GPU idle on both sides, per step), where pinned memory is mapped.
        self._zero_copy = on_cuda and host_mapped(self.inputs.stage.host)
        self.num_graph_steps = 0  # decode steps replayed
        self.num_prefill_graph_steps = 0
        self.num_eager_steps = 0
        self.num_lookahead_steps = 0  # steps launched before the previous step's tokens reached the host
        # The graphs' logits (decode graphs, prefill graphs of at most as many sequences), one buffer for all,
        # outside the graph pool: a replay leaves them readable for the logprob matrices of its step.
        self.graph_logits: torch.Tensor | None = None
        if sizes:
            self._graph_logits(self.graphs.max_size)  # before capture, on this stream
            with torch.inference_mode():
                # One pool, the graphs with the most rows first: the others reuse its memory.
                pool = torch.cuda.graph_pool_handle()
                most_tokens = self.prefill_graphs.keys[-1][0] if self.prefill_graphs.keys else 0
                for graphs in ((self.prefill_graphs, self.graphs) if most_tokens >= self.graphs.max_size else
                               (self.graphs, self.prefill_graphs)):
                    graphs.capture(self._prepare_padding, self._graph_forward, pool)

    @staticmethod
    def profile_forward(model: nn.Module, scratch: torch.Tensor, num_tokens: int, num_rows: int,
                        max_model_len: int) -> None:
        """The largest step's forward, logits and sampling over a scratch cache, for memory profiling."""
        device = scratch.device
        i32 = {"dtype": torch.int32, "device": device}
        ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        # Positions wrap at max_model_len: the rotary table has no rows past it; memory is the same.
        positions = torch.arange(num_tokens, device=device) % max_model_len
        ctx = CudaAttentionContext(layer_caches(scratch), torch.arange(num_tokens, device=device),
                                   torch.arange(scratch.shape[2], **i32)[None], torch.tensor([num_tokens], **i32),
                                   torch.tensor([0, num_tokens], **i32), decode=False, max_seq_len=num_tokens)
        hidden = model(ids, positions, ctx)
        logits = model.compute_logits(hidden[-num_rows:])
        sample(logits, torch.zeros(num_rows, 6, device=device), torch.zeros(num_rows, 3, dtype=torch.int64,
                                                                            device=device))

    # ------------------------------------------------------------------------------------- graphs
    @staticmethod
    def _graph_shape(key: int | tuple[int, int, bool]) -> tuple[int, int]:
        """(tokens, sequences) of a graph key: a decode batch size b is (b, b)."""
        return (key, key) if isinstance(key, int) else key[:2]

    def _prepare_padding(self, key: int | tuple[int, int, bool]) -> None:
        """Inputs of a graph's shape, all padding: slot -1, no context, greedy sampling, no CSR
        entries, logits of token 0."""
        tokens, seqs = self._graph_shape(key)
        layout = self.inputs.layout(tokens, seqs, seqs)
        layout.np["block_tables"][:] = 0
        self.inputs.fill(layout, None, self.block_size, seqs, tokens)
        self.sampling.pack([], seqs, full_csr=True, stage=self.inputs.sampling_stage(layout))
        layout.upload()
        if not isinstance(key, int):
            self.inputs.logit_rows.np[:seqs] = 0
            self.inputs.logit_rows.upload(seqs)

    def _graph_forward(self, key: int | tuple[int, int, bool]) -> GraphOutputs:
        """The captured step: decode batches (key b) through the decode kernel, every token's logits;
        prefill shapes (key (tokens, seqs, mixed)) through the prefill kernel, a mixed one's single-token
        sequences (laid out first) through the decode kernel, the logits of the staged rows."""
        tokens, seqs = self._graph_shape(key)
        decode = isinstance(key, int)
        d = self.inputs.layout(tokens, seqs, seqs).dev
        split = mixed_split(d["seq_lens"], d["query_start"]) if not decode and key[2] else {}
        ctx = CudaAttentionContext(self.caches, d["slots"], d["block_tables"], d["seq_lens"], d["query_start"],
                                   decode=decode, max_seq_len=self.max_seq_len, workspace=self.workspace, **split)
        hidden = self.model(d["input_ids"], d["positions"], ctx)
        if not decode:
            hidden = hidden.index_select(0, self.inputs.logit_rows.dev[:seqs])
        logits = self.model.compute_logits(hidden, out=self._graph_logits(seqs) if self._logits_shared(seqs) else None)
        sampled, logprobs, _ = sample(logits, **self.sampling.static_kwargs(seqs, d["params_f32"], d["params_i64"]))
        return torch.stack((sampled.double(), logprobs.double()))

    def _logits_shared(self, seqs: int) -> bool:
        """Whether a graph of `seqs` sequences writes its logits into the shared buffer (every decode graph, and
        the prefill graphs of at most as many sequences): its steps can serve requests that ask for logprobs."""
        return seqs <= self.graphs.max_size

    def _graph_logits(self, rows: int) -> torch.Tensor:
        """The first `rows` rows of the graphs' shared logits buffer, made with room for the largest decode
        batch (at construction; on first use when stand-in graphs were installed later, as the CPU tests do)."""
        buf = self.graph_logits
        if buf is None or buf.shape[0] < rows:
            buf = self.graph_logits = torch.empty(max(rows, self.graphs.max_size), self.model.config.vocab_size,
                                                  dtype=torch.float32, device=self.device)
        return buf[:rows]

    # --------------------------------------------------------------------------------------- step
    def launch(self, plan: StepPlan, prev: PendingStep | None = None) -> PendingStep:
        """Enqueue one step (uploads, forward, sampling, the copy of its results to the host) and
        return without waiting for the device; `collect` waits and returns the results.

        A step planned with `prev` in flight (`plan.in_flight`) is launched while prev may still run:
        the input token of each row with a `feed` is prev's sample of that sampling row, copied on the
        device before the forward, and its sampling row counts that token as an output already
        (`plan.sample_ahead`). Its other rows (prompt chunks) have their tokens on the host.
        """
        if plan.in_flight:
            if prev is None:
                raise ValueError("a step planned with a step in flight needs that step")
            if prev.inputs_done is not None:
                # The host is about to rewrite the pinned staging buffers prev was uploaded from.
                # prev's uploads are the first work queued after the step before it, which the host
                # has already waited for, so this returns at once in steady state.
                prev.inputs_done.synchronize()
        rows = plan.samples
        t = plan.num_tokens
        num_decode = plan.num_decode
        one_token = plan.one_token  # every row has one new token: the decode kernel serves the step
        one_row_each = plan.one_sample_each  # sampling row i is row i (what a decode graph does)
        # Prompt logprobs' logits rows are a prompt's tokens, and grammar masks are applied between the logits
        # and the sampler: both run eagerly.
        graphable = not plan.prompt_tokens and not plan.grammar_rows
        feeds = (plan.feed_rows, plan.feed_tokens) if plan.in_flight else None
        want_logprobs = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        num_seqs = len(plan.rows)
        on_cuda = self.device.type == "cuda"
        # Host buffers the results are copied into alternate between consecutive steps: the host
        # reads step N's while step N+1's copy may already be queued.
        parity = self._parity
        self._parity ^= 1
        pending = PendingStep(plan, want_logprobs)

        # A graph of the step's padded shape: b for a decode batch of b, else (tokens, sequences, mixed).
        key: int | tuple[int, int, bool] | None = None
        if graphable:
            if one_token and one_row_each:
                key = self.graphs.padded_size(num_seqs)
            elif not one_token:
                # A prompt forking n > 1 sequences samples n rows from its last token: a shape with room for
                # every sampling row (sequence slots past the real ones are padding).
                key = self.prefill_graphs.padded_shape(t, max(num_seqs, len(rows)), num_decode > 0)
                if key is not None and want_logprobs and not self._logits_shared(key[1]):
                    key = None  # this graph's logits are its own: no logprob matrices from them
        if key is not None:
            tokens_pad, seqs_pad = self._graph_shape(key)
            layout = self.inputs.layout(tokens_pad, seqs_pad, seqs_pad)
            sampling, static = self.sampling.pack(rows, seqs_pad, full_csr=True,
                                                  stage=self.inputs.sampling_stage(layout),
                                                  ahead=plan.sample_ahead)
            if not static:
                key = None
        if key is not None:
            self.inputs.fill(layout, plan, self.block_size, seqs_pad, tokens_pad)
            staged_rows = 0
            if not one_token:  # the sampled rows' hidden states, padding rows reading token 0
                self.inputs.logit_rows.np[:len(rows)] = plan.sample_tokens
                self.inputs.logit_rows.np[len(rows):seqs_pad] = 0
                staged_rows = seqs_pad
            self._upload(layout, feeds, prev, pending, parity, staged_rows)
            if one_token:
                packed = self.graphs.replay(key)
                self.num_graph_steps += 1
            else:
                packed = self.prefill_graphs.replay(key)
                self.num_prefill_graph_steps += 1
            if want_logprobs:
                # From the replay's logits (sampling row i = logits row i), queued before any later step's
                # replay rewrites them.
                assert self.graph_logits is not None
                mat = _logprob_matrix(self.graph_logits, packed[0], rows, want_logprobs, self.device)
                pending.host_sample = mat.to("cpu", non_blocking=True)
            # The step's one device-to-host copy: ids and logprobs in one fp64 matrix.
            found = self._host_graph_out.get((seqs_pad, parity))
            if found is None:
                buf = torch.empty((2, seqs_pad), dtype=torch.float64, pin_memory=on_cuda)
                found = self._host_graph_out[(seqs_pad, parity)] = (buf, self._zero_copy and host_mapped(buf))
            host, mapped = found
            if mapped:
                stage_copy(host, packed)
            else:
                host.copy_(packed, non_blocking=True)
            pending.host_packed = host
            pending.device_tokens = packed[0]
        else:
            num_rows = len(rows)
            staged = num_rows <= self.inputs.max_rows
            layout = self.inputs.layout(t, num_seqs, num_rows if staged else 0)
            stage = self.inputs.sampling_stage(layout) if staged else None
            sampling, _ = self.sampling.pack(rows, stage=stage, ahead=plan.sample_ahead)
            longest = self.inputs.fill(layout, plan, self.block_size, num_seqs, t)
            logit_rows = plan.prompt_tokens + plan.sample_tokens
            logit_index: torch.Tensor | None = None  # None: every token's hidden state
            staged_rows = 0
            if logit_rows != list(range(t)):
                if len(logit_rows) <= self.inputs.logit_rows.np.shape[0]:
                    # Uploaded with the step's inputs, before `inputs_done`: the next step may
                    # rewrite this pinned buffer as soon as that event has passed.
                    self.inputs.logit_rows.np[:len(logit_rows)] = logit_rows
                    staged_rows = len(logit_rows)
                else:
                    logit_index = torch.tensor(logit_rows, dtype=torch.int64).to(self.device, non_blocking=True)
            self._upload(layout, feeds, prev, pending, parity, staged_rows)
            if staged_rows:
                logit_index = self.inputs.logit_rows.dev[:staged_rows]
            tokens, logprobs, prompt_mat, sample_mat = self._eager(layout, plan, one_token, longest, sampling,
                                                                   logit_index, want_logprobs)
            self.num_eager_steps += 1
            # Token ids, their logprobs and the logprob matrices come back in the step's one sync.
            host_tokens, host_logprobs = self.host_tokens[parity], self.host_logprobs[parity]
            if num_rows <= host_tokens.numel():
                host_tokens, host_logprobs = host_tokens[:num_rows], host_logprobs[:num_rows]
                host_tokens.copy_(tokens, non_blocking=True)
                host_logprobs.copy_(logprobs, non_blocking=True)
            else:
                host_tokens = tokens.to("cpu", non_blocking=True)
                host_logprobs = logprobs.to("cpu", non_blocking=True)
            pending.host_tokens, pending.host_logprobs = host_tokens, host_logprobs
            pending.host_prompt = prompt_mat.to("cpu", non_blocking=True) if prompt_mat is not None else None
            pending.host_sample = sample_mat.to("cpu", non_blocking=True) if sample_mat is not None else None
            pending.device_tokens = tokens
        if plan.in_flight:
            self.num_lookahead_steps += 1
        if on_cuda:
            pending.done = self._events[parity][1]
            pending.done.record(torch.cuda.current_stream(self.device))
        return pending

    def _upload(self, layout: StageLayout, feeds: tuple[list[int], list[int]] | None, prev: PendingStep | None,
                pending: PendingStep, parity: int, logit_rows: int = 0) -> None:
        """Send the staged inputs (and the first `logit_rows` staged logit rows); for a step planned with
        one in flight (`feeds`: prev's sampling rows and the token indices they feed), then overwrite
        those input tokens with prev's samples on the device (stream order: after prev's sampling,
        before this step's forward). Records when the pinned buffers are free to be rewritten."""
        n = 0
        identity = True
        if feeds is not None:
            src, dst = feeds
            n = len(src)
            # Steady decode: every sequence takes prev's row of the same index.
            identity = src == dst == list(range(n))
            if n and not identity:
                staged = layout.np["feeds"]
                staged[:n] = dst
                staged[n:2 * n] = src
        if n:
            assert prev is not None and prev.device_tokens is not None
        kernel = self._zero_copy and layout.nbytes <= STAGE_KERNEL_MAX_BYTES
        if kernel:
            # One small kernel: the staged bytes read in place, then the lookahead input ids.
            layout.stage(prev.device_tokens if n else None, None if identity else layout.dev["feeds"], n)
        else:
            layout.upload()
        if logit_rows:
            self.inputs.logit_rows.upload(logit_rows)
        if self.device.type == "cuda":
            pending.inputs_done = self._events[parity][0]
            pending.inputs_done.record(torch.cuda.current_stream(self.device))
        if n and not kernel:
            ids = layout.dev["input_ids"]
            if identity:
                ids[:n].copy_(prev.device_tokens[:n])
            else:
                index = layout.dev["feeds"]
                ids.index_copy_(0, index[:n], prev.device_tokens.index_select(0, index[n:2 * n]).to(ids.dtype))

    def release(self, pending: PendingStep) -> None:
        """Give up a launched step whose results nobody needs. Wait only until the host may rewrite
        the pinned buffers it was uploaded from; its device work runs on, ahead of whatever is
        launched later on the same stream, and its result buffer is not the next step's."""
        # A step planned with one in flight reads no reused pinned buffer after `inputs_done` (logit rows
        # go up before it; prompt-logprob steps are never planned so); for any other step wait for all of it.
        event = pending.inputs_done if pending.plan.in_flight else pending.done
        if event is not None:
            event.synchronize()

    def collect(self, pending: PendingStep) -> dict[str, RowResult]:
        """Wait for a launched step's results to reach the host and return them per row."""
        if pending.done is not None:
            pending.done.synchronize()
        if pending.host_packed is not None:
            n = len(pending.plan.samples)
            ids, lps = pending.host_packed.tolist()
            return self._results(pending.plan, [int(x) for x in ids[:n]], lps[:n], pending.want_logprobs,
                                 pending.host_sample, None)
        assert pending.host_tokens is not None and pending.host_logprobs is not None
        return self._results(pending.plan, pending.host_tokens.tolist(), pending.host_logprobs.tolist(),
                             pending.want_logprobs, pending.host_sample, pending.host_prompt)

    def _eager(self, layout: StageLayout, plan: StepPlan, decode: bool, longest: int,
               sampling: dict[str, torch.Tensor | None], logit_index: torch.Tensor | None, want_logprobs: list[int],
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The eager forward and sampling; `logit_index`: the token rows to compute logits for (prompt
        rows, then sampled rows) on the device, None for every token."""
        num_seqs = len(plan.rows)
        rows = plan.samples
        workspace = None
        if decode and self.workspace is not None:
            need = decode_workspace_size(num_seqs, self.num_heads, self.num_kv_heads, self.head_dim, longest,
                                         device=self.device.index or 0)
            if need <= self.workspace.numel() * 4:
                workspace = self.workspace
        d = layout.dev
        ctx = CudaAttentionContext(self.caches, d["slots"], d["block_tables"], d["seq_lens"], d["query_start"],
                                   decode=decode, max_seq_len=max(longest, 1), workspace=workspace,
                                   num_decode_seqs=plan.num_decode)
        hidden = self.model(d["input_ids"], d["positions"], ctx)
        logits = self.model.compute_logits(hidden if logit_index is None else hidden.index_select(0, logit_index))
        num_prompt = len(plan.prompt_tokens)
        prompt_mat = None
        if num_prompt:
            top = max(s.prompt_logprobs or 0 for s in plan.rows if s.prompt_logprob_targets)
            targets = [t for s in plan.rows for t in s.prompt_logprob_targets]
            target_dev = torch.tensor(targets, dtype=torch.int64).to(self.device, non_blocking=True)
            prompt_mat = logprob_matrix(logits[:num_prompt], target_dev, top)
        if not rows:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return empty, empty.float(), prompt_mat, None
        sample_logits = logits[num_prompt:]
        if plan.masks is not None:
            tokens, logprobs = self._sample_masked(plan, sample_logits, sampling)
        else:
            tokens, logprobs, _ = sample(sample_logits, **sampling)
        sample_mat = _logprob_matrix(sample_logits, tokens, rows, want_logprobs, self.device) if want_logprobs else None
        return tokens, logprobs, prompt_mat, sample_mat

    def _sample_masked(self, plan: StepPlan, logits: torch.Tensor, sampling: dict[str, torch.Tensor | None],
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampling under grammar masks: the masks (filled on the host while the forward was queued) go up,
        our kernel sets the forbidden tokens of a copy of the logits to -inf (the sampler's penalties and
        temperature keep -inf), the sampler draws from the copy, and the reported logprobs are read from the
        raw logits, as in an unconstrained step."""
        assert plan.masks is not None and plan.sample_masks is not None
        masks = plan.masks.wait().to(self.device, non_blocking=True)
        index = torch.tensor(plan.sample_masks, dtype=torch.int32).to(self.device, non_blocking=True)
        masked = logits.float().clone()
        apply_token_bitmask(masked, masks, index)
        tokens, _, _ = sample(masked, **sampling)
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens.view(-1, 1)).view(-1)
        return tokens, logprobs

    @staticmethod
    def _results(plan: StepPlan, tokens: list[int], logprobs: list[float], want_logprobs: list[int],
                 sample_mat: torch.Tensor | None, prompt_mat: torch.Tensor | None) -> dict[str, RowResult]:
        results = {s.seq_id: RowResult([]) for s in plan.rows}
        if prompt_mat is not None:
            matrix = prompt_mat.tolist()
            r = 0
            for s in plan.rows:
                for target in s.prompt_logprob_targets:
                    results[s.seq_id].prompt_logprobs.append(
                        step_logprobs_from_row(matrix[r], int(target), s.prompt_logprobs or 0))
                    r += 1
        detail = dict(zip(want_logprobs, sample_mat.tolist())) if sample_mat is not None else {}
        for i, (row, owner, token) in enumerate(zip(plan.samples, plan.sample_owners, tokens)):
            if i in detail:
                step = step_logprobs_from_row(detail[i], token, row.params.logprobs or 0)
                results[owner].sampled.append(SampledToken(token, step.logprob, step))
            else:
                results[owner].sampled.append(SampledToken(token, float(logprobs[i])))
        return results


def _logprob_matrix(logits: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow], want: list[int],
                    device: torch.device) -> torch.Tensor:
    """The logprob matrix (see gpu_sampler.logprob_matrix) of the sampling rows in `want` (indices into rows,
    logits and the sampled tokens), at the largest top-N any of them asked for."""
    top = max(rows[i].params.logprobs or 0 for i in want)
    index = torch.tensor(want, dtype=torch.int64).to(device, non_blocking=True)
    return logprob_matrix(logits.index_select(0, index), tokens.index_select(0, index).long(), top)


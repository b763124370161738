"""The CUDA step path (cuda_runner.py: staged inputs, kernel attention context, GPU sampling inputs,
logprobs on the device) run on the CPU through the kernels' PyTorch references, against HF and the
CPU engine. The same code runs on the GPU with the compiled kernels (test_engine_cuda_graphs.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_engine import GREEDY, assert_all_free, engine_for, make_prompts, reference, run_staggered, tiny

from wllm.engine.cuda_graphs import DecodeGraphs, PrefillGraphs, graph_batch_sizes, prefill_graph_shapes
from wllm.engine.cuda_runner import CudaStepRunner
from wllm.engine.gpu_sampler import SamplingBuffers
from wllm.engine.sampler import Sampler, SamplingRow
from wllm.kernels import pack_sampling_rows, sample
from wllm.sampling_params import SamplingParams


def kernel_engine(model, **kwargs):
    """An engine whose runner steps through CudaStepRunner (on the CPU: kernel references)."""
    engine = engine_for(model, **kwargs)
    worker = engine.worker
    worker.runner = CudaStepRunner(model, worker.kv_cache, max_num_batched_tokens=kwargs.get("budget", 2048),
                                   max_num_seqs=kwargs.get("seqs", 256), max_model_len=engine.max_model_len,
                                   enforce_eager=True)
    return engine


class _Replayed:
    """Stands in for CUDA graphs on the CPU: "capture" keeps the forward, "replay" runs it on the
    padded persistent buffers, so the padding and static-buffer logic of graph steps is exercised."""

    def capture(self, prepare, forward, pool=None):
        self._forward = forward
        self.replayed = []  # the keys replayed, in order
        for key in reversed(self.keys):
            prepare(key)
            self._graphs[key] = (None, forward(key))

    def replay(self, key):
        self.replayed.append(key)
        return self._forward(key)


class ReplayedEagerly(_Replayed, DecodeGraphs):
    """Decode graphs on the CPU (see _Replayed)."""


class PrefillReplayedEagerly(_Replayed, PrefillGraphs):
    """Prefill-step graphs on the CPU (see _Replayed)."""


def install_graphs(runner, budget, seqs, prefill=True):
    """Stand-in decode graphs (and prefill-step graphs) on a CPU runner, captured as the GPU's are."""
    runner.graphs = ReplayedEagerly(graph_batch_sizes(seqs), runner.device)
    if prefill:
        runner.prefill_graphs = PrefillReplayedEagerly(prefill_graph_shapes(budget, seqs), runner.device)
    with torch.inference_mode():
        runner.prefill_graphs.capture(runner._prepare_padding, runner._graph_forward)
        runner.graphs.capture(runner._prepare_padding, runner._graph_forward)


def graph_engine(model, prefill=False, **kwargs):
    engine = kernel_engine(model, **kwargs)
    install_graphs(engine.worker.runner, kwargs.get("budget", 2048), kwargs.get("seqs", 256), prefill)
    return engine


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_padded_graph_steps_match_hf_and_seeded_sampling_is_unchanged(name, tmp_path_factory):
    torch.manual_seed(0)
    model, hf = tiny(name, tmp_path_factory)
    prompts = make_prompts(16)
    engine = graph_engine(model, budget=7, seqs=12)  # graph sizes 1, 2, 4, 8, 16: every step is padded
    outs = run_staggered(engine, prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference(name, hf, prompts)
    runner = engine.worker.runner
    assert runner.num_graph_steps > 0 and runner.num_eager_steps > 0
    assert_all_free(engine)
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, seed=i, ignore_eos=True,
                             logit_bias={7: 0.5} if i % 2 else None) for i in range(5)]
    padded = graph_engine(model, seqs=8).generate(prompts[:5], params)
    eager = kernel_engine(model, seqs=8).generate(prompts[:5], params)
    assert [o.outputs[0].token_ids for o in padded] == [o.outputs[0].token_ids for o in eager]


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_padded_prefill_graph_steps_match_hf_and_eager(name, tmp_path_factory):
    """Short prefill and mixed steps replayed at a padded (tokens, sequences) shape, decode rows through the
    decode kernel and prompt rows through the prefill kernel: chunked prompts (chunks that sample nothing),
    prefix-cache hits, mixed steps of up to 12 sequences; greedy matches HF, seeded sampling with penalties
    and logit_bias matches the eager path."""
    torch.manual_seed(0)
    model, hf = tiny(name, tmp_path_factory)
    prompts = make_prompts(16)
    engine = graph_engine(model, prefill=True, budget=20, seqs=12)  # prefill shapes 16/32 tokens x 1-16 seqs
    outs = run_staggered(engine, prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference(name, hf, prompts)
    runner = engine.worker.runner
    # Every step fits a captured shape: none runs eagerly. The first prompts have nobody decoding beside them
    # (prompt-only graphs); later steps carry decode rows (mixed graphs), some of more than 8 sequences.
    assert runner.num_prefill_graph_steps > 0 and runner.num_graph_steps > 0 and runner.num_eager_steps == 0
    replayed = runner.prefill_graphs.replayed
    assert not replayed[0][2] and any(mixed and s > 8 for _, s, mixed in replayed)
    assert_all_free(engine)
    again = run_staggered(engine, prompts, GREEDY, per_step=1)  # now every prompt hits the prefix cache
    assert [o.outputs[0].token_ids for o in again] == reference(name, hf, prompts)
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, seed=i, ignore_eos=True,
                             logit_bias={7: 0.5} if i % 2 else None, repetition_penalty=1.3 if i % 3 else 1.0,
                             presence_penalty=0.5 if i == 4 else 0.0) for i in range(5)]
    graphed = graph_engine(model, prefill=True, seqs=8)
    padded = graphed.generate(prompts[:5], params)
    eager = kernel_engine(model, seqs=8).generate(prompts[:5], params)
    assert [o.outputs[0].token_ids for o in padded] == [o.outputs[0].token_ids for o in eager]
    assert graphed.worker.runner.num_prefill_graph_steps > 0


def test_prefill_graph_shapes_cover_the_budget_and_stop_there():
    def grid(tokens, seqs):
        return [(t, s) for t in tokens for s in seqs if s <= t]

    def both(shapes):  # every shape mixed, those of up to 8 sequences also prompt-only
        return [(t, s, m) for t, s in shapes for m in (False, True) if m or s <= 8]

    full = prefill_graph_shapes(8448, 256)
    assert full == both(grid((16, 32, 64, 128, 256, 512), [1 << i for i in range(9)]))
    assert len(full) == 44 + 24
    assert prefill_graph_shapes(40, 12) == both(grid((16, 32, 64), (1, 2, 4, 8, 16)))
    assert prefill_graph_shapes(7, 1) == [(16, 1, False), (16, 1, True)]
    assert prefill_graph_shapes(512, 3) == both(grid((16, 32, 64, 128, 256, 512), (1, 2, 4)))
    assert max(s for _, s, _ in prefill_graph_shapes(8448, 4096)) == 512  # no more sequences than tokens
    graphs = PrefillReplayedEagerly(prefill_graph_shapes(40, 12), torch.device("cpu"))
    graphs.capture(lambda key: None, lambda key: key)
    assert graphs.padded_shape(17, 3, True) == (32, 4, True) and graphs.padded_shape(64, 8, False) == (64, 8, False)
    # No prompt-only graph of 16 sequences: a step without decode rows takes the mixed one.
    assert graphs.padded_shape(20, 9, False) == (32, 16, True) and graphs.padded_shape(16, 16, True) == (16, 16, True)
    assert graphs.padded_shape(65, 1, False) is None and graphs.padded_shape(3, 17, True) is None
    assert graphs.replay((32, 4, True)) == (32, 4, True)


@pytest.mark.parametrize(("name", "budget", "caching"), [("llama", 5, True), ("llama", 2048, False),
                                                          ("gemma2", 7, True), ("mistral", 6, True)])
def test_kernel_path_greedy_matches_hf_staggered(name, budget, caching, tmp_path_factory):
    torch.manual_seed(0)
    model, hf = tiny(name, tmp_path_factory)
    prompts = make_prompts(16)
    ref = reference(name, hf, prompts)
    engine = kernel_engine(model, budget=budget, caching=caching)
    outs = run_staggered(engine, prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert engine.worker.runner.num_eager_steps == engine.num_steps
    if caching:
        assert engine.stats()["prefix_cache_hits"] > 0
    assert_all_free(engine)


@pytest.mark.parametrize("cpu_blocks", [64, 0])
def test_kernel_path_under_kv_pressure_swap_and_recompute(cpu_blocks, tmp_path_factory):
    torch.manual_seed(0)
    model, hf = tiny("llama", tmp_path_factory)
    prompts = make_prompts(16)
    ref = reference("llama", hf, prompts)
    engine = kernel_engine(model, budget=16, blocks=12, cpu_blocks=cpu_blocks)
    outs = run_staggered(engine, prompts, GREEDY, per_step=4)
    assert [o.outputs[0].token_ids for o in outs] == ref
    stats = engine.stats()
    assert (stats["num_preemptions_swap"] > 0) == (cpu_blocks > 0) and stats["num_preemptions"] > 0
    assert_all_free(engine)


def test_kernel_path_seeded_sampling_is_batch_independent_and_reproducible(tmp_path_factory):
    torch.manual_seed(0)
    model, _ = tiny("llama", tmp_path_factory)
    prompts = make_prompts(8)
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=10, seed=100 + i, ignore_eos=True)
              for i in range(8)]
    batch = kernel_engine(model, budget=9).generate(prompts, params)
    again = kernel_engine(model).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in again]
    for i in (0, 5):
        alone = kernel_engine(model).generate([prompts[i]], params[i])[0]
        assert alone.outputs[0].token_ids == batch[i].outputs[0].token_ids
    assert len({tuple(o.outputs[0].token_ids) for o in batch}) == 8


def test_kernel_path_n_sequences_fork(tmp_path_factory):
    torch.manual_seed(0)
    model, _ = tiny("llama", tmp_path_factory)
    prompt = make_prompts()[1]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7, ignore_eos=True)
    engine = kernel_engine(model, caching=False)
    (out,) = engine.generate([prompt], params)
    single = kernel_engine(model).generate([prompt], SamplingParams(temperature=1.0, max_tokens=6, seed=7,
                                                                    ignore_eos=True))[0]
    assert out.outputs[0].token_ids == single.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert_all_free(engine)


def test_kernel_path_logprobs_match_the_cpu_engine(tmp_path_factory):
    torch.manual_seed(0)
    model, _ = tiny("llama", tmp_path_factory)
    prompts = make_prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    ours = kernel_engine(model, budget=5).generate(prompts, params)
    cpu = engine_for(model, budget=5).generate(prompts, params)
    for a, b in zip(ours, cpu):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        pairs = list(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])) + list(zip(a.outputs[0].logprobs,
                                                                                  b.outputs[0].logprobs))
        for x, y in pairs:
            assert (x.token_id, x.rank) == (y.token_id, y.rank)
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
            assert [t.token_id for t in x.top] == [t.token_id for t in y.top]
            assert [t.logprob for t in x.top] == pytest.approx([t.logprob for t in y.top], abs=1e-5)
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-4)



def _assert_same_logprobs(got, want, tol=1e-5):
    """Every sequence of two outputs of one request: the same tokens, logprobs, ranks and top alternatives."""
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    for a, b in zip(got.outputs, want.outputs, strict=True):
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
            assert (x.token_id, x.rank) == (y.token_id, y.rank)
            assert x.logprob == pytest.approx(y.logprob, abs=tol)
            assert [t.token_id for t in x.top] == [t.token_id for t in y.top]
            assert [t.logprob for t in x.top] == pytest.approx([t.logprob for t in y.top], abs=tol)


@pytest.mark.parametrize("name", ["llama", "gemma2"])  # gemma2: the final logit softcap, written in place
def test_decode_graphs_serve_logprob_requests_as_the_eager_path_does(name, tmp_path_factory):
    """Decode steps whose requests ask for logprobs replay the decode graphs (their logits land in the shared
    buffer the logprob matrices are computed from): every decode step is graphed, and tokens, logprobs, ranks
    and top alternatives equal the eager kernel path's, beside requests that ask for none or fewer."""
    torch.manual_seed(0)
    model, _ = tiny(name, tmp_path_factory)
    prompts = make_prompts(6)
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=[3, None, 0, 5, 1, None][i])
              for i in range(6)]
    params[4] = SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=6, ignore_eos=True, logprobs=2)
    graphed = graph_engine(model, seqs=8)
    got = graphed.generate(prompts, params)
    want = kernel_engine(model, seqs=8).generate(prompts, params)
    runner = graphed.worker.runner
    assert runner.num_graph_steps >= 5 and runner.num_eager_steps == 1  # the one prefill step
    for a, b in zip(got, want, strict=True):
        _assert_same_logprobs(a, b)
    assert [len(s.top) for s in got[3].outputs[0].logprobs] == [5] * 6 and got[1].outputs[0].logprobs is None
    assert_all_free(graphed)
    # Prefill and mixed steps too (prompts arriving while others decode, chunked by a 7-token budget), from
    # prefill graphs of up to 8 sequences (the decode graphs' largest batch: they share the logits buffer).
    graphed = graph_engine(model, prefill=True, budget=7, seqs=8)
    got = run_staggered(graphed, prompts, params)
    want = run_staggered(kernel_engine(model, budget=7, seqs=8), prompts, params)
    runner = graphed.worker.runner
    assert runner.num_prefill_graph_steps >= 5 and runner.num_graph_steps >= 3 and runner.num_eager_steps == 0
    for a, b in zip(got, want, strict=True):
        _assert_same_logprobs(a, b)
    assert_all_free(graphed)


def test_prefill_graphs_serve_prompts_that_fork_n_sequences(tmp_path_factory):
    """A prompt forking n > 1 sequences samples n rows from its last token; its prefill or mixed step replays a
    graph with room for every sampling row (more rows than sequences), and every sequence of every request
    equals the eager kernel path's, seeded, with prompts arriving while others decode."""
    torch.manual_seed(0)
    model, _ = tiny("llama", tmp_path_factory)
    prompts = make_prompts(5)
    params = [SamplingParams(n=n, temperature=1.0, top_p=0.9, seed=20 + i, max_tokens=5, ignore_eos=True)
              for i, n in enumerate([1, 3, 2, 4, 1])]
    graphed = graph_engine(model, prefill=True, budget=16, seqs=16)
    got = run_staggered(graphed, prompts, params, per_step=1)
    want = run_staggered(kernel_engine(model, budget=16, seqs=16), prompts, params, per_step=1)
    runner = graphed.worker.runner
    assert runner.num_eager_steps == 0 and runner.num_prefill_graph_steps >= 5
    assert any(s > 1 for _, s, _ in runner.prefill_graphs.replayed)
    for a, b in zip(got, want, strict=True):
        _assert_same_logprobs(a, b)
    assert [len(o.outputs) for o in got] == [1, 3, 2, 4, 1]
    assert len({tuple(c.token_ids) for c in got[3].outputs}) > 1  # the forks sample apart
    assert_all_free(graphed)


def test_a_one_token_fork_beside_a_one_token_chunk_is_not_a_decode_step(tmp_path_factory):
    """Every sequence with one new token but sampling rows that are not one per sequence (a one-token prompt
    forking 2 beside a mid-prompt one-token chunk that samples nothing: 2 rows for 2 sequences) must not take a
    decode graph, whose row i is sequence i (found in review: the fork sampled from the other prompt's row)."""
    torch.manual_seed(0)
    model, _ = tiny("llama", tmp_path_factory)
    prompts = [[5], make_prompts(1)[0]]
    params = [SamplingParams(n=2, temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)]
    got = graph_engine(model, prefill=True, budget=2, seqs=8).generate(prompts, params)
    want = kernel_engine(model, budget=2, seqs=8).generate(prompts, params)
    for a, b in zip(got, want, strict=True):
        _assert_same_logprobs(a, b)


@pytest.mark.parametrize("seed", range(12))
def test_graph_steps_equal_eager_steps_on_random_mixes(seed, tmp_path_factory):
    """Random short and one-token prompts, n 1-3, greedy and seeded sampling, logprobs or not, token budgets from
    2 tokens, staggered arrivals: with decode and prefill graphs installed every request's sequences, tokens and
    logprobs equal the eager kernel path's."""
    import random

    rng = random.Random(seed)
    torch.manual_seed(0)
    model, _ = tiny("llama", tmp_path_factory)
    k = rng.randint(3, 8)
    prompts = [p[: rng.choice([1, 2, 3, len(p)])] for p in make_prompts(k, seed=seed + 1)]
    params = [SamplingParams(n=rng.choice([1, 1, 2, 3]), temperature=rng.choice([0.0, 1.0]), seed=100 + i,
                             max_tokens=rng.randint(2, 6), ignore_eos=True, logprobs=rng.choice([None, 0, 2]))
              for i in range(k)]
    budget, seqs, per = rng.choice([2, 3, 5, 7, 16]), rng.choice([4, 8, 16]), rng.choice([1, 2])
    graphed = graph_engine(model, prefill=True, budget=budget, seqs=seqs, caching=rng.choice([True, False]))
    got = run_staggered(graphed, prompts, params, per_step=per)
    want = run_staggered(kernel_engine(model, budget=budget, seqs=seqs), prompts, params, per_step=per)
    runner = graphed.worker.runner
    assert runner.num_graph_steps + runner.num_prefill_graph_steps > 0
    for a, b in zip(got, want, strict=True):
        _assert_same_logprobs(a, b, tol=1e-4)
    assert_all_free(graphed)

def _rows():
    base = dict(temperature=0.0, max_tokens=8)
    specs = [
        SamplingParams(**base),
        SamplingParams(**base, logit_bias={5: 100.0, 7: -2.0, 10_000: 1.0}),  # 10000 is out of the vocab
        SamplingParams(**base, min_tokens=4, stop_token_ids=[11]),
        SamplingParams(**base, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, max_tokens=8, seed=3),
    ]
    rows = []
    for i, p in enumerate(specs):
        rows.append(SamplingRow(p, seed=p.seed if p.seed is not None else 40 + i, index=i % 2,
                                prompt_token_ids=[3, 4, 5, 11], output_token_ids=[6, 6, 9][: i % 4],
                                eos_token_ids=[2]))
    return rows


def test_sampling_buffers_pack_like_the_kernel_packer_and_greedy_matches_the_cpu_sampler():
    torch.manual_seed(0)
    vocab = 64
    rows = _rows()
    logits = torch.randn(len(rows), vocab) * 3
    logits[:, 2] = 50.0  # EOS would win where min_tokens does not ban it
    buffers = SamplingBuffers(8, vocab, torch.device("cpu"), bias_capacity=16, penalty_capacity=32)
    packed, static = buffers.pack(rows)
    assert static
    ours = sample(logits.clone(), **packed)
    theirs = sample(logits.clone(), **pack_sampling_rows(rows))
    assert torch.equal(ours[0], theirs[0]) and torch.allclose(ours[1], theirs[1])
    cpu = Sampler()(logits.clone(), rows)
    greedy = [i for i, r in enumerate(rows) if r.params.temperature == 0.0]
    assert [int(ours[0][i]) for i in greedy] == [cpu[i].token_id for i in greedy]
    assert int(ours[0][1]) == 5 and int(ours[0][2]) != 2  # the bias wins; EOS banned under min_tokens

    # Padding rows are greedy with no CSR entries; the full-capacity CSR gives the same samples.
    full, static = buffers.pack(rows, 8, full_csr=True)
    assert static and full["params_f32"].shape == (8, 6) and full["bias_tokens"].shape == (16,)
    padded = torch.cat([logits, torch.randn(3, vocab)])
    tokens = sample(padded.clone(), **full)[0]
    assert torch.equal(tokens[: len(rows)], ours[0])
    assert torch.equal(tokens[len(rows):], padded[len(rows):].argmax(-1))

    # A later step without entries zeroes the offsets the previous step left on the device.
    plain, _ = buffers.pack([rows[0]], 4, full_csr=True)
    assert not plain["bias_offsets"].any() and not plain["penalty_offsets"].any()
    assert not buffers.bias_off.dev.any() and not buffers.pen_off.dev.any()
    assert torch.equal(sample(padded[:4].clone(), **plain)[0], padded[:4].argmax(-1))

    # Over capacity: one-off tensors, flagged as not static (no graph replay for that step).
    small = SamplingBuffers(8, vocab, torch.device("cpu"), bias_capacity=2, penalty_capacity=32)
    packed, static = small.pack(rows)
    assert not static and torch.equal(sample(logits.clone(), **packed)[0], theirs[0])


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 4]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 8))
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_sizes(0)


def test_enforce_eager_is_an_engine_argument():
    from wllm.engine.config import engine_config_from_kwargs

    assert engine_config_from_kwargs(enforce_eager=True).enforce_eager
    assert not engine_config_from_kwargs().enforce_eager




def test_enforce_eager_flag_on_serve_and_generate():
    from wllm.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--enforce-eager"]).enforce_eager
    assert not parser.parse_args(["serve"]).enforce_eager
    assert parser.parse_args(["generate", "hi", "--enforce-eager"]).enforce_eager
    assert not parser.parse_args(["generate", "hi"]).enforce_eager


def test_prefill_graphs_leave_prompt_logprob_steps_eager(tmp_path_factory):
    """With prefill-step graphs installed, a prompt asking for prompt logprobs still runs its prefill eagerly;
    a prompt forking n > 1 sequences (n sampling rows from its last token), one asking for logprobs of its
    samples and a plain one are graphed; each gives what the eager path gives."""
    torch.manual_seed(0)
    model, _ = tiny("llama", tmp_path_factory)
    prompt = make_prompts()[1]
    cases = [SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=7, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)]
    for i, params in enumerate(cases):
        graphed = graph_engine(model, prefill=True, seqs=8, caching=False)
        (got,) = graphed.generate([prompt], params)
        (want,) = kernel_engine(model, seqs=8, caching=False).generate([prompt], params)
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert (got.prompt_logprobs is None) == (want.prompt_logprobs is None)
        assert (graphed.worker.runner.num_prefill_graph_steps > 0) == (i != 2)
        assert_all_free(graphed)


def test_captured_mixed_split_matches_the_eager_split(monkeypatch):
    """In a captured mixed step the split between decode rows and prompt rows is worked out on the device
    (mixed_split): the decode kernel serves the single-token sequences laid out first, the prefill kernel
    sees only the prompt rows, and the result equals the eager step's split (num_decode_seqs) row for row,
    with padding sequences and padding tokens after the real ones."""
    from wllm.engine import cuda_attention
    from wllm.engine.cuda_attention import CudaAttentionContext, mixed_split

    torch.manual_seed(0)
    bs, hkv, hq, d, num_blocks = 4, 2, 4, 16, 40
    k_cache, v_cache = torch.randn(2, num_blocks, bs, hkv, d).unbind(0)
    # 3 decode rows (contexts 5, 17, 9), a 4-token chunk after 6 cached tokens, a fresh 7-token prompt, a
    # padding sequence; 14 tokens padded to 20.
    lens = torch.tensor([5, 17, 9, 10, 7, 0], dtype=torch.int32)
    starts = torch.tensor([0, 1, 2, 3, 7, 14, 14], dtype=torch.int32)
    tables = torch.randperm(num_blocks)[:6 * 6].reshape(6, 6).to(torch.int32)
    q = torch.randn(20, hq, d)
    slots = torch.full((20,), -1, dtype=torch.int64)
    caches = [(k_cache, v_cache)]
    eager = CudaAttentionContext(caches, slots, tables, lens, starts, decode=False, max_seq_len=24,
                                 num_decode_seqs=3)
    want = eager._attention(q, k_cache, v_cache, 0.25, None, None)
    split = mixed_split(lens, starts)
    assert split["decode_lens"].tolist() == [5, 17, 9, 0, 0, 0]
    assert split["prefill_starts"].tolist() == [3, 3, 3, 3, 7, 14, 14]
    seen = []
    prefill = cuda_attention.paged_prefill_attention

    def spy(*args, **kwargs):
        seen.append(args[5].tolist())
        return prefill(*args, **kwargs)

    monkeypatch.setattr(cuda_attention, "paged_prefill_attention", spy)
    captured = CudaAttentionContext(caches, slots, tables, lens, starts, decode=False, max_seq_len=24, **split)
    got = captured._attention(q, k_cache, v_cache, 0.25, None, None)
    assert seen == [[3, 3, 3, 3, 7, 14, 14]]  # the prefill kernel never sees a decode row
    torch.testing.assert_close(got[:14], want[:14])
    # No decode rows at all (a pure prefill step): the split leaves every sequence to the prefill kernel.
    none = mixed_split(torch.tensor([4, 9, 0], dtype=torch.int32), torch.tensor([0, 4, 9, 9], dtype=torch.int32))
    assert none["decode_lens"].tolist() == [0, 0, 0] and none["prefill_starts"].tolist() == [0, 4, 9, 9]


def test_incremental_staging_equals_a_fresh_write():
    """`StepInputs.fill` rewrites only the block-table entries added since the same layout's last fill, and
    `SamplingBuffers.pack` only the output counts of rows it staged there before. Whatever happens between
    steps -- tables growing in place, rows reordered, dropped or added, a block list replaced (recompute),
    another layout written over the same host bytes, a row with penalties or no staging at all -- what is
    staged must equal a write into fresh buffers."""
    import random

    from wllm.engine.cuda_runner import StepInputs
    from wllm.engine.step_plan import StepPlan, StepRow

    rng = random.Random(0)
    cpu, bs, vocab = torch.device("cpu"), 4, 50
    inputs, buffers = StepInputs(64, 12, 128, cpu), SamplingBuffers(128, vocab, cpu)
    plain = SamplingParams(temperature=0.7, top_k=5, seed=1)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    seqs = []  # [seq id, block list, output list, sampling row]
    for i in range(20):
        outs = [1] * rng.randrange(1, 8)
        row = SamplingRow(plain, 7, i, (1, 2, 3), outs, [2])
        seqs.append([f"s{i}", [rng.randrange(1000) for _ in range(rng.randrange(1, 4))], outs, row])
    current = seqs[:12]
    for step in range(150):
        event = rng.random()
        if event < 0.1:
            rng.shuffle(current)
        elif event < 0.2:
            current = rng.sample(seqs, rng.randrange(1, 16))
        elif event < 0.3:
            victim = rng.choice(current)
            victim[1] = [rng.randrange(1000) for _ in victim[1]]  # recomputed: a new list, the same length
        for s in current:  # every sequence decodes one token; now and then it takes a new block
            s[2].append(rng.randrange(vocab))
            if rng.random() < 0.25 and len(s[1]) < 12:
                s[1].append(rng.randrange(1000))
        penalty_step = rng.random() < 0.1
        rows = [SamplingRow(penalised, 7, 0, (1, 2, 3), s[2], [2]) if penalty_step and k == 0 else s[3]
                for k, s in enumerate(current)]
        out = StepPlan.build([StepRow(s[0], [s[2][-1]], len(s[1]) * bs - 1 - rng.randrange(bs), s[1], 1, r)
                              for s, r in zip(current, rows)])
        n = len(out.rows)
        padded = n + (rng.randrange(1, 3) if rng.random() < 0.2 else 0)  # mostly the last step's layout
        ahead = rng.choice([0, 1, [rng.randrange(2) for _ in range(n)]])
        event = rng.random()
        if event < 0.15:  # another shape's step writes over the shared host bytes
            other = inputs.layout(40, 30, 30)
            buffers.pack([s[3] for s in seqs[:30]], 30, stage=inputs.sampling_stage(other))
            inputs.fill(other, None, bs, 30, 40)
            other.np["block_tables"][:] = 99
        elif event < 0.25:  # a graph shape's pack that falls back to an eager step (no fill of that shape)
            other = inputs.layout(padded + 8, padded + 8, padded + 8)
            buffers.pack([s[3] for s in seqs[:padded + 8]], padded + 8, stage=inputs.sampling_stage(other))
        layout = inputs.layout(padded, padded, padded)
        staged = rng.random() < 0.9
        buffers.pack(rows, padded, full_csr=True, stage=inputs.sampling_stage(layout) if staged else None,
                     ahead=ahead)
        longest = inputs.fill(layout, out, bs, padded, padded)

        fresh_inputs, fresh_buffers = StepInputs(64, 12, 128, cpu), SamplingBuffers(128, vocab, cpu)
        fresh = fresh_inputs.layout(padded, padded, padded)
        fresh_buffers.pack(rows, padded, full_csr=True, stage=fresh_inputs.sampling_stage(fresh), ahead=ahead)
        assert fresh_inputs.fill(fresh, out, bs, padded, padded) == longest
        for name in ("input_ids", "positions", "slots", "seq_lens", "query_start"):
            np.testing.assert_array_equal(layout.np[name], fresh.np[name], err_msg=f"step {step}: {name}")
        np.testing.assert_array_equal(layout.np["block_tables"][:n], fresh.np["block_tables"][:n],
                                      err_msg=f"step {step}: block tables")
        if staged:
            for name in ("params_f32", "params_i64"):
                np.testing.assert_array_equal(layout.np[name], fresh.np[name], err_msg=f"step {step}: {name}")
        else:
            np.testing.assert_array_equal(buffers.f32.np[:padded], fresh.np["params_f32"])
            np.testing.assert_array_equal(buffers.i64.np[:padded], fresh.np["params_i64"])


def test_a_graph_step_that_falls_back_to_eager_does_not_leave_stale_block_tables(tmp_path_factory):
    """Regression (found in review): a decode step padded to a graph's shape packs its sampling rows into
    that shape's staging layout, whose bytes overlap another layout's block tables; when the pack then
    overflows its CSR buffers the step runs eagerly in that other layout, whose table rows must be
    rewritten, not trusted from its last fill. Greedy tokens equal the eager engine's."""
    torch.manual_seed(0)
    model, _ = tiny("llama", tmp_path_factory)
    prompts = [p for p in make_prompts(16) if len(p) > 8][:5]
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    penalised = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)
    params = [plain] * 4 + [penalised]  # rows 0-3 are staged before the penalised row sends pack the long way

    def run(engine):
        runner = engine.worker.runner
        runner.sampling = SamplingBuffers(runner.sampling.max_rows, runner.sampling.vocab_size, runner.device,
                                          penalty_capacity=4)  # the penalised row overflows: no graph step
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), prompt, p)
        final = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    final[int(out.request_id)] = out.outputs[0].token_ids
        return [final[i] for i in range(len(prompts))], runner

    eager, _ = run(kernel_engine(model, seqs=8))
    graphed, runner = run(graph_engine(model, seqs=8))  # 5 decode rows pad to graph size 8, then fall back
    assert runner.num_graph_steps == 0 and runner.num_eager_steps > 0
    assert graphed == eager

"""Scheduler: one token budget, chunked prefill, FCFS/priority, bounded queue, swap and recompute."""

import pytest

from wllm.engine.config import CacheConfig, SchedulerConfig
from wllm.engine.request import QueueFullError, RequestGroup
from wllm.engine.sampler import SampledToken
from wllm.engine.scheduler import Scheduler
from wllm.engine.step_plan import RowResult
from wllm.sampling_params import SamplingParams

EOS = 0


def make(budget=8, seqs=8, blocks=16, bs=4, cpu=0, policy="fcfs", max_waiting=0, caching=True, max_len=256):
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs, policy=policy, max_waiting=max_waiting),
        CacheConfig(block_size=bs, enable_prefix_caching=caching),
        blocks, cpu, max_len, [EOS],
    )


def add(s, rid, n_prompt, max_tokens=4, priority=0, first_token=100, arrival=None, **kw):
    tokens = list(range(first_token, first_token + n_prompt))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    s.add_group(RequestGroup(rid, tokens, params, priority=priority, arrival_time=arrival))


def run_step(s, token=7):
    out = s.schedule()
    results = {x.seq_id: RowResult([SampledToken(token + k, -0.5) for k in range(x.num_samples)]) for x in out.rows}
    s.update_from_output(out, results)
    return out


def plan(out):
    return [(x.seq_id, x.start_pos, len(x.token_ids), x.num_samples) for x in out.rows]


def test_chunked_prefill_under_one_budget_then_decode_first():
    s = make(budget=8)
    add(s, "a", 10)
    add(s, "b", 6, first_token=200)
    assert plan(run_step(s)) == [("a", 0, 8, 0)]
    assert plan(run_step(s)) == [("a", 8, 2, 1), ("b", 0, 6, 1)]
    add(s, "c", 20, first_token=300)
    # Running decodes come first, then c gets what is left of the budget.
    assert plan(run_step(s)) == [("a", 10, 1, 1), ("b", 6, 1, 1), ("c", 0, 6, 0)]
    assert s.seqs["a"].output_token_ids == [7, 7]
    assert [b.block_id for b in s.seqs["a"].blocks] == [0, 1, 2]
    assert [b.block_id for b in s.seqs["b"].blocks] == [3, 4]
    assert [b.block_id for b in s.seqs["c"].blocks] == [5, 6]


def test_budget_of_one_token_round_robins_nothing_twice():
    s = make(budget=1)
    add(s, "a", 2, max_tokens=2)
    outs = [plan(run_step(s)) for _ in range(3)]
    assert outs == [[("a", 0, 1, 0)], [("a", 1, 1, 1)], [("a", 2, 1, 1)]]
    assert s.seqs == {} and s.kv.num_free_blocks == 16
    assert s.groups["a"].is_finished and s.groups["a"].seqs[0].output_token_ids == [7, 7]


def test_max_num_seqs_and_finish_frees_blocks():
    s = make(budget=64, seqs=2)
    for i, rid in enumerate("abc"):
        add(s, rid, 3, max_tokens=1, first_token=100 * (i + 1))
    out = run_step(s)
    assert [x.seq_id for x in out.rows] == ["a", "b"]
    assert s.groups["a"].seqs[0].finish_reason == "length"
    assert s.kv.num_free_blocks == 16
    assert [x.seq_id for x in run_step(s).rows] == ["c"]


def test_bounded_waiting_queue_rejects_with_clear_error():
    s = make(max_waiting=2)
    add(s, "a", 3)
    add(s, "b", 3)
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        add(s, "c", 3)
    with pytest.raises(ValueError, match="already in use"):
        add(s, "a", 3)


def test_prompt_too_long_is_rejected():
    s = make(blocks=4, bs=4)  # 16 slots, so max_model_len is capped to 16
    assert s.max_model_len == 16
    with pytest.raises(ValueError, match="at most 15 prompt tokens"):
        add(s, "a", 16)


def test_priority_policy_orders_by_priority_then_arrival():
    s = make(budget=3, policy="priority")
    add(s, "late-low", 3, priority=5, arrival=1.0)
    add(s, "urgent", 3, priority=-1, arrival=2.0)
    add(s, "normal-early", 3, priority=0, arrival=0.5)
    assert [x.seq_id for x in run_step(s).rows] == ["urgent"]
    assert [x.seq_id for x in s.waiting] == ["normal-early", "late-low"]


def test_stop_conditions_eos_stop_token_and_min_tokens():
    s = make(budget=64)
    add(s, "eos", 3, max_tokens=8)
    add(s, "stopid", 3, max_tokens=8, first_token=200, stop_token_ids=[9])
    add(s, "ign", 3, max_tokens=2, first_token=300, ignore_eos=True)
    out = s.schedule()
    tokens = {"eos": EOS, "stopid": 9, "ign": EOS}
    s.update_from_output(out, {x.seq_id: RowResult([SampledToken(tokens[x.seq_id], 0.0)]) for x in out.rows})
    g = s.groups
    assert (g["eos"].seqs[0].finish_reason, g["eos"].seqs[0].stop_reason) == ("stop", None)
    assert (g["stopid"].seqs[0].finish_reason, g["stopid"].seqs[0].stop_reason) == ("stop", 9)
    assert g["ign"].seqs[0].finish_reason is None
    assert s.kv.num_free_blocks == 16 - 1


def test_preemption_swaps_to_cpu_and_resumes_exactly():
    # 4 GPU blocks of 2 tokens; two sequences of 3 prompt tokens each take 2 blocks.
    s = make(budget=16, blocks=4, bs=2, cpu=8)
    add(s, "a", 3, max_tokens=6)
    add(s, "b", 3, max_tokens=6, first_token=200)
    run_step(s)  # both prefilled, each holds 2 blocks, pool full
    assert [b.block_id for b in s.seqs["a"].blocks] == [0, 1]
    assert [b.block_id for b in s.seqs["b"].blocks] == [2, 3]
    assert plan(run_step(s)) == [("a", 3, 1, 1), ("b", 3, 1, 1)]  # position 3 still fits
    out = run_step(s)  # a needs a third block for position 4: b (the newest) is swapped out
    assert out.blocks_to_swap_out == [(2, 0), (3, 1)]
    assert plan(out) == [("a", 4, 1, 1)]
    assert s.seqs["b"].status.value == "swapped" and s.seqs["b"].swapped_cpu_blocks == [0, 1]
    assert s.num_preemptions_swap == 1
    assert [b.block_id for b in s.seqs["a"].blocks] == [0, 1, 3]
    # a reaches max_model_len (4 blocks x 2 = 8 tokens) two steps later; then b is swapped back
    # into the blocks a freed (its last block first) and continues at position 4.
    run_step(s)
    run_step(s)
    assert "a" not in s.seqs and s.groups["a"].seqs[0].finish_reason == "length"
    out = run_step(s)
    assert out.blocks_to_swap_in == [(0, 2), (1, 3)]
    assert plan(out) == [("b", 4, 1, 1)]
    assert s.seqs["b"].output_token_ids == [7, 7, 7]
    while s.seqs:
        run_step(s)
    assert s.kv.num_free_blocks == 4 and len(s.cpu_free) == 8


def test_preemption_recomputes_when_cpu_pool_is_too_small():
    s = make(budget=16, blocks=4, bs=2, cpu=1)
    add(s, "a", 3, max_tokens=6)
    add(s, "b", 3, max_tokens=6, first_token=200)
    run_step(s)
    run_step(s)
    out = run_step(s)
    assert out.blocks_to_swap_out == []
    assert s.num_preemptions_recompute == 1
    b = s.seqs["b"]
    assert b.status.value == "waiting" and b.num_computed_tokens == 0 and b.output_token_ids == [7, 7]
    while "a" in s.seqs:
        run_step(s)
    hits_before = s.kv.prefix_hits
    out = run_step(s)
    # a's growth evicted b's cached blocks, so b recomputes prompt + outputs in one chunk and
    # samples its third token.
    assert plan(out) == [("b", 0, 5, 1)]
    assert s.kv.prefix_hits == hits_before
    run_step(s)
    assert s.seqs["b"].output_token_ids == [7, 7, 7, 7]


def test_abort_frees_blocks_at_once():
    s = make()
    add(s, "a", 10)
    run_step(s)
    assert s.kv.num_free_blocks == 14
    s.abort("a")
    assert s.kv.num_free_blocks == 16
    assert s.groups["a"].seqs[0].finish_reason == "abort"
    assert s.schedule().is_empty


def test_n_greater_than_one_forks_after_prefill_sharing_blocks():
    s = make(budget=64, bs=4)
    add(s, "a", 6, max_tokens=3, n=3)
    out = run_step(s)
    assert plan(out) == [("a", 0, 6, 3)]
    group = s.groups["a"]
    assert [q.output_token_ids for q in group.seqs] == [[7], [8], [9]]
    assert [[b.block_id for b in q.blocks] for q in group.seqs] == [[0, 1], [0, 2], [0, 3]]
    out = run_step(s)
    assert out.blocks_to_copy == [(1, 2), (1, 3)]
    assert [x.seq_id for x in out.rows] == ["a", "a#1", "a#2"]
    while s.seqs:
        run_step(s)
    assert s.kv.num_free_blocks == 16

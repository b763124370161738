"""AsyncEngine: streaming to asyncio consumers, abort, back-pressure, failures never hang."""

from __future__ import annotations

import asyncio

import pytest
import torch
from model_utils import hf_greedy, stream_outputs
from test_engine import GREEDY, MAX_TOKENS, assert_all_free, make_prompts, tiny

from wllm.engine.async_engine import AsyncEngine, EngineDeadError
from wllm.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from wllm.engine.llm_engine import LLMEngine
from wllm.engine.request import QueueFullError
from wllm.outputs import CompletionDelta, RequestDelta
from wllm.sampling_params import SamplingParams


def async_engine(model, max_waiting=0, failures=3):
    config = EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=128, num_cpu_blocks=0),
                          scheduler=SchedulerConfig(max_num_batched_tokens=16, max_waiting=max_waiting))
    return AsyncEngine(LLMEngine(model, None, config), max_consecutive_failures=failures)


async def collect(engine, rid, prompt, params=GREEDY):
    return await stream_outputs(engine, prompt, params, rid)


def test_concurrent_streams_match_hf_and_are_cumulative(tmp_path_factory):
    torch.manual_seed(0)
    model, hf = tiny("llama", tmp_path_factory)
    prompts = make_prompts(6)
    engine = async_engine(model)

    async def main():
        return await asyncio.gather(*(collect(engine, f"r{i}", p) for i, p in enumerate(prompts)))

    try:
        results = asyncio.run(main())
        for prompt, outs in zip(prompts, results):
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
            assert outs[-1].outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS)
            lengths = [len(o.outputs[0].token_ids) for o in outs]
            assert lengths == sorted(lengths) and lengths[-1] == MAX_TOKENS
        stats = engine.stats()
        assert stats["healthy"] and stats["generation_tokens"] == 6 * MAX_TOKENS
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    finally:
        engine.shutdown()
    assert_all_free(engine.engine)


def test_consumer_that_stops_iterating_aborts_its_request(tmp_path_factory):
    model, _ = tiny("llama", tmp_path_factory)
    engine = async_engine(model)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        gen = engine.generate(make_prompts()[1], params, "long")
        async for _ in gen:
            break
        await gen.aclose()
        # A later request runs normally; by then the abort has been applied.
        outs = await collect(engine, "next", [5, 6, 7])
        await engine.abort("unknown-id")  # harmless
        return outs

    try:
        outs = asyncio.run(main())
        assert outs[-1].finished
        assert "long" not in engine.engine.scheduler.groups
    finally:
        engine.shutdown()
    assert_all_free(engine.engine)


def test_full_queue_and_bad_input_raise_from_generate(tmp_path_factory):
    model, _ = tiny("llama", tmp_path_factory)
    engine = async_engine(model, max_waiting=1)
    engine.engine.scheduler.config.max_num_seqs = 1

    async def main():
        first = asyncio.ensure_future(collect(engine, "a", [5, 6, 7]))
        second = asyncio.ensure_future(collect(engine, "b", [5, 6, 8]))
        third = asyncio.ensure_future(collect(engine, "c", [5, 6, 9]))
        results = await asyncio.gather(first, second, third, return_exceptions=True)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(engine, "d", [10**6])
        return results

    try:
        results = asyncio.run(main())
        errors = [r for r in results if isinstance(r, QueueFullError)]
        assert len(errors) >= 1  # at most one waits while one runs; the rest are turned away
        assert all(isinstance(r, QueueFullError) or r[-1].finished for r in results)
    finally:
        engine.shutdown()
    assert_all_free(engine.engine)


def test_failing_steps_fail_requests_then_mark_engine_unhealthy(tmp_path_factory):
    model, _ = tiny("llama", tmp_path_factory)
    engine = async_engine(model, failures=2)
    real_forward = model.forward

    def forward(input_ids, positions, ctx):
        if (input_ids == 299).any():
            raise RuntimeError("boom")
        return real_forward(input_ids, positions, ctx)

    model.forward = forward

    async def main():
        one = await collect(engine, "x1", [5, 299])
        assert one[-1].error == "RuntimeError: boom" and one[-1].outputs[0].finish_reason == "error"
        assert engine.is_healthy()
        ok = await collect(engine, "ok", [5, 6])
        assert ok[-1].error is None
        await collect(engine, "x2", [7, 299])
        two = await collect(engine, "x3", [8, 299])
        assert two[-1].error is not None
        return two

    try:
        asyncio.run(main())
        engine._thread.join(timeout=30)  # the loop ends itself after the second failure in a row
        assert not engine.is_healthy()

        async def after():
            with pytest.raises(EngineDeadError):
                await collect(engine, "late", [5, 6])

        asyncio.run(after())
    finally:
        del model.forward
        engine.shutdown()


def test_abort_frees_blocks_and_stats_show_it_while_idle(tmp_path_factory):
    model, _ = tiny("llama", tmp_path_factory)
    engine = async_engine(model)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        gen = engine.generate(make_prompts()[1], params, "long")
        first = await gen.__anext__()
        assert not first.finished
        running = engine.stats()["num_running"]
        await engine.abort("long")  # returns once the engine applied it; no later step runs
        return running, engine.stats()

    try:
        running, stats = asyncio.run(main())
        assert running == 1
        assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0
        assert "long" not in engine.engine.scheduler.groups
    finally:
        engine.shutdown()
    assert_all_free(engine.engine)


def test_a_slow_consumer_gets_what_it_missed_merged_not_a_backlog():
    """The engine thread publishes deltas faster than the consumer takes them: the consumer gets fewer,
    merged deltas that together say exactly what was published, the last one finished; an error is final."""
    import threading
    import time

    from wllm.engine.async_engine import _Stream

    def output(n, finished=False):  # the n-th token's delta
        return RequestDelta("r", [CompletionDelta(0, "x" if n % 3 else "yz", [n - 1])], finished=finished)

    async def main():
        stream = _Stream(asyncio.get_running_loop())

        def produce():
            for n in range(1, 2001):
                stream.put(output(n, finished=n == 2000))

        thread = threading.Thread(target=produce)
        thread.start()
        seen, ids, text = [], [], ""
        async for item in stream:
            ids += item.outputs[0].token_ids
            text += item.outputs[0].text
            seen.append(len(ids))
            time.sleep(0.0005)  # a consumer slower than the producer
            if item.finished:
                break
        thread.join()
        return seen, ids, text

    seen, ids, text = asyncio.run(main())
    assert seen[-1] == 2000 and seen == sorted(set(seen)) and len(seen) < 2000
    assert ids == list(range(2000)) and text == "".join("x" if n % 3 else "yz" for n in range(1, 2001))

    async def error_is_final():
        stream = _Stream(asyncio.get_running_loop())
        stream.put(RuntimeError("boom"))
        stream.put(output(1))
        async for item in stream:
            return item

    assert isinstance(asyncio.run(error_is_final()), RuntimeError)


def test_a_stream_interval_wakes_the_consumer_every_n_tokens():
    """With `interval` 3 a consumer that keeps up is woken for the first output, then each time 3 more
    tokens have come, and for the finished one; with 1, for every output. Errors always wake it."""
    from wllm.engine.async_engine import _Stream

    def output(n, finished=False, choices=1):  # the n-th token of each choice
        return RequestDelta("r", [CompletionDelta(i, "x", [n - 1]) for i in range(choices)], finished=finished)

    async def run(interval, last=10, error_at=None, choices=1, behind=0):
        """Outputs 1..last tokens (per choice); the consumer misses the wake-ups of the first `behind`."""
        stream = _Stream(asyncio.get_running_loop(), interval)
        seen = []
        tokens = [0]

        async def consume():
            async for item in stream:
                if isinstance(item, BaseException):
                    seen.append("error")
                    return
                tokens[0] += len(item.outputs[0].token_ids)
                seen.append(tokens[0])
                if item.finished:
                    return

        task = asyncio.create_task(consume())
        for n in range(1, last + 1):
            stream.put(RuntimeError("boom") if n == error_at else output(n, n == last, choices))
            if n > behind:
                for _ in range(5):  # the consumer takes each wake-up before the next output
                    await asyncio.sleep(0)
        await asyncio.wait_for(task, 10)
        return seen

    assert asyncio.run(run(3)) == [1, 4, 7, 10]
    assert asyncio.run(run(3, choices=2)) == [1, 4, 7, 10]  # tokens per choice, not summed over n
    # A consumer woken at 1 token but running only after the 4th reads 4; its next frame comes 4 tokens
    # after what it read (8), not 4 after the token it was woken for (5).
    assert asyncio.run(run(4, behind=3)) == [4, 8, 10]
    assert asyncio.run(run(4, last=6)) == [1, 5, 6]
    assert asyncio.run(run(1, last=5)) == [1, 2, 3, 4, 5]
    assert asyncio.run(run(3, error_at=3)) == [1, "error"]
    with pytest.raises(ValueError, match="stream_interval"):
        AsyncEngine(_IdleEngine(), stream_interval=0)


class _IdleEngine:
    """An `EngineCore` that never has work of its own."""

    num_failed_steps = 0
    tokenizer = None
    max_model_len = 16

    def stats(self):
        return {}

    def add_request(self, *args, **kwargs):
        pass

    def has_unfinished(self):
        return False

    def step_deltas(self):
        return []

    def abort_delta(self, request_id):
        return None

    def take_rejected(self):
        return []

    def is_alive(self):
        return True

    def close(self):
        pass


def test_a_step_wakes_each_event_loop_once_for_all_its_streams():
    """`_deliver` publishes a step's outputs and wakes every stream of one event loop with one loop callback
    (one self-pipe write), not one per stream; streams on another loop get their own, and every consumer
    still sees every output it waits for."""
    import threading

    from wllm.engine.async_engine import _Stream

    engine = AsyncEngine(_IdleEngine())
    loops = [asyncio.new_event_loop() for _ in range(2)]
    calls = []
    for loop in loops:
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda cb, *a, _real=real, _loop=loop: (calls.append((_loop, cb)), _real(cb, *a))[1]
    streams = {f"r{i}": _Stream(loops[i % 2]) for i in range(10)}
    engine._streams.update(streams)

    def outputs(n, finished):  # the n-th token's deltas
        return [RequestDelta(rid, [CompletionDelta(0, "", [7])], finished=finished) for rid in streams]

    async def consume(rid):
        seen, tokens = [], 0
        async for o in _until_finished(streams[rid]):
            tokens += len(o.outputs[0].token_ids)
            seen.append(tokens)
        return seen

    results = {}

    async def consume_all(rids):
        return await asyncio.gather(*(consume(r) for r in rids))

    def run(loop, rids):
        results.update(zip(rids, loop.run_until_complete(consume_all(rids))))

    threads = [threading.Thread(target=run, args=(loop, [r for i, r in enumerate(streams) if i % 2 == k]))
               for k, loop in enumerate(loops)]
    for t in threads:
        t.start()
    engine._deliver(outputs(1, False))
    wakes = [loop for loop, cb in calls if cb.__name__ == "_wake_all"]
    assert sorted(map(id, wakes)) == sorted(map(id, loops))  # one callback per loop for ten streams
    for t in threads:  # the consumers take the first output before the last one comes
        t.join(timeout=0.2)
    engine._deliver(outputs(2, True))
    for t in threads:
        t.join(timeout=10)
    assert len([cb for _, cb in calls if cb.__name__ == "_wake_all"]) <= 4 and not engine._streams
    assert all(seen[-1] == 2 for seen in results.values()) and len(results) == 10
    for loop in loops:
        loop.close()


async def _until_finished(stream):
    async for item in stream:
        yield item
        if item.finished:
            return


def test_a_client_loop_closed_while_its_request_waits_does_not_kill_the_engine():
    """Regression (found in review): the engine thread answers a queued `add` on the caller's event loop;
    if that loop has closed meanwhile (its `asyncio.run` ended), the engine thread must carry on, not die
    and mark the engine unhealthy for every other client."""
    import contextlib
    import threading
    import time

    class SlowAdd(_IdleEngine):
        def add_request(self, *args, **kwargs):
            time.sleep(0.3)  # the next client's add waits behind this one

    engine = AsyncEngine(SlowAdd())

    async def one(rid):
        async for _ in engine.generate([1], SamplingParams(), rid):
            pass

    async def short_lived():
        task = asyncio.ensure_future(one("b"))
        await asyncio.sleep(0.05)  # "b"'s add is queued behind "a"'s
        task.cancel()

    async def first_client():
        task = asyncio.ensure_future(one("a"))
        await asyncio.wait([task], timeout=1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    loop = asyncio.new_event_loop()
    first = threading.Thread(target=lambda: loop.run_until_complete(first_client()))
    first.start()
    time.sleep(0.05)  # "a"'s add runs on the engine thread now
    asyncio.run(short_lived())  # this loop is closed before the engine thread gets to "b"'s add
    time.sleep(0.6)
    first.join()
    loop.close()
    try:
        assert engine.is_healthy(), engine._dead
    finally:
        engine.shutdown()

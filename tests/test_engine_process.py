"""EngineProcess: the engine in a spawned child process behind AsyncEngine (`wllm serve --engine-process`).

The child runs the embedded SmolLM2-135M-Instruct on the CPU; its streams must equal an in-process engine's
(tokens, text, logprobs, n > 1, stop strings, prompt logprobs), refusals must reach the request as the
same errors, aborts must end the stream and free the child's blocks, and a dead child must fail every
request and make the engine unhealthy instead of hanging anyone.
"""

from __future__ import annotations

import asyncio
import random
import time

import msgspec
import pytest
from fake_engine import FloodEngine
from model_utils import stream_outputs

from wllm.engine.async_engine import AsyncEngine, EngineDeadError
from wllm.engine.engine_process import EngineProcess
from wllm.engine.llm_engine import LLMEngine
from wllm.model.default_model import default_model_path
from wllm.outputs import (
    CompletionOutput,
    DeltaEncoder,
    OutputAccumulator,
    RequestDelta,
    RequestMetrics,
    RequestOutput,
    StepLogprobs,
    TokenLogprob,
    merge_deltas,
)
from wllm.sampling_params import SamplingParams

KWARGS = {"device": "cpu", "max_model_len": 256, "kv_cache_memory": 64 << 20, "max_num_batched_tokens": 256,
          "block_size": 16}
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "Hello"]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12),
    SamplingParams(temperature=0, max_tokens=20, stop=[" the", "."], logprobs=2),
    SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10, logprobs=1),
    SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1, ignore_eos=True),
]


@pytest.fixture(scope="module")
def proc_engine():
    engine = AsyncEngine(EngineProcess(str(default_model_path()), KWARGS))
    engine.start()
    yield engine
    engine.shutdown(close_engine=True)


def _final(out: RequestOutput):
    return [(c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [(s.token_id, round(s.logprob, 4), [t.token_id for t in s.top])
                                              for s in c.logprobs])
            for c in out.outputs]


def test_streams_equal_the_in_process_engine(proc_engine):
    tok = proc_engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]

    async def run(engine):
        return await asyncio.gather(*(stream_outputs(engine, ids, params, f"r{i}")
                                      for i, (ids, params) in enumerate(zip(prompts, PARAMS))))

    got = asyncio.run(run(proc_engine))
    local = AsyncEngine(LLMEngine.from_pretrained(str(default_model_path()), **KWARGS))
    local.start()
    try:
        want = asyncio.run(run(local))
    finally:
        local.shutdown(close_engine=True)
    for g, w in zip(got, want):
        assert _final(g[-1]) == _final(w[-1])
        assert g[-1].finished and not any(o.finished for o in g[:-1])
        assert list(g[-1].prompt_token_ids) == list(w[-1].prompt_token_ids)
        assert g[-1].metrics is not None and g[-1].metrics.first_token_time is not None
        for a, b in zip(g, g[1:]):  # cumulative: each output extends the one before
            for ca, cb in zip(a.outputs, b.outputs):
                assert list(cb.token_ids[:len(ca.token_ids)]) == list(ca.token_ids)
    prompt_lps = got[3][-1].prompt_logprobs
    assert prompt_lps is not None and len(prompt_lps) == len(prompts[3])
    assert [p and p.token_id for p in prompt_lps] == [p and p.token_id for p in want[3][-1].prompt_logprobs]
    assert len(got[2][-1].outputs) == 2


def test_refused_requests_get_the_engines_errors(proc_engine):
    async def main():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await stream_outputs(proc_engine, [1, 10**9], SamplingParams(max_tokens=2), "bad-id")
        with pytest.raises(ValueError):
            await stream_outputs(proc_engine, [1] * 300, SamplingParams(max_tokens=2), "too-long")
        # The engine goes on serving.
        outs = await stream_outputs(proc_engine, [1, 2, 3], SamplingParams(temperature=0, max_tokens=3), "after")
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3

    asyncio.run(main())
    assert proc_engine.is_healthy()


def test_abort_ends_the_stream_and_frees_the_childs_blocks(proc_engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        seen = []
        async for out in proc_engine.generate([1, 2, 3, 4], params, "long"):
            seen.append(out)
            if len(seen) == 2:
                await proc_engine.abort("long")
        return seen

    seen = asyncio.run(main())
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in seen) < 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the child's answer to the abort carries its fresh stats
        s = proc_engine.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_cache_usage"] == 0:
            break
        time.sleep(0.05)
    s = proc_engine.stats()
    assert s["num_running"] == 0 and s["kv_cache_usage"] == 0

    async def stop_iterating():  # a consumer that stops iterating aborts its request too
        gen = proc_engine.generate([5, 6, 7], params, "dropped")
        await gen.__anext__()
        await gen.aclose()
        return await stream_outputs(proc_engine, [5, 6, 7], SamplingParams(temperature=0, max_tokens=2), "dropped")

    assert asyncio.run(stop_iterating())[-1].finished  # the id is free again


def test_a_dead_child_fails_every_request_and_the_engine():
    engine = AsyncEngine(EngineProcess(str(default_model_path()), KWARGS))
    engine.start()
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    try:
        async def main():
            outs = []
            async for out in engine.generate([1, 2, 3], params, "victim"):
                outs.append(out)
                if len(outs) == 2:
                    engine.engine._proc.kill()
            return outs

        outs = asyncio.run(asyncio.wait_for(main(), 60))
        assert outs[-1].finished and outs[-1].error and "engine process" in outs[-1].error
        assert not engine.is_healthy()
        with pytest.raises(EngineDeadError):
            asyncio.run(stream_outputs(engine, [1, 2], SamplingParams(max_tokens=2), "later"))
    finally:
        engine.shutdown(close_engine=True)


def test_a_load_error_reaches_the_caller(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(Exception) as info:
        EngineProcess(str(missing), {"device": "cpu"})
    assert str(missing.name) in str(info.value)


def _lp(token: int) -> StepLogprobs:
    return StepLogprobs(token_id=token, logprob=-0.5, rank=1, top=[TokenLogprob(token, -0.5)])


def test_deltas_rebuild_every_output():
    """Cumulative outputs -> DeltaEncoder -> msgpack (as over the pipe) -> OutputAccumulator equal themselves:
    tokens and logprobs growing, text growing (by nothing, or by a held-back stop string's release), choices
    that appear later, prompt logprobs in chunks, several requests interleaved; and merging any run of a
    request's consecutive deltas (a consumer that fell behind) says the same as the deltas one by one."""
    rng = random.Random(0)
    enc = DeltaEncoder()
    wire = msgspec.msgpack.Encoder()
    back_from_wire = msgspec.msgpack.Decoder(RequestDelta)
    dec: dict[str, OutputAccumulator] = {}
    merged: dict[str, OutputAccumulator] = {}
    unmerged: dict[str, list[RequestDelta]] = {}
    state: dict[str, dict] = {}
    for step in range(400):
        rid = f"q{rng.randrange(5)}"
        s = state.setdefault(rid, {"prompt": [rng.randrange(100) for _ in range(rng.randrange(1, 6))],
                                   "plp": [None], "choices": {}})
        if rng.random() < 0.3:
            s["plp"].extend(_lp(rng.randrange(50)) for _ in range(rng.randrange(3)))
        for i in range(rng.randrange(1, 3)):
            c = s["choices"].setdefault(i, {"ids": [], "lps": [], "text": ""})
            for _ in range(rng.randrange(3)):
                t = rng.randrange(100)
                c["ids"].append(t)
                c["lps"].append(_lp(t))
            c["text"] += "".join(rng.choice("ab c\u00e9") for _ in range(rng.randrange(4)))
        finished = rng.random() < 0.1
        outs = [CompletionOutput(index=i, text=c["text"], token_ids=list(c["ids"]), logprobs=list(c["lps"]),
                                 cumulative_logprob=-1.0 * len(c["ids"]),
                                 finish_reason="length" if finished else None)
                for i, c in sorted(s["choices"].items())]
        out = RequestOutput(request_id=rid, prompt_token_ids=s["prompt"], outputs=outs, finished=finished,
                            num_cached_tokens=step % 7, prompt_logprobs=list(s["plp"]),
                            metrics=RequestMetrics(arrival_time=float(step)))
        if rid not in dec:
            dec[rid] = OutputAccumulator(rid, s["prompt"])
            merged[rid] = OutputAccumulator(rid, s["prompt"])
            unmerged[rid] = []
        delta = back_from_wire.decode(wire.encode(enc.encode(out)))
        dec[rid].add(delta)
        unmerged[rid].append(delta)
        if finished or rng.random() < 0.4:
            merged[rid].add(merge_deltas(unmerged[rid]))
            unmerged[rid] = []
        for acc in (dec[rid], merged[rid]) if not unmerged[rid] else (dec[rid],):
            back = acc.output()
            assert back.request_id == rid and back.finished == finished
            assert list(back.prompt_token_ids) == s["prompt"] and list(back.prompt_logprobs) == s["plp"]
            assert back.num_cached_tokens == step % 7 and back.metrics == out.metrics
            for b, o in zip(back.outputs, outs, strict=True):
                assert (b.index, b.text, list(b.token_ids), list(b.logprobs), b.cumulative_logprob,
                        b.finish_reason) == (o.index, o.text, o.token_ids, o.logprobs, o.cumulative_logprob,
                                             o.finish_reason)
        if finished:
            del state[rid], dec[rid], merged[rid], unmerged[rid]
    assert set(enc._sent) == set(state) == set(dec)


def test_a_burst_of_long_prompts_while_streaming(proc_engine):
    """A burst of requests arrives while another streams: commands and results cross in both directions at
    once, and every request comes back whole (its prompt echoed once, in its first output)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 40000) for _ in range(120)] for _ in range(64)]

    async def main():
        streaming = asyncio.ensure_future(
            stream_outputs(proc_engine, [1, 2, 3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), "bg"))
        await asyncio.sleep(0.2)
        outs = await asyncio.gather(*(stream_outputs(proc_engine, p, SamplingParams(temperature=0, max_tokens=2),
                                              f"burst{i}") for i, p in enumerate(prompts)))
        return outs, await streaming

    outs, bg = asyncio.run(asyncio.wait_for(main(), 300))
    assert all(o[-1].finished and len(o[-1].outputs[0].token_ids) == 2 for o in outs)
    assert len(bg[-1].outputs[0].token_ids) == 40


def _flood_engine(**kwargs) -> AsyncEngine:
    engine = AsyncEngine(EngineProcess("flood", kwargs, engine_factory=FloodEngine.create))
    engine.start()
    return engine


def test_commands_and_results_never_wait_on_each_other():
    """Megabytes of prompts go to the child while it sends them back in its first outputs (as prompt
    logprobs), far more than a pipe holds either way. A parent thread that sent commands and read results in
    turn deadlocked here (each side blocked sending into a full pipe, the other not reading), as `wllm serve
    --engine-process` once did under many clients; the sender thread keeps the reader reading."""
    engine = _flood_engine(step_delay=0.002)
    prompts = [list(range(i, i + 4000)) for i in range(200)]

    async def main():
        params = SamplingParams(max_tokens=3, prompt_logprobs=0)
        return await asyncio.gather(*(stream_outputs(engine, p, params, f"f{i}") for i, p in enumerate(prompts)))

    try:
        outs = asyncio.run(asyncio.wait_for(main(), 60))
    except asyncio.TimeoutError:
        engine.engine._proc.kill()  # unblocks a parent stuck sending: the test fails instead of hanging
        raise
    finally:
        engine.shutdown(close_engine=True)
    assert [[lp.token_id for lp in o[-1].prompt_logprobs[1:]] for o in outs] == [p[1:] for p in prompts]
    assert all(o[-1].outputs[0].token_ids == [7, 8, 9] and o[-1].outputs[0].text == "ttt" for o in outs)


def test_a_child_that_dies_while_idle_makes_the_engine_unhealthy():
    engine = _flood_engine()
    try:
        assert asyncio.run(stream_outputs(engine, [1], SamplingParams(max_tokens=2), "a"))[-1].finished
        assert engine.is_healthy()
        engine.engine._proc.kill()
        engine.engine._proc.join(10)
        assert not engine.is_healthy()  # /health answers 503 without waiting for a request
        with pytest.raises(EngineDeadError, match="process exited"):
            asyncio.run(stream_outputs(engine, [1], SamplingParams(max_tokens=2), "b"))
    finally:
        engine.shutdown(close_engine=True)


def test_a_child_whose_step_raises_fails_the_engine():
    engine = _flood_engine(fail_at_step=3)
    try:
        outs = asyncio.run(asyncio.wait_for(stream_outputs(engine, [1, 2], SamplingParams(max_tokens=50), "x"), 60))
        assert outs[-1].finished and "the stub engine broke" in (outs[-1].error or "")
        assert not engine.is_healthy()
    finally:
        engine.shutdown(close_engine=True)
    assert not engine.engine._proc.is_alive()


def test_a_factory_error_reaches_the_caller():
    with pytest.raises(ValueError, match="only serves 'flood'"):
        EngineProcess("other", engine_factory=FloodEngine.create)


def test_an_id_reused_right_after_its_abort_gets_only_its_own_outputs():
    """The child sends a step's outputs before it sees an abort; a new request under the aborted id, added
    meanwhile, must not receive the old request's tokens."""
    engine = _flood_engine()
    try:
        async def main():
            results = []
            for round_ in range(300):
                old = [100000 + round_] * 5
                tokens = 0
                async for out in engine.generate(old, SamplingParams(max_tokens=1000), "same"):
                    tokens += len(out.outputs[0].token_ids)
                    if tokens >= 2:
                        await engine.abort("same")
                new = [200000 + round_] * 3
                results.append([d async for d in engine.generate(new, SamplingParams(max_tokens=3), "same")])
            return results

        for deltas in asyncio.run(asyncio.wait_for(main(), 60)):
            assert [t for d in deltas for t in d.outputs[0].token_ids] == [7, 8, 9]
            assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    finally:
        engine.shutdown(close_engine=True)


def test_every_message_crosses_as_a_typed_struct():
    """Commands and replies round-trip through msgpack as the tagged Structs they are; errors keep the class
    the server maps to a status (ValueError 400, QueueFullError 503) and their message."""
    from wllm.engine.engine_process import (
        Aborted,
        AbortRequest,
        AddRequest,
        Command,
        EngineFailed,
        EngineProcessError,
        Rejected,
        RemoteError,
        Reply,
        Shutdown,
        StepOutputs,
    )
    from wllm.engine.request import QueueFullError
    from wllm.outputs import CompletionDelta

    enc = msgspec.msgpack.Encoder()
    commands = [AddRequest("a#0", [1, 2], SamplingParams(n=2, stop=["x"], logit_bias={5: -1.0}), 3, "salt", 1.5),
                AbortRequest("a#0"), Shutdown()]
    assert [msgspec.msgpack.decode(enc.encode(c), type=Command) for c in commands] == commands
    delta = RequestDelta("a#0", [CompletionDelta(0, "hi", [4], [_lp(4)], -0.5, "stop", "x")], True, 2,
                         [None, _lp(2)], RequestMetrics(arrival_time=1.0, first_token_time=2.0))
    replies = [StepOutputs([delta], {"num_running": 1, "kv_cache_usage": 0.5}, 0), Aborted("a#0", {}),
               Rejected("a#0", RemoteError.of(ValueError("bad")), {}), EngineFailed(RemoteError.of(KeyError("k")))]
    assert [msgspec.msgpack.decode(enc.encode(r), type=Reply) for r in replies] == replies
    errors = [RemoteError.of(e).exception() for e in (ValueError("v"), QueueFullError("q"), OSError("o"))]
    assert [(type(e), str(e)) for e in errors] == [(ValueError, "v"), (QueueFullError, "q"), (EngineProcessError, "o")]


def test_a_command_msgpack_cannot_carry_fails_alone():
    """A prompt id past 64 bits cannot be encoded for the pipe: that request is refused as bad input (a
    ValueError, a 400 over HTTP), and the commands after it still reach the child."""
    engine = _flood_engine()
    try:
        with pytest.raises(ValueError, match="cannot be sent to the engine process"):
            engine.engine.add_request("bad", [2**65], SamplingParams(max_tokens=2))

        async def main():
            return await asyncio.wait_for(stream_outputs(engine, [1, 2, 3], SamplingParams(max_tokens=3), "good"), 60)

        outs = asyncio.run(main())
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == [7, 8, 9]
    finally:
        engine.shutdown(close_engine=True)

"""The engine process on CUDA (`wllm serve`'s default there): a child with CUDA graphs streams what an
in-process engine of the same weights gives."""

from __future__ import annotations

import asyncio

import pytest
from model_utils import stream_outputs

from wllm.engine.async_engine import AsyncEngine
from wllm.engine.engine_process import EngineProcess
from wllm.engine.llm_engine import LLMEngine
from wllm.sampling_params import SamplingParams

pytestmark = pytest.mark.cuda

KWARGS = {"load_format": "dummy", "dtype": "bfloat16", "device": "cuda", "gpu_memory_utilization": 0.2,
          "max_model_len": 1024, "seed": 0}
PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=11, n=2, max_tokens=17, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]


def _streams(engine: AsyncEngine, prompts: list[list[int]]) -> list[list]:
    """Each request alone, one after another: the same batches in both engines, so bf16 results are the
    same bit for bit (concurrent requests could meet in different steps in the two)."""
    async def run():
        return [await stream_outputs(engine, ids, params, f"r{i}")
                for i, (ids, params) in enumerate(zip(prompts, PARAMS))]

    engine.start()
    try:
        return asyncio.run(run())
    finally:
        engine.shutdown(close_engine=True)


def test_the_cuda_engine_process_streams_what_the_in_process_engine_gives():
    child = EngineProcess("qwen2.5-0.5b", KWARGS)
    tok = child.tokenizer
    prompts = [tok.encode(p) for p in ("The capital of France is", "Once upon a time, in a land far away,",
                                       "def fib(n):")]
    got = _streams(AsyncEngine(child), prompts)
    assert not child.is_alive()  # shutdown(close_engine=True) stopped the child
    want = _streams(AsyncEngine(LLMEngine.from_pretrained("qwen2.5-0.5b", **KWARGS)), prompts)
    for g, w in zip(got, want):
        final_g, final_w = g[-1], w[-1]
        assert final_g.finished and not any(o.finished for o in g[:-1])
        assert [list(c.token_ids) for c in final_g.outputs] == [list(c.token_ids) for c in final_w.outputs]
        assert [c.text for c in final_g.outputs] == [c.text for c in final_w.outputs]
        for cg, cw in zip(final_g.outputs, final_w.outputs):
            assert (cg.logprobs is None) == (cw.logprobs is None)
            if cg.logprobs is not None:
                assert [s.token_id for s in cg.logprobs] == [s.token_id for s in cw.logprobs]
                assert [s.logprob for s in cg.logprobs] == pytest.approx([s.logprob for s in cw.logprobs], abs=1e-3)

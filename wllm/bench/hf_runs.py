"""The HF transformers baseline, measured in the same process on the same device.

The model is built from the shape's config with random weights (`from_config`, no download),
directly on the device so an 8B model is not initialised on a slow host CPU first. Latency and
prefill use eager `generate` at batch 1; throughput uses HF's continuous batching
(`generate_batch`, attn_implementation "paged|sdpa") under `torch.no_grad()`: its worker thread
writes to tensors created outside, which `torch.inference_mode()` forbids.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch

from wllm.bench.report import BenchError
from wllm.bench.shapes import Shape
from wllm.bench.wllm_runs import PromptSource, synchronize

HF_MISSING = "the HF baseline needs transformers (pip install transformers), or pass --skip-hf"


def require_transformers() -> Any:
    """The transformers module, or BenchError saying how to get it or skip the baseline."""
    try:
        import transformers
    except ImportError:
        raise BenchError(HF_MISSING) from None
    return transformers


def build_hf_model(shape: Shape, device: torch.device, dtype: torch.dtype, attn_implementation: str) -> Any:
    """An HF model of the shape's architecture with transformers' own random initialisation."""
    tf = require_transformers()
    cfg = dict(shape.hf_config)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise ValueError(f"{shape.source}: the config has no model_type, so HF cannot build the baseline")
    cfg.pop("torch_dtype", None)  # the dtype is chosen here
    config = tf.AutoConfig.for_model(model_type, **cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # "paged|" prefix deprecation notice
        with torch.device(device):
            try:
                model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                            attn_implementation=attn_implementation)
            except ValueError:
                # Releases that dropped the "paged|" spelling page the plain backend themselves.
                if not attn_implementation.startswith("paged|"):
                    raise
                model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                            attn_implementation=attn_implementation[6:])
    return model.eval()


def _hf_generate_call(model: Any, device: torch.device) -> Any:
    """`call(prompt_batch, max_new_tokens) -> seconds` with eager generate, EOS suppressed."""

    @torch.no_grad()
    def call(batch: list[list[int]], max_new_tokens: int) -> float:
        ids = torch.tensor(batch, device=device)
        mask = torch.ones_like(ids)
        synchronize(device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        synchronize(device)
        elapsed = time.perf_counter() - start
        if out.shape[1] != ids.shape[1] + max_new_tokens:
            raise BenchError(f"HF generate returned {out.shape[1] - ids.shape[1]} of {max_new_tokens} tokens")
        return elapsed

    return call


def hf_latency(model: Any, device: torch.device, prompts: PromptSource, prompt_len: int, output_len: int,
               runs: int, warmup: int) -> Any:
    """Batch-1 eager generate timings (see wllm_runs.latency_timing)."""
    from wllm.bench.wllm_runs import latency_timing

    return latency_timing(_hf_generate_call(model, device), prompts, prompt_len, output_len, runs, warmup)


def hf_prefill(model: Any, device: torch.device, prompts: PromptSource, prompt_len: int, runs: int,
               warmup: int) -> list[float]:
    """Seconds per eager generate call with max_new_tokens=1 on one prompt."""
    call = _hf_generate_call(model, device)
    for _ in range(warmup):
        call(prompts.take(1, prompt_len), 1)
    return [call(prompts.take(1, prompt_len), 1) for _ in range(runs)]


def hf_throughput(model: Any, prompts: PromptSource, num_requests: int, prompt_len: int, output_len: int,
                  warmup: int) -> tuple[float, float]:
    """(processing seconds, wall seconds) of one `generate_batch` call over all requests, EOS disabled.

    generate_batch sizes its paged cache and captures its CUDA graphs inside the call, before
    the first request is queued; wLLM does both when the engine is built, outside its timing.
    So the processing time runs from the first request's creation to the last one's end (HF's
    own perf_counter stamps); the wall time with that set-up is returned as well.
    """
    tf = require_transformers()

    def run(count: int, max_new_tokens: int) -> tuple[float, float]:
        gen_cfg = tf.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1,
                                      pad_token_id=0)
        batch = prompts.take(count, prompt_len)
        device = next(model.parameters()).device
        with torch.no_grad():
            synchronize(device)
            start = time.perf_counter()
            outs = model.generate_batch(batch, generation_config=gen_cfg)
            synchronize(device)
            wall = time.perf_counter() - start
        results = list(outs.values())
        bad = [o for o in results if o.error is not None or len(o.generated_tokens) != max_new_tokens]
        if len(results) != count or bad:
            detail = bad[0].error if bad else f"{len(results)} of {count} results"
            raise BenchError(f"HF generate_batch did not finish every request: {detail}")
        first = min(o.created_time for o in results)
        last = max(o.lifespan[1] for o in results)
        processing = last - first if 0 < last - first <= wall else wall
        return processing, wall

    for _ in range(warmup):
        run(min(num_requests, 8), min(output_len, 4))
    return run(num_requests, output_len)

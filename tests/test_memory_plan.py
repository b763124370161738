"""The memory planner: what a model needs before its weights are loaded, and the refusal's numbers."""

from __future__ import annotations

import pytest
import torch

from wllm.engine.memory_plan import (
    GRAPH_RESERVE,
    InsufficientMemoryError,
    activation_bytes,
    budget_from,
    kv_bytes_per_token,
    plan_for,
)
from wllm.model.loader.dummy import dummy_config
from wllm.model.loader.model_loader import _model_config, build_model

GiB = 1 << 30


def _meta_plan(shape: str, dtype: torch.dtype = torch.bfloat16, **kw: int):
    config = _model_config(dummy_config(shape), shape)
    with torch.device("meta"):
        model = build_model(config, "meta", dtype)
    args = dict(block_size=16, max_num_batched_tokens=8192, max_num_seqs=256)
    args.update(kw)
    return config, plan_for(model, config, dtype, name=shape, graphs=True, **args)


def test_weights_and_kv_of_the_8b_shape() -> None:
    config, plan = _meta_plan("llama-3.1-8b")
    # Llama 3.1 8B has 8,030,261,248 parameters; 2 bytes each in bf16.
    assert plan.weights == 8_030_261_248 * 2
    # 32 layers x 8 KV heads x 128 x (K and V) x 2 bytes = 128 KiB per token.
    assert plan.kv_per_token == kv_bytes_per_token(config, torch.bfloat16) == 128 << 10
    assert plan.activations == activation_bytes(config, torch.bfloat16, 8192, 256) + GRAPH_RESERVE
    assert plan.kv_tokens_bytes(4096) == 4096 * (128 << 10)
    assert plan.kv_tokens_bytes(4097) == 4112 * (128 << 10)  # whole blocks


def test_a_12_gib_card_refuses_the_dense_8b_with_the_numbers() -> None:
    _, plan = _meta_plan("llama-3.1-8b")
    budget = budget_from(total=141 * GiB, free=140 * GiB, utilization=0.9, limit=12 * GiB, device="cuda:0")
    assert budget.bytes == int(12 * GiB * 0.9) - GiB
    with pytest.raises(InsufficientMemoryError) as exc:
        plan.check(budget, 4096)
    msg = str(exc.value)
    assert "14.96 GiB of weights" in msg and "0.50 GiB of KV cache for one 4096-token sequence" in msg
    assert "9.80 GiB is available on cuda:0 (--gpu-memory-limit 12.00 GiB x utilization 0.9" in msg
    assert "1.00 GiB used by other processes" in msg
    assert "does not fit even with a short context" in msg


def test_a_context_that_does_not_fit_names_one_that_does() -> None:
    _, plan = _meta_plan("llama-3.2-1b")
    budget = budget_from(total=6 * GiB, free=6 * GiB, utilization=1.0, limit=None, device="cuda:0")
    plan.check(budget, 4096)  # fits
    with pytest.raises(InsufficientMemoryError, match=r"At --max-model-len (\d+) it fits") as exc:
        plan.check(budget, 131072)
    suggested = int(str(exc.value).rsplit("--max-model-len ", 1)[1].split()[0])
    assert suggested % 256 == 0 and suggested < 131072
    plan.check(budget, suggested)  # the suggestion really fits
    with pytest.raises(InsufficientMemoryError):
        plan.check(budget, suggested + 256 * 64)


def test_an_asked_for_context_the_cache_cannot_hold_is_refused_on_the_cpu() -> None:
    from wllm import LLM

    with pytest.raises(InsufficientMemoryError, match=r"max_model_len 4096 needs 256 KV-cache blocks.*"
                       r"from kv_cache_memory\); at max_model_len \d+ it fits"):
        LLM("smollm2-135m", load_format="dummy", device="cpu", dtype="float32", max_model_len=4096,
            kv_cache_memory=16 << 20)


def test_a_default_context_is_capped_to_the_cache(caplog: pytest.LogCaptureFixture) -> None:
    from wllm import LLM

    llm = LLM("smollm2-135m", load_format="dummy", device="cpu", dtype="float32", kv_cache_memory=16 << 20)
    try:
        assert llm.engine.max_model_len < 8192
        assert "not the model's 8192" in caplog.text
    finally:
        llm.close()


def test_the_loader_check_on_cuda_uses_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pre-allocation check LLMEngine.from_pretrained hands the loader on CUDA (the card faked)."""
    from types import SimpleNamespace

    from wllm.engine.config import engine_config_from_kwargs
    from wllm.engine.memory_plan import loader_check as _gpu_memory_check

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (140 * GiB, 141 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(
        multi_processor_count=132))
    config, _ = _meta_plan("llama-3.1-8b")
    with torch.device("meta"):
        model = build_model(config, "meta", torch.bfloat16)
    check = _gpu_memory_check(engine_config_from_kwargs(gpu_memory_limit=12 * GiB), torch.device("cuda", 0))
    with pytest.raises(InsufficientMemoryError, match="14.96 GiB of weights.*--gpu-memory-limit 12.00 GiB"):
        check(model, config, torch.bfloat16)
    # The whole card: fits, including the 8192-token default step and one 1024-token sequence.
    _gpu_memory_check(engine_config_from_kwargs(), torch.device("cuda", 0))(model, config, torch.bfloat16)
    # An asked-for context is checked as asked.
    big = _gpu_memory_check(engine_config_from_kwargs(gpu_memory_limit=24 * GiB, max_model_len=131072),
                            torch.device("cuda", 0))
    with pytest.raises(InsufficientMemoryError, match=r"131072-token sequence.*At --max-model-len \d+ it fits"):
        big(model, config, torch.bfloat16)


@pytest.mark.parametrize("text,value", [("12GiB", 12 * GiB), ("12G", 12 * GiB), ("12gb", 12 * 10**9),
                                        ("512MiB", 512 << 20), ("1.5GiB", 3 * GiB // 2), ("4096", 4096)])
def test_sizes_on_the_command_line(text: str, value: int) -> None:
    from wllm.entrypoints.serve_cli import parse_size

    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "12XB", "-1G", "G", "0"])
def test_bad_sizes_name_the_format(text: str) -> None:
    import argparse

    from wllm.entrypoints.serve_cli import parse_size

    with pytest.raises(argparse.ArgumentTypeError, match="expected a size such as 12GiB"):
        parse_size(text)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_limit_on_the_card_shrinks_the_kv_cache_and_refuses_what_does_not_fit() -> None:
    from wllm import LLM
    from wllm.model.loader import ModelLoadError

    free = LLM("qwen2.5-0.5b", load_format="dummy", max_model_len=2048, gpu_memory_utilization=0.5)
    blocks_free = free.engine.worker.num_gpu_blocks
    free.close()
    capped = LLM("qwen2.5-0.5b", load_format="dummy", max_model_len=2048, gpu_memory_limit=6 * GiB,
                 gpu_memory_utilization=0.9)
    blocks_capped = capped.engine.worker.num_gpu_blocks
    capped.close()
    assert 0 < blocks_capped < blocks_free
    with pytest.raises(ModelLoadError, match="GiB of weights.*--gpu-memory-limit 0.50 GiB"):
        LLM("llama-3.1-8b", load_format="dummy", gpu_memory_limit=GiB // 2)


def test_a_second_model_counts_what_the_first_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several models in one server load one after another: what the first holds is not the second's."""
    from wllm.engine.memory_plan import gpu_budget

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (25 * GiB, 141 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 115 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 115 * GiB)
    budget = gpu_budget(torch.device("cuda", 0), 0.9, None)
    assert budget.bytes == int(141 * GiB * 0.9) - GiB - 115 * GiB
    assert "115.00 GiB held by the models loaded before" in budget.describe()
    _, plan = _meta_plan("llama-3.1-8b")
    with pytest.raises(InsufficientMemoryError, match="held by the models loaded before"):
        plan.check(budget, 4096)

"""Every architecture against HF transformers: tiny random models saved with save_pretrained,
loaded by wLLM's loader; float32 logits and greedy continuations must match."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from model_utils import TINY_MODELS, batch_logit_diff, check_greedy, one_thread, prompts, tiny_hf_bert, tiny_hf_model

from wllm.model.contiguous_attention import ContiguousAttention
from wllm.model.loader import load_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_architecture_matches_hf(name: str, tmp_path: Path) -> None:
    hf = tiny_hf_model(name)
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float32")
    assert loaded.config.architecture == hf.config.architectures[0]
    assert loaded.load_format == "safetensors" and loaded.tokenizer_path == tmp_path
    seqs = prompts((20, 13))
    assert batch_logit_diff(loaded.model, hf, seqs) < 1e-4
    check_greedy(loaded.model, hf, seqs[1], 32)


def test_gemma2_sliding_window_and_softcap_are_active(tmp_path: Path) -> None:
    # Guard against a test that passes because the features never kick in: switching the window
    # or the soft-caps off in our model must change the logits by far more than the tolerance.
    hf = tiny_hf_model("gemma2")
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype="float32").model
    seqs = prompts((24,))
    assert batch_logit_diff(model, hf, seqs) < 1e-4
    layer0 = model.model.layers[0].self_attn
    assert layer0.sliding_window == 8 and model.model.layers[1].self_attn.sliding_window is None
    layer0.sliding_window = None
    assert batch_logit_diff(model, hf, seqs) > 1e-3
    layer0.sliding_window = 8
    model.config.final_logit_softcapping = None
    assert batch_logit_diff(model, hf, seqs) > 1e-3


def test_llama31_rope_scaling_is_active(tmp_path: Path) -> None:
    hf = tiny_hf_model("llama3.1")
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float32")
    assert loaded.config.rope_scaling and loaded.config.rope_scaling["rope_type"] == "llama3"
    seqs = prompts((40,))
    assert batch_logit_diff(loaded.model, hf, seqs) < 1e-4
    # Without the scaling the same weights give different logits (the rope bands matter).
    loaded.model.rotary._config.rope_scaling = None
    loaded.model.rotary._cache = None
    assert batch_logit_diff(loaded.model, hf, seqs) > 1e-3


def test_sharded_safetensors_folder(tmp_path: Path) -> None:
    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_model(tmp_path, dtype="float32")
    assert batch_logit_diff(loaded.model, hf, prompts((9, 17))) < 1e-4


@torch.no_grad()
def test_bert_matches_hf(tmp_path: Path) -> None:
    hf = tiny_hf_bert()
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float32")
    model = loaded.model
    seqs = prompts((11, 6))
    ctx = ContiguousAttention()
    ctx.prepare([0, 1], [len(s) for s in seqs])
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    types = torch.cat(
        [torch.zeros(6, dtype=torch.long), torch.ones(5, dtype=torch.long), torch.zeros(6, dtype=torch.long)]
    )
    hidden = model(ids, pos, ctx, token_type_ids=types)
    ref0 = hf(torch.tensor([seqs[0]]), token_type_ids=types[None, :11]).last_hidden_state[0]
    ref1 = hf(torch.tensor([seqs[1]])).last_hidden_state[0]
    assert (hidden[:11] - ref0).abs().max().item() < 1e-4
    assert (hidden[11:] - ref1).abs().max().item() < 1e-4
    with pytest.raises(NotImplementedError, match="no language-model head"):
        model.compute_logits(hidden)


def test_bfloat16_load_is_close(tmp_path: Path) -> None:
    hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    # bf16 keeps ~3 significant digits; logits of this tiny model are O(1).
    assert batch_logit_diff(loaded.model, hf, prompts((10,))) < 0.1


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_architecture_on_cuda_kernels(name: str, tmp_path: Path) -> None:
    # The CUDA path (RMSNorm and rotary kernels on strided q/k views) against HF on the CPU.
    hf = tiny_hf_model(name)
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float32", device="cuda")
    assert loaded.device.type == "cuda"
    seqs = prompts((20, 13))
    assert batch_logit_diff(_CpuLogits(loaded.model), hf, seqs) < 1e-3
    check_greedy(_CpuLogits(loaded.model), hf, seqs[1], 32)


class _CpuLogits(torch.nn.Module):
    """Runs a CUDA model on CPU token tensors and returns CPU logits, for the CPU-side helpers."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = model
        self.dev = next(model.parameters()).device

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, ctx: ContiguousAttention) -> torch.Tensor:
        return self.inner(ids.to(self.dev), positions.to(self.dev), ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden).cpu()

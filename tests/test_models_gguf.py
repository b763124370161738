"""Every architecture through GGUF: tiny random HF models written as GGUF (F32, and Q8_0
compared against HF run with the same quantize-dequantize round trip), loaded by wLLM."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers as tf
from gguf_writer import GGMLType, write_gguf
from model_utils import TINY_MODELS, batch_logit_diff, check_greedy, one_thread, prompts, tiny_hf_bert, tiny_hf_model
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from wllm.model.contiguous_attention import ContiguousAttention
from wllm.model.loader import load_model

# llama.cpp's llama architecture has no sliding-window key, so a windowed Mistral cannot round-trip
# through GGUF; Mistral without a window is the llama case.
GGUF_MODELS = sorted(n for n in TINY_MODELS if n != "mistral")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def gguf_hf_config(hf: tf.PreTrainedModel) -> dict[str, Any]:
    """The model's config in the flat (pre-v5) form llama.cpp's converter reads, plus the
    Llama 3.1 per-frequency factors the converter stores as `rope_freqs`."""
    cfg = hf.config.to_dict()
    rope = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rope.get("rope_theta", 10000.0)
    cfg["partial_rotary_factor"] = rope.get("partial_rotary_factor", 1.0)
    if rope.get("rope_type") == "llama3":
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
        plain = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, scaled.numel() * 2, 2).float() / (scaled.numel() * 2)))
        cfg["rope_freq_factors"] = (plain / scaled).tolist()
    return cfg


def extra_metadata(name: str) -> dict[str, Any]:
    if name == "gemma2":
        # GGUF has no query_pre_attn_scalar; llama.cpp's converter writes it as attention.scale.
        return {"gemma2.attention.scale": 24**-0.5}
    return {}


@torch.no_grad()
def round_trip(hf: tf.PreTrainedModel, qtype: GGMLType) -> tf.PreTrainedModel:
    """A copy of `hf` whose 2-D weights went through gguf.quants quantize + dequantize."""
    out = copy.deepcopy(hf)
    for _, p in out.named_parameters():
        if p.ndim >= 2:
            q = gguf.quants.quantize(p.detach().numpy().astype(np.float32), qtype)
            p.copy_(torch.from_numpy(gguf.quants.dequantize(q, qtype).reshape(p.shape)))
    return out


@pytest.mark.parametrize("qtype", [GGMLType.F32, GGMLType.Q8_0], ids=["F32", "Q8_0"])
@pytest.mark.parametrize("name", GGUF_MODELS)
def test_gguf_matches_hf(name: str, qtype: GGMLType, tmp_path: Path) -> None:
    hf = tiny_hf_model(name)
    [path] = write_gguf(
        tmp_path / f"{name}.gguf", gguf_hf_config(hf), hf.state_dict(), qtype, extra_metadata=extra_metadata(name)
    )
    loaded = load_model(path, dtype="float32")
    assert loaded.load_format == "gguf" and loaded.tokenizer_path == path
    assert loaded.config.architecture == hf.config.architectures[0]
    oracle = hf if qtype == GGMLType.F32 else round_trip(hf, qtype)
    seqs = prompts((20, 13))
    assert batch_logit_diff(loaded.model, oracle, seqs) < 1e-4
    check_greedy(loaded.model, oracle, seqs[0], 32)
    if qtype != GGMLType.F32:
        # The quantization is real: the unquantized HF model gives different logits.
        assert batch_logit_diff(loaded.model, hf, seqs) > 1e-4


def test_split_gguf(tmp_path: Path) -> None:
    hf = tiny_hf_model("qwen3")
    paths = write_gguf(tmp_path / "split.gguf", gguf_hf_config(hf), hf.state_dict(), GGMLType.F16, split_max_tensors=6)
    assert len(paths) > 2
    # Any part's path or the folder loads the whole set.
    for source in (paths[0], tmp_path):
        loaded = load_model(source, dtype="float32")
        assert loaded.path == paths[0]
        # F16 storage: compare with HF at the same precision of weights.
        oracle = copy.deepcopy(hf)
        with torch.no_grad():
            for _, p in oracle.named_parameters():
                if p.ndim >= 2:
                    p.copy_(p.half().float())
        assert batch_logit_diff(loaded.model, oracle, prompts((12,))) < 1e-4


@torch.no_grad()
def test_bert_gguf(tmp_path: Path) -> None:
    hf = tiny_hf_bert()
    [path] = write_gguf(tmp_path / "bert.gguf", hf.config.to_dict(), hf.state_dict(), GGMLType.F32)
    model = load_model(path, dtype="float32").model
    [seq] = prompts((9,))
    ctx = ContiguousAttention()
    ctx.prepare([0], [len(seq)])
    hidden = model(torch.tensor(seq), torch.arange(len(seq)), ctx)
    ref = hf(torch.tensor([seq])).last_hidden_state[0]
    assert (hidden - ref).abs().max().item() < 1e-4

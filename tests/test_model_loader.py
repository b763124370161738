"""load_model sources, dtypes and failure modes; ModelConfig normalisation; dummy shapes."""

from __future__ import annotations

import gc
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from model_utils import batch_logit_diff, one_thread, prompts, tiny_hf_model
from safetensors.torch import load_file, save_file

from wllm.model.config import ConfigError, ModelConfig
from wllm.model.contiguous_attention import ContiguousAttention
from wllm.model.loader import ModelLoadError, load_model
from wllm.model.loader.dummy import DUMMY_CONFIGS
from wllm.model.models import ModelBase, supported_architectures


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny-llama"
    hf = tiny_hf_model("llama")
    hf.save_pretrained(folder)
    return folder


def _live_models() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), ModelBase))


# ---- ModelConfig --------------------------------------------------------------------------------


def test_config_defaults_and_normalisation() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    cfg = ModelConfig.from_hf(base)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling) == (4, 16, 10000.0, None)
    assert cfg.attention_scale == 16**-0.5 and cfg.rotary_dim == 16
    assert not cfg.tie_word_embeddings  # LlamaConfig's default when the key is absent
    gemma = ModelConfig.from_hf(
        {**base, "architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_act": "gelu"}
    )
    assert gemma.tie_word_embeddings and gemma.hidden_act == "gelu_pytorch_tanh"
    # Old-style "type" key and v5-style rope_parameters both normalise to rope_type.
    old = ModelConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    assert old.rope_scaling == new.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert old.rope_theta == new.rope_theta == 5e5
    with pytest.raises(ConfigError, match="longrope.*supported: default, linear, dynamic, llama3, yarn"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    with pytest.raises(ConfigError, match="lacks required field 'vocab_size'"):
        ModelConfig.from_hf({k: v for k, v in base.items() if k != "vocab_size"})


def test_config_sliding_windows_per_family() -> None:
    common = {
        "vocab_size": 10,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "sliding_window": 16,
    }
    gemma2 = ModelConfig.from_hf(
        {**common, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "query_pre_attn_scalar": 256}
    )
    assert gemma2.layer_sliding_windows == [16, None, 16, None]
    assert gemma2.attention_scale == 256**-0.5
    qwen_off = ModelConfig.from_hf({**common, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    assert qwen_off.layer_sliding_windows == [None] * 4 and qwen_off.attention_bias
    qwen_on = ModelConfig.from_hf(
        {
            **common,
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "use_sliding_window": True,
            "max_window_layers": 2,
        }
    )
    assert qwen_on.layer_sliding_windows == [None, None, 16, 16]
    mistral = ModelConfig.from_hf({**common, "architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    assert mistral.layer_sliding_windows == [16] * 4


# ---- sources and formats ------------------------------------------------------------------------


def test_hf_folder_dtype_and_generation_config(llama_dir: Path) -> None:
    (llama_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "eos_token_id": 2}))
    loaded = load_model(str(llama_dir))  # auto: config says float32
    assert loaded.dtype == torch.float32 and loaded.device == torch.device("cpu")
    assert loaded.generation_config["temperature"] == 0.6
    assert loaded.path == llama_dir and loaded.tokenizer_path == llama_dir
    half = load_model(llama_dir, dtype="float16")
    assert next(half.model.parameters()).dtype == torch.float16
    with pytest.raises(ModelLoadError, match="unsupported dtype 'int8'"):
        load_model(llama_dir, dtype="int8")
    with pytest.raises(ModelLoadError, match="load_format='gguf' but this is not a GGUF"):
        load_model(llama_dir, load_format="gguf")
    with pytest.raises(ModelLoadError, match="unknown load_format 'pt'"):
        load_model(llama_dir, load_format="pt")


def test_missing_path_and_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no config.json and no .gguf"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="lacks required field"):
        load_model(tmp_path)
    text = tmp_path / "model.txt"
    text.write_text("hi")
    with pytest.raises(ModelLoadError, match="unsupported model file"):
        load_model(text)


def test_no_safetensors_mentions_bin(llama_dir: Path) -> None:
    (llama_dir / "model.safetensors").rename(llama_dir / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        load_model(llama_dir)


def test_unknown_architecture_lists_supported(llama_dir: Path) -> None:
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as err:
        load_model(llama_dir)
    msg = str(err.value)
    assert "config.json" in msg and "MambaForCausalLM" in msg
    assert all(arch in msg for arch in supported_architectures())


def test_truncated_and_corrupt_safetensors(llama_dir: Path) -> None:
    weights = llama_dir / "model.safetensors"
    # Compare with what already lives: models of earlier tests in this process may still exist.
    before = _live_models()
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(llama_dir)
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ModelLoadError, match="model.safetensors.*not a readable safetensors"):
        load_model(llama_dir)
    assert _live_models() == before


def test_shape_mismatch_names_tensor_and_shapes(llama_dir: Path) -> None:
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    before = _live_models()
    with pytest.raises(ModelLoadError) as err:
        load_model(llama_dir)
    msg = str(err.value)
    assert str(llama_dir) in msg and "mlp." in msg
    assert re.search(r"checkpoint shape \((128, 64|64, 128)\) != model shape \((96, 64|64, 96)\)", msg)
    # The half-built model is not kept alive by the exception or its traceback.
    assert _live_models() == before


def test_missing_and_unexpected_weights(llama_dir: Path) -> None:
    path = llama_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lacks 1 weight.*layers\.1\.self_attn\.qkv_proj\.weight \(parts k\)"):
        load_model(llama_dir)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    tensors["model.layers.0.extra.weight"] = torch.zeros(3)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"unexpected weight 'model\.layers\.0\.extra\.weight' with shape \(3,\)"):
        load_model(llama_dir)


def test_sharded_index_with_missing_shard(tmp_path: Path) -> None:
    hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(ModelLoadError, match=f"index.json names shard.*{shards[-1].name}"):
        load_model(tmp_path)


# ---- hub ----------------------------------------------------------------------------------------


def test_hub_offline_not_cached(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub.constants as hub_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(
        ModelLoadError, match="wllm-test/absent: not in the local Hugging Face cache and HF_HUB_OFFLINE"
    ):
        load_model("wllm-test/absent")


def test_hub_offline_from_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub.constants as hub_constants

    # The layout huggingface_hub keeps: refs/main holds the commit, snapshots/<commit>/ the files.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--wllm-test--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    hf = tiny_hf_model("llama")
    hf.save_pretrained(repo / "snapshots" / commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    loaded = load_model("wllm-test/tiny-llama", dtype="float32")
    assert loaded.path == repo / "snapshots" / commit
    assert batch_logit_diff(loaded.model, hf, prompts((7,))) < 1e-4


# ---- dummy --------------------------------------------------------------------------------------


@torch.no_grad()
def test_dummy_shape_gives_finite_logits() -> None:
    assert {"qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b", "qwen3-8b"} <= set(DUMMY_CONFIGS)
    loaded = load_model("smollm2-135m", load_format="dummy", dtype="bfloat16")
    assert loaded.path is None and loaded.tokenizer_path is None
    cfg = loaded.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    model = loaded.model
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ctx = ContiguousAttention()
    ctx.prepare([0], [8])
    logits = model.compute_logits(model(torch.arange(8) * 100, torch.arange(8), ctx))
    assert logits.dtype == torch.float32 and logits.shape == (8, 49152)
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_dummy_real_configs_build_on_meta() -> None:
    # Every named shape must be a valid config our classes accept (built on meta: no memory).
    from wllm.model.loader.dummy import dummy_config
    from wllm.model.loader.model_loader import build_model

    for name in DUMMY_CONFIGS:
        cfg = ModelConfig.from_hf(dummy_config(name))
        model = build_model(cfg, "meta", torch.bfloat16)
        n = sum(p.numel() for p in model.parameters())
        assert n > 1e8, name
    assert cfg.layer_sliding_windows == [None] * cfg.num_hidden_layers
    eight_b = ModelConfig.from_hf(dummy_config("llama-3.1-8b"))
    n = sum(p.numel() for p in build_model(eight_b, "meta", torch.bfloat16).parameters())
    assert 8.0e9 < n < 8.1e9


def test_dummy_errors(llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="unknown dummy model shape|no such file"):
        load_model("gpt-5", load_format="dummy")
    loaded = load_model(llama_dir, load_format="dummy")
    assert loaded.config.hidden_size == 64 and loaded.tokenizer_path == llama_dir


@pytest.mark.cuda
@torch.no_grad()
@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-8b", "qwen2.5-0.5b", "llama-3.2-1b"])
def test_dummy_real_shape_on_cuda(name: str) -> None:
    import time

    start = time.perf_counter()
    loaded = load_model(name, load_format="dummy", device="cuda")
    torch.cuda.synchronize()
    took = time.perf_counter() - start
    model = loaded.model
    assert loaded.dtype == torch.bfloat16 and next(model.parameters()).is_cuda
    ctx = ContiguousAttention()
    ctx.prepare([0, 1], [37, 5])
    ids = torch.randint(0, loaded.config.vocab_size, (42,), device="cuda")
    pos = torch.cat([torch.arange(37), torch.arange(5)]).cuda()
    logits = model.compute_logits(model(ids, pos, ctx))
    assert logits.shape == (42, loaded.config.vocab_size) and torch.isfinite(logits).all()
    # Random init straight on the GPU: seconds, not minutes, even for 8B.
    assert took < 30, f"dummy {name} took {took:.1f}s"
    print(f"dummy {name}: {took:.2f}s, {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB peak")
    del model, loaded
    torch.cuda.empty_cache()


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "attention_factor": 0.9,
        },
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "mscale": 0.7,
            "mscale_all_dim": 1.0,
        },
    ],
    ids=["linear", "llama3", "yarn", "yarn-params", "yarn-mscale"],
)
def test_rope_scaling_matches_hf(rope: dict) -> None:
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from wllm.model.config import rope_attention_factor, rope_inv_freq

    theta = 500000.0
    hf_cfg = tf.LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        max_position_embeddings=2048,
        rope_parameters={**rope, "rope_theta": theta},
    )
    ref, ref_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu")
    ours = ModelConfig.from_hf({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    assert ours.rope_theta == theta and ours.rope_scaling["rope_type"] == rope["rope_type"]
    torch.testing.assert_close(rope_inv_freq(ours), ref.float(), rtol=1e-6, atol=0)
    assert rope_attention_factor(ours) == pytest.approx(ref_factor)

"""GGUF loading: hf_config, HF-named weights (permutes, norms, fusions), split files, bad files, SmolLM2."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader, quants
from gguf.constants import GGMLQuantizationType as GGMLType
from gguf_writer import write_gguf
from test_gguf_dequant import random_blocks
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from wllm.model.loader.errors import ModelLoadError
from wllm.model.loader.gguf_loader import GGUFModel, find_gguf_parts, load_gguf
from wllm.model.loader.quantized import QuantizedTensor

BASE = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
TINY: dict[str, dict[str, Any]] = {
    "llama": dict(BASE, tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=50000.0),
    "qwen2": dict(BASE, tie_word_embeddings=True),
    "qwen3": dict(BASE, head_dim=32, tie_word_embeddings=False),
    "gemma": dict(BASE, head_dim=16),
    "gemma2": dict(
        BASE, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    ),
    "phi3": dict(BASE, tie_word_embeddings=False),
    "bert": dict(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, type_vocab_size=2, pad_token_id=0,
    ),
}
ARCHS = list(TINY)
# Config keys our hf_config must reproduce from the GGUF metadata.
CONFIG_KEYS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "max_position_embeddings", "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "pad_token_id", "rms_norm_eps", "rope_theta", "head_dim", "sliding_window", "attn_logit_softcapping",
    "final_logit_softcapping", "query_pre_attn_scalar", "layer_norm_eps", "type_vocab_size",
)


def tiny_model(arch: str) -> tuple[Any, torch.nn.Module]:
    torch.manual_seed(0)
    hc = AutoConfig.for_model(arch, **TINY[arch])
    cls = AutoModel if arch == "bert" else AutoModelForCausalLM
    model = cls.from_config(hc).eval()
    with torch.no_grad():
        # Random norm weights, so a missing gemma -1 or a swapped norm shows.
        for name, p in model.named_parameters():
            if "norm" in name.lower():
                p.uniform_(0.5, 1.5)
    return hc, model


def hf_outputs(model: torch.nn.Module, arch: str) -> torch.Tensor:
    ids = torch.tensor([[3, 17, 42, 5, 88, 9, 61]])
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.last_hidden_state if arch == "bert" else out.logits


def expected_value(arch: str, name: str, value: torch.Tensor, qtype: GGMLType) -> torch.Tensor:
    """What the loader must give back for an HF tensor written with write_gguf(qtype=...)."""
    v = value.detach().float().numpy()
    if arch in ("gemma", "gemma2") and name.endswith("norm.weight"):
        return torch.from_numpy((v + np.float32(1)) - np.float32(1))
    if v.ndim < 2 or qtype == GGMLType.F32:
        return torch.from_numpy(v)
    if qtype == GGMLType.F16:
        return torch.from_numpy(v.astype(np.float16).astype(np.float32))
    # Quantization works row by row, so the llama row permutation commutes with it.
    return torch.from_numpy(quants.dequantize(quants.quantize(v, qtype), qtype))


@pytest.mark.parametrize("arch", ARCHS)
def test_roundtrip_f32_config_weights_and_logits(arch: str, tmp_path: Path) -> None:
    hc, model = tiny_model(arch)
    sd = model.state_dict()
    write_gguf(tmp_path / "m.gguf", hc.to_dict(), sd)
    with load_gguf(tmp_path / "m.gguf") as g:
        cfg = g.hf_config
        weights = dict(g.iter_weights(dequantize=True))
        assert list(weights) == g.weight_names()
    assert cfg["model_type"] == arch and cfg["architectures"] == [type(model).__name__]
    for key in CONFIG_KEYS:
        if key in cfg and hasattr(hc, key):
            assert cfg[key] == getattr(hc, key), key
    if arch != "bert":
        assert cfg["rope_theta"] == hc.rope_parameters["rope_theta"]
    expected_names = {n for n in sd if not n.startswith("pooler.")}
    if hc.tie_word_embeddings:
        expected_names.discard("lm_head.weight")
    assert set(weights) == expected_names
    for name, value in weights.items():
        torch.testing.assert_close(value, expected_value(arch, name, sd[name], GGMLType.F32), rtol=0, atol=0)

    # A fresh HF model built from our hf_config and our weights computes the same outputs.
    model2 = type(model)(type(hc)(**{k: v for k, v in cfg.items() if k != "model_type"})).eval()
    missing, unexpected = model2.load_state_dict(weights, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight", "pooler.dense.weight", "pooler.dense.bias"}
    if arch == "bert":
        model2.pooler.load_state_dict(model.pooler.state_dict())
    if hc.tie_word_embeddings and hasattr(model2, "tie_weights"):
        model2.tie_weights()
    torch.testing.assert_close(hf_outputs(model2, arch), hf_outputs(model, arch), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q5_1, GGMLType.F16, GGMLType.BF16],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3", "qwen3"])
def test_roundtrip_quantized(arch: str, qtype: GGMLType, tmp_path: Path) -> None:
    hc, model = tiny_model(arch)
    sd = model.state_dict()
    write_gguf(tmp_path / "q.gguf", hc.to_dict(), sd, qtype=qtype)
    g = load_gguf(tmp_path / "q.gguf")
    dense = dict(g.iter_weights(dequantize=True))
    raw = dict(g.iter_weights(dequantize=False))
    assert list(dense) == list(raw)
    for name, value in dense.items():
        if qtype != GGMLType.BF16:  # gguf.quants has no BF16 quantize round trip helper here
            torch.testing.assert_close(value, expected_value(arch, name, sd[name], qtype), rtol=0, atol=0)
        stored = raw[name]
        if value.ndim == 2 and qtype not in (GGMLType.F16, GGMLType.BF16):
            assert isinstance(stored, QuantizedTensor) and stored.ggml_type == qtype
            assert stored.shape == tuple(sd[name].shape)
            assert torch.equal(stored.dequantize(), value)
        elif value.ndim == 2:
            assert stored.dtype == (torch.float16 if qtype == GGMLType.F16 else torch.bfloat16)
            assert torch.equal(stored.float(), value)
            if qtype == GGMLType.BF16:
                assert torch.equal(value, sd[name].to(torch.bfloat16).float())


def test_kquant_blocks_survive_llama_permute(tmp_path: Path) -> None:
    # K-quant bytes (which gguf.quants cannot produce) go through the writer's permute and the
    # loader's un-permute; the bytes per HF row must come back unchanged.
    cfg = dict(TINY["llama"], hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    hc, model = tiny_model_from(cfg)
    sd: dict[str, Any] = dict(model.state_dict())
    q = QuantizedTensor(torch.from_numpy(random_blocks(GGMLType.Q4_K, 256, 1, seed=1)), GGMLType.Q4_K, (256, 256))
    k = QuantizedTensor(torch.from_numpy(random_blocks(GGMLType.Q6_K, 128, 1, seed=2)), GGMLType.Q6_K, (128, 256))
    # The IQ4 types (non-linear 4-bit levels) load the same way.
    v = QuantizedTensor(torch.from_numpy(random_blocks(GGMLType.IQ4_XS, 128, 1, seed=3)), GGMLType.IQ4_XS, (128, 256))
    o = QuantizedTensor(torch.from_numpy(random_blocks(GGMLType.IQ4_NL, 256, 8, seed=4)), GGMLType.IQ4_NL, (256, 256))
    sd["model.layers.1.self_attn.q_proj.weight"] = q
    sd["model.layers.1.self_attn.k_proj.weight"] = k
    sd["model.layers.1.self_attn.v_proj.weight"] = v
    sd["model.layers.1.self_attn.o_proj.weight"] = o
    write_gguf(tmp_path / "k.gguf", hc.to_dict(), sd, qtype=GGMLType.F16)
    raw = dict(load_gguf(tmp_path / "k.gguf").iter_weights())
    assert torch.equal(raw["model.layers.1.self_attn.q_proj.weight"].data, q.data)
    assert torch.equal(raw["model.layers.1.self_attn.k_proj.weight"].data, k.data)
    assert torch.equal(raw["model.layers.1.self_attn.v_proj.weight"].data, v.data)
    assert torch.equal(raw["model.layers.1.self_attn.o_proj.weight"].data, o.data)
    dense = dict(load_gguf(tmp_path / "k.gguf").iter_weights(dequantize=torch.bfloat16))
    assert dense["model.layers.1.self_attn.q_proj.weight"].dtype == torch.bfloat16
    for name, qt in (("q_proj", q), ("v_proj", v), ("o_proj", o)):
        torch.testing.assert_close(dense[f"model.layers.1.self_attn.{name}.weight"], qt.dequantize(torch.bfloat16))


def tiny_model_from(cfg: dict[str, Any]) -> tuple[Any, torch.nn.Module]:
    torch.manual_seed(0)
    hc = AutoConfig.for_model("llama", **cfg)
    return hc, AutoModelForCausalLM.from_config(hc).eval()


def test_llama_q_k_unpermute_matches_gguf_py_permute(tmp_path: Path) -> None:
    # Independent check of the permutation: llama.cpp's converter permute (as in gguf-py's
    # reference) applied to the HF weight must be what the file holds.
    hc, model = tiny_model("llama")
    sd = model.state_dict()
    write_gguf(tmp_path / "m.gguf", hc.to_dict(), sd)
    reader = GGUFReader(tmp_path / "m.gguf")
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    w = sd["model.layers.0.self_attn.k_proj.weight"].numpy()
    n_kv = hc.num_key_value_heads
    permuted = w.reshape(n_kv, 2, w.shape[0] // n_kv // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(stored["blk.0.attn_k.weight"], permuted)
    assert not np.array_equal(permuted, w)


def test_phi3_separate_qkv_is_fused(tmp_path: Path) -> None:
    hc, model = tiny_model("phi3")
    sd: dict[str, Any] = dict(model.state_dict())
    qkv = sd.pop("model.layers.0.self_attn.qkv_proj.weight")
    q, k, v = qkv.split([64, 32, 32])
    sd.update({"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
               "model.layers.0.self_attn.v_proj.weight": v})
    write_gguf(tmp_path / "p.gguf", hc.to_dict(), sd, qtypes={"model.layers.0.self_attn.v_proj.weight": GGMLType.Q8_0})
    g = load_gguf(tmp_path / "p.gguf")
    weights = dict(g.iter_weights(dequantize=True))
    assert list(weights) == g.weight_names()
    assert "model.layers.0.self_attn.q_proj.weight" not in weights
    fused = weights["model.layers.0.self_attn.qkv_proj.weight"]
    torch.testing.assert_close(fused[:96], qkv[:96], rtol=0, atol=0)
    torch.testing.assert_close(fused[96:], expected_value("phi3", "", v, GGMLType.Q8_0), rtol=0, atol=0)


def test_rope_freqs_and_longrope_go_to_config(tmp_path: Path) -> None:
    hc, model = tiny_model("llama")
    factors = [1.0, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    write_gguf(tmp_path / "r.gguf", {**hc.to_dict(), "rope_freq_factors": factors}, model.state_dict())
    g = load_gguf(tmp_path / "r.gguf")
    assert g.hf_config["rope_freq_factors"] == factors
    assert g.hf_config["rope_scaling"] is None
    assert "rope_freqs.weight" in g.tensors and not any("rope" in n for n in g.weight_names())

    hc, model = tiny_model("phi3")
    long_f, short_f = [float(i + 1) for i in range(8)], [1.0] * 8
    cfg = {**hc.to_dict(), "original_max_position_embeddings": 64,
           "rope_scaling": {"rope_type": "longrope", "long_factor": long_f, "short_factor": short_f}}
    write_gguf(tmp_path / "p.gguf", cfg, model.state_dict())
    pc = load_gguf(tmp_path / "p.gguf").hf_config
    assert pc["rope_scaling"]["rope_type"] == "longrope"
    assert pc["rope_scaling"]["long_factor"] == long_f and pc["rope_scaling"]["short_factor"] == short_f
    assert pc["original_max_position_embeddings"] == 64


def test_gemma2_config_details(tmp_path: Path) -> None:
    hc, model = tiny_model("gemma2")
    write_gguf(tmp_path / "g.gguf", hc.to_dict(), model.state_dict())
    cfg = load_gguf(tmp_path / "g.gguf").hf_config
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert cfg["hidden_act"] == "gelu_pytorch_tanh" and cfg["tie_word_embeddings"] is True
    assert (cfg["sliding_window"], cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == (8, 50.0, 30.0)


def test_dequantize_false_keeps_storage_dtypes(tmp_path: Path) -> None:
    hc, model = tiny_model("llama")
    write_gguf(tmp_path / "m.gguf", hc.to_dict(), model.state_dict(), qtype=GGMLType.F16)
    raw = dict(load_gguf(tmp_path / "m.gguf").iter_weights())
    assert raw["model.norm.weight"].dtype == torch.float32
    assert raw["model.layers.0.mlp.up_proj.weight"].dtype == torch.float16
    # Copy-on-write map: writing into a yielded tensor never changes the file.
    raw["model.norm.weight"].fill_(7.0)
    again = dict(load_gguf(tmp_path / "m.gguf").iter_weights())
    assert torch.equal(again["model.norm.weight"], model.state_dict()["model.norm.weight"])
    with pytest.raises(TypeError, match="bool or a torch.dtype"):
        next(load_gguf(tmp_path / "m.gguf").iter_weights(dequantize="yes"))  # type: ignore[arg-type]


def test_split_gguf(tmp_path: Path) -> None:
    hc, model = tiny_model("qwen2")
    sd = model.state_dict()
    write_gguf(tmp_path / "single.gguf", hc.to_dict(), sd, qtype=GGMLType.Q8_0)
    split_dir = tmp_path / "split"
    split_dir.mkdir()
    parts = write_gguf(split_dir / "m.gguf", hc.to_dict(), sd, qtype=GGMLType.Q8_0, split_max_tensors=7)
    assert len(parts) >= 3 and parts[0].name == f"m-00001-of-{len(parts):05d}.gguf"
    single = load_gguf(tmp_path / "single.gguf")
    want = dict(single.iter_weights(dequantize=True))
    for entry in (parts[0], parts[-1], split_dir):
        g = load_gguf(entry)
        assert g.paths == parts and g.hf_config == single.hf_config
        got = dict(g.iter_weights(dequantize=True))
        assert list(got) == list(want)
        assert all(torch.equal(got[n], want[n]) for n in want)
    os.remove(parts[1])
    with pytest.raises(ModelLoadError, match=parts[1].name):
        load_gguf(parts[0])
    # A part renamed so its siblings cannot be found.
    lone = tmp_path / "lone.gguf"
    parts[0].rename(lone)
    with pytest.raises(ModelLoadError, match="split GGUF"):
        load_gguf(lone)


def write_tiny(path: Path, arch: str = "llama", **kw: Any) -> Path:
    hc, model = tiny_model(arch)
    write_gguf(path, hc.to_dict(), model.state_dict(), **kw)
    return path


def test_bad_files(tmp_path: Path) -> None:
    good = write_tiny(tmp_path / "good.gguf")
    data = good.read_bytes()

    with pytest.raises(ModelLoadError, match="no such GGUF"):
        load_gguf(tmp_path / "absent.gguf")
    bad = tmp_path / "bad_magic.gguf"
    bad.write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(ModelLoadError, match=r"bad_magic\.gguf: not a GGUF file.*architectures llama"):
        load_gguf(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_gguf(empty)
    for cut, where in ((len(data) - 100, "tensor data"), (200, "header"), (10, "tiny")):
        short = tmp_path / f"short_{where.replace(' ', '_')}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=rf"{short.name}: truncated.*Q4_K"):
            load_gguf(short)


def test_unknown_architecture(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(tmp_path / "mamba.gguf", "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"mamba\.gguf: GGUF architecture 'mamba' is not supported.*qwen3"):
        load_gguf(tmp_path / "mamba.gguf")


def test_unsupported_quant_type_and_moe_tensor(tmp_path: Path) -> None:
    # A tensor in IQ2_XXS (block 256, 66 bytes), which wLLM does not dequantize.
    w = gguf.GGUFWriter(tmp_path / "iq.gguf", "llama")
    for key, value in (("llama.block_count", 2), ("llama.embedding_length", 64)):
        w.add_uint32(key, value)
    w.add_tensor("token_embd.weight", np.zeros((96, 66), dtype=np.uint8), raw_dtype=GGMLType.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"iq\.gguf: tensor token_embd\.weight has GGML type IQ2_XXS.*IQ4_XS"):
        load_gguf(tmp_path / "iq.gguf")

    # A Mixtral-style expert tensor in a llama GGUF.
    hc, model = tiny_model("llama")
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_gate_exps\.weight' is not part of a llama model"):
        write_and_load_with_extra_tensor(tmp_path / "moe.gguf", hc, model, "blk.0.ffn_gate_exps.weight")


def write_and_load_with_extra_tensor(path: Path, hc: Any, model: torch.nn.Module, name: str) -> GGUFModel:
    write_gguf(path, hc.to_dict(), model.state_dict())
    reader = GGUFReader(path)
    w = gguf.GGUFWriter(path.with_suffix(".x.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        w.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.add_tensor(name, np.zeros((2, 4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return load_gguf(path.with_suffix(".x.gguf"))


def test_find_gguf_parts_rejects_ambiguous_folder(tmp_path: Path) -> None:
    write_tiny(tmp_path / "a.gguf")
    write_tiny(tmp_path / "b.gguf")
    with pytest.raises(ModelLoadError, match="a.gguf, b.gguf"):
        find_gguf_parts(tmp_path)


# ---- the embedded SmolLM2-135M-Instruct Q4_1 GGUF ------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> GGUFModel:
    from wllm.model.default_model import default_model_path

    return load_gguf(default_model_path())


def test_smollm2_config_and_metadata(smollm2: GGUFModel) -> None:
    cfg = smollm2.hf_config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert (cfg["vocab_size"], cfg["max_position_embeddings"]) == (49152, 8192)
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["rms_norm_eps"], cfg["rope_theta"]) == (1e-5, 100000.0)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    assert cfg["rope_scaling"] is None and cfg["partial_rotary_factor"] == 1.0
    md = smollm2.metadata
    assert md["general.architecture"] == "llama"
    assert len(md["tokenizer.ggml.tokens"]) == 49152 and md["tokenizer.ggml.tokens"][1] == "<|im_start|>"
    assert "<|im_start|>" in md["tokenizer.chat_template"]
    assert type(md["llama.block_count"]) is int and type(md["tokenizer.ggml.add_bos_token"]) is bool


@pytest.mark.slow
def test_smollm2_every_tensor_bit_exact(smollm2: GGUFModel) -> None:
    reader = GGUFReader(smollm2.path)
    ref = {t.name: t for t in reader.tensors}
    assert set(ref) == set(smollm2.tensors)
    types = set()
    for name, info in smollm2.tensors.items():
        types.add(info.ggml_type)
        got = QuantizedTensor(torch.from_numpy(info.raw), info.ggml_type, info.shape).dequantize().numpy()
        want = quants.dequantize(ref[name].data, ref[name].tensor_type).reshape(info.shape)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name
    assert types == {GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.F32}


@pytest.mark.slow
def test_smollm2_names_and_unpermute_match_transformers(smollm2: GGUFModel) -> None:
    # transformers' own GGUF loader is the oracle for HF names and the Q/K un-permute.
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        meta_model = LlamaForCausalLM(LlamaConfig(**smollm2.hf_config))
    ref = load_gguf_checkpoint(str(smollm2.path), return_tensors=True, model_to_load=meta_model)["tensors"]
    ours = dict(smollm2.iter_weights(dequantize=True))
    assert set(ours) == set(ref)
    for name, value in ours.items():
        assert torch.equal(value, ref[name].float()), name


def test_config_from_metadata_keys() -> None:
    from wllm.model.loader.gguf_config import build_hf_config

    def md(arch: str, **extra: Any) -> dict[str, Any]:
        base = {"general.architecture": arch, f"{arch}.embedding_length": 4608, f"{arch}.block_count": 46,
                f"{arch}.feed_forward_length": 36864, f"{arch}.attention.head_count": 32,
                f"{arch}.attention.head_count_kv": 16, f"{arch}.attention.key_length": 128}
        return {**base, **{k.replace("ARCH", arch): v for k, v in extra.items()}}

    shapes = {"token_embd.weight": (256000, 4608)}
    # Gemma 2 27B: no attention.scale key, so the scalar is hidden / heads, as llama.cpp decides by depth.
    assert build_hf_config("x", md("gemma2"), shapes, None)["query_pre_attn_scalar"] == 144  # type: ignore[arg-type]
    cfg = build_hf_config("x", md("gemma2", **{"ARCH.attention.scale": float(np.float32(24**-0.5))}), shapes, None)  # type: ignore[arg-type]
    assert cfg["query_pre_attn_scalar"] == 24

    cfg = build_hf_config("x", md(
        "llama", **{"ARCH.rope.scaling.type": "linear", "ARCH.rope.scaling.factor": 4.0,
                    "ARCH.rope.dimension_count": 64, "tokenizer.ggml.eos_token_id": 2,
                    "tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 2}),
        shapes, None)  # type: ignore[arg-type]
    assert cfg["rope_scaling"] == {"rope_type": "linear", "type": "linear", "factor": 4.0}
    assert cfg["partial_rotary_factor"] == 0.5 and cfg["head_dim"] == 128
    assert cfg["eos_token_id"] == [2, 7]
    assert cfg["vocab_size"] == 256000 and cfg["tie_word_embeddings"] is True

    with pytest.raises(ModelLoadError, match="x: GGUF metadata lacks required key llama.block_count"):
        build_hf_config("x", {k: v for k, v in md("llama").items() if "block_count" not in k}, shapes, None)  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError, match="per-layer KV head counts"):
        build_hf_config("x", md("llama", **{"ARCH.attention.head_count_kv": [4, 8]}), shapes, None)  # type: ignore[arg-type]

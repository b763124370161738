"""The fast GGUF paths: header parser vs gguf.GGUFReader, the per-process header cache, and
dequantization into other dtypes / into `out` (bit-exact against float32-then-cast)."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.constants import GGMLQuantizationType as GGMLType
from test_gguf_dequant import random_blocks

from wllm.model.loader import gguf_file
from wllm.model.loader.dequant import dequantize
from wllm.model.loader.gguf_file import GGUFFormatError, clear_gguf_header_cache, read_gguf_header
from wllm.model.loader.quantized import QuantizedTensor
from wllm.model.tokenizer.gguf_vocab import read_gguf_vocab

V = GGUFValueType


def write_kv_file(path: Path, endian: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE, n_tokens: int = 300) -> Path:
    """A GGUF with every value type, a vocabulary (unicode, empty and long strings) and tensors."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama", endianess=endian)
    for key, val, vtype in (
        ("t.u8", 200, V.UINT8), ("t.i8", -100, V.INT8), ("t.u16", 60000, V.UINT16), ("t.i16", -30000, V.INT16),
        ("t.u32", 4_000_000_000, V.UINT32), ("t.i32", -2_000_000_000, V.INT32), ("t.f32", 1e-5, V.FLOAT32),
        ("t.u64", 2**63 + 5, V.UINT64), ("t.i64", -(2**62), V.INT64), ("t.f64", 0.1, V.FLOAT64),
        ("t.bool", True, V.BOOL), ("t.str", "héllo ▁wörld 🙂", V.STRING),
    ):
        w.add_key_value(key, val, vtype)
    w.add_key_value("t.arr_f32", [0.5, -1.25, 3.1e-7], V.ARRAY, V.FLOAT32)
    w.add_key_value("t.arr_bool", [True, False, True], V.ARRAY, V.BOOL)
    w.add_array("t.arr_nested", [[1, 2], [3, 4, 5]])
    tokens = ["", "<s>", "a" * 1000] + ["".join(chr(c) for c in rng.integers(32, 0x3000, 1 + i % 7))
                                        for i in range(n_tokens - 3)]
    w.add_token_list(tokens)
    w.add_token_scores(rng.standard_normal(n_tokens).astype(np.float32).tolist())
    w.add_token_types([int(x) for x in rng.integers(1, 7, n_tokens)])
    w.add_token_merges([f"{tokens[i]} {tokens[i + 1]}" for i in range(3, n_tokens - 1)])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_bos_token_id(1)
    w.add_add_bos_token(False)
    w.add_chat_template("{{ messages }}")
    w.add_tensor("a.weight", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("b.weight", random_blocks(GGMLType.Q4_1, 2, 1).reshape(2, 20), raw_dtype=GGMLType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_same_as_reader(path: Path) -> None:
    ours = read_gguf_header(path)
    ref = GGUFReader(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert keys == list(ours.fields)
    for key in keys:
        field = ref.fields[key]
        want, got = field.contents(), ours.value(key)
        if isinstance(got, list) and got and isinstance(got[0], list):
            # Nested arrays stay nested here; GGUFReader flattens them (and so does GGUFModel.metadata).
            got = [x for inner in got for x in inner]
        assert got == want and type(got) is type(want), key
        if isinstance(want, list):
            assert [type(x) for x in got] == [type(x) for x in want], key
        assert ours.value_type(key) == field.types[0]
    assert ours.data_offset == ref.data_offset and ours.alignment == ref.alignment
    assert [(t.name, t.ggml_type, t.dims, t.offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.tensor_type, tuple(t.shape.tolist()), t.data_offset, t.n_bytes) for t in ref.tensors
    ]


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["le", "be"])
def test_header_matches_gguf_reader(tmp_path: Path, endian: gguf.GGUFEndian) -> None:
    path = write_kv_file(tmp_path / "kv.gguf", endian)
    assert_same_as_reader(path)
    assert read_gguf_header(path).value("t.arr_nested") == [[1, 2], [3, 4, 5]]
    assert read_gguf_header(path).byte_order == ("<" if endian == gguf.GGUFEndian.LITTLE else ">")


def test_vocab_from_path_matches_vocab_from_reader(tmp_path: Path) -> None:
    path = write_kv_file(tmp_path / "vocab.gguf")
    fast, slow = read_gguf_vocab(path), read_gguf_vocab(GGUFReader(path))
    assert fast == slow
    assert fast.tokens[2] == "a" * 1000 and fast.tokens[0] == "" and fast.add_bos is False


def test_header_cache_hits_and_invalidates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clear_gguf_header_cache()
    calls: list[Path] = []
    parse = gguf_file._parse
    monkeypatch.setattr(gguf_file, "_parse", lambda p, buf, size: calls.append(p) or parse(p, buf, size))
    path = write_kv_file(tmp_path / "c.gguf")
    first = read_gguf_header(path)
    assert read_gguf_header(str(path)) is first and len(calls) == 1
    # The values handed out are copies: changing them does not change the cached header.
    first.value("tokenizer.ggml.tokens").append("x")
    assert len(read_gguf_header(path).value("tokenizer.ggml.tokens")) == 300
    # A rewritten file (new size and mtime) is parsed again.
    write_kv_file(path, n_tokens=301)
    assert len(read_gguf_header(path).value("tokenizer.ggml.tokens")) == 301 and len(calls) == 2
    clear_gguf_header_cache()
    read_gguf_header(path)
    assert len(calls) == 3


def test_model_and_tokenizer_parse_the_file_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from wllm.model.default_model import default_model_path
    from wllm.model.loader.gguf_loader import load_gguf
    from wllm.model.tokenizer.tokenizer import Tokenizer

    path = default_model_path()
    clear_gguf_header_cache()
    calls: list[Path] = []
    parse = gguf_file._parse
    monkeypatch.setattr(gguf_file, "_parse", lambda p, buf, size: calls.append(p) or parse(p, buf, size))
    with load_gguf(path) as model:
        assert len(model.metadata["tokenizer.ggml.tokens"]) == 49152
    tok = Tokenizer.from_gguf(path)
    assert len(calls) == 1
    assert tok.source == os.path.abspath(path)
    assert tok.encode("Hello world", add_special_tokens=False) == [19556, 905]


def test_bad_headers(tmp_path: Path) -> None:
    data = write_kv_file(tmp_path / "good.gguf").read_bytes()
    cases: list[tuple[bytes, str]] = [
        (data[:400], "truncated or corrupt"),
        (data[:4] + (9).to_bytes(4, "little") + data[8:], "unsupported GGUF version 9"),
        (b"GGML" + data[4:], "not a GGUF file"),
        (data[:20], "truncated GGUF file \\(20 bytes"),
    ]
    for i, (blob, match) in enumerate(cases):
        p = tmp_path / f"bad{i}.gguf"
        p.write_bytes(blob)
        with pytest.raises(GGUFFormatError, match=match):
            read_gguf_header(p)
    # An absurd string length must fail cleanly, not allocate.
    p = tmp_path / "huge.gguf"
    p.write_bytes(data[:24] + (2**62).to_bytes(8, "little") + data[32:])
    with pytest.raises(GGUFFormatError, match="truncated or corrupt"):
        read_gguf_header(p)


def test_unknown_tensor_type(tmp_path: Path) -> None:
    path = write_kv_file(tmp_path / "t.gguf")
    header = read_gguf_header(path)
    blob = bytearray(path.read_bytes())
    # Tensor info: name, n_dims u32, dims u64 x 2, then the ggml type u32.
    at = blob.rindex(b"b.weight", 0, header.data_offset) + len("b.weight") + 4 + 8 * 2
    assert int.from_bytes(blob[at : at + 4], "little") == GGMLType.Q4_1
    blob[at : at + 4] = (250).to_bytes(4, "little")
    bad = tmp_path / "unknown_type.gguf"
    bad.write_bytes(bytes(blob))
    with pytest.raises(GGUFFormatError, match="unknown GGML tensor type 250"):
        read_gguf_header(bad)


@pytest.mark.parametrize("t", [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K,
                               GGMLType.F16, GGMLType.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_dequantize_dtype_and_out_match_float32_then_cast(
    t: GGMLType, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wllm.model.loader import dequant

    monkeypatch.setattr(dequant, "_CHUNK_BLOCKS", 8)  # several chunks through the scratch buffer
    block = gguf.GGML_QUANT_SIZES[t][0]
    shape = (5, 3 * block)
    raw = torch.from_numpy(random_blocks(t, 5 * 3, 1, seed=3))
    want = dequantize(raw, t, shape).to(dtype)
    got = dequantize(raw, t, shape, dtype=dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    out = torch.full(shape, 7.0, dtype=dtype)
    assert QuantizedTensor(raw, t, shape).dequantize(out=out) is out
    assert torch.equal(out, want)


def test_dequantize_out_is_checked() -> None:
    raw = torch.from_numpy(random_blocks(GGMLType.Q4_0, 2, 1))
    with pytest.raises(ValueError, match="contiguous floating tensor of shape \\(2, 32\\)"):
        dequantize(raw, GGMLType.Q4_0, (2, 32), out=torch.empty(32, 2).t())
    with pytest.raises(ValueError, match="contiguous floating tensor"):
        dequantize(raw, GGMLType.Q4_0, (2, 32), out=torch.empty(2, 32, dtype=torch.int32))


def test_index_rows_cpu_gather_matches_and_checks_range() -> None:
    raw = torch.from_numpy(random_blocks(GGMLType.Q4_K, 6, 2, seed=9))
    qt = QuantizedTensor(raw, GGMLType.Q4_K, (6, 512))
    perm = torch.tensor([5, 0, 3, 3, 1])
    picked = qt.index_rows(perm)
    assert picked.shape == (5, 512) and torch.equal(picked.data, qt.data.index_select(0, perm))
    for bad in ([0, 6], [-1, 2]):
        with pytest.raises(IndexError, match="out of range for 6 rows"):
            qt.index_rows(bad)

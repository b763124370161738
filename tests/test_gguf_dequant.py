"""Pure-PyTorch GGUF dequantization vs gguf.quants (bit-exact), and QuantizedTensor row operations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader, quants
from gguf.constants import GGML_QUANT_SIZES

from wllm.model.loader import dequant as dq
from wllm.model.loader.dequant import SUPPORTED_TYPES, GGMLType, dequantize
from wllm.model.loader.errors import ModelLoadError, UnsupportedQuantTypeError
from wllm.model.loader.quantized import QuantizedTensor

# Byte offsets of the fp16 scale/min fields inside one block: random bytes there could be
# inf/NaN, which real files never hold, so the tests overwrite them with finite values.
F16_FIELDS = {
    GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,), GGMLType.Q2_K: (80, 82), GGMLType.Q3_K: (108,), GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,), GGMLType.IQ4_NL: (0,), GGMLType.IQ4_XS: (0,),
}
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


def random_blocks(t: GGMLType, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random but valid raw bytes for a [rows, blocks_per_row * block_size] tensor of type t."""
    rng = np.random.default_rng(seed)
    block, nbytes = GGML_QUANT_SIZES[t]
    if t in FLOAT_TYPES:
        vals = rng.standard_normal((rows, blocks_per_row)).astype(np.float32) * 3
        if t == GGMLType.F16:
            return vals.astype(np.float16).view(np.uint8)
        if t == GGMLType.BF16:
            return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return vals.view(np.uint8)
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        # Span tiny (subnormal) to large magnitudes, both signs.
        scale = (rng.standard_normal(raw.shape[0]) * 10.0 ** rng.integers(-6, 3, raw.shape[0]))
        raw[:, off : off + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def assert_bits_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape
    assert a.dtype == b.dtype == np.float32
    mismatch = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
    assert mismatch.size == 0, f"{mismatch.size} values differ, first at {mismatch[:5]}"


@pytest.mark.parametrize("t", SUPPORTED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_random_blocks_bit_exact(t: GGMLType, rows: int) -> None:
    block = GGML_QUANT_SIZES[t][0]
    blocks_per_row = 5 if block > 1 else 37
    raw = random_blocks(t, rows, blocks_per_row, seed=rows)
    ref = quants.dequantize(raw, t)
    out = dequantize(torch.from_numpy(raw), t, (rows, blocks_per_row * block))
    assert out.dtype == torch.float32
    assert_bits_equal(out.numpy(), ref)


@pytest.mark.parametrize("t", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_three_dim_shape(t: GGMLType) -> None:
    block = GGML_QUANT_SIZES[t][0]
    raw = random_blocks(t, 2 * 3, 2, seed=5).reshape(2, 3, -1)
    ref = quants.dequantize(raw, t)
    out = dequantize(torch.from_numpy(raw), int(t), (2, 3, 2 * block))
    assert_bits_equal(out.numpy(), ref)


def test_chunked_path_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    # Many blocks in small chunks must give the same values as one chunk.
    raw = torch.from_numpy(random_blocks(GGMLType.Q4_K, 9, 3, seed=11))
    whole = dequantize(raw, GGMLType.Q4_K, (9, 768))
    monkeypatch.setattr(dq, "_CHUNK_BLOCKS", 4)
    chunked = dequantize(raw, GGMLType.Q4_K, (9, 768))
    assert torch.equal(whole.view(torch.int32), chunked.view(torch.int32))


def test_result_does_not_alias_input() -> None:
    raw = torch.from_numpy(random_blocks(GGMLType.F32, 2, 4))
    out = dequantize(raw, GGMLType.F32, (2, 4))
    out.fill_(0)
    assert raw.view(torch.float32).abs().sum() > 0


@pytest.mark.parametrize("t", [GGMLType.IQ2_XXS, GGMLType.TQ1_0, GGMLType.Q8_1, "IQ3_S", 999])
def test_unsupported_type_names_supported_ones(t: object) -> None:
    with pytest.raises(UnsupportedQuantTypeError) as exc:
        dequantize(torch.zeros(256, dtype=torch.uint8), t, (1, 256))  # type: ignore[arg-type]
    msg = str(exc.value)
    assert "Q4_K" in msg and "Q8_0" in msg and "BF16" in msg and "IQ4_XS" in msg
    assert isinstance(exc.value, ModelLoadError)


def test_wrong_byte_count_and_shape() -> None:
    with pytest.raises(ValueError, match="needs 36 bytes"):
        dequantize(torch.zeros(35, dtype=torch.uint8), GGMLType.Q4_0, (2, 32))
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize(torch.zeros(18, dtype=torch.uint8), GGMLType.Q4_0, (1, 31))
    with pytest.raises(ValueError, match="uint8"):
        dequantize(torch.zeros(9, dtype=torch.float16), GGMLType.Q4_0, (1, 32))


@pytest.fixture(scope="module")
def smollm2_reader() -> GGUFReader:
    from wllm.model.default_model import default_model_path

    return GGUFReader(default_model_path())


def test_smollm2_real_blocks(smollm2_reader: GGUFReader) -> None:
    # One tensor of each type in the file; the loader tests check every tensor.
    seen: set[GGMLType] = set()
    for t in smollm2_reader.tensors:
        if t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        shape = tuple(reversed([int(x) for x in t.shape]))
        data = np.ascontiguousarray(t.data).view(np.uint8)
        out = dequantize(torch.from_numpy(data.copy()), t.tensor_type, shape)
        assert_bits_equal(out.numpy(), quants.dequantize(t.data, t.tensor_type).reshape(shape))
    assert {GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.F32} <= seen


def make_qt(t: GGMLType, rows: int, blocks_per_row: int, seed: int = 0) -> QuantizedTensor:
    raw = random_blocks(t, rows, blocks_per_row, seed)
    return QuantizedTensor(torch.from_numpy(raw), t, (rows, blocks_per_row * GGML_QUANT_SIZES[t][0]))


def test_quantized_tensor_basics() -> None:
    qt = make_qt(GGMLType.Q6_K, 4, 2)
    assert qt.shape == (4, 512) and qt.nbytes == 4 * 2 * 210 and qt.numel() == 2048
    full = qt.dequantize()
    assert torch.equal(full, torch.from_numpy(quants.dequantize(qt.data.numpy(), GGMLType.Q6_K)))
    half = qt.dequantize(torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, full.to(torch.bfloat16))
    assert qt.to("cpu") is qt
    assert "Q6_K" in repr(qt)


def test_quantized_tensor_row_ops_match_dense() -> None:
    torch.manual_seed(0)
    qt = make_qt(GGMLType.Q4_0, 10, 3, seed=3)
    dense = qt.dequantize()
    assert torch.equal(qt.narrow_rows(2, 5).dequantize(), dense[2:7])
    perm = torch.randperm(10)
    assert torch.equal(qt.index_rows(perm).dequantize(), dense[perm])
    a, b, c = qt.split_rows([3, 3, 4])
    assert torch.equal(QuantizedTensor.cat([c, a, b]).dequantize(), torch.cat([dense[6:], dense[:6]]))
    with pytest.raises(ValueError, match="add up"):
        qt.split_rows([3, 3])
    with pytest.raises(IndexError):
        qt.narrow_rows(8, 5)
    with pytest.raises(ValueError, match="type and row shape"):
        QuantizedTensor.cat([qt, make_qt(GGMLType.Q8_0, 2, 3)])


def test_quantized_tensor_rejects_bad_bytes() -> None:
    with pytest.raises(ValueError, match="needs 36 bytes"):
        QuantizedTensor(torch.zeros(40, dtype=torch.uint8), GGMLType.Q4_0, (2, 32))
    with pytest.raises(UnsupportedQuantTypeError):
        QuantizedTensor(torch.zeros(40, dtype=torch.uint8), GGMLType.IQ1_S, (2, 32))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_cuda_bit_exact(t: GGMLType) -> None:
    block = GGML_QUANT_SIZES[t][0]
    raw = random_blocks(t, 33, 4, seed=7)
    ref = quants.dequantize(raw, t)
    out = dequantize(torch.from_numpy(raw).cuda(), t, (33, 4 * block))
    assert out.device.type == "cuda"
    assert_bits_equal(out.cpu().numpy(), ref)

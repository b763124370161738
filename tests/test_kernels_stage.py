"""Step staging (`kernels.stage_copy`): one small kernel that copies a step's staged bytes between pinned
host memory and the device in place and writes a lookahead step's input ids from the previous step's samples.

CPU (CI): the reference and argument errors. CUDA (-m cuda): host -> device and device -> host on odd sizes
and misaligned offsets, both id dtypes, identity and gathered rows, and `host_mapped`.
"""

from __future__ import annotations

import pytest
import torch

from wllm.kernels import reference
from wllm.kernels.ops import host_mapped, stage_copy


def test_reference_copies_bytes_then_writes_input_ids() -> None:
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    ids = dst[:32].view(torch.int64)  # the input ids live inside the staged bytes, as in the runner
    pairs = torch.tensor([3, 0, 2, 0], dtype=torch.int64)  # token 3 <- row 2, token 0 <- row 0
    prev = torch.tensor([7.0, 8.0, 9.0], dtype=torch.float64)
    stage_copy(dst, src, ids, prev, pairs, 2)
    assert ids[0].item() == 7 and ids[3].item() == 9
    assert torch.equal(dst[8:24], src[8:24])
    stage_copy(dst, src)
    assert torch.equal(dst, src)
    reference.stage_copy(dst, src, ids, prev.long(), None, 3)
    assert ids[:3].tolist() == [7, 8, 9]


@pytest.mark.parametrize("case,match", [
    ("sizes", "dst has 8 bytes, src 16"),
    ("ids_dtype", "int64 input_ids"),
    ("prev_dtype", "int64/float64 prev_tokens"),
    ("short_pairs", "at least n elements"),
])
def test_errors(case: str, match: str) -> None:
    dst, src = torch.zeros(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    ids, prev, pairs = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), None
    if case == "sizes":
        dst = dst[:8]
    elif case == "ids_dtype":
        ids = ids.int()
    elif case == "prev_dtype":
        prev = prev.float()
    elif case == "short_pairs":
        pairs = torch.zeros(5, dtype=torch.int64)
    with pytest.raises(ValueError, match=match):
        stage_copy(dst, src, ids, prev, pairs, 3)


@pytest.mark.cuda
def test_host_mapped() -> None:
    assert host_mapped(torch.zeros(64, dtype=torch.uint8, pin_memory=True))
    assert not host_mapped(torch.zeros(64, dtype=torch.uint8))
    assert not host_mapped(torch.zeros(64, dtype=torch.uint8, device="cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("nbytes", [1, 15, 16, 17, 1040, 4099, 70000])
@pytest.mark.parametrize("offset", [0, 16, 3])
@pytest.mark.parametrize("prev_dtype", [torch.int64, torch.float64])
@pytest.mark.parametrize("gather", [False, True])
def test_host_to_device_with_input_ids(nbytes: int, offset: int, prev_dtype: torch.dtype, gather: bool) -> None:
    """Pinned host bytes to the device at 16-byte aligned and misaligned offsets (the byte path), then the
    input ids (the first bytes of dst, as in the runner) from the previous step's samples: identity, or
    scattered (token, row) pairs staged inside the same bytes."""
    gen = torch.Generator().manual_seed(nbytes + offset)
    host = torch.randint(0, 256, (offset + nbytes,), dtype=torch.uint8, generator=gen).pin_memory()
    src = host[offset:]
    dev = torch.zeros(offset + nbytes + 64, dtype=torch.uint8, device="cuda")
    dst = dev[offset:offset + nbytes]
    n = min(5, nbytes // 8) if offset % 8 == 0 else 0
    prev = torch.tensor([11, 22, 33, 44, 55, 66], dtype=prev_dtype, device="cuda")
    ids = dev[offset:offset + 8 * n].view(torch.int64) if n else None
    pairs = None
    tokens, rows = list(range(n)), list(range(n))
    if n and gather:  # the pairs lie inside dst too (after the ids), written by the same copy
        need = 8 * n + 16 * n
        if nbytes < need:
            pytest.skip("too short for ids and pairs")
        tokens, rows = list(reversed(range(n))), [4, 0, 5, 1, 2][:n]
        host[offset + 8 * n:offset + need].view(torch.int64).copy_(torch.tensor(tokens + rows))
        pairs = dev[offset + 8 * n:offset + need].view(torch.int64)
    want = src.clone().cuda()
    if n:
        want_ids = want[:8 * n].view(torch.int64)
        for t, r in zip(tokens, rows):
            want_ids[t] = int(prev[r])
    stage_copy(dst, src, ids, prev if n else None, pairs, n)
    torch.cuda.synchronize()
    assert torch.equal(dst, want)
    assert dev[offset + nbytes:].eq(0).all()  # nothing written past the end


@pytest.mark.cuda
@pytest.mark.parametrize("nbytes", [16, 24, 4096, 4100])
def test_device_to_host_and_repeated_steps(nbytes: int) -> None:
    """Device bytes written into pinned host memory in place (the sampled ids of a graph step), read by the
    host after a sync; a second step with new values through the same buffers sees the new values."""
    host = torch.zeros(nbytes, dtype=torch.uint8).pin_memory()
    for trial in range(3):
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        stage_copy(host, src)
        torch.cuda.synchronize()
        assert torch.equal(host, src.cpu()), f"trial {trial}"
    staged = torch.zeros(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    for value in (3, 200):  # the host rewrites the staging between launches: no stale cached copy is read
        staged.fill_(value)
        stage_copy(dev, staged)
        torch.cuda.synchronize()
        assert dev.eq(value).all()

"""benchmarks/trace_decode_layer.py's offline analysis: records of a trace build -> per-kernel timeline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# (family code, grid.x, splits in blockIdx.z) of the layer's kernels in launch order, as common.cuh tags them.
KERNELS = [(2, 1, 1), (4, 6, 1), (1, 1, 1), (8, 2, 3), (4, 6, 1), (2, 1, 1), (4, 4, 1), (4, 5, 1)]


def synthetic_trace(layers: int, period_ns: int = 100_000) -> np.ndarray:
    """Kernel k of layer l: CTAs start at l * period + k * 10 us (+ 8 ns per CTA), their waits return 3 us later."""
    recs = []
    for layer in range(layers):
        for k, (family, grid, splits) in enumerate(KERNELS):
            t0 = layer * period_ns + k * 10_000
            for cta in range(grid * splits):
                block, z = cta % grid, cta // grid
                for event, t in ((0, t0 + 8 * cta), (1, t0 + 3_000 + 8 * cta)):
                    tag = family | (event << 8) | (grid << 12) | (block << 32) | (z << 48) | ((cta % 7) << 56)
                    recs.append((tag, t + 1_000_000))
    rng = np.random.default_rng(0)
    out = np.array(recs, dtype=np.uint64)
    return out[rng.permutation(len(out))]  # the dump order of the translation units is arbitrary


def test_analyze_a_saved_trace(tmp_path: Path) -> None:
    path = tmp_path / "trace.npy"
    np.save(path, synthetic_trace(layers=5))
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trace_decode_layer.py"), "--analyze", str(path)],
                         capture_output=True, text=True, timeout=120, check=True)
    lines = res.stdout.splitlines()
    assert "5 layers; layer length 100.00 us" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert list(rows) == ["norm_in", "qkv", "rope", "attention", "o", "norm_post", "gate_up", "down"]
    # grid, CTAs, then first start, last start, first wait, last wait (us from the layer's first CTA)
    assert rows["qkv"][1:3] == ["6", "6"] and rows["attention"][1:3] == ["2", "6"]
    assert [float(v) for v in rows["o"][4:]] == [40.0, 40.04, 43.0, 43.04]
    assert [float(v) for v in rows["down"][4:]] == [70.0, 70.03, 73.0, 73.03]

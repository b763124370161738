"""Benchmark results: one row per (benchmark, shape), printed as a table, saved as JSON, drawn as a chart."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CHART_MISSING = "--chart needs matplotlib: pip install 'wllm-server[bench]' (or pip install matplotlib)"


class BenchError(RuntimeError):
    """A benchmark cannot run or finished wrongly; the message says what to do."""


@dataclass
class BenchResult:
    """wLLM's number for one benchmark and shape, next to HF's and the hardware floor.

    `higher_is_better` is True for rates (tok/s) and False for times (seconds). `hf_note` says how
    the HF number was obtained when it is not a full run of the same workload (capped and
    extrapolated, or measured over fewer tokens).
    """

    bench: str
    shape: str
    metric: str
    higher_is_better: bool
    wllm: float
    floor: float
    hf: float | None = None
    hf_note: str = ""
    floor_note: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def floor_fraction(self) -> float:
        """How close wLLM comes to the floor: 1.0 = at the floor."""
        if self.wllm <= 0 or self.floor <= 0:
            return 0.0
        return self.wllm / self.floor if self.higher_is_better else self.floor / self.wllm

    @property
    def vs_hf(self) -> float | None:
        """wLLM's speed-up over HF (> 1 = wLLM is faster)."""
        if self.hf is None or self.hf <= 0 or self.wllm <= 0:
            return None
        return self.wllm / self.hf if self.higher_is_better else self.hf / self.wllm

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(floor_fraction=self.floor_fraction, vs_hf=self.vs_hf)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        """Inverse of to_dict (the derived fields are recomputed, not read; unknown keys are ignored)."""
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


def format_value(value: float | None, metric: str) -> str:
    """Rates with thousands separators, times in seconds with 2-3 significant decimals."""
    if value is None:
        return "-"
    if metric.endswith("tok/s"):
        return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"
    if value >= 1:
        return f"{value:,.2f}"
    return f"{value:.3f}" if value >= 0.01 else f"{value:.2e}"


def format_percent(fraction: float) -> str:
    pct = 100 * fraction
    return f"{pct:.1f}%" if pct >= 0.1 or pct == 0 else f"{pct:.2g}%"


def format_table(results: list[BenchResult]) -> str:
    """A Markdown table (pastes into benchmarks/RESULTS.md); footnotes mark capped HF numbers."""
    header = ["benchmark", "shape", "metric", "wLLM", "HF", "wLLM vs HF", "floor", "of floor"]
    rows: list[list[str]] = []
    notes: list[str] = []
    for r in results:
        hf = format_value(r.hf, r.metric)
        if r.hf_note:  # a capped run, or why there is no number
            notes.append(r.hf_note)
            hf += "*" * len(notes)
        vs = r.vs_hf
        floor = format_value(r.floor, r.metric) + (f" ({r.floor_note})" if r.floor_note else "")
        rows.append([r.bench, r.shape, r.metric, format_value(r.wllm, r.metric), hf,
                     "-" if vs is None else f"{vs:.2f}x", floor, format_percent(r.floor_fraction)])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    numeric = {3, 4, 5, 6, 7}

    def line(cells: list[str]) -> str:
        padded = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(padded) + " |"

    sep = "|" + "|".join("-" * (w + 1) + (":" if i in numeric else "-") for i, w in enumerate(widths)) + "|"
    out = [line(header), sep] + [line(row) for row in rows]
    out += [f"{'*' * (i + 1)} HF {note}" for i, note in enumerate(notes)]
    return "\n".join(out)


def write_json(path: str | os.PathLike[str], results: list[BenchResult], meta: dict[str, Any]) -> None:
    """Write {"meta": ..., "results": [...]} with every number and how it was obtained."""
    data = {"meta": meta, "results": [r.to_dict() for r in results]}
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def read_json(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[BenchResult]]:
    """(meta, results) of a file written by write_json; ValueError naming the file otherwise."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return data["meta"], [BenchResult.from_dict(r) for r in data["results"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a wllm bench JSON file ({type(e).__name__}: {e})") from None


def check_chart_support() -> None:
    """Raise BenchError with an install hint when matplotlib is missing (call before a long run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError(CHART_MISSING) from None


def draw_chart(path: str | os.PathLike[str], results: list[BenchResult], title: str = "") -> None:
    """One panel per result: wLLM, HF and the floor as bars (a logarithmic axis when the bars
    differ more than 30x), the fraction of the floor and the speed-up over HF in the heading;
    '*' marks a capped HF number."""
    check_chart_support()
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed (servers, CI, Windows services)
    import matplotlib.pyplot as plt

    n = max(len(results), 1)
    cols = min(n, 3)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.9 * nrows), squeeze=False)
    colors = {"wLLM": "#2b6cb0", "HF": "#a0aec0", "floor": "#2f855a"}
    for ax, r in zip(axes.flat, results):
        labels = ["wLLM", "HF", "floor"]
        values = [r.wllm, r.hf or 0.0, r.floor]
        positive = [v for v in values if v > 0]
        # A baseline a hundred times slower than the floor flattens the interesting bars: go logarithmic.
        log = bool(positive) and max(positive) / min(positive) > 30
        if log:
            ax.set_yscale("log")
        bars = ax.bar(labels, values, color=[colors[k] for k in labels])
        for bar, v, label in zip(bars, values, labels):
            text = "n/a" if label == "HF" and r.hf is None else format_value(v, r.metric)
            if label == "HF" and r.hf_note:
                text += "*"
            y = v if v > 0 else (min(positive) if log and positive else 0.0)
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=8)
        better = "higher" if r.higher_is_better else "lower"
        versus = f"{format_percent(r.floor_fraction)} of floor"
        if r.vs_hf is not None:
            versus += f", {r.vs_hf:.2f}x HF"
        ax.set_title(f"{r.bench}: {r.shape}\n{r.metric}, {better} is better\n{versus}", fontsize=9)
        ax.margins(y=0.15)
        if log:
            ax.set_ylabel("log scale", fontsize=7)
    for ax in list(axes.flat)[len(results):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

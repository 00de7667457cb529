"""What ``trainmon compare`` writes: a CSV of every pair, a summary, TensorBoard scalars and PNG plots.

```
OUT/similarity.csv                 rank,step,name,name_b,sign_agreement,cosine,norm_ratio,bin_distance,...
OUT/summary.json                   thresholds, and per rank the first divergent step and parameters
OUT/rank_<r>/events.out.tfevents.* tags compare/{name}/{metric}, and compare/min/similarity per step
OUT/plots/rank_<r>_similarity.png  similarity of every parameter over the steps
OUT/plots/rank_<r>/<name>.png      the four figures of each parameter that diverged first
```
"""

from __future__ import annotations

import csv
import json
import math
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from trainmon.gradprobe.compare import METRICS, Comparison, PairRow, RankResult
from trainmon.writer.tensorboard import EventFile

CSV_COLUMNS = ("rank", "step", "name", "name_b", *METRICS, "divergent")
# Parameters drawn one by one (those that diverged first, least similar first)
MAX_PARAM_PLOTS = 8


def _number(x: float) -> str:
    return "" if math.isnan(x) else repr(float(x))


def write_csv(comparison: Comparison, path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(CSV_COLUMNS)
        for result in comparison.ranks:
            for row in result.rows:
                out.writerow(
                    [row.rank, row.step, row.name, row.name_b]
                    + [_number(getattr(row, m)) for m in METRICS]
                    + [int(row.divergent)]
                )


def summary(comparison: Comparison) -> dict[str, Any]:
    return {
        "thresholds": asdict(comparison.thresholds),
        "first_divergent_step": comparison.first_step,
        "ranks": [
            {
                "rank": r.rank,
                "steps_compared": len(r.steps),
                "params_compared": len({row.name for row in r.rows}),
                "first_divergent_step": r.first_step,
                "first_divergent_params": r.first_params,
                "only_in_a": r.only_a,
                "only_in_b": r.only_b,
                "unaligned_samples": r.unaligned_samples,
            }
            for r in comparison.ranks
        ],
    }


def write_tensorboard(result: RankResult, directory: Path) -> None:
    """One event file per rank directory; a step's scalars are one write."""
    by_step: dict[int, list[PairRow]] = {}
    for row in result.rows:
        by_step.setdefault(row.step, []).append(row)
    now = time.time()
    with EventFile(directory) as events:
        for step, rows in sorted(by_step.items()):
            tags = [f"compare/{row.name}/{m}" for row in rows for m in METRICS]
            values = [getattr(row, m) for row in rows for m in METRICS]
            sims = [row.similarity for row in rows if not math.isnan(row.similarity)]
            tags.append("compare/min/similarity")
            values.append(min(sims) if sims else math.nan)
            events.write_scalars(step, now, tags, np.asarray(values, dtype=np.float64))


def _safe(name: str) -> str:
    return re.sub(r"[^\w.\-]+", "_", name)[:150] or "_"


def _series(result: RankResult) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    for row in result.rows:
        s = out.setdefault(row.name, {"step": [], **{m: [] for m in METRICS}})
        s["step"].append(row.step)
        for m in METRICS:
            s[m].append(getattr(row, m))
    return out


def write_plots(result: RankResult, directory: Path, threshold: float) -> list[Path]:
    """PNG plots (matplotlib's Agg canvas: no display, no pyplot state). Returns the files written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    directory.mkdir(parents=True, exist_ok=True)
    series = _series(result)
    written = []
    fig = Figure(figsize=(9, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    first = set(result.first_params[:MAX_PARAM_PLOTS])
    for name, s in series.items():
        if name not in first:
            ax.plot(s["step"], s["similarity"], color="0.75", linewidth=0.8)
    for name in result.first_params[:MAX_PARAM_PLOTS]:
        s = series[name]
        ax.plot(s["step"], s["similarity"], linewidth=1.8, label=name)
    ax.axhline(threshold, color="tab:red", linestyle=":", linewidth=1, label=f"threshold {threshold:g}")
    if result.first_step is not None:
        ax.axvline(
            result.first_step,
            color="tab:red",
            linestyle="--",
            linewidth=1,
            label=f"first divergence: step {result.first_step}",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("similarity")
    ax.set_title(f"rank {result.rank}: gradient similarity, run B vs run A")
    ax.legend(loc="lower left", fontsize="small")
    path = directory / f"rank_{result.rank}_similarity.png"
    fig.savefig(path, dpi=100)
    written.append(path)
    for name in result.first_params[:MAX_PARAM_PLOTS]:
        s = series[name]
        fig = Figure(figsize=(9, 6))
        FigureCanvasAgg(fig)
        axes = fig.subplots(2, 2, sharex=True)
        for ax, metric in zip(axes.ravel(), METRICS[:4], strict=True):
            ax.plot(s["step"], s[metric], marker=".")
            ax.set_title(metric, fontsize="small")
            if result.first_step is not None:
                ax.axvline(result.first_step, color="tab:red", linestyle="--", linewidth=1)
        fig.suptitle(f"rank {result.rank}: {name}")
        path = directory / f"rank_{result.rank}" / f"{_safe(name)}.png"
        path.parent.mkdir(exist_ok=True)
        fig.savefig(path, dpi=100)
        written.append(path)
    return written


def write_report(comparison: Comparison, out: Path, plots: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(comparison, out / "similarity.csv")
    (out / "summary.json").write_text(json.dumps(summary(comparison), indent=2) + "\n", encoding="utf-8")
    for result in comparison.ranks:
        write_tensorboard(result, out / f"rank_{result.rank}")
        if plots:
            write_plots(result, out / "plots", comparison.thresholds.first)

"""Noise: how far apart the statistics of two runs that differ only in reduction order lie, per kind, dtype.

    python bench/compare_noise.py [--steps 20] [--out DIR]

Trains the demo's TinyGPT (4 layers, embedding, attention, LayerNorm, MLP, AdamW) twice per dtype on the
CPU, same weights and data, the monitor at full coverage: once as it is, once with every ``nn.Linear``
computing its product as the sum of two halves of the inner dimension (the same function, other rounding in
forward and in both backward products: what other kernels, thread splits or atomics do) and every
LayerNorm's statistics in another order. float32, and bfloat16 under ``torch.autocast``. Then compares each
pair's statistics (:mod:`trainmon.read.compare`) and prints, per kind, the largest relative difference at
the first step and over all steps, that in ulps of the compute dtype (what the default tolerance's factors,
:mod:`trainmon.read.compare.tolerance`, must stay above), and the largest score at the default tolerance with
the state's slack (below 1: no divergence). A third pair per dtype adds a real change (GELU's tanh
approximation in one MLP) for the margin.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import trainmon  # noqa: E402
from trainmon.demo import DemoSetup, build, lm_loss, synthetic_batch  # noqa: E402
from trainmon.read.compare.engine import compare  # noqa: E402
from trainmon.read.compare.source import RankReader, open_run  # noqa: E402
from trainmon.read.compare.tolerance import Tolerance, unit_roundoff  # noqa: E402

FULL = {"xy_distribution": True, "wg_distribution": True, "param_distribution": True, "mv_distribution": True,
        "format": ["tensorboard"], "tensorboard_ranks": []}  # fmt: skip


def split_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    h = self.in_features // 2
    out = F.linear(x[..., :h], self.weight[:, :h]) + F.linear(x[..., h:], self.weight[:, h:])
    return out if self.bias is None else out + self.bias


def reordered_layer_norm(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    mean = x.flip(-1).sum(-1, keepdim=True) / d
    var = ((x - mean) ** 2).flip(-1).sum(-1, keepdim=True) / d
    return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


def train(out: Path, steps: int, dtype: torch.dtype, variant: str) -> None:
    setup = DemoSetup()
    model, opt = build(setup, seed=0)
    for module in model.modules():
        if variant in ("reordered", "changed") and isinstance(module, nn.Linear):
            module.forward = types.MethodType(split_linear, module)
        if variant in ("reordered", "changed") and isinstance(module, nn.LayerNorm):
            module.forward = types.MethodType(reordered_layer_norm, module)
    if variant == "changed":  # a real change: the tanh approximation of GELU in layer 1's MLP
        mlp = model.layers[1].mlp
        mlp.forward = types.MethodType(lambda self, x: self.fc2(F.gelu(self.fc1(x), approximate="tanh")), mlp)
    data = torch.Generator().manual_seed(1)
    with trainmon.attach(model, opt, config=FULL, logdir=out):
        for _ in range(steps):
            batch = synthetic_batch(setup, data)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss = lm_loss(model, batch)
            loss.backward()
            opt.step()


def measure(a: Path, b: Path) -> tuple[dict[str, dict], int]:
    """Per kind: the largest relative difference at the first step and over all steps, that in ulps of the
    run's compute dtype, and the largest score at the default tolerance (with the state's slack); and how
    many cells the default calls divergent."""
    reader_a, reader_b = RankReader(open_run(a)), RankReader(open_run(b))
    u = unit_roundoff("bfloat16" if "bf16" in a.name else "float32")
    rows: dict[str, dict] = {}

    def sink(chunk) -> None:
        for p, pair in enumerate(chunk.plan.pairs):
            rel, score = chunk.rel[:, p], chunk.score[:, p]
            row = rows.setdefault(pair.kind, {"first": 0.0, "all": 0.0, "score": 0.0, "worst": ""})
            row["first"] = max(row["first"], float(np.nanmax(rel[:1])))
            if float(np.nanmax(rel)) > row["all"]:
                row["all"], row["worst"] = float(np.nanmax(rel)), pair.name
            row["score"] = max(row["score"], float(np.nanmax(score)))

    result = compare(reader_a, reader_b, reader_a.ranks, Tolerance(), sink=sink)
    for row in rows.values():
        row["ulps"] = row["all"] / u
    return rows, result.ranks[0].divergent_cells


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None, help="where the runs go (default: a temporary folder)")
    args = ap.parse_args()
    base = Path(args.out or tempfile.mkdtemp(prefix="trainmon-noise-"))
    torch.set_num_threads(2)
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        runs = {v: base / f"{tag}-{v}" for v in ("base", "reordered", "changed")}
        for variant, path in runs.items():
            train(path, args.steps, dtype, variant)
        for other in ("reordered", "changed"):
            found, cells = measure(runs["base"], runs[other])
            print(f"{tag}: base vs {other} ({args.steps} steps): {cells} divergent cells, default tolerance")
            print(f"  {'kind':<16}{'step 0':>10}{'all steps':>11}{'ulps':>8}{'score':>8}  largest in")
            for kind, row in found.items():
                figures = f"{row['first']:>10.2e}{row['all']:>11.2e}{row['ulps']:>8.1f}{row['score']:>8.2f}"
                print(f"  {kind:<16}{figures}  {row['worst']}")
    print(f"runs in {base}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

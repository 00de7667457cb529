"""grad_probe storage per step against msprobe's L1 sign files, and the collector's time per step.

Two measurements:

* a real run: a 4.2M-parameter MLP (4 x Linear(1024, 1024)) trained for a few steps with the default
  grad_probe (L2, 1024 samples), the bytes written per step measured on disk;
* GPT-2 small's parameter shapes (124M parameters, 148 tensors): bytes per step from the record layout
  (the format's size formula, which the test suite checks against the files).

msprobe's L1 writes one bool ``.npy`` per parameter and step: a 128-byte header and 1 byte an element.

    .venv/bin/python bench/gradprobe_storage.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import trainmon
from trainmon.run.gradprobe import ParamLayout
from trainmon.run.layout import probe_bin_file, probe_index_file

STEPS = 5


def msprobe_l1(shapes: list[tuple[int, ...]]) -> int:
    return sum(128 + torch.Size(s).numel() for s in shapes)


def ours(shapes: list[tuple[int, ...]], k: int = 1024, sign_bitmap: bool = False) -> int:
    return sum(
        ParamLayout(
            "p",
            0,
            s,
            "float32",
            "L2",
            (-1.0, 0.0, 1.0),
            0,
            "name",
            min(k, torch.Size(s).numel()),
            sign_bitmap,
        ).nbytes
        for s in shapes
    )


def gpt2_small() -> list[tuple[int, ...]]:
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [
            (d,),
            (d,),
            (d, 3 * d),
            (3 * d,),
            (d, d),
            (d,),
            (d,),
            (d,),
            (d, 4 * d),
            (4 * d,),
            (4 * d, d),
            (d,),
        ]
    return shapes + [(d,), (d,)]


def real_run() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 1024)
    with tempfile.TemporaryDirectory() as tmp:
        timings = {}
        for probe in (False, True):
            run = Path(tmp) / f"run{int(probe)}"
            cfg = {"enable": probe}
            with trainmon.attach(model, opt, logdir=run, grad_probe=cfg, format="csv") as mon:
                t0 = time.perf_counter()
                for _ in range(STEPS):
                    opt.zero_grad()
                    model(x).square().mean().backward()
                    opt.step()
                timings[probe] = (time.perf_counter() - t0) / STEPS
                mon.flush()
        written = probe_bin_file(run, 0).stat().st_size + probe_index_file(run, 0).stat().st_size
    shapes = [tuple(p.shape) for p in model.parameters()]
    n = sum(p.numel() for p in model.parameters())
    print(f"MLP 4 x Linear(1024,1024), {n:,} parameters, {len(shapes)} tensors, {STEPS} steps (CPU)")
    print(f"  trainmon grad_probe L2, K=1024: {written / STEPS:,.0f} B/step (index included)")
    print(f"  msprobe L1 sign files:          {msprobe_l1(shapes):,} B/step")
    print(f"  ratio: {written / STEPS / msprobe_l1(shapes):.3%}")
    print(f"  step time: {timings[False] * 1e3:.1f} ms without, {timings[True] * 1e3:.1f} ms with grad_probe")


def gpt2() -> None:
    shapes = gpt2_small()
    n = sum(torch.Size(s).numel() for s in shapes)
    ms = msprobe_l1(shapes)
    print(f"GPT-2 small shapes, {n:,} parameters, {len(shapes)} tensors (record layout formula)")
    for k, bitmap in ((1024, False), (256, False), (1024, True)):
        b = ours(shapes, k, bitmap)
        print(
            f"  L2, K={k}{', sign_bitmap' if bitmap else ''}: {b:,} B/step = "
            f"{b / ms:.3%} of msprobe L1 ({ms:,} B)"
        )


if __name__ == "__main__":
    torch.set_num_threads(2)
    real_run()
    gpt2()

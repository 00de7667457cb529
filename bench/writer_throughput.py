"""Writer throughput: scalars per second through the writer's sinks (by default TensorBoardSink + CsvSink;
``--sinks`` adds the statistics store and the anomaly sink, or measures them alone).

Builds realistic step records (by default 1000 rows x 7 statistics: activations, activation grads,
weight grads and Adam moments of a transformer, names like ``layers.12.mlp.fc1.output``), with a
fresh (equal) row tuple every step as the collector builds it, and writes 200 steps into a temporary
run directory. The clock covers ``records.derive`` and both sinks' ``write`` (or, with ``--thread``,
submit through the WriterThread until ``close()`` returns). A scalar is one (row, statistic) value,
counted once although both sinks write it.

    python bench/writer_throughput.py [--steps 200] [--rows 1000] [--ops min,max,...] [--thread]

Target: >= 1,000,000 scalars/s on a 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainmon.anomaly.sink import AnomalySink  # noqa: E402
from trainmon.config import load_config  # noqa: E402
from trainmon.run import records  # noqa: E402
from trainmon.run.records import Row, StepRecord  # noqa: E402
from trainmon.writer.csv import CsvSink  # noqa: E402
from trainmon.writer.layouts import LayoutCache  # noqa: E402
from trainmon.writer.statstore import StatStoreSink  # noqa: E402
from trainmon.writer.tensorboard import TensorBoardSink  # noqa: E402
from trainmon.writer.thread import WriterThread  # noqa: E402

MODULES = ("input_layernorm", "self_attention.qkv", "self_attention.proj", "post_attention_layernorm",
           "mlp.fc1", "mlp.fc2")


def make_rows(n: int) -> tuple[Row, ...]:
    """``n`` rows cycling over kinds and transformer sites, like a real step's record."""
    rows: list[Row] = []
    gen = itertools.count()
    while len(rows) < n:
        i = next(gen)
        layer, mod = divmod(i, len(MODULES))
        layer %= 48
        site = f"layers.{layer}.{MODULES[mod]}"
        for kind, name, shape, dtype, phase in (
            ("actv", f"{site}.output", torch.Size([8, 1024, 4096]), torch.bfloat16, "forward"),
            ("actv_grad", f"{site}.output", torch.Size([8, 1024, 4096]), torch.bfloat16, "backward"),
            ("grad_reduced", f"{site}.weight", torch.Size([4096, 4096]), torch.float32, "optimizer"),
            ("exp_avg", f"{site}.weight", torch.Size([4096, 4096]), torch.float32, "optimizer"),
            ("exp_avg_sq", f"{site}.weight", torch.Size([4096, 4096]), torch.float32, "optimizer"),
        ):
            rows.append(Row(kind, name, 0, 0, phase, shape, dtype))
    return tuple(rows[:n])


def make_partials(n: int, rng: np.random.Generator) -> np.ndarray:
    p = np.empty((n, records.N_PARTIALS))
    numel = rng.integers(1 << 20, 1 << 26, n).astype(np.float64)
    scale = 10.0 ** rng.uniform(-6, 2, n)
    p[:, records.NUMEL] = numel
    p[:, records.NANS] = (rng.random(n) < 0.001) * rng.integers(1, 100, n)
    p[:, records.INFS] = 0.0
    p[:, records.ZEROS] = np.floor(numel * rng.random(n) * 0.01)
    p[:, records.MIN] = -scale * rng.uniform(1, 5, n)
    p[:, records.MAX] = scale * rng.uniform(1, 5, n)
    p[:, records.SUM] = scale * rng.standard_normal(n) * np.sqrt(numel)
    p[:, records.SUMSQ] = scale**2 * numel
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--ops", default=",".join(records.STATS))
    ap.add_argument("--ndigits", type=int, default=None)
    ap.add_argument("--thread", action="store_true", help="go through WriterThread (submit + flush)")
    ap.add_argument("--dir", default=None, help="write here instead of a temporary directory")
    ap.add_argument("--sinks", default="tb,csv",
                    help="comma-separated: tb (TensorBoard events of every tensor), summary (TensorBoard's "
                         "summary view, the default since issue 33), csv, store (the columnar statistics "
                         "store), anomalies (rules, records, steps table, summary); 'all' = tb, csv, store, "
                         "anomalies, as a rank that writes everything; 'default' = summary, store, anomalies "
                         "(a rank by default); 'store,anomalies' = a rank above 16 ranks by default")
    args = ap.parse_args()
    named = {"all": ["tb", "csv", "store", "anomalies"], "default": ["summary", "store", "anomalies"]}
    chosen = named.get(args.sinks) or args.sinks.split(",")
    ops = args.ops.split(",")

    rng = np.random.default_rng(0)
    base_rows = make_rows(args.rows)
    partials = [make_partials(args.rows, rng) for _ in range(min(args.steps, 20))]
    # a fresh, equal rows tuple every step (as the collector builds it), made before the clock starts
    recs = [StepRecord(s, 0, tuple(Row(*r) for r in base_rows), partials[s % len(partials)], time.time())
            for s in range(args.steps)]
    tmp = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="trainmon-bench-"))
    rank_dir = tmp / "rank_0"
    try:
        make = {
            "tb": lambda: TensorBoardSink(rank_dir, ops, multi_chunk=False),
            "summary": lambda: TensorBoardSink(rank_dir, ops, multi_chunk=False, tensors="summary"),
            "csv": lambda: CsvSink(rank_dir, ops, args.ndigits),
            "store": lambda: StatStoreSink(tmp, 0),
            "anomalies": lambda: AnomalySink(load_config({}).alert, 0, "bench", tmp),
        }
        sinks = tuple(make[name]() for name in chosen)
        per_sink = [0.0] * len(sinks)
        derive_s = 0.0
        groups = LayoutCache(records.TensorGroups)  # as the writer thread: the rows' grouping once per layout
        writer = WriterThread(sinks, max_pending=1 << 30) if args.thread else None
        t0 = time.perf_counter()
        for record in recs:
            if writer is not None:
                writer.submit(record)
                continue
            a = time.perf_counter()
            derived = records.Derived(record, groups.get(record.rows))
            b = time.perf_counter()
            derive_s += b - a
            for k, sink in enumerate(sinks):
                c = time.perf_counter()
                sink.write(record, derived)
                per_sink[k] += time.perf_counter() - c
        if writer is not None:
            writer.close()
        else:
            for sink in sinks:
                sink.close()  # the store seals its segment here (counted: a run pays it once a segment)
        elapsed = time.perf_counter() - t0
        scalars = args.rows * len(ops) * args.steps
        size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
        mode = "thread" if writer else "direct"
        ms = 1e3 / args.steps
        print(f"rows={args.rows} ops={len(ops)} steps={args.steps} mode={mode} sinks={','.join(chosen)}")
        print(f"{scalars / elapsed:,.0f} scalars/s  ({elapsed:.3f} s, {elapsed * ms:.2f} ms/step, "
              f"{size / 1e6:.1f} MB written)")
        if writer is None:
            timed = zip(sinks, per_sink, strict=True)
            parts = ", ".join(f"{type(s).__name__} {t * ms:.2f} ms" for s, t in timed)
            print(f"  per step: derive {derive_s * ms:.2f} ms, {parts}")
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

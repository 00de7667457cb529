"""Query latency of the TensorBoard plugin on big runs (a benchmark, not a test).

Builds, in a temporary directory, a run with 1,000,000 anomaly records (64 ranks, 10,000 steps, 2,000
tensor names) and a statistics store of 10,000 steps x 500 names, then times the plugin's routes through
TensorBoard's real WSGI application (JSON encoding and middleware included). The run is written in the
previous release's layout (JSON-lines records, a binary store: quick to generate) and converted with
``trainmon migrate`` into the columnar tables the monitor writes, which the plugin then reads:

    .venv/bin/python bench/plugin_queries.py [--records 1000000] [--repeat 7]

Goals (issue 4): a timeline query under 300 ms after indexing; the 10,000 x 500 heatmap under 1 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from tensorboard.backend import application
from tensorboard.backend.event_processing import data_provider as dp
from tensorboard.backend.event_processing import plugin_event_multiplexer as pem
from tensorboard.plugins import base_plugin
from trainmon_tb.loader import TrainmonLoader
from werkzeug.test import Client
from werkzeug.wrappers import Response

from trainmon.run.anomalies import anomaly_to_json
from trainmon.run.layout import anomalies_file, stats_names_file, stats_records_file
from trainmon.run.migrate import migrate
from trainmon.run.records import STATS, Anomaly
from trainmon.run.statstore import STAT_RECORD

KINDS = ("actv", "actv_grad", "grad_unreduced", "grad_reduced", "param_updated", "scalar")
RULES = ("nan", "inf", "zscore", "turbulence", "threshold")


def write_anomalies(run: Path, n: int, ranks: int, steps: int, names: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    per_rank = n // ranks
    for rank in range(ranks):
        step = np.sort(rng.integers(0, steps, per_rank))
        name = rng.integers(0, names, per_rank)
        kind = rng.integers(0, len(KINDS), per_rank)
        rule = rng.integers(0, len(RULES), per_rank)
        origin = rng.random(per_rank) < 0.001
        path = anomalies_file(run, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for i in range(per_rank):
                a = Anomaly(
                    step=int(step[i]),
                    rank=rank,
                    kind=KINDS[kind[i]],
                    name=f"layers.{name[i] // 20}.sub{name[i] % 20}.output",
                    stat="norm",
                    value=float(i),
                    rule=RULES[rule[i]],
                    seq=i % 500,
                    origin=bool(origin[i]),
                    wall_time=1.7e9 + i,
                    message="synthetic",
                )
                f.write(anomaly_to_json(a) + "\n")


def write_stats(run: Path, steps: int, names: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    path = stats_names_file(run, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(f'{{"id":{i},"kind":"grad_reduced","name":"layers.{i}.weight"}}\n' for i in range(names))
    )
    with open(stats_records_file(run, 0), "wb") as f:
        for start in range(0, steps, 1000):
            block = np.empty((min(1000, steps - start), names), dtype=STAT_RECORD)
            block["step"] = np.arange(start, start + len(block))[:, None]
            block["id"] = np.arange(names)[None, :]
            block["stats"] = rng.lognormal(size=(len(block), names, len(STATS))).astype(np.float32)
            f.write(block.tobytes())


def client_for(logdir: Path) -> tuple[Client, object]:
    parser = argparse.ArgumentParser()
    loader = TrainmonLoader()
    loader.define_flags(parser)
    flags = parser.parse_args([])
    provider = dp.MultiplexerDataProvider(pem.EventMultiplexer(), str(logdir))
    context = base_plugin.TBContext(logdir=str(logdir), data_provider=provider, flags=flags)
    plugin = loader.load(context)
    plugin.registry.stop()
    return Client(application.TensorBoardWSGI([plugin], data_provider=provider), Response), plugin


def timed(client: Client, route: str, repeat: int) -> tuple[float, int]:
    times, size = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = client.get(f"/data/plugin/trainmon/{route}")
        body = r.get_data()
        times.append(time.perf_counter() - t0)
        assert r.status_code == 200, body[:300]
        size = len(body)
    return statistics.median(times) * 1000, size


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--names", type=int, default=2_000)
    parser.add_argument("--heatmap-names", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        logdir = Path(tmp)
        run = logdir / "big"
        t0 = time.perf_counter()
        write_anomalies(run, args.records, args.ranks, args.steps, args.names)
        write_stats(run, args.steps, args.heatmap_names)
        migrate(run)  # into the columnar tables a monitor of this release writes
        print(
            f"wrote {args.records:,} anomaly records and a {args.steps:,} x {args.heatmap_names} statistics "
            f"store in {time.perf_counter() - t0:.1f} s"
        )
        size = sum(f.stat().st_size for f in run.rglob("*") if f.is_file())
        print(f"run size on disk: {size / 2**20:.0f} MiB")
        client, plugin = client_for(logdir)
        t0 = time.perf_counter()
        summary = client.get("/data/plugin/trainmon/runs").get_json()["runs"][0]
        print(
            f"indexing (first /runs: anomalies + statistics store): {time.perf_counter() - t0:.2f} s; "
            f"{summary['anomalies']:,} records, ranks {len(summary['ranks'])}"
        )
        import trainmon_tb.runs as runs_module

        runs_module.MIN_REFRESH_SECS = 3600.0  # time the queries, not the (no-op) refresh checks
        mid = args.steps // 2
        routes = [
            ("timeline, rank axis, all steps, 1000 bins", "timeline?run=big&axis=rank&bins=1000"),
            ("timeline, module axis, all steps, 1000 bins", "timeline?run=big&axis=module&bins=1000"),
            (
                "timeline, filters (kinds, rules, glob, ranks)",
                "timeline?run=big&bins=1000&kinds=actv,grad_reduced&rules=nan,inf&name=layers.1*&ranks=0,1,2,3,40",
            ),
            ("timeline, zoomed (200 steps)", f"timeline?run=big&bins=200&step_lo={mid}&step_hi={mid + 199}"),
            (
                "events of one cell (10 steps, one rank)",
                f"events?run=big&step_lo={mid}&step_hi={mid + 9}&ranks=3",
            ),
            (
                "heatmap 10,000 steps x 500 names, 1000 bins",
                "heatmap?run=big&kind=grad_reduced&stat=norm&bins=1000",
            ),
            ("heatmap, 4000 bins", "heatmap?run=big&kind=grad_reduced&stat=max&bins=4000"),
            (
                "series of one name (10,000 steps)",
                "series?run=big&kind=grad_reduced&name=layers.7.weight&stat=norm",
            ),
        ]
        print(f"\n{'query':50s} {'median ms':>10s} {'bytes':>10s}")
        for label, route in routes:
            ms, nbytes = timed(client, route, args.repeat)
            print(f"{label:50s} {ms:10.1f} {nbytes:10,d}")
        print(
            f"\n(cpu count {os.cpu_count()}; median of {args.repeat} calls each; a statistic column "
            "is read on first use)"
        )


if __name__ == "__main__":
    main()

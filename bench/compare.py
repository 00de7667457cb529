"""Comparing two long runs: ``trainmon compare`` on a pair of 8-rank x 20,000-step x 289-tensor runs.

    python bench/compare.py build OUT [--ranks 8] [--steps 20000] [--tensors 289] [--late 15000] [--early 500]
                                      [--rank 3] [--noise 2e-4] [--jobs 2]
    python bench/compare.py measure OUT [--repeat 3]

``build`` writes three runs through the monitor's own write path with bench/scale.py's generated records (a
GPT-like layout of 289 tensors in hook order, statistics drifting from step to step with noise in every
mantissa bit): ``OUT/a``; ``OUT/late`` and ``OUT/early``, the same run with every value of every step moved by
relative noise ``--noise`` (reduction-order noise, well inside the tolerance) and, from step ``--late`` (or
``--early``) on rank ``--rank``, one forward output a third of the way into the step 25% larger and every
tensor after it in hook order 10% larger; from the next step on, every tensor of every rank (a real change
and what follows from it). Only the statistics store, the steps table and the manifest are written
(``tensorboard_ranks: []``, ``csv_ranks: []``): what the comparison reads.

``measure`` runs ``trainmon compare`` as a user does, in a fresh process, and reports its wall time and peak
memory (the largest resident set of the process), and whether it named the right rank, step and tensor:
``a`` against ``late`` in full (report folder included), and ``a`` against ``early`` with ``--first`` (stop at
the first step range holding a divergence); the latter also in-process, without Python's start and imports.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import scale  # noqa: E402  (bench/scale.py: the layout and the generated statistics)

from trainmon.run.records import MAX, MIN, SUM, SUMSQ  # noqa: E402

PAIR_FILE = "pair.json"
CONFIG = {"tensorboard_ranks": [], "csv_ranks": []}
CHANGE_ORIGIN = 0.25  # the changed forward output
CHANGE_AFTER = 0.10  # everything after it


class Changed:
    """bench/scale.py's statistics with reduction-order noise everywhere and a change from ``step`` on
    ``rank`` (see the module's docstring)."""

    def __init__(self, base: scale.Partials, noise: float, step: int | None, rank: int) -> None:
        self.base, self.noise, self.step, self.rank = base, noise, step, rank

    def __call__(self, rank: int, step: int) -> np.ndarray:
        p = self.base(rank, step).copy()
        n = len(p)
        factor = 1.0 + self.noise * np.random.default_rng((rank, step, 7)).standard_normal(n)
        if self.step is not None and (step > self.step or (step == self.step and rank == self.rank)):
            origin = self.base.origin if step == self.step else -1
            factor[origin + 1 :] *= 1.0 + CHANGE_AFTER
            if origin >= 0:
                factor[origin] *= 1.0 + CHANGE_ORIGIN
        for column in (MIN, MAX, SUM):
            p[:, column] *= factor
        p[:, SUMSQ] *= factor * factor
        return p


def _write_ranks(
    run: Path, ranks: list[int], noise: float, change_step: int | None, change_rank: int
) -> None:
    """One worker process: its ranks one after another, each through a writer thread of its own."""
    from trainmon.config import load_config
    from trainmon.run.records import StepRecord
    from trainmon.writer.manifest import ManifestSink
    from trainmon.writer.outputs import format_sinks
    from trainmon.writer.thread import WriterThread

    info = scale.BuildInfo(**json.loads((run / scale.INFO_FILE).read_text()))
    config = load_config(info.config)
    rows = scale.layout(info.tensors)
    partials = scale.Partials(rows, info)
    if change_step is not None or noise:
        partials = Changed(partials, noise, change_step, change_rank)
    for rank in ranks:
        sinks = format_sinks(config, run, rank, multi_chunk=False, world=info.ranks)
        if rank == 0:
            sinks.append(
                ManifestSink(run, {"world_size": info.ranks, "config": config.to_dict(), "chunks": 1})
            )
        writer = WriterThread(sinks, max_pending=64)
        for step in range(info.steps):
            while writer.pending >= 60:  # never drop a step
                time.sleep(0.001)
            writer.submit(StepRecord(step, rank, rows, partials(rank, step), step))
        if not writer.close(timeout=600):
            raise RuntimeError(f"rank {rank}: the writer did not finish")


def _build_run(run: Path, args: argparse.Namespace, noise: float, change_step: int | None) -> float:
    run.mkdir(parents=True, exist_ok=False)
    info = scale.BuildInfo(args.ranks, args.steps, len(scale.layout(args.tensors)), 0, args.steps + 1, False,
                           CONFIG)  # fmt: skip
    (run / scale.INFO_FILE).write_text(json.dumps(asdict(info)))
    jobs = max(1, min(args.jobs, args.ranks))
    start = time.perf_counter()
    procs = []
    for j in range(jobs):
        share = ",".join(map(str, range(j, args.ranks, jobs)))
        spec = json.dumps({"noise": noise, "step": change_step, "rank": args.rank})
        procs.append(subprocess.Popen([sys.executable, __file__, "_worker", str(run), share, spec]))
    if any(p.wait() for p in procs):
        raise SystemExit(f"error: a worker building {run} failed")
    return time.perf_counter() - start


def build(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        print(f"error: {out} exists and is not empty", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    seconds = {}
    for name, noise, step in (
        ("a", 0.0, None),
        ("late", args.noise, args.late),
        ("early", args.noise, args.early),
    ):
        seconds[name] = _build_run(out / name, args, noise, step)
        print(f"built {out / name} in {seconds[name]:.0f} s", flush=True)
    rows = scale.layout(args.tensors)
    origin = scale.Partials(rows, scale.BuildInfo(args.ranks, args.steps, len(rows), 0, 0, False, {})).origin
    pair = {"ranks": args.ranks, "steps": args.steps, "tensors": len(rows), "rank": args.rank,
            "late": args.late, "early": args.early, "noise": args.noise, "kind": rows[origin].kind,
            "name": rows[origin].name, "seconds": seconds}  # fmt: skip
    (out / PAIR_FILE).write_text(json.dumps(pair, indent=1))
    return 0


def _cli(*argv: str) -> tuple[float, int, dict, int]:
    """(wall seconds, peak RSS bytes, --json document, exit status) of one ``trainmon compare`` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "trainmon", "compare", *argv, "--json"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if done.returncode not in (0, 1):
        raise SystemExit(f"trainmon compare failed:\n{done.stderr[-3000:]}")
    # ru_maxrss of the children is the largest of any child so far: only a new maximum shows
    return seconds, max(peak, before) * 1024, json.loads(done.stdout), done.returncode


def _right(doc: dict, pair: dict, step: int) -> str:
    first = doc["first_divergence"] or {}
    found = (first.get("rank"), first.get("step"), first.get("kind"), first.get("name"))
    expected = (pair["rank"], step, pair["kind"], pair["name"])
    return f"rank {found[0]} step {found[1]} {found[2]} {found[3]} [{first.get('cause')}] -> " + (
        "right" if found == expected else f"WRONG (expected {expected})"
    )


def measure(args: argparse.Namespace) -> int:
    out = Path(args.out)
    pair = json.loads((out / PAIR_FILE).read_text())
    print(f"{pair['ranks']} ranks x {pair['steps']} steps x {pair['tensors']} tensors; change on rank "
          f"{pair['rank']} at step {pair['late']} (late) / {pair['early']} (early), noise {pair['noise']:g}; "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    times, peaks = [], []
    doc: dict = {}
    for i in range(args.repeat):
        report = out / f"report-{i}"
        seconds, peak, doc, rc = _cli(str(out / "a"), str(out / "late"), "--out", str(report))
        times.append(seconds)
        peaks.append(peak)
    print(f"full compare (report folder included): {statistics.median(times):.2f} s median of {args.repeat} "
          f"fresh processes (min {min(times):.2f} s), peak RSS {max(peaks) / 2**30:.2f} GiB; "
          f"{doc['steps_compared']} steps x {len(doc['ranks'])} ranks x {doc['tensors_compared']} tensors; "
          f"{_right(doc, pair, pair['late'])}")  # fmt: skip
    times = []
    for _ in range(args.repeat):
        seconds, peak, doc, rc = _cli(str(out / "a"), str(out / "early"), "--first", "--no-report")
        times.append(seconds)
    print(f"--first, divergence at step {pair['early']}: {statistics.median(times):.2f} s median of "
          f"{args.repeat} fresh processes (min {min(times):.2f} s); read {doc['ranges_read']} of "
          f"{doc['ranges_total']} step ranges; {_right(doc, pair, pair['early'])}")  # fmt: skip
    from trainmon.read.compare.engine import Options, compare
    from trainmon.read.compare.source import RankReader, open_run
    from trainmon.read.compare.tolerance import Tolerance

    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        a, b = RankReader(open_run(out / "a")), RankReader(open_run(out / "early"))
        result = compare(a, b, a.ranks, Tolerance(), options=Options(first_only=True))
        times.append(time.perf_counter() - start)
    print(f"--first in-process (no interpreter start, imports done): {statistics.median(times):.2f} s "
          f"median; first divergence at step {result.first.step} on rank {result.first.rank}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        spec = json.loads(argv[3])
        _write_ranks(Path(argv[1]), [int(r) for r in argv[2].split(",") if r], spec["noise"], spec["step"],
                     spec["rank"])  # fmt: skip
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the three runs")
    b.add_argument("out", metavar="OUT")
    b.add_argument("--ranks", type=int, default=8)
    b.add_argument("--steps", type=int, default=20000)
    b.add_argument("--tensors", type=int, default=289)
    b.add_argument("--late", type=int, default=15000, help="the step of the change in OUT/late")
    b.add_argument("--early", type=int, default=500, help="the step of the change in OUT/early")
    b.add_argument("--rank", type=int, default=3, help="the rank the change starts on")
    b.add_argument("--noise", type=float, default=2e-4, help="relative noise on every value of late/early")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    b.set_defaults(func=build)
    m = sub.add_parser("measure", help="time trainmon compare on the runs")
    m.add_argument("out", metavar="OUT")
    m.add_argument("--repeat", type=int, default=3)
    m.set_defaults(func=measure)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

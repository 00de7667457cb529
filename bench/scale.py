"""Scale: an N-rank run written through trainmon's real write path, and what it costs to store and to read.

    python bench/scale.py build OUT --ranks N --steps S [--tensors T] --nan-rank R --nan-step K [--jobs J]
    python bench/scale.py build OUT --ranks N --steps S --timing-only
    python bench/scale.py measure RUN [--only disk,analyze,...]

``build`` writes the run a job of N ranks would: every rank's step records go through the writer thread
(:class:`trainmon.writer.thread.WriterThread`) and the sinks the monitor builds (``format_sinks``: TensorBoard
events, the statistics store, CSV; the anomaly sink with its rules, records, steps table and summary; the
manifest on rank 0), at the default config unless ``--config`` says otherwise. The records are generated, not
copied: a GPT-like layout of T tensors (8 layers of layer norms, attention and MLP linears: activations and
their gradients, weight gradients and Adam moments, in hook order, evenly thinned to T), statistics drifting
from step to step with noise in every mantissa bit (so that compression is not flattered), rank R's first
NaN at step K (a layer's output in the forward pass, then everything downstream of it) and every other
rank's at K + 1, the NaN staying in every tensor afterwards (the parameters are NaN) unless ``--nan-once``.
Ranks are written by ``--jobs`` processes (each its ranks one after another); ``OUT/scale.json`` keeps the
build's parameters for ``measure``.

``measure`` prints one section per measurement; each is a function ``measure_<name>(run, info)`` in
:data:`MEASURES`, so more can be added without touching the others:

- ``disk``: bytes per rank-step, in total and per output (events, CSV, statistics store, anomaly records,
  steps table, summaries, the rest);
- ``analyze``: the wall time of ``trainmon analyze RUN`` (a fresh process each time, as a user runs it) and
  whether its answer is right (rank R, step K, a NaN);
- ``plugin``, ``tensorboard``, ``csv2tb``: the plugin's first answer and endpoints, TensorBoard's process-tree
  memory, ``csv2tb``'s peak memory (issue 23's other half fills these in);
- ``firstview``: the tab's first view in a real browser (``bench/plugin_first_view.py``).
- ``export``: ``trainmon export RUN`` as CSV and as every tensor's TensorBoard scalars: time, CPU, peak memory
  (issue 33: the default writes neither, the statistics store has them).
- ``time``: the tab's time views (issue 31): the first answer and what TensorBoard read by then, each time
  route's latency and size.

Every build also writes the timing tables (issue 31): every rank's ``timing/rank=<r>`` and ``rank_times/``
(:func:`timing_rows`: an 8-layer GPT's step on each rank, three throttled ranks, garbage collections now and
then, and one rank slowed in its forward for a while: the straggler episode, whose record the straggler rule
itself writes), then each rank's summary with its time. ``--timing-only`` writes only those (no statistics):
what the time view of 1,024 ranks x 20,000 steps reads, built in about a minute on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainmon.run.records import MAX, MIN, N_PARTIALS, NANS, NUMEL, SUM, SUMSQ, ZEROS, Row  # noqa: E402

INFO_FILE = "scale.json"  # no "tfevents" in the name: TensorBoard ignores it
LAYERS = 8
D = 256
MODULES = (  # (module, input width, output width, has bias): a pre-LN GPT block, in forward order
    ("ln1", D, D, True),
    ("attn.qkv", D, 3 * D, True),
    ("attn.proj", D, D, True),
    ("ln2", D, D, True),
    ("mlp.fc1", D, 4 * D, True),
    ("mlp.fc2", 4 * D, D, True),
)
TOKENS = 8 * 128  # batch x sequence


@dataclass(frozen=True)
class BuildInfo:
    ranks: int
    steps: int
    tensors: int
    nan_rank: int
    nan_step: int
    nan_once: bool
    config: dict
    seconds: float = 0.0
    # the timing tables (see "timing" below): the straggler episode and whether the statistics were left out
    straggler_rank: int = -1  # -1: none
    straggler_step: int = 0
    straggler_steps: int = 0
    timing_only: bool = False
    timing_seconds: float = 0.0


# ---------------------------------------------------------------------------------------------- the layout
def layout(tensors: int) -> tuple[Row, ...]:
    """T rows of a GPT-like step in hook order: forward activations, backward activation gradients, then
    per parameter its gradient (unreduced, reduced) and Adam moments; evenly thinned to ``tensors``."""
    forward, backward, params = [], [], []
    for layer in range(LAYERS):
        for module, d_in, d_out, bias in MODULES:
            name = f"layers.{layer}.{module}"
            forward.append(Row("actv", f"{name}.input", 0, 0, "forward", (8, 128, d_in), "torch.bfloat16"))
            forward.append(Row("actv", f"{name}.output", 0, 0, "forward", (8, 128, d_out), "torch.bfloat16"))
            backward.append(Row("actv_grad", f"{name}.output_grad", 0, 0, "backward", (8, 128, d_out),
                                "torch.bfloat16"))  # fmt: skip
            backward.append(Row("actv_grad", f"{name}.input_grad", 0, 0, "backward", (8, 128, d_in),
                                "torch.bfloat16"))  # fmt: skip
            shapes = [("weight", (d_out,) if module.startswith("ln") else (d_out, d_in))]
            if bias:
                shapes.append(("bias", (d_out,)))
            for pname, shape in shapes:
                for kind, phase in (("grad_unreduced", "backward"), ("grad_reduced", "optimizer"),
                                    ("exp_avg", "optimizer"), ("exp_avg_sq", "optimizer")):  # fmt: skip
                    params.append(Row(kind, f"{name}.{pname}", 0, 0, phase, shape, "torch.float32"))
    backward.reverse()  # backward runs the layers last to first
    order = ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq")
    rows = forward + backward + sorted(params, key=lambda r: order.index(r.kind))
    # fewer tensors: leave out whole groups, the least telling first, then thin the last one evenly
    drops = (
        lambda r: r.kind == "grad_unreduced",
        lambda r: r.kind == "actv" and r.name.endswith(".input"),
        lambda r: r.kind == "actv_grad" and r.name.endswith(".input_grad"),
        lambda r: r.kind == "exp_avg_sq",
        lambda r: r.kind == "exp_avg",
    )
    for drop in drops:
        if len(rows) <= tensors:
            break
        group = [i for i, r in enumerate(rows) if drop(r)]
        excess = len(rows) - tensors
        if excess < len(group):  # thin this group evenly
            group = [group[int(j)] for j in np.linspace(0, len(group) - 1, excess).round()]
        gone = set(group)
        rows = [r for i, r in enumerate(rows) if i not in gone]
    return tuple(rows[:tensors])


def _numel(row: Row) -> float:
    return float(np.prod(row.shape))


class Partials:
    """Statistics of every (rank, step): a per-tensor scale drifting with the step, noise in every value."""

    def __init__(self, rows: tuple[Row, ...], info: BuildInfo) -> None:
        self.rows, self.info = rows, info
        self.numel = np.array([_numel(r) for r in rows])
        base = np.random.default_rng(12345)
        self.scale = 10.0 ** base.uniform(-4, 1, len(rows))  # activations, gradients, moments all differ
        self.zeros = base.uniform(0, 0.02, len(rows))
        # where rank R's NaN starts: a forward output a third of the way in; everything after it in hook order
        outputs = [i for i, r in enumerate(rows) if r.kind == "actv" and r.name.endswith(".output")]
        self.origin = outputs[len(outputs) // 3] if outputs else 0

    def __call__(self, rank: int, step: int) -> np.ndarray:
        rng = np.random.default_rng((rank, step))
        n = len(self.rows)
        drift = 1.0 + 0.3 * np.sin(step / 50.0 + np.arange(n))
        s = self.scale * drift * rng.lognormal(0.0, 0.05, n)
        p = np.empty((n, N_PARTIALS))
        p[:, NUMEL] = self.numel
        p[:, NANS] = 0.0
        p[:, 2] = 0.0  # infs
        p[:, ZEROS] = np.floor(self.numel * self.zeros * rng.uniform(0.9, 1.1, n))
        p[:, MIN] = -s * rng.uniform(3.0, 5.0, n)
        p[:, MAX] = s * rng.uniform(3.0, 5.0, n)
        p[:, SUM] = s * rng.standard_normal(n) * np.sqrt(self.numel)
        p[:, SUMSQ] = s * s * self.numel * rng.uniform(0.9, 1.1, n)
        first = self.info.nan_step + (0 if rank == self.info.nan_rank else 1)
        if step == first or (step > first and not self.info.nan_once):
            bad = np.arange(n) >= (self.origin if step == first else 0)  # then every tensor: NaN weights
            p[bad, NANS] = self.numel[bad]
            p[bad, MIN], p[bad, MAX], p[bad, SUM], p[bad, SUMSQ], p[bad, ZEROS] = np.inf, -np.inf, 0, 0, 0
        return p


# ---------------------------------------------------------------------------------------------- build
def _sinks(config, run: Path, rank: int, world: int) -> list:
    """The sinks the monitor builds for ``rank`` of a ``world``-rank job (``trainmon.writer.lifecycle``)."""
    import inspect

    from trainmon.anomaly.sink import AnomalySink
    from trainmon.writer.manifest import ManifestSink
    from trainmon.writer.outputs import format_sinks

    kwargs: dict[str, Any] = {}
    params = inspect.signature(format_sinks).parameters
    if "world" in params:  # TensorBoard events of a few ranks and the all_ranks run, at scale
        kwargs["world"] = world
    if "aggregates" in params:  # as a job with a process group: rank 0 writes the all_ranks run
        kwargs.update(aggregates=True, all_ranks_writer=rank == 0)
    sinks = format_sinks(config, run, rank, multi_chunk=False, **kwargs)
    sinks.append(AnomalySink(config.alert, rank, run.name, run))
    if rank == 0:
        sinks.append(ManifestSink(run, {"world_size": world, "config": config.to_dict(), "chunks": 1}))
    return sinks


def _aggregate(partials: Partials, world: int, step: int) -> np.ndarray:
    """The step's tensors merged over every rank (what the all-reduce of the monitor's all_ranks table gives):
    counts and sums added, the smallest min, the largest max."""
    out = partials(0, step).copy()
    for rank in range(1, world):
        p = partials(rank, step)
        low, high = np.minimum(out[:, MIN], p[:, MIN]), np.maximum(out[:, MAX], p[:, MAX])
        out += p  # (a NaN tensor's min is +inf, its max -inf: taken before the sums, never subtracted)
        out[:, MIN], out[:, MAX] = low, high
    return out


def _write_ranks(run: Path, ranks: list[int]) -> None:
    """One worker process: its ranks, one after another, each through a writer thread of its own."""
    import dataclasses

    from trainmon.config import load_config
    from trainmon.run import records as records_module
    from trainmon.run.records import StepRecord, TensorGroups
    from trainmon.writer.thread import WriterThread

    info = BuildInfo(**json.loads((run / INFO_FILE).read_text()))
    config = load_config(info.config)
    rows = layout(info.tensors)
    partials = Partials(rows, info)
    aggregate = getattr(records_module, "RankAggregate", None)
    keys = TensorGroups(rows).keys
    all_ranks = aggregate is not None and "all_ranks" in {f.name for f in dataclasses.fields(StepRecord)}
    t0 = time.time()
    for rank in ranks:
        writer = WriterThread(_sinks(config, run, rank, info.ranks), max_pending=64)
        for step in range(info.steps):
            record = StepRecord(step, rank, rows, partials(rank, step), t0 + step)
            if all_ranks and rank == 0:  # the all_ranks run's step, as the monitor's all-reduce hands it over
                merged = aggregate(keys, _aggregate(partials, info.ranks, step))
                record = dataclasses.replace(record, all_ranks=merged)
            while writer.pending >= 60:  # never drop a step: wait for the writer instead
                time.sleep(0.001)
            writer.submit(record)
        if not writer.close(timeout=600):
            raise RuntimeError(f"rank {rank}: the writer did not finish")


# ---------------------------------------------------------------------------------------------- timing
# What a step of the generated job takes on a rank at full speed, in ms (an 8-layer GPT on one accelerator):
# its parts before and after the two monitored collectives, the gradients' all-reduce at the end of backward
# and the gradient norm's all-reduce in the optimizer step.
PHASE_MS = {"data": 2.0, "forward": 38.0, "backward": 71.0, "optimizer": 11.0, "monitor": 0.7, "other": 2.5}
ALLREDUCE_MS = 8.0  # the gradients' all-reduce, once the last rank has arrived
NORM_MS = 0.3  # the gradient norm's all-reduce
NOISE = 0.02  # every part of every rank-step: lognormal, this sigma
SLOW_FACTOR = 1.08  # a few throttled ranks: forward and backward this much slower, all along
STRAGGLER_MS = 45.0  # the straggler episode: this much more in one rank's forward
GC_PROBABILITY = 0.0002  # a rank-step with a full garbage collection (in its forward or backward) ...
GC_MS = (40.0, 120.0)  # ... this long
TIMING_BLOCK = 1000  # steps generated and written at once: one segment of the tables (columnar.SEGMENT_STEPS)


def slow_ranks(info: BuildInfo) -> tuple[int, ...]:
    """The throttled ranks: three of them from 8 ranks on (never the straggler)."""
    if info.ranks < 8:
        return ()
    picked = dict.fromkeys((info.ranks // 7, info.ranks // 2 + 3, info.ranks - 2))
    return tuple(r for r in picked if r != info.straggler_rank)


def timing_rows(info: BuildInfo, block: int) -> np.ndarray:
    """The exchanged rows (:data:`trainmon.run.timing.EXCHANGED` then the collective slots) of every rank at
    the steps of ``block`` (``block * TIMING_BLOCK ..``): ``(steps, ranks, WIDTH)``, in seconds. Every rank
    leaves a collective when the last one has arrived and the transfer is done, so the others wait for the
    throttled ranks, the straggler and a rank in a garbage collection: :func:`trainmon.run.timing.rank_times`
    derives that wait from the slots as the monitor does."""
    from trainmon.run.timing import FIELD, SLOT0, WIDTH

    lo, hi = block * TIMING_BLOCK, min(info.steps, (block + 1) * TIMING_BLOCK)
    n, world = hi - lo, info.ranks
    rng = np.random.default_rng((20260, block))
    steps = np.arange(lo, hi)

    def part(ms: float) -> np.ndarray:
        return ms * rng.lognormal(0.0, NOISE, (n, world))

    drift = (1.0 + 0.03 * np.sin(steps / 500.0))[:, None]
    speed = np.ones(world)
    speed[list(slow_ranks(info))] = SLOW_FACTOR
    data, forward = part(PHASE_MS["data"]), part(PHASE_MS["forward"]) * drift * speed
    backward = part(PHASE_MS["backward"]) * drift * speed
    if info.straggler_rank >= 0:
        episode = (steps >= info.straggler_step) & (steps < info.straggler_step + info.straggler_steps)
        forward[episode, info.straggler_rank] += STRAGGLER_MS
    gc = np.where(rng.random((n, world)) < GC_PROBABILITY, rng.uniform(*GC_MS, (n, world)), 0.0)
    arrived = data + forward + backward + gc
    grads = arrived.max(axis=1, keepdims=True) - arrived + part(ALLREDUCE_MS)
    optimizer = part(PHASE_MS["optimizer"])
    norm = optimizer.max(axis=1, keepdims=True) - optimizer + part(NORM_MS)
    monitor, other = part(PHASE_MS["monitor"]), part(PHASE_MS["other"])
    comm = grads + norm
    rows = np.zeros((n, world, WIDTH))
    parts = {"data": data, "forward": forward, "backward": backward, "optimizer": optimizer, "comm": comm,
             "gc": gc, "monitor": monitor, "other": other}  # fmt: skip
    for name, ms in parts.items():
        rows[..., FIELD[name]] = ms / 1e3
    rows[..., FIELD["step"]] = sum(parts.values()) / 1e3
    rows[..., FIELD["gc_count"]] = gc > 0
    rows[..., FIELD["comm_count"]] = 2
    rows[..., FIELD["present"]] = 1
    rows[..., SLOT0], rows[..., SLOT0 + 1] = grads / 1e3, norm / 1e3
    return rows


def _segment(partition: Path, seq: int, table: Any, options: Any) -> None:
    """``table`` (one block's steps) as the sealed segment ``seq`` of ``partition``, as a job's writer seals
    it (seq = the block: every process writes its own blocks)."""
    import pyarrow.parquet as pq

    from trainmon.run.columnar import ROW_GROUP_ROWS
    from trainmon.run.layout import sealing_name, segment_name

    partition.mkdir(parents=True, exist_ok=True)
    steps = table.column("step").to_numpy()
    tmp = partition / sealing_name(seq)
    pq.write_table(table, tmp, row_group_size=ROW_GROUP_ROWS, **options.kwargs())
    os.replace(tmp, partition / segment_name(seq, int(steps[0]), int(steps[-1])))


def _write_timing(run: Path, blocks: list[int]) -> None:
    """One worker process: the timing tables of its blocks of steps (every rank's ``timing/rank=<r>`` and,
    in a job of several ranks, ``rank_times/``), and each rank's time summed over them (for the summaries)."""
    import pyarrow as pa

    from trainmon.run.layout import rank_times_dir, timing_rank_dir
    from trainmon.run.timetable import RANK_TIMES_OPTIONS, TIMING_OPTIONS, TIMING_SCHEMA, rank_times_batch
    from trainmon.run.timing import FIELD, TIMES, rank_times

    info = BuildInfo(**json.loads((run / INFO_FILE).read_text()))
    world = info.ranks
    sums = np.zeros((world, len(TIMES)))
    for block in blocks:
        rows = timing_rows(info, block)
        n = len(rows)
        times = np.stack([rank_times(r) for r in rows])  # (n, world, TIMES)
        sums += np.nansum(times, axis=0)
        steps = pa.array(np.arange(block * TIMING_BLOCK, block * TIMING_BLOCK + n), pa.int64())
        if world > 1:  # one process exchanges nothing: no rank_times (the plugin reads timing/ then)
            batch = rank_times_batch(steps.to_numpy(), times)
            _segment(rank_times_dir(run), block, pa.Table.from_batches([batch]), RANK_TIMES_OPTIONS)
        gc_count = rows[..., FIELD["gc_count"]].astype(np.int32)
        comm_count = rows[..., FIELD["comm_count"]].astype(np.int32)
        for rank in range(world):
            columns = [steps, *(pa.array(times[:, rank, j]) for j in range(len(TIMES))),
                       pa.array(gc_count[:, rank]), pa.array(comm_count[:, rank])]  # fmt: skip
            _segment(timing_rank_dir(run, rank), block, pa.Table.from_arrays(columns, schema=TIMING_SCHEMA),
                     TIMING_OPTIONS)  # fmt: skip
    np.save(run / f".timing-sums-{os.getpid()}.npy", sums)


def straggler_records(info: BuildInfo) -> list:
    """The straggler rule's records of the straggler rank (the rule at its defaults, ``phase: all``), judged
    by :class:`trainmon.anomaly.straggler.StragglerEngine` as the rank's writer judges each step, over the
    steps from a little before the episode to a little after its start (the rule on every rank at every step
    of a 20,000-step job of 1,024 ranks would take hours; the other ranks are no stragglers)."""
    from trainmon.anomaly.straggler import StragglerEngine
    from trainmon.config.rules import StragglerRule
    from trainmon.run.records import N_PARTIALS, StepRecord
    from trainmon.run.timing import StepTiming

    rank = info.straggler_rank
    if rank < 0 or info.ranks < 2:
        return []
    rule = StragglerRule()
    engine = StragglerEngine([rule])
    lo = max(0, info.straggler_step - 4 * rule.window - rule.warmup)
    hi = min(info.steps, info.straggler_step + 4 * rule.window)
    blocks: dict[int, np.ndarray] = {}
    found = []
    for step in range(lo, hi):
        block = step // TIMING_BLOCK
        if block not in blocks:
            blocks[block] = timing_rows(info, block)
        rows = blocks[block][step - block * TIMING_BLOCK]
        timing = StepTiming(step, rank, rows[rank], rows)
        record = StepRecord(step, rank, (), np.empty((0, N_PARTIALS)), 1.7e9 + step, timing=timing)
        found.extend(engine.evaluate(record))
    return found


def build_timing(out: Path, info: BuildInfo, jobs: int) -> float:
    """Write the timing tables of the run (``jobs`` processes, blocks of steps shared among them), then each
    rank's summary with its time (the summary the statistics' writers left, else a new one: ``--timing-only``)
    and the straggler's records through its anomaly log, as its writer would have. Returns the seconds."""
    import dataclasses

    from trainmon.anomaly.log import AnomalyLog
    from trainmon.run.layout import summary_file
    from trainmon.run.summary import RankSummary, read_summary, write_summary
    from trainmon.run.timing import TIMES

    start = time.perf_counter()
    blocks = list(range((info.steps + TIMING_BLOCK - 1) // TIMING_BLOCK))
    jobs = max(1, min(jobs, len(blocks)))
    shares = [",".join(map(str, blocks[j::jobs])) for j in range(jobs)]
    procs = [subprocess.Popen([sys.executable, __file__, "_timing", str(out), share]) for share in shares]
    if any(p.wait() for p in procs):
        raise RuntimeError("a timing worker failed")
    sums = np.zeros((info.ranks, len(TIMES)))
    for part in out.glob(".timing-sums-*.npy"):
        sums += np.load(part)
        part.unlink()
    for rank in range(info.ranks):
        summary = read_summary(summary_file(out, rank)) or RankSummary(
            rank, steps=info.steps, first_step=0, last_step=info.steps - 1, wall_time=1.7e9 + info.steps
        )
        time_sums = dict(zip(TIMES, sums[rank].tolist(), strict=True))
        write_summary(out, dataclasses.replace(summary, timed=info.steps, time=time_sums))
    records = straggler_records(info)
    if records:
        log = AnomalyLog(out, info.straggler_rank)
        for record in records:
            log.write_step(record.step, [record])
        log.close()
    return time.perf_counter() - start


def build(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        print(f"error: {out} exists and is not empty", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(args.config) if args.config else {}
    straggler = args.straggler_rank if args.straggler_rank is not None else (args.ranks * 2) // 3
    # by default half-way; with statistics after the first NaN (analyze's first anomaly stays the NaN)
    after_nan = max(0, min(args.nan_step + 1, args.steps - 10))
    default_from = args.steps // 2 if args.timing_only else after_nan
    slow_from = args.straggler_step if args.straggler_step is not None else default_from
    slow_steps = args.straggler_steps or max(50, args.steps // 10)
    info = BuildInfo(args.ranks, args.steps, len(layout(args.tensors)), args.nan_rank, args.nan_step,
                     args.nan_once, config, straggler_rank=straggler if args.ranks > 1 else -1,
                     straggler_step=slow_from, straggler_steps=slow_steps,
                     timing_only=args.timing_only)  # fmt: skip
    (out / INFO_FILE).write_text(json.dumps(asdict(info)))
    jobs = max(1, min(args.jobs, args.ranks))
    start = time.perf_counter()
    if args.timing_only:  # the manifest the statistics' writers would have left (rank 0's)
        from trainmon.run.manifest import write_manifest

        write_manifest(out, {"world_size": args.ranks, "config": config, "chunks": 1})
    else:
        shares = [",".join(map(str, range(j, args.ranks, jobs))) for j in range(jobs)]
        procs = [subprocess.Popen([sys.executable, __file__, "_worker", str(out), share]) for share in shares]
        codes = [p.wait() for p in procs]
        if any(codes):
            print(f"error: a worker failed ({codes})", file=sys.stderr)
            return 1
    seconds = time.perf_counter() - start
    timing_seconds = build_timing(out, info, args.jobs)
    total = seconds + timing_seconds
    done = {**asdict(info), "seconds": total, "timing_seconds": timing_seconds}
    (out / INFO_FILE).write_text(json.dumps(done))
    what = "timing tables only" if args.timing_only else f"{info.tensors} tensors"
    nan = "" if args.timing_only else f"; first NaN: rank {args.nan_rank} at step {args.nan_step}"
    last = info.straggler_step + info.straggler_steps - 1
    print(f"built {out}: {args.ranks} ranks x {args.steps} steps x {what} in {total:.0f} s ({jobs} "
          f"processes; the timing tables {timing_seconds:.0f} s){nan}; straggler: rank "
          f"{info.straggler_rank}'s forward +{STRAGGLER_MS:.0f} ms, steps {info.straggler_step}-{last}; "
          f"throttled: {list(slow_ranks(info))}")
    return 0


# ---------------------------------------------------------------------------------------------- measure
def _sizes(run: Path) -> dict[str, int]:
    """Bytes under ``run`` by output."""
    from trainmon.run.layout import (
        anomalies_dir,
        plugin_dir,
        rank_times_dir,
        stats_dir,
        steps_dir,
        summary_dir,
        timing_dir,
    )

    parts = {"stats": stats_dir(run), "anomalies": anomalies_dir(run), "steps": steps_dir(run),
             "summary": summary_dir(run), "timing": timing_dir(run),
             "rank_times": rank_times_dir(run)}  # fmt: skip
    out = dict.fromkeys(("events", "csv", *parts, "other"), 0)
    for dirpath, _, files in os.walk(run):
        here = Path(dirpath)
        for f in files:
            size = (here / f).stat().st_size
            if f == INFO_FILE and here == run:
                continue
            key = next((k for k, d in parts.items() if here == d or d in here.parents), None)
            if key is None:
                if "tfevents" in f:
                    key = "events"
                elif f.endswith(".csv") and plugin_dir(run) not in here.parents:
                    key = "csv"
                else:
                    key = "other"
            out[key] += size
    return out


def measure_disk(run: Path, info: BuildInfo) -> None:
    sizes = _sizes(run)
    rank_steps = info.ranks * info.steps
    total = sum(sizes.values())
    print(f"disk: {total / 1e9:.2f} GB, {total / rank_steps / 1e3:.2f} KB per rank-step "
          f"({info.ranks} ranks x {info.steps} steps)")
    for key, size in sizes.items():
        print(f"  {key:<10} {size / rank_steps / 1e3:8.2f} KB per rank-step  {size / 1e6:10.1f} MB")


def _analyze(run: Path, *args: str) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trainmon", "analyze", str(run), *args], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)  # fmt: skip
    return time.perf_counter() - start, proc.stdout


def measure_analyze(run: Path, info: BuildInfo, repeat: int = 5) -> None:
    times = []
    doc: dict = {}
    for _ in range(repeat):
        seconds, out = _analyze(run, "--json")
        times.append(seconds)
        doc = json.loads(out)
    first = doc["first"] or {}
    right = (first.get("rank"), first.get("step"), first.get("rule")) == (info.nan_rank, info.nan_step, "nan")
    print(f"analyze: {statistics.median(times):.2f} s median of {repeat} fresh processes "
          f"(first {times[0]:.2f} s, min {min(times):.2f} s); answer: rank {first.get('rank')} step "
          f"{first.get('step')} {first.get('kind')} {first.get('name')} [{first.get('rule')}] -> "
          f"{'right' if right else 'WRONG'}; {doc['anomalies']} anomalies on {doc['ranks']} ranks")
    seconds, _ = _analyze(run, "--json", "--rule", "nan,inf", "--top", "64")
    print(f"analyze --rule nan,inf --top 64 (what --explain starts with): {seconds:.2f} s")


# ---------------------------------------------------------------------------------------------- readers
def _tree_rss(pid: int, field: str = "VmRSS:") -> dict[int, int]:
    """Resident bytes of ``pid`` and each of its descendants (from /proc): ``VmRSS:`` (each process's whole
    resident set, pages shared between processes counted in each) or ``Pss:`` (shared pages divided among the
    processes sharing them, so that the sum is the tree's real footprint)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status" if field == "VmRSS:" else f"/proc/{p}/smaps_rollup") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith(field))
            out[p] = rss * 1024
        except (OSError, StopIteration):
            pass
        todo.extend(children.get(p, []))
    return out


class _Sampler:
    """Samples the RSS of a process tree in a thread: the peak of the sum, and the peak of the root alone."""

    def __init__(self, pid: int, every: float = 0.2) -> None:
        import threading

        self.pid, self.every = pid, every
        self.peak = self.root_peak = self.pss_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            tree = _tree_rss(self.pid)
            self.peak = max(self.peak, sum(tree.values()))
            self.root_peak = max(self.root_peak, tree.get(self.pid, 0))
            self.pss_peak = max(self.pss_peak, sum(_tree_rss(self.pid, "Pss:").values()))
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _TensorBoard:
    """``tensorboard --logdir RUN`` on 127.0.0.1 (a free port), started at ``start``."""

    def __init__(self, logdir: Path, tmp: Path) -> None:
        import re

        self.tmp = tmp
        err = tmp / "tb.err"
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
             "--port", "0"],
            stdout=subprocess.DEVNULL, stderr=open(err, "wb"),  # noqa: SIM115 - the process keeps it
            env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tb_plugin'}"},
        )  # fmt: skip
        self.sampler = _Sampler(self.proc.pid)
        deadline = time.monotonic() + 120
        while True:
            m = re.search(r"http://127\.0\.0\.1:(\d+)/", err.read_text(errors="replace"))
            if m:
                self.base = f"http://127.0.0.1:{m.group(1)}"
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("TensorBoard did not start:\n" + err.read_text(errors="replace")[-2000:])
            time.sleep(0.05)

    def get(self, path: str, timeout: float = 600) -> tuple[float, int, int, Any]:
        """(seconds, JSON bytes, bytes sent gzip-compressed, the parsed answer) of one request."""
        import gzip
        import urllib.request

        req = urllib.request.Request(self.base + path, headers={"Accept-Encoding": "gzip"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            zipped = r.headers.get("Content-Encoding") == "gzip"
        seconds = time.perf_counter() - t0
        body = gzip.decompress(raw) if zipped else raw
        return seconds, len(body), len(raw), json.loads(body) if body[:1] in (b"{", b"[") else None

    def close(self) -> None:
        self.sampler.stop()
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


# ---------------------------------------------------------------------------------------------- plugin
def measure_plugin(run: Path, info: BuildInfo) -> None:
    """The trainmon tab's server side in a real ``tensorboard --logdir RUN``: the first complete answer after
    the start (the run list with the run's anomalies, then its timeline), each endpoint's latency (median of
    7) and size, the TensorBoard process's memory with the plugin's caches filled; then, in this process,
    what a refresh costs when nothing is new."""
    import tempfile
    import urllib.parse

    q = urllib.parse.quote
    with tempfile.TemporaryDirectory() as tmp:
        tb = _TensorBoard(run, Path(tmp))  # as a user opens the run: tensorboard --logdir RUN
        try:
            rid = "."
            while True:  # TensorBoard itself
                try:
                    tb.get("/data/plugins_listing")
                    break
                except OSError:
                    time.sleep(0.05)
            serving = time.perf_counter() - tb.start
            while True:
                try:
                    _, _, _, runs = tb.get("/data/plugin/trainmon/runs")
                except OSError:
                    runs = None
                mine = next((r for r in (runs or {}).get("runs", []) if r["run"] == rid), None)
                if mine and mine["anomalies"] > 0:
                    break
                if time.perf_counter() - tb.start > 900:
                    raise RuntimeError(f"the plugin never listed {rid}: {runs}")
                time.sleep(0.05)
            listed = time.perf_counter() - tb.start
            _, _, _, timeline = tb.get(f"/data/plugin/trainmon/timeline?run={q(rid)}&bins=440")
            first_answer = time.perf_counter() - tb.start
            first = timeline.get("first") or {}
            print(
                f"plugin: first answer {first_answer:.2f} s after the start of tensorboard --logdir (the run "
                f"listed at {listed:.2f} s, TensorBoard answering from {serving:.2f} s; with "
                f"{mine['anomalies']} anomalies on {len(mine['ranks'])} ranks; "
                f"the timeline names rank {first.get('rank')} step {first.get('step')} [{first.get('rule')}])"
            )
            nan_rank, nan_step = info.nan_rank, info.nan_step
            tensor = "layers.0.attn.qkv.output"
            tl = f"timeline?run={q(rid)}&bins=440"
            hm = f"heatmap?run={q(rid)}&rank={nan_rank}&kind=actv"
            routes = [
                ("runs", "runs"),
                ("timeline (rank rows, 440 bins)", f"timeline?run={q(rid)}&bins=440"),
                ("timeline, nothing new (since=key)", f"{tl}&since={q(timeline['key'])}"),
                ("timeline, NaN rank's group expanded", f"timeline?run={q(rid)}&bins=440&expand={nan_rank}"),
                ("timeline (module rows)", f"timeline?run={q(rid)}&bins=440&axis=module"),
                ("timeline zoomed to the NaN step",
                 f"timeline?run={q(rid)}&bins=440&step_lo={nan_step}&step_hi={nan_step}"),
                ("events of the first NaN's cell",
                 f"events?run={q(rid)}&step_lo={nan_step}&step_hi={nan_step}&ranks={nan_rank}"),
                ("heatmap actv norm, 1000 bins (first: read)",
                 f"{hm}&stat=norm&bins=1000"),
                ("heatmap actv norm, 1000 bins", f"{hm}&stat=norm&bins=1000"),
                ("heatmap actv max, 4000 bins", f"{hm}&stat=max&bins=4000"),
                ("series of one tensor", f"series?run={q(rid)}&rank={nan_rank}&kind=actv&name={q(tensor)}"),
            ]  # fmt: skip
            print(f"  {'route':<44} {'median':>9} {'JSON':>10} {'sent (gzip)':>12}")
            for label, path in routes:
                once = "(first" in label
                times, sizes = [], (0, 0)
                for _ in range(1 if once else 7):
                    seconds, size, sent, _ = tb.get("/data/plugin/trainmon/" + path)
                    times.append(seconds)
                    sizes = (size, sent)
                print(
                    f"  {label:<44} {statistics.median(times) * 1e3:7.0f} ms {sizes[0] / 1e3:8.1f} KB "
                    f"{sizes[1] / 1e3:10.1f} KB"
                )
            tree = _tree_rss(tb.proc.pid)
            print(
                f"  TensorBoard's Python process (the plugin and its caches): "
                f"{_mib(tree.get(tb.proc.pid, 0))} now, peak {_mib(tb.sampler.root_peak)}; "
                f"whole tree {_mib(sum(tree.values()))}"
            )
        finally:
            tb.close()
    _measure_refresh(run)


def _measure_refresh(run: Path, repeat: int = 20) -> None:
    from trainmon_tb.runs import Run

    from trainmon.run.layout import rank_partitions

    plugin = run / "plugins" / "trainmon"
    files = sum(len(rank_partitions(plugin / t)) for t in ("anomalies", "stats", "steps"))
    files += len(list((plugin / "summary").glob("rank_*.json")))
    t0 = time.perf_counter()
    r = Run(run.name, run)
    r.refresh()
    loaded = time.perf_counter() - t0
    time.sleep(2.1)  # the folders' modification times are then old enough to be trusted
    r.refresh()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        r.refresh()
        times.append(time.perf_counter() - t0)
    print(
        f"plugin refresh with nothing new: {statistics.median(times) * 1e3:.2f} ms median of {repeat} "
        f"(max {max(times) * 1e3:.2f} ms) over {files} rank files; the first load took {loaded:.2f} s in "
        f"this process ({len(r.anomalies)} anomaly records)"
    )


# ---------------------------------------------------------------------------------------------- time
def _read_bytes(pid: int) -> int:
    """Bytes the process has read from files so far (``rchar`` of /proc/<pid>/io: the page cache included)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def measure_time(run: Path, info: BuildInfo) -> None:
    """The tab's time views in a real ``tensorboard --logdir RUN``: the first answer after the start (the run
    listed, its timeline), with what TensorBoard's process had read by then (the time data must not be read
    before a time heat map asks for it); 2 s later (when the tab, its first view drawn, asks), each time
    route's latency (the first request of a time reads it: measured once; the others median of 7) and size;
    TensorBoard's memory with the times cached."""
    import tempfile
    import urllib.parse

    from trainmon.run.layout import rank_times_dir, timing_dir

    def size(folder: Path) -> int:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())

    q = urllib.parse.quote
    rid = "."
    with tempfile.TemporaryDirectory() as tmp:
        tb = _TensorBoard(run, Path(tmp))
        try:
            while True:  # TensorBoard itself
                try:
                    tb.get("/data/plugins_listing")
                    break
                except OSError:
                    time.sleep(0.02)
            serving = time.perf_counter() - tb.start
            while True:
                try:
                    _, _, _, runs = tb.get("/data/plugin/trainmon/runs")
                except OSError:
                    runs = None
                mine = next((r for r in (runs or {}).get("runs", []) if r["run"] == rid), None)
                if mine:
                    break
                if time.perf_counter() - tb.start > 300:
                    raise RuntimeError(f"the plugin never listed {rid}: {runs}")
                time.sleep(0.05)
            listed = time.perf_counter() - tb.start
            _, _, _, timeline = tb.get(f"/data/plugin/trainmon/timeline?run={q(rid)}&bins=440")
            first_answer = time.perf_counter() - tb.start
            read_then = _read_bytes(tb.proc.pid)
            episodes = timeline.get("episodes") or []
            print(
                f"time: first answer {first_answer:.2f} s after the start of tensorboard --logdir, "
                f"{first_answer - serving:.2f} s after TensorBoard's own first answer ({serving:.2f} s; the "
                f"run listed at {listed:.2f} s, timed: {mine.get('timed')}); TensorBoard's process had read "
                f"{read_then / 1e6:.1f} MB of files by then (the timing tables: rank_times/ "
                f"{size(rank_times_dir(run)) / 1e6:.0f} MB, timing/ {size(timing_dir(run)) / 1e6:.0f} MB); "
                f"the timeline labels {len(episodes)} straggler episode(s): "
                + ", ".join(f"rank {e['rank']} {e['phase']} {e['factor']:.2f}x from step {e['step']}"
                            for e in episodes[:3])  # fmt: skip
            )
            slow = info.straggler_rank if info.straggler_rank >= 0 else 0
            at = episodes[0]["step"] if episodes else info.straggler_step
            # the tab asks for the time heat map once its first view is drawn, TensorBoard's own page and the
            # timeline in a fresh browser: 2-3 s after TensorBoard answers (bench/plugin_first_view.py)
            time.sleep(2.0)
            hm = f"time_heatmap?run={q(rid)}"
            routes = [
                ("step, 600 bins (first: reads the time)", f"{hm}&time=step&bins=600"),
                ("step, 600 bins (the tab 1,400 px wide)", f"{hm}&time=step&bins=600"),
                ("step, 1000 bins", f"{hm}&time=step&bins=1000"),
                ("step, 2000 bins (the most)", f"{hm}&time=step&bins=2000"),
                ("forward, 600 bins (first: reads it)", f"{hm}&time=forward&bins=600"),
                ("forward, 600 bins", f"{hm}&time=forward&bins=600"),
                ("wait, 600 bins (first: reads it)", f"{hm}&time=wait&bins=600"),
                ("wait, 600 bins", f"{hm}&time=wait&bins=600"),
                ("forward around the episode, its group open",
                 f"{hm}&time=forward&bins=600&step_lo={max(0, at - 250)}&step_hi={at + 749}&expand={slow}"),
                ("rank_steps of the straggler (first)", f"rank_steps?run={q(rid)}&rank={slow}&points=600"),
                ("rank_steps of the straggler", f"rank_steps?run={q(rid)}&rank={slow}&points=600"),
                ("timeline with the episode", f"timeline?run={q(rid)}&bins=440"),
            ]  # fmt: skip
            print(f"  {'route':<48} {'median':>9} {'max':>9} {'JSON':>10} {'sent (gzip)':>12}")
            worst = 0.0
            for label, path in routes:
                once = "(first" in label
                times, sizes = [], (0, 0)
                for _ in range(1 if once else 7):
                    seconds, n, sent, answer = tb.get("/data/plugin/trainmon/" + path)
                    if isinstance(answer, dict) and "error" in answer:
                        raise RuntimeError(f"{path}: {answer['error']}")
                    times.append(seconds)
                    sizes = (n, sent)
                worst = max(worst, max(times))
                print(
                    f"  {label:<48} {statistics.median(times) * 1e3:7.0f} ms {max(times) * 1e3:6.0f} ms "
                    f"{sizes[0] / 1e3:8.1f} KB {sizes[1] / 1e3:10.1f} KB"
                )
            tree = _tree_rss(tb.proc.pid)
            print(
                f"  slowest time request: {worst * 1e3:.0f} ms; TensorBoard's Python process with 3 times "
                f"cached: {_mib(tree.get(tb.proc.pid, 0))} (peak {_mib(tb.sampler.root_peak)})"
            )
        finally:
            tb.close()


# ---------------------------------------------------------------------------------------------- TensorBoard
def measure_tensorboard(run: Path, info: BuildInfo) -> None:
    """``tensorboard --logdir RUN`` until every scalar of every TensorBoard run of RUN is served (the last
    step of each run's tags), with the peak memory of its process tree (TensorBoard and its data server)."""
    import tempfile
    import urllib.parse

    runs = sorted({p.parent.relative_to(run).as_posix() for p in run.rglob("events.out.tfevents.*")})
    with tempfile.TemporaryDirectory() as tmp:
        tb = _TensorBoard(run, Path(tmp))
        try:
            last = info.steps - 1
            pending = set(runs)
            tags: dict[str, int] = {}
            while pending:
                if time.perf_counter() - tb.start > 1800:
                    raise RuntimeError(f"TensorBoard did not load {sorted(pending)[:5]} within 30 minutes")
                try:
                    _, _, _, listing = tb.get("/data/plugin/scalars/tags", timeout=120)
                except OSError:
                    time.sleep(0.5)
                    continue
                for name in sorted(pending):
                    run_tags = (listing or {}).get(name) or {}
                    if not run_tags:
                        continue
                    tag = sorted(run_tags)[-1]
                    quoted = urllib.parse.quote
                    path = f"/data/plugin/scalars/scalars?run={quoted(name)}&tag={quoted(tag)}"
                    try:
                        _, _, _, points = tb.get(path, timeout=120)
                    except OSError:
                        continue
                    if points and max(p[1] for p in points) == last and len(run_tags) == tags.get(name, -1):
                        pending.discard(name)
                    tags[name] = len(run_tags)
                time.sleep(0.5)
            seconds = time.perf_counter() - tb.start
            time.sleep(1.0)
            tree = _tree_rss(tb.proc.pid)
            print(
                f"tensorboard: {len(runs)} TensorBoard runs ({', '.join(runs[:4])}"
                f"{' ...' if len(runs) > 4 else ''}), {sum(tags.values())} tags, every one served to step "
                f"{last} after {seconds:.1f} s; process tree peak {_mib(tb.sampler.peak)} (resident sets; "
                f"proportional: {_mib(tb.sampler.pss_peak)}), now {_mib(sum(tree.values()))} "
                f"({len(tree)} processes)"
            )
        finally:
            tb.close()


# ---------------------------------------------------------------------------------------------- csv2tb
def measure_csv2tb(run: Path, info: BuildInfo) -> None:
    """``trainmon csv2tb RUN`` (default workers) into a temporary folder: time and the peak memory of its
    process tree (the workers included)."""
    import shutil
    import tempfile

    csvs = list(run.glob("rank_*/*.csv"))
    if not csvs:
        print("csv2tb: the run has no CSV (format without csv, the default: see export)")
        return
    size = sum(p.stat().st_size for p in csvs)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tb"
        t0 = time.perf_counter()
        command = [sys.executable, "-m", "trainmon", "csv2tb", str(run), "-o", str(out), "--no-progress"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        sampler = _Sampler(proc.pid, every=0.1)
        output = proc.communicate()[0]
        sampler.stop()
        seconds = time.perf_counter() - t0
        if proc.returncode:
            print(f"csv2tb: failed ({proc.returncode}): {output[-2000:]}")
            return
        files = list(out.rglob("events.out.tfevents.*"))
        print(
            f"csv2tb: {len(csvs)} CSV files, {size / 1e9:.2f} GB -> {len(files)} event files in "
            f"{seconds:.1f} s; peak memory of its process tree {_mib(sampler.pss_peak)} (proportional set "
            f"size: pages the processes share counted once; the sum of their resident sets peaked at "
            f"{_mib(sampler.peak)})"
        )
        shutil.rmtree(out, ignore_errors=True)


def measure_firstview(run: Path, info: BuildInfo) -> None:
    """The tab's first view in a real browser (bench/plugin_first_view.py: HTTP up to the timeline drawn, the
    tab's own part of it, a reload, /timeline's size)."""
    script = Path(__file__).with_name("plugin_first_view.py")
    subprocess.run([sys.executable, str(script), str(run)], check=True)


# ---------------------------------------------------------------------------------------------- export
def measure_export(run: Path, info: BuildInfo) -> None:
    """``trainmon export RUN --format csv`` and ``--format tensorboard`` (every rank) into a temporary folder:
    time, the CPU time of the process and its peak memory, and what it wrote."""
    import resource
    import shutil
    import tempfile

    for fmt in ("csv", "tensorboard"):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out"
            command = [sys.executable, "-m", "trainmon", "export", str(run), "--format", fmt, "-o", str(out)]
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=env)  # fmt: skip
            sampler = _Sampler(proc.pid, every=0.1)
            output = proc.communicate()[0]
            sampler.stop()
            seconds = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            if proc.returncode:
                print(f"export --format {fmt}: failed ({proc.returncode}): {output[-2000:]}")
                continue
            files = [p for p in out.rglob("*") if p.is_file()]
            size = sum(p.stat().st_size for p in files)
            print(
                f"export --format {fmt}: {len(files)} files, {size / 1e9:.2f} GB "
                f"({size / (info.ranks * info.steps) / 1e3:.1f} KB per rank-step) in {seconds:.1f} s "
                f"({cpu:.1f} s CPU); peak memory {_mib(sampler.pss_peak)} (proportional set; resident "
                f"{_mib(sampler.peak)})"
            )
            shutil.rmtree(out, ignore_errors=True)


MEASURES: dict[str, Callable[[Path, BuildInfo], None]] = {
    "disk": measure_disk,
    "analyze": measure_analyze,
    "plugin": measure_plugin,
    "tensorboard": measure_tensorboard,
    "csv2tb": measure_csv2tb,
    "firstview": measure_firstview,
    "export": measure_export,
    "time": measure_time,
}


def measure(args: argparse.Namespace) -> int:
    run = Path(args.run)
    info = BuildInfo(**json.loads((run / INFO_FILE).read_text()))
    names = args.only.split(",") if args.only else list(MEASURES)
    unknown = [n for n in names if n not in MEASURES]
    if unknown:
        print(f"error: unknown measurement(s) {unknown}; known: {', '.join(MEASURES)}", file=sys.stderr)
        return 2
    print(f"{run}: {info.ranks} ranks x {info.steps} steps x {info.tensors} tensors, first NaN rank "
          f"{info.nan_rank} step {info.nan_step}; {os.cpu_count()} CPUs")
    for name in names:
        MEASURES[name](run, info)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        _write_ranks(Path(argv[1]), [int(r) for r in argv[2].split(",") if r])
        return 0
    if argv[:1] == ["_timing"]:
        _write_timing(Path(argv[1]), [int(b) for b in argv[2].split(",") if b])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write an N-rank run through the real write path")
    b.add_argument("out", metavar="OUT")
    b.add_argument("--ranks", type=int, required=True)
    b.add_argument("--steps", type=int, required=True)
    b.add_argument("--tensors", type=int, default=289, help="tensors a step (default 289: an 8-layer GPT)")
    b.add_argument("--nan-rank", type=int, default=None, help="the first NaN's rank (not with --timing-only)")
    b.add_argument("--nan-step", type=int, default=None, help="its step")
    b.add_argument("--nan-once", action="store_true", help="only the first NaN step is NaN (default: stays)")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    b.add_argument("--config", default=None, help="config keys as JSON (default: trainmon's defaults)")
    b.add_argument("--straggler-rank", type=int, default=None, help="rank slowed for a while (default 2/3 N)")
    b.add_argument("--straggler-step", type=int, default=None,
                   help="its first slow step (default: the step after the NaN; S / 2 with --timing-only)")
    b.add_argument("--straggler-steps", type=int, default=None, help="its slow steps (default max(50, S/10))")
    b.add_argument("--timing-only", action="store_true",
                   help="only the timing tables, summaries and straggler records (no statistics): what a "
                   "1,024-rank x 20,000-step run's time view reads, built in minutes")  # fmt: skip
    b.set_defaults(func=build)
    m = sub.add_parser("measure", help="disk, analyze, plugin, TensorBoard and csv2tb figures of a built run")
    m.add_argument("run", metavar="RUN")
    m.add_argument("--only", default=None, help=f"comma-separated: {', '.join(MEASURES)}")
    m.set_defaults(func=measure)
    args = ap.parse_args(argv)
    if args.command == "build":
        if args.timing_only:
            args.nan_rank, args.nan_step = -1, -1
        elif args.nan_rank is None or args.nan_step is None:
            ap.error("--nan-rank and --nan-step are required (without --timing-only)")
        elif not 0 <= args.nan_rank < args.ranks:
            ap.error("--nan-rank must be one of the ranks")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

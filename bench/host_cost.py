"""The monitor's host cost on the CPU: time per collected step and per monitored tensor, garbage collections
and their pauses, and Python allocations per step; the loop to iterate on, as a GPU is lent rarely.

The workload is the GPU yardstick's model (``gpt_cuda.py``: 16 layers, the same modules and parameters, so
the same ~2,000 rows a collected step) at a tiny width, so that the device work is next to nothing and
what is left is the host's: hooks, the step buffer, kernel launches and what the writer takes from the
training thread. Two ways to run the statistics:

* ``native``: the CPU path as users run it (the C kernel on tensors of a few hundred elements);
* ``triton``: the GPU path's host side. The Triton backend runs on CPU tensors (``TRITON_INTERPRET=1``)
  with its kernels replaced by stand-ins that launch nothing (as ``bench/launch_count.py``), so every
  host-side part of it runs: tensor tables, descriptors, shared rows, the launches' arguments. A real
  launch's own cost (Triton's launcher, the driver) is not in it: ``launches`` says how many there are.

A *user heap* of long-lived objects (``--heap``, 1M by default: what a large training script keeps) makes
Python's full collections as long as in a real job, so the pauses the monitor adds show at their true size.

Off and on alternate in blocks within one process (``--pairs`` pairs of ``--block`` steps, 10 x 60 by
default), so the drift of a shared machine cancels out: a mode's host time and ratio are the median over the
pairs of an on block against the off block just before it (the pooled means are in the JSON). Each on block
starts with ``attach`` and ``--warmup`` monitored steps that hold the monitor's first collected step (step 0:
its caches of row descriptions and hooks fill, the Triton path learns which tensors change in place): attach
is not a step, and the first collected step is a one-off, so both are timed apart. The collector starts from a
known state (one ``gc.collect()`` after the user heap is built and the model warmed up), so that what a block
promotes, not where building the heap left Python's count, decides whether a full collection falls in it.

Reported per mode: mean and median step, host time per collected step and per monitored tensor (on minus off,
over the rows a step records), generation-2 collections and their pauses in the on and off blocks (the JSON
says at which step each one fell), attach and the first collected step (ms), objects promoted to the oldest
generation by attach and the warm-up (a one-off, the process's first attach: it imports the writer's side,
pyarrow and pandas) and per steady step after it, and the net growth of Python allocations per steady step
(``tracemalloc``, a separate run).

    python bench/host_cost.py                                    # full, full_api, wg+mv; native, triton
    python bench/host_cost.py --modes full --backends triton --pairs 4 --block 60
    python bench/host_cost.py --json host.json
    python bench/host_cost.py --modes full_api --backends triton --split 20   # where a row's time goes

``--split STEPS`` (the Triton backend) adds, after the pairs, STEPS monitored steps with the host side's
parts timed apart, each a part's own time (the parts it calls taken out): Triton's launcher
(``triton_path.launch``: here a stand-in, so only trainmon's side of a launch), the batches' staging (their
tables and descriptors built and uploaded: ``_launch_batch``, the uploads), the reducer's rows (``row``,
``rows``, ``adam_rows``, ``merged_row``, ``complete``) and the step buffer (``StepBuffer``'s adds and
``finish``); and the torch operations dispatched per row (a monitored step's against an unmonitored one's,
counted under a dispatch mode), with what one costs on this CPU. Per row, in us; what is left of the host
time per tensor is the hooks, the schedule and the glue between (and the C hot path of the step buffer,
which the hooks call straight). On a GPU machine the same parts meet CUDA tensors and the real launcher:
the split says which of them a CPU run under-predicts.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"

FULL = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
}
MODES: dict[str, dict] = {
    "full": FULL,  # default outputs: TensorBoard, CSV and the columnar tables, written from this process
    "full_api": {**FULL, "format": "api"},  # nothing written: the collection side alone
    "wgmv": {"wg_distribution": True, "mv_distribution": True},
    "full_interval10": {**FULL, "step_interval": 10},
}


class _GcWatch:
    """Every collection of the process: generation and pause, attributed to the block running."""

    def __init__(self) -> None:
        self.block = "off"
        self.pair = 0
        self.step = -1  # within the block
        self.pauses: dict[str, dict[int, list[float]]] = {}
        self.full: list[tuple[str, int, int]] = []  # (block, pair, step) of each generation-2 collection
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            pauses = self.pauses.setdefault(self.block, {0: [], 1: [], 2: []})
            pauses[info["generation"]].append(time.perf_counter() - self._start)
            if info["generation"] == 2:
                self.full.append((self.block, self.pair, self.step))

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


class _StandInKernels:
    """Stands in for trainmon.stats.triton_kernels: ``kernel[grid](...)`` counts and returns, and stage 2
    writes clean rows (the element count and zeros), so the rules see finite tensors as in training;
    constants and the ``triton`` module are the real ones."""

    def __init__(self, real) -> None:
        self._real = real
        self.launches = 0

    def _launch(self, *args, **kwargs) -> None:
        self.launches += 1

    def _finalize(self, descs, part, out, **kwargs) -> None:
        self.launches += 1
        d = descs.view(-1, self._real.DESC_WIDTH)
        out[d[:, 2]] = 0.0
        out[d[:, 2], 0] = d[:, 3].double()

    def __getattr__(self, name: str):
        value = getattr(self._real, name)
        if name == "triton" or not hasattr(value, "__getitem__"):
            return value
        stand_in = _Kernel(self._finalize if name == "finalize" else self._launch)
        setattr(self, name, stand_in)  # later lookups find it at once
        return stand_in


class _Kernel:
    """``kernel[grid]`` gives the launch function."""

    def __init__(self, launch) -> None:
        self._launch = launch

    def __getitem__(self, grid):
        return self._launch


# the yardstick's activations (16-64 MiB) fill a batch by bytes after about 12 tensors, the tiny model's by
# count only after 256: this many a batch gives the tiny model the yardstick's number of batch launches
BATCH_HELP = "Triton backend: at most this many tensors a batch (12: as many batches as on the GPU yardstick)"


def _user_heap(objects: int) -> list:
    """Long-lived objects a training script holds (datasets' metadata, configs, module trees): containers,
    as only those are tracked by the collector."""
    return [{"i": i, "v": [i]} for i in range(objects // 2)]


def _workload(args: argparse.Namespace):
    sys.path.insert(0, str(args.workload_dir))
    import torch
    import torch.nn.functional as F
    from gpt_cuda import GPT

    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, d=args.d, h=args.heads, layers=args.layers, T=args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, args.vocab, (1, args.seq + 1))

    def step(monitor) -> None:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        if monitor is not None:
            monitor.track("loss", loss)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return model, optimizer, step


def _use_backend(backend: str, batch_tensors: int | None = None):
    from trainmon import stats
    from trainmon.stats import triton_path

    if backend == "native":
        stats.set_backend("native")
        return None
    stats.set_backend("triton")
    if batch_tensors:
        triton_path.BATCH_TENSORS = batch_tensors
    stand_in = _StandInKernels(triton_path.kernels())
    triton_path._kernels = stand_in
    return stand_in


def measure(mode: str, backend: str, args: argparse.Namespace) -> dict:
    """Inside the measuring subprocess: the promotions run, alternating off/on blocks, the allocation run."""
    import torch

    import trainmon

    torch.set_num_threads(1)
    logging.getLogger("trainmon").setLevel(logging.ERROR if backend == "native" else logging.CRITICAL)
    stand_in = _use_backend(backend, args.batch_tensors)
    model, optimizer, step = _workload(args)
    heap = _user_heap(args.heap)
    config = MODES[mode]
    times: dict[str, list[float]] = {"off": [], "on": [], "attach": [], "first": []}
    rows = launches = 0
    with tempfile.TemporaryDirectory(prefix="tm-host-") as logdir:
        for _ in range(args.warmup):
            step(None)
        gc.collect()  # a known start: what the blocks promote decides where full collections fall
        watch = _GcWatch()
        watch.block = "promotions"
        promoted = _promotions(model, optimizer, step, config, Path(logdir) / "promoted", args)
        for pair in range(args.pairs):
            watch.pair = pair
            watch.block = "off"
            for i in range(args.block):
                watch.step = i
                start = time.perf_counter()
                step(None)
                times["off"].append(time.perf_counter() - start)
            watch.block, watch.step = "attach", -1
            start = time.perf_counter()
            monitor = trainmon.attach(model, optimizer, config=config, logdir=Path(logdir) / f"run{pair}")
            times["attach"].append(time.perf_counter() - start)
            watch.block = "warmup"  # steps 0 .. warmup-1: the first collected step is step 0
            for i in range(args.warmup):
                watch.step = i
                start = time.perf_counter()
                step(monitor)
                if i == 0:
                    times["first"].append(time.perf_counter() - start)
            watch.block = "on"
            launches_before = stand_in.launches if stand_in else 0
            for i in range(args.block):
                watch.step = i
                start = time.perf_counter()
                step(monitor)
                times["on"].append(time.perf_counter() - start)
            if stand_in:
                launches += stand_in.launches - launches_before
            latest = monitor._latest
            rows = len(latest[0].rows) if latest is not None else 0
            watch.block, watch.step = "close", -1
            monitor.close()
        watch.close()
        growth = _allocations(model, optimizer, step, config, Path(logdir) / "alloc", args)
        split = None
        if args.split and backend == "triton":
            split = _split(model, optimizer, step, config, Path(logdir) / "split", args)
    del heap
    collected = args.pairs * sum(
        1 for i in range(args.warmup, args.warmup + args.block) if _collected(config, i)
    )
    return {
        "mode": mode,
        "backend": backend,
        "rows": rows,
        "pairs": args.pairs,
        "collected_steps": collected,
        "launches_per_collected_step": launches / collected if stand_in and collected else None,
        "off_ms": [t * 1e3 for t in times["off"]],
        "on_ms": [t * 1e3 for t in times["on"]],
        "attach_ms": [t * 1e3 for t in times["attach"]],
        "first_step_ms": [t * 1e3 for t in times["first"]],
        "gc": {block: {str(g): p for g, p in gens.items()} for block, gens in watch.pauses.items()},
        "gen2_at": [{"block": b, "pair": p, "step": i} for b, p, i in watch.full],
        "promoted_once": promoted["once"],
        "promoted_per_step": promoted["per_step"],
        "alloc_bytes_per_step": growth,
        "split": split,
    }


# the host side's parts (--split): module, class (None: a module function), functions
SPLIT_PARTS = {
    "launcher": [("trainmon.stats.triton_path", None, ("launch",))],
    "batch staging": [
        ("trainmon.stats.triton_path", "TritonReducer", ("_launch_batch",)),
        ("trainmon.stats.triton_path", "TableCache", ("upload",)),
        ("trainmon.stats.triton_path", None, ("upload",)),
    ],
    "reducer rows": [
        (
            "trainmon.stats.triton_path",
            "TritonReducer",
            ("row", "rows", "adam_rows", "merged_row", "complete"),
        )
    ],
    "step buffer": [
        (
            "trainmon.step.buffer",
            "StepBuffer",
            ("add", "add_many", "add_pieces", "add_merged", "add_update_ratio", "add_shard", "finish"),
        )
    ],
}


class _PartClock:
    """Each part's own time (the parts it calls taken out) and calls, through wrappers put in place of the
    parts' functions; ``close`` puts the functions back."""

    def __init__(self) -> None:
        self.own: dict[str, float] = dict.fromkeys(SPLIT_PARTS, 0.0)
        self.calls: dict[str, int] = dict.fromkeys(SPLIT_PARTS, 0)
        self._stack: list[list] = []  # per call running: [part, start, time of the parts it called]
        self._undo: list[tuple] = []

    def install(self) -> None:
        import importlib

        for part, places in SPLIT_PARTS.items():
            for module_name, class_name, names in places:
                owner = importlib.import_module(module_name)
                if class_name:
                    owner = getattr(owner, class_name)
                for name in names:
                    original = owner.__dict__.get(name)
                    if original is None:
                        continue
                    setattr(owner, name, self.wrap(part, original))
                    self._undo.append((owner, name, original))

    def wrap(self, part: str, fn):
        clock = self

        def timed(*args, **kwargs):
            frame = [part, time.perf_counter(), 0.0]
            clock._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                clock._stack.pop()
                spent = time.perf_counter() - frame[1]
                clock.own[part] += spent - frame[2]
                clock.calls[part] += 1
                if clock._stack:
                    clock._stack[-1][2] += spent

        return timed

    def close(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def _torch_ops(step, monitor) -> int:
    """The torch operations one step dispatches (forward, backward, the optimizer, and the monitor's)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step(monitor)
    return Count.ops


def _dispatch_us() -> float:
    """What one small torch operation costs on this CPU: a view and a detach of a 1K-element tensor."""
    import torch

    x = torch.zeros(1024)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(2000):
            x.view(torch.int32).detach()
        best = min(best, (time.perf_counter() - start) / 4000)
    return best * 1e6


def _split(model, optimizer, step, config: dict, logdir: Path, args: argparse.Namespace) -> dict:
    """The host side's parts over ``--split`` monitored steps (see the module docstring)."""
    import trainmon

    off_ops = _torch_ops(step, None)
    # what a wrapper adds to a call, taken out of the parts' times below
    noop = _PartClock().wrap("launcher", lambda: None)
    start = time.perf_counter()
    for _ in range(10000):
        noop()
    wrapper_s = (time.perf_counter() - start) / 10000
    # in place before attach: what the monitor binds at attach (a reducer's methods) is the timed one
    clock = _PartClock()
    clock.install()
    try:
        start = time.perf_counter()
        for _ in range(args.split):
            step(None)
        off_seconds = time.perf_counter() - start
        monitor = trainmon.attach(model, optimizer, config=config, logdir=logdir)
        try:
            for _ in range(args.warmup):
                step(monitor)
            on_ops = _torch_ops(step, monitor)
            clock.own, clock.calls = dict.fromkeys(SPLIT_PARTS, 0.0), dict.fromkeys(SPLIT_PARTS, 0)
            start = time.perf_counter()
            for _ in range(args.split):
                step(monitor)
            seconds = time.perf_counter() - start
            latest = monitor._latest
            rows = len(latest[0].rows) if latest is not None else 0
        finally:
            monitor.close()
    finally:
        clock.close()
    per_row = args.split * max(1, rows)
    wrappers = sum(clock.calls.values()) * wrapper_s  # what the wrappers added to the monitored steps
    own = {part: max(0.0, clock.own[part] - clock.calls[part] * wrapper_s) for part in SPLIT_PARTS}
    return {
        "steps": args.split,
        "rows": rows,
        "step_ms": seconds / args.split * 1e3,
        "off_step_ms": off_seconds / args.split * 1e3,
        # the monitor's host time per row in these steps, against as many unmonitored steps just before
        "host_us_per_row": max(0.0, seconds - off_seconds - wrappers) / per_row * 1e6,
        "us_per_row": {part: t / per_row * 1e6 for part, t in own.items()},
        "calls_per_step": {part: clock.calls[part] / args.split for part in SPLIT_PARTS},
        "wrapper_us": wrapper_s * 1e6,
        "torch_ops_per_row": (on_ops - off_ops) / max(1, rows),
        "dispatch_us_per_op": _dispatch_us(),
    }


def _collected(config: dict, i: int) -> bool:
    return i % config.get("step_interval", 1) == 0


def _promotions(model, optimizer, step, config: dict, logdir: Path, args: argparse.Namespace) -> dict:
    """Objects promoted to the oldest generation, counted at every collection of the middle generation (the
    one that promotes) under the collector's usual thresholds: by attach and the warm-up (``once``: the
    process's first attach, as this runs first) and per steady step after it (``per_step``, over
    ``--promotion-steps``). Each promoted object counts towards the next full collection even if it dies
    right after, so this, not what is alive at the step's end, is what brings full collections on."""
    import trainmon

    promoted = [0]
    before = [0]

    def count(phase: str, info: dict) -> None:
        if info["generation"] != 1:
            return
        size = len(gc.get_objects(2))
        if phase == "start":
            before[0] = size
        else:
            promoted[0] += max(0, size - before[0])

    gc.callbacks.append(count)
    try:
        monitor = trainmon.attach(model, optimizer, config=config, logdir=logdir)
        try:
            for _ in range(args.warmup):
                step(monitor)
            monitor.flush()
            once, promoted[0] = promoted[0], 0
            for _ in range(args.promotion_steps):
                step(monitor)
            per_step = promoted[0] / args.promotion_steps
        finally:
            monitor.close()
    finally:
        gc.callbacks.remove(count)
    return {"once": once, "per_step": per_step}


def _allocations(model, optimizer, step, config: dict, logdir: Path, args: argparse.Namespace) -> float:
    """Net growth of Python's traced memory per steady monitored step (the writer flushed at both ends, so
    queued records do not count).

    Traced from before attach, and read after ``--alloc-warmup`` steps: caches that keep what earlier steps
    made (the Triton path's tables of tensor addresses, an LRU of 32) fill and then replace entries made under
    tracing, so their turnover shows as what it is, none. CPython's own type-attribute cache is emptied before
    each reading: it keeps the name string of the last lookup in each of its 4,096 slots, the slot chosen by
    the string's address, and pyarrow looks up its Python sink's ``write`` with a new string each call, so
    the cache takes up to ~220 KB of ``"write"`` strings over thousands of steps and then stays there:
    bounded, and the interpreter's, not the monitor's."""
    import tracemalloc

    import trainmon

    tracemalloc.start()
    try:
        monitor = trainmon.attach(model, optimizer, config=config, logdir=logdir)
        try:
            for _ in range(args.warmup + args.alloc_warmup):
                step(monitor)
            before = _traced(monitor)
            for _ in range(args.alloc_steps):
                step(monitor)
            after = _traced(monitor)
        finally:
            monitor.close()
    finally:
        tracemalloc.stop()
    return (after - before) / args.alloc_steps


def _traced(monitor) -> int:
    import tracemalloc

    monitor.flush()
    gc.collect()
    sys._clear_type_cache()
    return tracemalloc.get_traced_memory()[0]


def summarise(data: dict) -> dict:
    off, on = data["off_ms"], data["on_ms"]
    rows = data["rows"]
    collected = max(1, data["collected_steps"])
    blocks = len(on)
    mean_on, mean_off = statistics.fmean(on), statistics.fmean(off)
    med_on, med_off = statistics.median(on), statistics.median(off)
    # host time per collected step: what the monitored steps took beyond the unmonitored ones, per pair (an
    # on block against the off block just before it), the median over the pairs: a load that comes and goes
    # on a shared machine moves a block or two, not the figure
    pairs = data["pairs"]
    size = blocks // pairs
    diffs, ratios = [], []
    for k in range(pairs):
        pair_on = statistics.fmean(on[k * size : (k + 1) * size])
        pair_off = statistics.fmean(off[k * size : (k + 1) * size])
        diffs.append(pair_on - pair_off)
        ratios.append(pair_on / pair_off)
    per_collected_ms = statistics.median(diffs) * blocks / collected
    gen2 = {block: len(g.get("2", [])) for block, g in data["gc"].items()}
    pause2 = {block: sum(g.get("2", [])) * 1e3 for block, g in data["gc"].items()}
    return {
        "mode": data["mode"],
        "backend": data["backend"],
        "rows": rows,
        "off_mean_ms": mean_off,
        "on_mean_ms": mean_on,
        "off_median_ms": med_off,
        "on_median_ms": med_on,
        "mean_ratio": statistics.median(ratios),
        "mean_ratio_pooled": mean_on / mean_off,
        "host_ms_per_collected_step": per_collected_ms,
        "host_us_per_tensor_pooled": (mean_on - mean_off) * blocks / collected * 1e3 / rows if rows else None,
        "host_us_per_tensor_pairs": [d * blocks / collected * 1e3 / rows for d in diffs] if rows else None,
        "host_us_per_tensor": per_collected_ms * 1e3 / rows if rows else None,
        "host_us_per_tensor_median": (med_on - med_off) * 1e3 / rows
        if rows and collected == blocks
        else None,
        "gen2_off": gen2.get("off", 0),
        "gen2_on": gen2.get("on", 0),
        "gen2_pause_off_ms": pause2.get("off", 0.0),
        "gen2_pause_on_ms": pause2.get("on", 0.0),
        "longest_on_ms": max(on),
        "longest_off_ms": max(off),
        "gen2_elsewhere": len(data["gen2_at"]) - gen2.get("on", 0) - gen2.get("off", 0),
        "attach_ms": statistics.median(data["attach_ms"]),
        "first_step_ms": statistics.median(data["first_step_ms"]),
        "promoted_once": data["promoted_once"],
        "promoted_per_step": data["promoted_per_step"],
        "alloc_bytes_per_step": data["alloc_bytes_per_step"],
        "launches_per_collected_step": data["launches_per_collected_step"],
        "split": _split_summary(data.get("split"), per_collected_ms * 1e3 / rows if rows else None),
    }


def _split_summary(split: dict | None, host_us: float | None) -> dict | None:
    """The parts per row beside the split's own host time per row (the pairs' figure kept beside it): what
    is left is the rest."""
    if not split:
        return None
    parts = dict(split["us_per_row"])
    parts["torch ops (count x this CPU's cost)"] = split["torch_ops_per_row"] * split["dispatch_us_per_op"]
    return {
        **split,
        "host_us_per_tensor_pairs": host_us,
        "parts_us_per_row": parts,
        "rest_us_per_row": split["host_us_per_row"] - sum(split["us_per_row"].values()),
    }


def split_lines(r: dict) -> list[str]:
    """The split's line for one mode (none where it was not asked for)."""
    split = r.get("split")
    if not split:
        return []
    parts = "; ".join(f"{name} {us:.2f}" for name, us in split["parts_us_per_row"].items())
    rest = split["rest_us_per_row"]
    calls = ", ".join(f"{k} {v:.0f}" for k, v in split["calls_per_step"].items())
    return [
        f"{r['mode']} / {r['backend']}: host us per row by part ({split['steps']} steps, "
        f"{split['rows']} rows): {parts}; the rest (hooks, schedule, glue) {rest:.2f} of "
        f"{split['host_us_per_row']:.2f}; torch ops per row {split['torch_ops_per_row']:.2f} at "
        f"{split['dispatch_us_per_op']:.2f} us each here; calls per step: {calls}"
    ]


def _print_table(results: list[dict], steps_each: int) -> None:
    print(
        f"\n{'mode':<16}{'backend':<8}{'rows':>6}{'off ms':>8}{'on ms':>8}{'mean x':>8}{'us/tensor':>10}"
        f"{'gen2 on/off':>12}{'pauses ms on/off':>18}{'promoted once/step':>19}{'B/step':>7}{'launches':>9}"
        f"{'attach ms':>10}{'first ms':>9}"
    )
    for r in results:
        launches = r["launches_per_collected_step"]
        print(
            f"{r['mode']:<16}{r['backend']:<8}{r['rows']:>6}{r['off_mean_ms']:>8.2f}{r['on_mean_ms']:>8.2f}"
            f"{r['mean_ratio']:>8.3f}{r['host_us_per_tensor'] or 0:>10.2f}"
            f"{r['gen2_on']:>6}/{r['gen2_off']:<5}"
            f"{r['gen2_pause_on_ms']:>9.0f}/{r['gen2_pause_off_ms']:<8.0f}"
            f"{r['promoted_once']:>12.0f}/{r['promoted_per_step']:<6.1f}{r['alloc_bytes_per_step']:>7.0f}"
            f"{'' if launches is None else format(launches, '.0f'):>9}"
            f"{r['attach_ms']:>10.0f}{r['first_step_ms']:>9.1f}"
        )
    print(
        f"({steps_each} steps on and {steps_each} off per mode; mean x and us/tensor: the median over the "
        "pairs of blocks of the step time ratio and of the host time per monitored tensor per collected "
        "step; promoted: objects promoted to the oldest generation by attach and the first steps (the "
        "process's first attach), and per steady step; attach and first: attach and the first collected "
        "step, medians over the pairs, outside the blocks)"
    )
    for r in results:
        for line in split_lines(r):
            print(line)
    for r in results:
        if r["gen2_elsewhere"]:
            print(
                f"{r['mode']} / {r['backend']}: {r['gen2_elsewhere']} generation-2 collection(s) outside "
                "the blocks (the promotions run, attach, warm-up, close): see the JSON"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", nargs="+", default=["full", "full_api", "wgmv"], choices=list(MODES))
    parser.add_argument("--backends", nargs="+", default=["native", "triton"], choices=["native", "triton"])
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--block", type=int, default=60, help="steps per block (pairs x block = 600)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--alloc-steps", type=int, default=30)
    parser.add_argument("--alloc-warmup", type=int, default=50, help="traced steps before the first reading")
    parser.add_argument("--promotion-steps", type=int, default=60)
    parser.add_argument("--heap", type=int, default=1_000_000, help="long-lived objects of the user script")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--d", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--workload-dir", type=Path, default=BENCH)
    parser.add_argument("--batch-tensors", type=int, default=0, help=BATCH_HELP)
    parser.add_argument(
        "--split", type=int, default=0, metavar="STEPS", help="Triton backend: time the host side's parts"
    )
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args)))
        return
    results, raw = [], []
    passed = [a for a in sys.argv[1:] if a not in ("--json",)]
    if args.json:
        i = passed.index(str(args.json)) if str(args.json) in passed else -1
        if i >= 0:
            del passed[i]
    for backend in args.backends:
        for mode in args.modes:
            env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
            argv = [sys.executable, __file__, *passed, "--child", mode, backend]
            out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env)
            data = json.loads(out.stdout.strip().splitlines()[-1])
            raw.append(data)
            results.append(summarise(data))
            r = results[-1]
            print(
                f"{mode} / {backend}: {r['host_us_per_tensor'] or 0:.2f} us per tensor, "
                f"gen2 {r['gen2_on']} on / {r['gen2_off']} off",
                flush=True,
            )
    _print_table(results, args.pairs * args.block)
    if args.json:
        args.json.write_text(json.dumps({"summary": results, "raw": raw}, indent=1) + "\n")


if __name__ == "__main__":
    main()

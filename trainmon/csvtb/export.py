"""``trainmon export RUN``: the statistics store written out as msprobe CSV (``--format csv``) or as every
tensor's TensorBoard scalars (``--format tensorboard``), the files ``format: csv`` and ``tensorboard_tensors:
all`` would have written during the run: ``OUT/rank_<r>/<kind>.csv`` and
``OUT/rank_<r>/events.out.tfevents.*``.

The files are written by the monitor's own sinks (:class:`~trainmon.writer.csv.CsvSink`,
:class:`~trainmon.writer.tensorboard.TensorBoardSink`), fed one stored step at a time, so they are the same
bytes: the store keeps each statistic as the float32 that CSV and TensorBoard write (NaN/Inf counts exactly),
each tensor's dtype and shape, and the steps table each step's wall time. The statistics (``ops``) and
``ndigits`` are the run's (its manifest), unless given. Three things the store does not keep, said in the
summary's notes where they apply:

- micro-steps: the store holds each tensor's statistics of the whole step (micro-batches merged exactly) and
  every exported row has ``micro_step`` 0, so a run with gradient accumulation exports one CSV row per tensor
  and step where ``format: csv`` wrote one per micro-step (and once-a-step rows, such as weight gradients,
  lose the micro-step they were taken in);
- ``ndigits``: CSV floats rounded to N places are rounded from the float32 the store holds, not from the
  float64 the writer rounded, so a digit beyond float32's precision may differ (the default, ``ndigits:
  null``, writes the float32's shortest text: the same bytes);
- an event file's first record holds the time its writer opened it (the run's start here, from the manifest),
  and its name the host and process.

Streaming: a rank's store is read one segment at a time (at most ~2 million rows), whatever the run's length.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainmon.read.csv_sources import output_beside
from trainmon.run.layout import rank_dir
from trainmon.run.manifest import read_manifest
from trainmon.run.records import STATS, Row, StepRecord
from trainmon.run.statstore import dictionary_ids, iter_store, stat_ranks
from trainmon.run.steptable import read_steps
from trainmon.run.timetable import TIMING_COLUMNS, read_timing
from trainmon.writer.csv import CsvSink
from trainmon.writer.tbview import TensorPatterns
from trainmon.writer.tensorboard import TensorBoardSink
from trainmon.writer.timetags import RANK_TAGS

__all__ = ["FORMATS", "ExportError", "ExportSummary", "export"]

FORMATS = ("csv", "tensorboard")
_COLUMNS = ("step", "kind", "name", *STATS, "numel", "dtype", "shape")
_LAYOUTS_KEPT = 32  # distinct step layouts whose rows are kept (a run has one or a few)
_EMPTY = np.zeros((0, 8))


class ExportError(ValueError):
    """The export cannot be done as asked (no store, output files in the way, ...)."""


@dataclass
class ExportSummary:
    out: Path
    format: str
    ranks: list[int] = field(default_factory=list)
    steps: int = 0  # rank-steps written
    rows: int = 0  # tensors x steps written
    files: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


class _Text(str):
    """A dtype or shape as the store holds its text: the CSV writes it as it is (``format_shape`` reads a
    shape that is no sequence of sizes as its text)."""

    def __iter__(self):
        raise TypeError("not a shape")


class _Derived:
    """The statistics of one stored step as the sinks read them: per row and per tensor, the same values (the
    store holds tensors, micro-steps merged)."""

    __slots__ = ("rows", "tensors")

    def __init__(self, values: dict[str, np.ndarray]) -> None:
        self.rows = self.tensors = values


def _dtype_text(dtype: str | None, framework: str) -> str:
    """A dtype as the writer's CSV spelled it: ``torch.bfloat16``; MindSpore's ``BFloat16``."""
    if not dtype:
        return ""
    if framework != "mindspore":
        return f"torch.{dtype}"
    text = dtype[:1].upper() + dtype[1:]
    for low, high in (("Bfloat", "BFloat"), ("Uint", "UInt")):
        text = text.replace(low, high)
    return text


def _ranks_of(run: Path, wanted: Sequence[int] | None) -> list[int]:
    found = stat_ranks(run)
    if not found:
        raise ExportError(
            f"{run}: no statistics store (plugins/trainmon/stats/): the run was written without the "
            "tensorboard format, or is no trainmon run"
        )
    if wanted is None:
        return found
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ExportError(f"{run}: no statistics store of rank(s) {missing}; the store has ranks {found}")
    return sorted(set(wanted))


def _prepare(directory: Path, fmt: str, force: bool) -> None:
    """``directory`` ready for a rank's files: those of ``fmt`` already there are refused, or with ``force``
    removed."""
    if not directory.exists():
        return
    if fmt == "csv":
        found = sorted(p for p in directory.iterdir() if p.suffix == ".csv")
    else:
        found = sorted(p for p in directory.iterdir() if "tfevents" in p.name)
    if found and not force:
        raise ExportError(
            f"{directory} holds {len(found)} {fmt} file(s) already ({found[0].name}, ...); choose another -o "
            "or pass --force to replace them"
        )
    for path in found:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


class _Steps:
    """The stored steps of one rank as step records: rows (kind, name, dtype, shape) per distinct layout,
    built once, and each statistic per tensor."""

    def __init__(self, split_chunks: bool, framework: str, patterns: TensorPatterns | None) -> None:
        self.split_chunks = split_chunks  # CSV: "<vpp>:<name>" back into vpp_stage and name
        self.framework = framework
        self.patterns = patterns
        self._layouts: OrderedDict[bytes, tuple[tuple[Row, ...], np.ndarray | None]] = OrderedDict()
        self._kinds: dict[str, int] = {}
        self._names: dict[str, int] = {}
        self._dtypes: dict[str, int] = {}
        self._shapes: dict[str, int] = {}
        self._kept: dict[tuple[int, int], bool] = {}
        self.merged_micro_steps = False  # a tensor's element count says its micro-steps were merged

    def _ids(self, table, name: str, ids: dict[str, int]) -> np.ndarray | None:
        if name not in table.column_names:
            return None
        column = table.column(name)
        if column.null_count == len(column):  # a store written before dtype and shape were kept
            return None
        return dictionary_ids(column, ids).astype(np.int64)

    def records(self, table, wall_times: _WallTimes) -> Iterator[tuple[StepRecord, _Derived]]:
        steps = np.asarray(table.column("step").to_numpy(), dtype=np.int64)
        kinds = self._ids(table, "kind", self._kinds)
        names = self._ids(table, "name", self._names)
        dtypes = self._ids(table, "dtype", self._dtypes)
        shapes = self._ids(table, "shape", self._shapes)
        assert kinds is not None and names is not None
        nodtype = np.full(len(steps), -1, dtype=np.int64)
        ident = np.stack([kinds, names, nodtype if dtypes is None else dtypes,
                          nodtype if shapes is None else shapes], axis=1)  # fmt: skip
        values = {}
        for stat in STATS:
            column = table.column(stat)
            values[stat] = np.asarray(column.to_numpy(), dtype=np.float64)
        has_numel = "numel" in table.column_names
        numel = table.column("numel").to_numpy(zero_copy_only=False) if has_numel else None
        change = np.flatnonzero(steps[1:] != steps[:-1]) + 1
        bounds = np.concatenate(([0], change, [len(steps)]))
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            rows, keep = self._layout(ident[a:b], None if numel is None else numel[a:b])
            step = int(steps[a])
            if keep is None:
                stats = {s: v[a:b] for s, v in values.items()}
            else:
                stats = {s: v[a:b][keep] for s, v in values.items()}
            if not rows:
                continue
            wall = wall_times.of(step)
            yield StepRecord(step, 0, rows, _EMPTY, wall), _Derived(stats)

    def _layout(self, ident: np.ndarray, numel) -> tuple[tuple[Row, ...], np.ndarray | None]:
        key = ident.tobytes()
        found = self._layouts.get(key)
        if found is not None:
            self._layouts.move_to_end(key)
            return found
        kinds, names = list(self._kinds), list(self._names)
        dtypes, shapes = list(self._dtypes), list(self._shapes)
        rows: list[Row] = []
        keep: list[int] = []
        for i, (k, n, d, s) in enumerate(ident.tolist()):
            kind, name = kinds[k], names[n]
            if self.patterns is not None and not self._wanted(k, n, kind, name):
                continue
            keep.append(i)
            vpp, bare = 0, name
            if self.split_chunks:
                head, sep, rest = name.partition(":")
                if sep and head.isdigit():
                    vpp, bare = int(head), rest
            shape = shapes[s] if s >= 0 else ""
            dtype = _dtype_text(dtypes[d] if d >= 0 else None, self.framework)
            rows.append(Row(kind, bare, vpp, 0, "", _Text(shape), dtype))
            if numel is not None and not self.merged_micro_steps and s >= 0:
                self.merged_micro_steps = _merged(shape, numel[i])
        mask = None if len(keep) == len(ident) else np.asarray(keep, dtype=np.intp)
        found = (tuple(rows), mask)
        self._layouts[key] = found
        if len(self._layouts) > _LAYOUTS_KEPT:
            self._layouts.popitem(last=False)
        return found

    def _wanted(self, k: int, n: int, kind: str, name: str) -> bool:
        known = self._kept.get((k, n))
        if known is None:
            assert self.patterns is not None
            known = self._kept[(k, n)] = self.patterns.matches(kind, name)
        return known


def _merged(shape: str, numel: object) -> bool:
    """Whether a tensor's element count is a multiple of its shape's: micro-steps merged into one row."""
    try:
        size = math.prod(int(d) for d in shape.strip("[]").split(",") if d.strip())
        count = int(numel)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return False
    return size > 0 and count > size


class _WallTimes:
    """Each step's wall time from the steps table. A step written twice (a job resumed from an earlier
    checkpoint) has a row each time, in write order, as the statistics store has its rows: the n-th time a
    step is read from the store takes its n-th wall time."""

    def __init__(self, run: Path, rank: int, lo: int | None, hi: int | None, default: float) -> None:
        self.default = default
        self._times: dict[int, list[float]] = {}
        self._read: dict[int, int] = {}
        try:
            table = read_steps(run, rank, ["step", "wall_time"], lo, hi)
        except (OSError, ValueError):
            return
        for step, wall in zip(table.column("step").to_pylist(), table.column("wall_time").to_pylist(),
                              strict=True):  # fmt: skip
            self._times.setdefault(step, []).append(wall)

    @property
    def first(self) -> float | None:
        return min((times[0] for times in self._times.values()), default=None)

    def of(self, step: int) -> float:
        times = self._times.get(step)
        if not times:
            return self.default
        n = self._read.get(step, 0)
        self._read[step] = n + 1
        return times[min(n, len(times) - 1)]


class _StepTimes:
    """Each timed step's times from the rank's timing table, in milliseconds as the writer gives them to
    TensorBoard (``time/<name>_ms``). A step timed twice (a resumed job) takes its rows in write order."""

    def __init__(self, run: Path, rank: int, lo: int | None, hi: int | None) -> None:
        self._rows: dict[int, list[np.ndarray]] = {}
        try:
            table = read_timing(run, rank, ("step", *TIMING_COLUMNS), lo, hi)
        except (OSError, ValueError):
            return
        if not table.num_rows:
            return
        times = np.stack([table.column(c).to_numpy() for c in TIMING_COLUMNS], axis=1) * 1e3
        for i, step in enumerate(table.column("step").to_pylist()):
            self._rows.setdefault(step, []).append(times[i])

    def of(self, step: int) -> np.ndarray | None:
        rows = self._rows.get(step)
        return rows.pop(0) if rows else None


def export(
    run: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    fmt: str,
    ranks: Sequence[int] | None = None,
    steps: tuple[int | None, int | None] | None = None,
    names: Sequence[str] | None = None,
    ops: Sequence[str] | None = None,
    ndigits: int | None | str = "run",
    force: bool = False,
) -> ExportSummary:
    """Write ``run``'s statistics store as ``fmt`` (``csv`` or ``tensorboard``) into ``out`` (default:
    ``RUN-csv`` / ``RUN-tensorboard`` beside the run, never inside it), one folder per rank. ``ranks``,
    ``steps`` (inclusive bounds) and ``names`` (patterns of a name or ``kind/name``, as
    ``tensorboard_tensors`` takes them) narrow it; ``ops`` and ``ndigits`` default to the run's
    (``ndigits="run"``)."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")
    start = time.perf_counter()
    run_dir = Path(run)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run folder")
    chosen = _ranks_of(run_dir, ranks)
    manifest = read_manifest(run_dir) or {}
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    ops = tuple(ops) if ops else tuple(config.get("ops") or STATS)
    unknown = [op for op in ops if op not in STATS]
    if unknown:
        raise ExportError(f"unknown statistic(s) {unknown}; statistics: {', '.join(STATS)}")
    if ndigits == "run":
        ndigits = config.get("ndigits")
    ndigits = None if ndigits is None else int(ndigits)
    split_chunks = int(manifest.get("chunks") or 1) > 1
    framework = str(manifest.get("framework") or "pytorch")
    created = manifest.get("created")
    out_dir = Path(out) if out is not None else output_beside(run_dir, fmt)
    summary = ExportSummary(out=out_dir, format=fmt, ranks=chosen)
    lo, hi = steps if steps is not None else (None, None)
    for r in chosen:
        _prepare(rank_dir(out_dir, r), fmt, force)
    patterns = TensorPatterns(names) if names else None
    merged = False
    for r in chosen:
        directory = rank_dir(out_dir, r)
        walls = _WallTimes(run_dir, r, lo, hi, float(created) if isinstance(created, (int, float)) else 0.0)
        begun = walls.default if isinstance(created, (int, float)) else (walls.first or 0.0)
        walls.default = begun
        reader = _Steps(split_chunks and fmt == "csv", framework, patterns)
        sink: CsvSink | TensorBoardSink
        if fmt == "csv":
            sink = CsvSink(directory, ops, ndigits)
        else:
            sink = TensorBoardSink(directory, ops, clock=lambda begun=begun: begun, tensors="all")
        # the step times go where the writer put them: after the step's statistics (on the CPU the times of a
        # step travel with it; on an accelerator the writer had them a few steps later)
        times = _StepTimes(run_dir, r, lo, hi) if fmt == "tensorboard" else None
        try:
            for table in iter_store(run_dir, r, _COLUMNS, lo, hi):
                for record, derived in reader.records(table, walls):
                    sink.write(record, derived)  # type: ignore[arg-type]
                    if times is not None and (ms := times.of(record.step)) is not None:
                        sink.events.write_scalars(record.step, record.wall_time, RANK_TAGS, ms)
                    summary.steps += 1
                    summary.rows += len(record.rows)
        finally:
            sink.close()
        merged = merged or reader.merged_micro_steps
        summary.files += len(sink.paths) if isinstance(sink, CsvSink) else 1
    if merged and fmt == "csv":
        summary.notes.append(
            "some tensors had several micro-steps a step (gradient accumulation): the statistics store keeps "
            "each tensor's statistics of the whole step, so these have one row a step (micro_step 0) where "
            "format: csv wrote one per micro-step"
        )
    if ndigits is not None and fmt == "csv":
        summary.notes.append(
            f"ndigits {ndigits}: floats are rounded from the float32 the store keeps, so a digit beyond "
            "float32's precision may differ from what the writer rounded"
        )
    summary.seconds = time.perf_counter() - start
    return summary

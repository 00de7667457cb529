"""CSV -> TensorBoard: one TensorBoard run (``OUT/rank_<r>/``, one event file) per rank.

Tags follow the monitor's own scheme, ``{kind}/{name}/{stat}``, with two additions that keep every CSV row
(see ``docs/csv2tb.md``):

- ``name`` is ``{vpp_stage}:{name}`` when any row of the rank has a ``vpp_stage`` other than 0 (the monitor's
  rule for models in several chunks), else the bare name;
- ``:micro{m}`` is appended to the name of every row of a kind whose ``micro_step`` column holds any value
  other than 0 (gradient accumulation): the monitor merges micro-steps into one value, a CSV row is one
  micro-step and stays one point.

A (tag, step) seen in several rows keeps the last one read (files in step-range order, rows in file order):
that is what a resumed run that rewrote some steps means.

A rank is converted by one process, streaming: every kind's files are read a batch at a time (CSV is in step
order) and the steps that every kind has read past are written, so memory stays bounded by a few batches
whatever the run's length. Ranks run in a process pool; a rank's event file is written by one process, as
everywhere in trainmon. Two things are only known once a rank has been read to its end, and are then fixed
by converting that rank again: a ``vpp_stage`` other than 0 (or a ``micro_step`` other than 0) first met after
steps were written with bare names restarts the rank with the prefixed (suffixed) names; a step that goes back
below what was written (a resumed run that wrote steps again into the same file) converts that rank in memory,
as a whole, so that the last row still wins.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from trainmon.csvtb.progress import Progress
from trainmon.read.csv import KindTable, ReadReport, iter_kind, read_kind
from trainmon.read.csv_sources import LayoutError, Source, find_sources, output_beside
from trainmon.run import records
from trainmon.writer.tensorboard import EventFile

__all__ = [
    "ConvertError",
    "ConvertSummary",
    "RankResult",
    "convert",
    "default_out",
    "rank_tags",
    "stream_rank",
    "write_rank",
]

_KIND_ORDER = {k.value: i for i, k in enumerate(records.Kind)}
# Distinct per-step tag layouts whose tag tuples are kept (steps usually share one or a few layouts).
_LAYOUTS_KEPT = 64
# Text read from one kind's files at a time while streaming: with every kind of a rank holding about one
# batch past the steps written, this bounds a worker's memory (parsing a batch takes tens of times its size:
# 2 MiB gave a 20,000-step rank of 5 kinds a peak of 237 MB, 8 MiB 512 MB, at the same speed).
STREAM_BATCH_BYTES = 2 << 20


class ConvertError(ValueError):
    """Bad arguments or an output that would be overwritten."""


@dataclass
class ConvertSummary:
    out: Path
    ranks: list[int] = field(default_factory=list)
    files: int = 0
    rows: int = 0
    scalars: int = 0  # values written (after duplicates)
    steps: int = 0  # distinct steps, summed over ranks
    duplicates: int = 0  # (tag, step) values replaced by a later row
    skipped: int = 0  # bad rows skipped (skip_bad)
    notes: list[str] = field(default_factory=list)
    event_files: list[Path] = field(default_factory=list)
    seconds: float = 0.0


def _kind_key(kind: str) -> tuple[int, str]:
    return (_KIND_ORDER.get(kind, len(_KIND_ORDER)), kind)


def rank_tags(tables: Sequence[KindTable]) -> tuple[list[str], list[np.ndarray]]:
    """The tags of one rank (in order of first appearance: kind, then row order, then stat column) and,
    per table, the tag id of every (row, stat): an int64 array shaped like ``table.values``."""
    multi_chunk = any(bool(t.vpp.any()) for t in tables)
    tags: list[str] = []
    index: dict[str, int] = {}
    ids_per_table = []
    for t in tables:
        suffix = t.has_micro and bool(t.micro.any())
        n_names = max(len(t.names), 1)
        n_micro = int(t.micro.max()) + 1 if len(t) else 1
        key = (t.vpp.astype(np.int64) * n_micro + t.micro) * n_names + t.code
        uniq, first, inv = np.unique(key, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")
        series_ids = np.empty((len(uniq), len(t.stats)), dtype=np.int64)
        for pos, u in zip(order.tolist(), uniq[order].tolist(), strict=True):
            rest, code = divmod(u, n_names)
            vpp, micro = divmod(rest, n_micro)
            label = records.chunk_name(vpp, t.names[code], multi_chunk)
            if suffix:
                label += f":micro{micro}"
            for j, stat in enumerate(t.stats):
                tag = records.tag(t.kind, label, stat)
                tid = index.get(tag)
                if tid is None:
                    tid = index[tag] = len(tags)
                    tags.append(tag)
                series_ids[pos, j] = tid
        ids_per_table.append(series_ids[inv.reshape(-1)])
    return tags, ids_per_table


class _Steps:
    """Writes (step, tag id, value) triples to an event file, one event group per step, the last value of a
    repeated (tag, step) winning."""

    def __init__(self, ef: EventFile, tags: list[str], wall_time: float) -> None:
        self.ef, self.tags, self.wall_time = ef, tags, wall_time
        self.layouts: dict[bytes, tuple[str, ...]] = {}
        self.scalars = self.steps = self.duplicates = 0

    def write(self, step: np.ndarray, tag_id: np.ndarray, value: np.ndarray) -> None:
        order = np.lexsort((tag_id, step))  # by step, then tag; stable, so equal pairs keep reading order
        step, tag_id, value = step[order], tag_id[order], value[order]
        last = np.ones(len(step), dtype=bool)
        last[:-1] = (step[1:] != step[:-1]) | (tag_id[1:] != tag_id[:-1])
        duplicates = int(len(step) - last.sum())
        if duplicates:
            step, tag_id, value = step[last], tag_id[last], value[last]
        bounds = np.flatnonzero(np.diff(step)) + 1
        starts = np.concatenate(([0], bounds)).tolist()
        stops = np.concatenate((bounds, [len(step)])).tolist()
        for a, b in zip(starts, stops, strict=True):
            if a == b:
                continue
            ids_here = tag_id[a:b]
            key = ids_here.tobytes()
            step_tags = self.layouts.get(key)
            if step_tags is None:
                if len(self.layouts) >= _LAYOUTS_KEPT:
                    self.layouts.clear()
                step_tags = self.layouts[key] = tuple(self.tags[i] for i in ids_here.tolist())
            self.ef.write_scalars(int(step[a]), self.wall_time, step_tags, value[a:b])
        self.scalars += int(len(step))
        self.steps += len(starts) if len(step) else 0
        self.duplicates += duplicates


def write_rank(tables: Sequence[KindTable], directory: Path, wall_time: float) -> tuple[Path, int, int, int]:
    """Write one rank's tables, held in memory, as one event file in ``directory``: (path, scalars, steps,
    duplicates)."""
    tables = sorted(tables, key=lambda t: _kind_key(t.kind))
    tags, ids = rank_tags(tables)
    tag_id = np.concatenate([i.reshape(-1) for i in ids]) if ids else np.empty(0, np.int64)
    step = (
        np.concatenate([np.repeat(t.step, len(t.stats)) for t in tables]) if tables else np.empty(0, np.int64)
    )
    value = np.concatenate([t.values.reshape(-1) for t in tables]) if tables else np.empty(0, np.float32)
    with EventFile(directory) as ef:
        out = _Steps(ef, tags, wall_time)
        out.write(step, tag_id, value)
    return ef.path, out.scalars, out.steps, out.duplicates


@dataclass
class RankResult:
    """What converting one rank wrote and read."""

    path: Path | None  # None: the rank had no rows to write (no event file)
    scalars: int
    steps: int
    duplicates: int
    report: ReadReport


class _Rename(Exception):
    """A name rule (chunk prefix, micro-step suffix) turned out different from the one steps were written
    with: convert the rank again with ``multi_chunk`` / ``micro_kinds``."""

    def __init__(self, multi_chunk: bool, micro_kinds: frozenset[str]) -> None:
        self.multi_chunk, self.micro_kinds = multi_chunk, micro_kinds


class _Rewound(Exception):
    """A step at or below one already written: the rank is converted in memory."""


class _TagIds:
    """The tags of one rank, given ids as their series first appear (``rank_tags``' rule, batch by batch)."""

    def __init__(self, multi_chunk: bool, micro_kinds: frozenset[str]) -> None:
        self.multi_chunk, self.micro_kinds = multi_chunk, micro_kinds
        self.tags: list[str] = []
        self.index: dict[str, int] = {}

    def of(self, t: KindTable) -> np.ndarray:
        """Tag id of every (row, stat) of ``t``, shaped like ``t.values``."""
        micro = t.has_micro and bool(t.micro.any())
        chunked = bool(t.vpp.any())
        if (chunked and not self.multi_chunk) or (micro and t.kind not in self.micro_kinds):
            raise _Rename(self.multi_chunk or chunked, self.micro_kinds | ({t.kind} if micro else set()))
        suffix = t.kind in self.micro_kinds
        n_names = max(len(t.names), 1)
        n_micro = int(t.micro.max()) + 1 if len(t) else 1
        key = (t.vpp.astype(np.int64) * n_micro + t.micro) * n_names + t.code
        uniq, inv = np.unique(key, return_inverse=True)
        series_ids = np.empty((len(uniq), len(t.stats)), dtype=np.int64)
        for pos, u in enumerate(uniq.tolist()):
            rest, code = divmod(u, n_names)
            vpp, m = divmod(rest, n_micro)
            label = records.chunk_name(vpp, t.names[code], self.multi_chunk)
            if suffix:
                label += f":micro{m}"
            for j, stat in enumerate(t.stats):
                tag = records.tag(t.kind, label, stat)
                tid = self.index.get(tag)
                if tid is None:
                    tid = self.index[tag] = len(self.tags)
                    self.tags.append(tag)
                series_ids[pos, j] = tid
        return series_ids[inv.reshape(-1)]


class _Stream:
    """One kind's rows read but not yet written, as (step, tag id, value) triples."""

    def __init__(self, batches) -> None:
        self.batches = batches
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.high = -1  # the largest step read so far: every step below it is complete in this kind
        self.exhausted = False

    def pull(self, ids: _TagIds, written: int) -> None:
        try:
            tables = next(self.batches)
        except StopIteration:
            self.exhausted = True
            return
        for t in tables:
            if int(t.step.min()) <= written:
                raise _Rewound()
            tag_id = ids.of(t)
            self.parts.append((np.repeat(t.step, len(t.stats)), tag_id.reshape(-1), t.values.reshape(-1)))
            self.high = max(self.high, int(t.step.max()))

    def take_below(self, limit: float) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The triples of steps below ``limit``; the rest stay."""
        out, keep = [], []
        for step, tag_id, value in self.parts:
            below = step < limit
            if below.all():
                out.append((step, tag_id, value))
            elif below.any():
                out.append((step[below], tag_id[below], value[below]))
                keep.append((step[~below], tag_id[~below], value[~below]))
            else:
                keep.append((step, tag_id, value))
        self.parts = keep
        return out


def _stream_once(
    sources: Sequence[Source],
    ef: EventFile,
    wall_time: float,
    steps: tuple[int | None, int | None] | None,
    skip_bad: bool,
    report: ReadReport,
    names: tuple[bool, frozenset[str]] | None,
) -> _Steps:
    streams = [
        _Stream(iter_kind(s, steps, skip_bad, report, STREAM_BATCH_BYTES))
        for s in sorted(sources, key=lambda s: _kind_key(s.kind))
    ]
    if names is None:
        # the name rules from each kind's first batch (read before anything is written)
        firsts = [next(st.batches, []) for st in streams]
        multi = any(bool(t.vpp.any()) for batch in firsts for t in batch)
        micro = frozenset(t.kind for batch in firsts for t in batch if t.has_micro and bool(t.micro.any()))
        ids = _TagIds(multi, micro)
        for st, batch in zip(streams, firsts, strict=True):
            st.batches = itertools.chain([batch], st.batches) if batch else st.batches
    else:
        ids = _TagIds(*names)
    out = _Steps(ef, ids.tags, wall_time)
    written = -1
    while True:
        live = [st for st in streams if not st.exhausted]
        if not live:
            break
        lagging = min(live, key=lambda st: st.high)
        lagging.pull(ids, written)
        limit = min((st.high for st in streams if not st.exhausted), default=float("inf"))
        if limit <= written + 1:
            continue
        parts = [p for st in streams for p in st.take_below(limit)]
        if parts:
            step, tag_id, value = (np.concatenate([p[i] for p in parts]) for i in range(3))
            out.write(step, tag_id, value)
            written = int(step.max())
    return out


def stream_rank(
    sources: Sequence[Source],
    directory: Path,
    wall_time: float,
    steps: tuple[int | None, int | None] | None = None,
    skip_bad: bool = False,
) -> RankResult:
    """Convert the CSV of one rank (its kinds' ``sources``) into one event file in ``directory``, reading a
    batch of each kind at a time (see the module docstring for the two cases that convert a rank again)."""
    names: tuple[bool, frozenset[str]] | None = None
    notes: list[str] = []
    while True:
        report = ReadReport()
        ef = EventFile(directory)
        try:
            with ef:
                out = _stream_once(sources, ef, wall_time, steps, skip_bad, report, names)
        except _Rename as e:
            ef.path.unlink(missing_ok=True)
            names = (e.multi_chunk, e.micro_kinds)
            continue
        except _Rewound:
            ef.path.unlink(missing_ok=True)
            files = sorted({str(f) for s in sources for f in s.files})
            shown = ", ".join(files[:2]) + (" ..." if len(files) > 2 else "")
            notes.append(
                f"rank {sources[0].rank}: steps go back in {shown} (a resumed run that wrote steps again?): "
                "this rank was converted in memory"
            )
            report = ReadReport()
            tables: list[KindTable] = []
            for source in sources:
                got, rep = read_kind(source, steps=steps, skip_bad=skip_bad)
                tables.extend(got)
                report.rows += rep.rows
                report.skipped += rep.skipped
                report.notes.extend(rep.notes)
            if not tables:
                return RankResult(None, 0, 0, 0, report)
            path, scalars, n_steps, dups = write_rank(tables, directory, wall_time)
            report.notes.extend(notes)
            return RankResult(path, scalars, n_steps, dups, report)
        except BaseException:
            ef.path.unlink(missing_ok=True)
            raise
        report.notes.extend(notes)
        if not out.scalars:  # nothing to convert: no event file, as before any row
            ef.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                directory.rmdir()
            return RankResult(None, 0, 0, 0, report)
        return RankResult(ef.path, out.scalars, out.steps, out.duplicates, report)


# ---------------------------------------------------------------------------------------------
# Tasks (module-level: they run in worker processes).


def _rank_task(
    sources: list[Source],
    directory: Path,
    wall_time: float,
    steps: tuple[int | None, int | None] | None,
    skip_bad: bool,
) -> RankResult:
    return stream_rank(sources, directory, wall_time, steps, skip_bad)


# ---------------------------------------------------------------------------------------------


def default_out(inputs: Sequence[str | os.PathLike[str]]) -> Path:
    """``INPUT-csv2tb`` beside one INPUT directory (see :func:`output_beside`)."""
    if len(inputs) != 1:
        raise ConvertError("-o OUT is required when several INPUTs are given")
    return output_beside(inputs[0], "csv2tb")


def _event_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if "tfevents" in p.name)


def _prepare_out(out: Path, ranks: list[int], force: bool) -> None:
    """Refuse to write where event files exist, unless ``force`` (then remove them first)."""
    existing = [f for r in ranks for f in _event_files(out / f"rank_{r}")]
    if existing and not force:
        shown = ", ".join(str(p) for p in existing[:3]) + (" ..." if len(existing) > 3 else "")
        raise ConvertError(
            f"{out} already holds event files ({len(existing)}: {shown}); choose another -o, remove them, "
            "or pass --force to replace them"
        )
    for f in existing:
        f.unlink()


def _cleanup(out: Path, ranks: list[int], created_out: bool) -> None:
    """After a failure: remove the event files written (none existed before) and the empty directories."""
    for r in ranks:
        d = out / f"rank_{r}"
        for f in _event_files(d):
            f.unlink(missing_ok=True)
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    if created_out and out.is_dir() and not any(out.iterdir()):
        shutil.rmtree(out, ignore_errors=True)


def _pool(workers: int) -> ProcessPoolExecutor:
    # fork: workers start at once and inherit the imported modules; elsewhere the platform's default
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork") if "fork" in methods else None
    return ProcessPoolExecutor(max_workers=workers, mp_context=ctx)


def _export_hint(inputs: Sequence[str | os.PathLike[str]]) -> str:
    """For a run written without CSV (the default): how to get its events or CSV from the statistics store."""
    from trainmon.run.layout import is_run
    from trainmon.run.statstore import stat_ranks  # pyarrow: only to say this

    runs = [Path(p) for p in inputs if is_run(p) and stat_ranks(p)]
    if not runs:
        return ""
    return (
        f"; {runs[0]} keeps every statistic in its statistics store: trainmon export {runs[0]} --format "
        "tensorboard writes every tensor's scalars (--format csv: msprobe CSV)"
    )


def convert(
    inputs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str] | None = None,
    *,
    kinds: set[str] | None = None,
    ranks: set[int] | None = None,
    steps: tuple[int | None, int | None] | None = None,
    workers: int | None = None,
    skip_bad: bool = False,
    force: bool = False,
    progress: TextIO | None = None,
) -> ConvertSummary:
    """Convert trainmon/msprobe CSV under ``inputs`` into ``out/rank_<r>/`` event files.

    Raises :class:`CsvError` for a bad row (unless ``skip_bad``), :class:`ConvertError` for an output that
    exists, :class:`~trainmon.read.csv_sources.LayoutError` for inputs with nothing to convert. On an error no
    event file of this call is left behind.
    """
    t0 = time.monotonic()
    wall_time = time.time()
    out_dir = Path(out) if out is not None else default_out(inputs)
    try:
        sources = find_sources(list(inputs), kinds=kinds, ranks=ranks, steps=steps)
    except LayoutError as e:
        raise ConvertError(str(e) + _export_hint(inputs)) from None
    rank_list = sorted({s.rank for s in sources})
    _prepare_out(out_dir, rank_list, force)
    created_out = not out_dir.exists()
    summary = ConvertSummary(out=out_dir, ranks=rank_list, files=sum(len(s.files) for s in sources))
    total = sum(s.size for s in sources)
    bar = Progress(total, progress, label="csv2tb ")
    by_rank = {r: [s for s in sources if s.rank == r] for r in rank_list}
    n_workers = workers if workers is not None else min(os.cpu_count() or 1, len(rank_list))
    n_workers = max(1, n_workers)

    def wrote(rank: int, result: RankResult) -> None:
        summary.rows += result.report.rows
        summary.skipped += result.report.skipped
        summary.notes.extend(result.report.notes)
        if result.path is not None:
            summary.event_files.append(result.path)
        summary.scalars += result.scalars
        summary.steps += result.steps
        summary.duplicates += result.duplicates
        bar.advance(sum(s.size for s in by_rank[rank]))

    try:
        if n_workers == 1:
            for rank, rank_sources in by_rank.items():
                wrote(rank, stream_rank(rank_sources, out_dir / f"rank_{rank}", wall_time, steps, skip_bad))
        else:
            with _pool(n_workers) as pool:
                running: dict[Future, int] = {}
                # big ranks first: better balance
                for rank in sorted(by_rank, key=lambda r: -sum(s.size for s in by_rank[r])):
                    job = pool.submit(
                        _rank_task, by_rank[rank], out_dir / f"rank_{rank}", wall_time, steps, skip_bad
                    )
                    running[job] = rank
                try:
                    while running:
                        done, _ = wait(running, return_when=FIRST_COMPLETED)
                        for fut in done:
                            wrote(running.pop(fut), fut.result())
                except BaseException:
                    for fut in running:
                        fut.cancel()
                    raise
    except BaseException:
        bar.close()
        _cleanup(out_dir, rank_list, created_out)
        raise
    bar.close()
    summary.event_files.sort()
    summary.seconds = time.monotonic() - t0
    return summary

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

Work is split into one task per (rank, kind) (parsing, the bulk of the time) and one per rank (tags and the
event file), run by a process pool; a rank's event file is written by one process, as everywhere in trainmon.
"""

from __future__ import annotations

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
from trainmon.read.csv import KindTable, ReadReport, read_kind
from trainmon.read.csv_sources import LayoutError, Source, find_sources, output_beside
from trainmon.run import records
from trainmon.writer.tensorboard import EventFile

__all__ = ["ConvertError", "ConvertSummary", "convert", "default_out", "rank_tags", "write_rank"]

_KIND_ORDER = {k.value: i for i, k in enumerate(records.Kind)}
# Distinct per-step tag layouts whose tag tuples are kept (steps usually share one or a few layouts).
_LAYOUTS_KEPT = 64


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


def write_rank(tables: Sequence[KindTable], directory: Path, wall_time: float) -> tuple[Path, int, int, int]:
    """Write one rank's tables as one event file in ``directory``: (path, scalars, steps, duplicates)."""
    tables = sorted(tables, key=lambda t: _kind_key(t.kind))
    tags, ids = rank_tags(tables)
    tag_id = np.concatenate([i.reshape(-1) for i in ids]) if ids else np.empty(0, np.int64)
    step = (
        np.concatenate([np.repeat(t.step, len(t.stats)) for t in tables]) if tables else np.empty(0, np.int64)
    )
    value = np.concatenate([t.values.reshape(-1) for t in tables]) if tables else np.empty(0, np.float32)
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
    layouts: dict[bytes, tuple[str, ...]] = {}
    with EventFile(directory) as ef:
        for a, b in zip(starts, stops, strict=True):
            if a == b:
                continue
            ids_here = tag_id[a:b]
            key = ids_here.tobytes()
            step_tags = layouts.get(key)
            if step_tags is None:
                if len(layouts) >= _LAYOUTS_KEPT:
                    layouts.clear()
                step_tags = layouts[key] = tuple(tags[i] for i in ids_here.tolist())
            ef.write_scalars(int(step[a]), wall_time, step_tags, value[a:b])
    return ef.path, int(len(step)), len(starts) if len(step) else 0, duplicates


# ---------------------------------------------------------------------------------------------
# Tasks (module-level: they run in worker processes).


def _read_task(
    source: Source, steps: tuple[int | None, int | None] | None, skip_bad: bool
) -> tuple[list[KindTable], ReadReport]:
    return read_kind(source, steps=steps, skip_bad=skip_bad)


def _write_task(tables: list[KindTable], directory: Path, wall_time: float) -> tuple[Path, int, int, int]:
    return write_rank(tables, directory, wall_time)


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
        raise ConvertError(str(e)) from None
    rank_list = sorted({s.rank for s in sources})
    _prepare_out(out_dir, rank_list, force)
    created_out = not out_dir.exists()
    summary = ConvertSummary(out=out_dir, ranks=rank_list, files=sum(len(s.files) for s in sources))
    total = sum(s.size for s in sources)
    bar = Progress(total, progress, label="csv2tb ")
    rank_size = {r: sum(s.size for s in sources if s.rank == r) for r in rank_list}
    pending_kinds = {r: sum(1 for s in sources if s.rank == r) for r in rank_list}
    tables: dict[int, list[KindTable]] = {r: [] for r in rank_list}
    n_workers = workers if workers is not None else min(os.cpu_count() or 1, len(sources))
    n_workers = max(1, n_workers)

    def took(report: ReadReport, source: Source, got: list[KindTable]) -> None:
        summary.rows += report.rows
        summary.skipped += report.skipped
        summary.notes.extend(report.notes)
        tables[source.rank].extend(got)
        pending_kinds[source.rank] -= 1
        bar.advance(source.size / 2)

    def wrote(rank: int, result: tuple[Path, int, int, int]) -> None:
        path, scalars, n_steps, dups = result
        summary.event_files.append(path)
        summary.scalars += scalars
        summary.steps += n_steps
        summary.duplicates += dups
        tables[rank] = []
        bar.advance(rank_size[rank] / 2)

    try:
        if n_workers == 1:
            for source in sources:
                got, report = read_kind(source, steps=steps, skip_bad=skip_bad)
                took(report, source, got)
                if pending_kinds[source.rank] == 0 and tables[source.rank]:
                    wrote(
                        source.rank,
                        write_rank(tables[source.rank], out_dir / f"rank_{source.rank}", wall_time),
                    )
        else:
            with _pool(n_workers) as pool:
                running: dict[Future, tuple[str, Source | int]] = {}
                for source in sorted(sources, key=lambda s: -s.size):  # big first: better balance
                    running[pool.submit(_read_task, source, steps, skip_bad)] = ("read", source)
                try:
                    while running:
                        done, _ = wait(running, return_when=FIRST_COMPLETED)
                        for fut in done:
                            what, item = running.pop(fut)
                            if what == "read":
                                assert isinstance(item, Source)
                                got, report = fut.result()
                                took(report, item, got)
                                if pending_kinds[item.rank] == 0 and tables[item.rank]:
                                    job = pool.submit(
                                        _write_task,
                                        tables[item.rank],
                                        out_dir / f"rank_{item.rank}",
                                        wall_time,
                                    )
                                    running[job] = ("write", item.rank)
                            else:
                                assert isinstance(item, int)
                                wrote(item, fut.result())
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

"""TensorBoard output: a minimal, fast event-file writer and the per-rank scalar sink.

Event files are TFRecord files of serialized ``tensorboard.Event`` protos. We encode the few message
shapes we need by hand (wall_time, step, file_version, and a Summary of ``simple_value`` scalars), so a
scalar costs a template copy and a 4-byte store instead of a protobuf object, and we frame records with
the native ``crc32c`` package instead of TensorBoard's pure-Python checksum.

Crash safety: the framed records of a step are handed to the OS in one ``write`` call on an ``O_APPEND``
descriptor (:class:`trainmon.run.append.AppendFile`), so a process killed at any moment leaves every completed
step readable (TensorBoard's readers stop at a truncated last record without error), and a write that fails
(a full disk) is cut back off before the next one, so no torn record ever sits before later steps.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from trainmon.run import records
from trainmon.run.append import AppendFile
from trainmon.run.records import Derived, Row, StepRecord
from trainmon.writer.layouts import LayoutCache
from trainmon.writer.tbview import ALL, SUMMARY, SummaryLayout, TensorPatterns, view_of
from trainmon.writer.timetags import AGGREGATE_TAGS, RANK_TAGS, aggregate_values, rank_values

__all__ = [
    "AllRanksSink",
    "EventFile",
    "LayoutCache",
    "TensorBoardSink",
    "check_ops",
    "masked_crc32c",
]

logger = logging.getLogger("trainmon")

# Largest serialized Summary in one Event; a step with more scalars is split into several events
# (all with the same step; each tag still appears once per step).
MAX_SUMMARY_BYTES = 512 * 1024


# ---------------------------------------------------------------------------------------------
# CRC32C (Castagnoli) with TFRecord masking.


def _make_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _make_table()


def table_crc32c(data, value: int = 0) -> int:
    """Pure-Python CRC32C (slow: only used where the ``crc32c`` package is missing)."""
    crc = value ^ 0xFFFFFFFF
    table = _TABLE
    for b in memoryview(data).cast("B"):
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


try:
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - exercised only where the wheel is missing
    _crc32c = table_crc32c


def masked_crc32c(data, value: int = 0) -> int:
    """TFRecord's masked CRC32C of ``data`` (continuing from an unmasked ``value``)."""
    return _mask(_crc32c(data, value))


def _mask(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# Protobuf wire encoding of the few messages we write.

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_F64 = struct.Struct("<d")


def _varint(n: int) -> bytes:
    if n < 0:  # int64 negatives are encoded as their 64-bit two's complement (10 bytes)
        n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


# Event: wall_time = 1 (double, wire type 1), step = 2 (varint), file_version = 3 (bytes),
# summary = 5 (bytes). Summary: value = 1 (bytes). Summary.Value: tag = 1 (bytes),
# simple_value = 2 (float, wire type 5).
_EV_WALL_TIME = b"\x09"
_EV_STEP = b"\x10"
_EV_FILE_VERSION = b"\x1a"
_EV_SUMMARY = b"\x2a"
_SUM_VALUE = b"\x0a"
_VAL_TAG = b"\x0a"
_VAL_SIMPLE = b"\x15"


def _value_prefix(tag: str) -> bytes:
    """Bytes of one ``Summary.value`` entry up to (not including) its 4-byte float."""
    tb = tag.encode("utf-8", "backslashreplace")  # names are encoded already (run.names); never fail a step
    body_len = 1 + len(_varint(len(tb))) + len(tb) + 1 + 4
    return _SUM_VALUE + _varint(body_len) + _VAL_TAG + _varint(len(tb)) + tb + _VAL_SIMPLE


def _event_head(wall_time: float, step: int | None) -> bytes:
    head = _EV_WALL_TIME + _F64.pack(wall_time)
    if step:  # proto3 leaves a zero step out
        head += _EV_STEP + _varint(int(step))
    return head


class _Chunk:
    """Precomputed bytes of one event's Summary with holes for the float values."""

    __slots__ = ("start", "stop", "template", "scatter", "size_field")

    def __init__(self, start: int, stop: int, prefixes: list[bytes]) -> None:
        self.start, self.stop = start, stop
        parts = []
        ends = []
        pos = 0
        for p in prefixes:
            parts.append(p)
            parts.append(b"\0\0\0\0")
            pos += len(p) + 4
            ends.append(pos)
        self.template = np.frombuffer(b"".join(parts), dtype=np.uint8)
        # byte offsets of the floats, in value order, 4 per value
        starts = np.asarray(ends, dtype=np.int64) - 4
        self.scatter = (starts[:, None] + np.arange(4, dtype=np.int64)).ravel()
        self.size_field = _EV_SUMMARY + _varint(pos)


class _TagLayout:
    __slots__ = ("tags", "chunks")

    def __init__(self, tags: tuple[str, ...], prefix_of) -> None:
        self.tags = tags
        self.chunks: list[_Chunk] = []
        prefixes: list[bytes] = []
        size = 0
        start = 0
        for i, t in enumerate(tags):
            p = prefix_of(t)
            if prefixes and size + len(p) + 4 > MAX_SUMMARY_BYTES:
                self.chunks.append(_Chunk(start, i, prefixes))
                prefixes, size, start = [], 0, i
            prefixes.append(p)
            size += len(p) + 4
        if prefixes:
            self.chunks.append(_Chunk(start, len(tags), prefixes))


def _frame(*parts) -> bytes:
    """``parts`` (concatenated) framed as one TFRecord: length, its masked CRC, the data, its masked CRC."""
    n = sum(len(memoryview(p).cast("B")) for p in parts)
    length = _U64.pack(n)
    crc = 0
    for p in parts:
        crc = _crc32c(p, crc)
    return b"".join((length, _U32.pack(masked_crc32c(length)), *parts, _U32.pack(_mask(crc))))


_uid = itertools.count()
_uid_lock = threading.Lock()


class EventFile:
    """Append-only TensorBoard event file of scalar summaries.

    One instance per run directory and process. Not thread-safe: use it from one thread (the writer
    thread) only.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        filename_suffix: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        with _uid_lock:
            uid = next(_uid)
        now = clock()  # the writer process is given the training process's clock
        name = (
            f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.{uid}{filename_suffix}"
        )
        self.path = self.directory / name
        version = b"brain.Event:2"
        # the first record; written again should the file be deleted and created anew
        header = _frame(_event_head(now, None) + _EV_FILE_VERSION + _varint(len(version)) + version)
        self._f = AppendFile(self.path, header)
        self._prefixes: dict[str, bytes] = {}
        self._layouts = LayoutCache(lambda tags: _TagLayout(tuple(tags), self._prefix))

    # -- layouts -----------------------------------------------------------------------------
    def _prefix(self, tag: str) -> bytes:
        p = self._prefixes.get(tag)
        if p is None:
            p = self._prefixes[tag] = _value_prefix(tag)
        return p

    # -- public API --------------------------------------------------------------------------
    def write_scalars(self, step: int, wall_time: float, tags: Sequence[str], values: np.ndarray) -> int:
        """Write one value per tag for ``step`` (float32 ``simple_value``; NaN/inf allowed), as few
        events as the size limit allows, then flush. Returns the bytes written."""
        with np.errstate(over="ignore"):  # beyond float32's range is +-inf, as TensorBoard would show
            vals = np.ascontiguousarray(values, dtype="<f4").reshape(-1)
        if len(vals) != len(tags):
            raise ValueError(f"{len(tags)} tags but {len(vals)} values")
        if not len(vals):
            return 0
        layout = self._layouts.get(tags if type(tags) is tuple else tuple(tags))
        raw = vals.view(np.uint8)
        head = _event_head(float(wall_time), int(step))
        framed = []
        for ch in layout.chunks:
            buf = ch.template.copy()
            buf[ch.scatter] = raw[4 * ch.start : 4 * ch.stop]
            framed.append(_frame(head, ch.size_field, buf))
        data = framed[0] if len(framed) == 1 else b"".join(framed)
        self._f.append(data)  # the whole step, or nothing
        return len(data)

    def flush(self) -> None:
        """Every step is with the OS once written: nothing is buffered here."""

    def close(self) -> None:
        self._f.close()

    @property
    def closed(self) -> bool:
        return self._f.closed

    def __enter__(self) -> EventFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# The sink.


def check_ops(ops: Sequence[str]) -> tuple[str, ...]:
    """Validate statistic names; msprobe's metadata ops (``shape``, ``dtype``, ``id``) are dropped."""
    out: list[str] = []
    for op in ops:
        if op in ("shape", "dtype", "id"):
            continue
        if op not in records.STATS:
            raise ValueError(f"unknown statistic {op!r}; expected one of {', '.join(records.STATS)}")
        if op not in out:
            out.append(op)
    return tuple(out)


class _RowLayout:
    """Per row-layout work of the TB sink: tags, and how rows merge into one value per tag."""

    __slots__ = ("tags", "groups")

    def __init__(self, rows: tuple[Row, ...], ops: tuple[str, ...], multi_chunk: bool) -> None:
        self.groups = records.TensorGroups(rows)
        self.tags = tuple(
            records.tag(kind, records.chunk_name(vpp, name, multi_chunk), op)
            for kind, vpp, name in self.groups.keys
            for op in ops
        )


class TensorBoardSink:
    """Scalars of one rank into ``rank_dir``: what ``tensors`` (``tensorboard_tensors``, see
    :mod:`trainmon.writer.tbview`) asks for; ``all``: tag ``{kind}/{name}/{stat}`` for every configured stat
    of every tensor.

    Rows sharing (kind, vpp_stage, name) within a step (micro-steps) are merged with the partials
    algebra (:func:`trainmon.run.records.merge`) and written as ONE value per tag: TensorBoard shows the
    step-level statistic while the CSV keeps one row per micro-step. ``announce``: say in the log, once,
    what a view other than the summary costs (one rank of the job does).
    """

    def __init__(
        self,
        rank_dir: str | os.PathLike[str],
        ops: Sequence[str],
        multi_chunk: bool = False,
        clock: Callable[[], float] = time.time,
        tensors: str | Sequence[str] = ALL,
        announce: bool = False,
    ) -> None:
        self.ops = check_ops(ops)
        self.multi_chunk = bool(multi_chunk)
        self.view = view_of(tensors)
        self.events = EventFile(rank_dir, clock=clock)
        if self.view == ALL:
            self._layouts = LayoutCache(lambda rows: _RowLayout(rows, self.ops, self.multi_chunk))
        else:
            patterns = None if self.view == SUMMARY else TensorPatterns(self.view)

            def summary(rows: tuple[Row, ...]) -> SummaryLayout:
                return SummaryLayout(records.TensorGroups(rows).keys, self.ops, self.multi_chunk, patterns)

            self._layouts = LayoutCache(summary)
        self._announce = announce and self.view != SUMMARY

    def values(self, record: StepRecord, derived: Derived) -> tuple[tuple[str, ...], np.ndarray]:
        """Tags and float64 values this sink writes for ``record``: one value per tensor (micro-steps
        merged) and statistic, or the figures of the summary."""
        layout = self._layouts.get(tuple(record.rows))
        if self.view != ALL:
            return layout.tags, layout.values(derived.merged, derived.tensors)
        if not self.ops or not layout.tags:
            return layout.tags, np.empty(0)
        vals = np.empty((len(layout.tags) // len(self.ops), len(self.ops)), dtype=np.float64)
        for j, op in enumerate(self.ops):
            vals[:, j] = derived.tensors[op]
        return layout.tags, vals.reshape(-1)

    def write(self, record: StepRecord, derived: Derived) -> None:
        tags, vals = self.values(record, derived)
        if len(tags):
            written = self.events.write_scalars(record.step, record.wall_time, tags, vals)
            if self._announce:
                self._announce = False
                keys = records.TensorGroups(tuple(record.rows)).keys
                announce_cost(self.events.directory, self.view, len(tags), written, keys, self.ops,
                              self.multi_chunk)  # fmt: skip
        if record.timing is not None:  # the step times, at the step they are of
            times = rank_values(record.timing)
            self.events.write_scalars(record.timing.step, record.wall_time, RANK_TAGS, times)

    def flush(self) -> None:
        self.events.flush()

    def close(self) -> None:
        self.events.close()


def announce_cost(
    directory: Path,
    view: str | tuple[str, ...],
    tags: int,
    written: int,
    keys: Sequence[tuple[str, int, str]],
    ops: Sequence[str],
    multi_chunk: bool,
) -> None:
    """Say once what a TensorBoard run costs when it shows more than the summary."""
    summary = len(SummaryLayout(keys, ops, multi_chunk).tags)
    setting = view if isinstance(view, str) else "[" + ", ".join(view) + "]"
    logger.info(
        "trainmon: TensorBoard run %s (tensorboard_tensors: %s): %d tags, %.1f KB a step on disk (the "
        "summary would be %d tags); TensorBoard loads thousands of tags slowly (minutes at 10,000)",
        directory,
        setting,
        tags,
        written / 1e3,
        summary,
    )


class _AggregateLayout:
    """Tags of the tensors present in an all_ranks step, and their slots."""

    __slots__ = ("keys", "tags", "slots", "summary")

    def __init__(
        self,
        keys: tuple,
        present: np.ndarray,
        ops: tuple[str, ...],
        multi_chunk: bool,
        view: str | tuple[str, ...],
    ) -> None:
        self.keys = keys
        self.slots = np.flatnonzero(present)
        self.summary: SummaryLayout | None = None
        if view == ALL:
            self.tags = tuple(
                records.tag(keys[i][0], records.chunk_name(keys[i][1], keys[i][2], multi_chunk), op)
                for i in self.slots
                for op in ops
            )
        else:
            patterns = None if view == SUMMARY else TensorPatterns(view)
            self.summary = SummaryLayout([keys[i] for i in self.slots], ops, multi_chunk, patterns)
            self.tags = self.summary.tags


class AllRanksSink:
    """The ``all_ranks`` TensorBoard run: each tensor's statistics over every rank of the job
    (:class:`~trainmon.run.records.RankAggregate`), same tags as the ranks' own runs, so TensorBoard draws
    them on one chart: ``min`` is the smallest over ranks, ``max`` the largest, ``nans``/``infs`` the sums,
    ``norm`` and ``mean`` those of all ranks' elements together, ``zeros`` their fraction of zeros. The
    summary view (:mod:`trainmon.writer.tbview`) is made of the same merged partials."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        ops: Sequence[str],
        multi_chunk: bool = False,
        clock: Callable[[], float] = time.time,
        tensors: str | Sequence[str] = ALL,
        announce: bool = False,
    ) -> None:
        self.ops = check_ops(ops)
        self.multi_chunk = bool(multi_chunk)
        self.view = view_of(tensors)
        self.events = EventFile(run_dir, clock=clock)
        self._layouts: dict[tuple[int, bytes], _AggregateLayout] = {}
        self._announce = announce and self.view != SUMMARY

    def write(self, record: StepRecord, derived: Derived) -> None:
        timing = record.timing
        if timing is not None and (times := aggregate_values(timing)) is not None:
            self.events.write_scalars(timing.step, record.wall_time, AGGREGATE_TAGS, times)
        agg = record.all_ranks
        if agg is None or not self.ops or not len(agg.keys):
            return
        present = agg.partials[:, records.NUMEL] > 0
        key = (id(agg.keys), present.tobytes())
        layout = self._layouts.get(key)
        if layout is None or layout.keys is not agg.keys:  # the table of tensors is one object until it grows
            if len(self._layouts) > 8:
                self._layouts.clear()
            layout = self._layouts[key] = _AggregateLayout(
                agg.keys, present, self.ops, self.multi_chunk, self.view
            )
        if not len(layout.slots):
            return
        merged = agg.partials[layout.slots]
        stats = records.derive(merged)
        if layout.summary is not None:
            vals = layout.summary.values(merged, stats)
        else:
            vals = np.stack([stats[op] for op in self.ops], axis=1).reshape(-1)
        written = self.events.write_scalars(record.step, record.wall_time, layout.tags, vals)
        if self._announce:
            self._announce = False
            keys = [agg.keys[i] for i in layout.slots]
            announce_cost(self.events.directory, self.view, len(layout.tags), written, keys, self.ops,
                          self.multi_chunk)  # fmt: skip

    def flush(self) -> None:
        self.events.flush()

    def close(self) -> None:
        self.events.close()

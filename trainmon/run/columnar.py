"""Per-rank columnar tables: an Arrow IPC stream for the steps being written, sealed into Parquet segments.

One table (the statistics store, the anomaly records, the per-step rows) is a hive-partitioned dataset, one
folder per rank::

    TABLE/rank=<r>/part-<seq>-<lo>-<hi>.parquet     a sealed segment: the rank's rows of steps lo..hi
    TABLE/rank=<r>/_open-<seq>-<lo>.arrows          the segment being written: an Arrow IPC stream
    TABLE/rank=<r>/_seal-<seq>.parquet.tmp          a segment being sealed (read by nobody)

DuckDB (``read_parquet('TABLE/*/*.parquet', hive_partitioning=true)``), pandas and pyarrow (``TABLE``),
Polars (``TABLE/**/*.parquet``) and Spark read the sealed segments of every rank as one table with a
``rank`` column; they skip names starting with ``_``. The rank is not stored inside the files.

**Writing** (:class:`SegmentWriter`, on the writer thread). Each step is one record batch, serialised in
memory and appended with one ``os.write`` on an ``O_APPEND`` descriptor. A failed or short append (a full
disk) is cut back to the last whole batch (``ftruncate``), raised naming the stream, and ends that stream:
the Arrow writer's state (the dictionaries it has sent) no longer matches the file, so the next append starts
a new stream under the next ``seq``. A stream is sealed when a step falls outside its segment (steps
``k * segment_steps ..``, aligned, so that every rank's segments cover the same steps), when it holds
``max_rows`` rows, when the writer closes, and, for a stream a killed job left behind, when a writer of the
same table and rank starts. Sealing writes the stream's whole batches to ``_seal-<seq>.parquet.tmp``, renames
it to ``part-...``, then removes the stream; it runs on a background thread (pyarrow works without the GIL),
so the writer thread goes on meanwhile. A seal that fails (a full disk) removes its temporary file and leaves
the stream as it was, readable; the writer seals it again at a stream end :data:`SEAL_RETRY_S` later and at
close, and a later writer of the partition at its start.

A partition deleted under the writer (the run folder removed under a running job) is noticed at the next
append (the open stream's link count is 0, or the folder is gone when a stream starts): said once for the
whole run folder (:func:`trainmon.run.append.say_deleted`), the folder is created again and a new stream
starts there; the steps the deleted files held are gone.

**Reading.** :func:`segments` lists a partition's segments in ``seq`` order (a stream whose ``seq`` already
has a sealed segment is a leftover of a seal that was killed before removing it, and is skipped);
:func:`read_stream` returns a stream's whole batches and stops quietly at a torn last message (a writer killed
mid-append, or appending right now); :func:`read_partition` returns the rows of a step range
from every segment, reading only the Parquet row groups whose ``step`` statistics overlap it. A damaged file
(a segment cut short, a stream overwritten in the middle) is read as far as it can be and noted
(:mod:`trainmon.run.damage`); the other segments are read as usual.

A job resumed into the same run starts a new ``seq``; steps written again after a resume are rows again
(readers that need one value per step take the last, in ``seq`` order).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from trainmon.run.append import naming, say_deleted
from trainmon.run.damage import note, read_or_note, reason
from trainmon.run.layout import SEGMENT_FILE, STREAM_FILE, sealing_name, segment_name, stream_name
from trainmon.run.names import encode_name

__all__ = [
    "array_numpy",
    "column_numpy",
    "GrowingDictionary",
    "ParquetOptions",
    "utf8",
    "Segment",
    "SegmentWriter",
    "read_partition",
    "read_segment",
    "read_stream",
    "seal_leftovers",
    "segments",
    "signature",
    "write_segments",
]

logger = logging.getLogger("trainmon")

# A segment covers this many steps (aligned: segment k holds steps k*N .. k*N+N-1) unless it fills first.
SEGMENT_STEPS = 1000
# ... or holds this many rows (bounds what sealing reads back at once).
MAX_SEGMENT_ROWS = 1 << 21
# Rows of a Parquet row group (a segment has one or a few; readers skip row groups outside a step range).
ROW_GROUP_ROWS = 1 << 17
# Segments of more rows than this are decoded by pyarrow's threads.
_THREADED_ROWS = 1 << 16
# How long closing a writer waits for its segments to be sealed.
SEAL_TIMEOUT_S = 120.0
# A seal that failed (a full disk) is tried again at a stream end this long after, or at close: not at every
# step of a long outage (each try reads the whole stream back).
SEAL_RETRY_S = 30.0


@dataclass(frozen=True)
class ParquetOptions:
    """How a table's segments are encoded: zstd; dictionaries for the columns named (names, steps, counts),
    byte-stream-split for the float columns of statistics (their bytes compress far better split by
    position); the Arrow schema is kept in the file, so dictionary columns read back as dictionaries."""

    dictionary: tuple[str, ...] | bool = True  # True: every column
    byte_stream_split: tuple[str, ...] = ()
    compression: str = "zstd"

    def kwargs(self) -> dict:
        dictionary = self.dictionary if isinstance(self.dictionary, bool) else list(self.dictionary)
        out: dict = {"compression": self.compression, "use_dictionary": dictionary}
        if self.byte_stream_split:
            out["use_byte_stream_split"] = list(self.byte_stream_split)
        return out


@dataclass(frozen=True)
class Segment:
    """One segment of a partition: sealed (Parquet, steps ``lo..hi``) or live (an Arrow IPC stream from
    step ``lo``, ``hi`` unknown until read)."""

    seq: int
    lo: int
    hi: int | None
    path: Path

    @property
    def sealed(self) -> bool:
        return self.hi is not None

    def overlaps(self, step_lo: int | None, step_hi: int | None) -> bool:
        if step_hi is not None and self.lo > step_hi:
            return False
        return not (step_lo is not None and self.hi is not None and self.hi < step_lo)


def segments(partition: Path) -> list[Segment]:
    """The segments of one rank's partition, in ``seq`` (write) order; leftover streams left out."""
    try:
        names = os.listdir(partition)
    except (FileNotFoundError, NotADirectoryError):
        return []
    sealed: dict[int, Segment] = {}
    live: dict[int, Segment] = {}
    for name in names:
        m = SEGMENT_FILE.match(name)
        if m:
            seq = int(m.group(1))
            sealed[seq] = Segment(seq, int(m.group(2)), int(m.group(3)), partition / name)
            continue
        m = STREAM_FILE.match(name)
        if m:
            seq = int(m.group(1))
            live[seq] = Segment(seq, int(m.group(2)), None, partition / name)
    found = list(sealed.values()) + [s for seq, s in live.items() if seq not in sealed]
    return sorted(found, key=lambda s: s.seq)


def utf8(text: str) -> str:
    """``text`` as Arrow can store it. Names reach the tables encoded already (:mod:`trainmon.run.names`);
    a string UTF-8 cannot hold (a lone surrogate, which file systems hand out through ``os.fsdecode``) is
    stored encoded the same way (``\\udc80``, a backslash as ``\\\\``), so ``decode_name`` gives it back
    and it never meets another string's text; every other string is unchanged."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return encode_name(text)


class GrowingDictionary:
    """The dictionary of one dictionary-encoded column, only ever growing (a new value is appended), so every
    batch of a stream indexes a prefix of the last dictionary and the stream writer sends only deltas."""

    def __init__(self, index_type: pa.DataType | None = None) -> None:
        self.index_type = pa.int32() if index_type is None else index_type
        self._ids: dict[str, int] = {}
        self._values: pa.Array | None = None
        self._np_index = np.dtype(f"int{self.index_type.bit_width}")

    def index(self, value: str) -> int:
        i = self._ids.get(value)
        if i is None:
            i = self._ids[value] = len(self._ids)
            self._values = None  # rebuilt on the next array()
        return i

    def indices(self, values: Sequence[str]) -> np.ndarray:
        return np.fromiter((self.index(v) for v in values), dtype=self._np_index, count=len(values))

    def array(self, indices: np.ndarray) -> pa.DictionaryArray:
        if self._values is None:
            self._values = pa.array([utf8(v) for v in self._ids], pa.string())
        return pa.DictionaryArray.from_arrays(pa.array(indices, self.index_type), self._values)


# ---------------------------------------------------------------------------------------------- reading
def signature(partition: Path) -> tuple:
    """A cheap fingerprint of a partition's files (names, sizes, modification times): equal while nothing was
    appended, sealed or replaced."""
    try:
        entries = list(os.scandir(partition))
    except (FileNotFoundError, NotADirectoryError):
        return ()
    out = []
    for e in entries:
        if SEGMENT_FILE.match(e.name) or STREAM_FILE.match(e.name):
            with contextlib.suppress(FileNotFoundError):
                st = e.stat()
                out.append((e.name, st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))


def read_stream(path: Path, schema: pa.Schema | None = None) -> pa.Table:
    """The whole record batches of an Arrow IPC stream. A torn last message (the writer was killed mid-append,
    or is appending now) ends the reading quietly; so does a stream too short to hold its schema (then the
    table is empty, with ``schema`` when given). A stream damaged elsewhere (bytes overwritten: the reading
    stops before the end of the file, or at something that is no message) is read up to the damage and noted
    (:mod:`trainmon.run.damage`)."""
    table, damage = _read_stream(path, schema)
    if damage:
        note(path, damage)
    return table


def _read_stream(path: Path, schema: pa.Schema | None) -> tuple[pa.Table, str]:
    """(the stream's whole batches, "" or what is damaged in it)."""
    with open(path, "rb") as f:  # FileNotFoundError: sealed meanwhile (read_partition lists again)
        data = f.read()
    batches: list[pa.RecordBatch] = []
    found_schema = schema
    source = pa.BufferReader(pa.py_buffer(data))
    start = 0  # where the message being read starts
    damage = ""
    try:
        reader = ipc.open_stream(source)
        found_schema = reader.schema
        start = source.tell()
        while True:
            batches.append(reader.read_next_batch())
            start = source.tell()
    except StopIteration:
        pass
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError, ValueError) as e:  # a torn or damaged message
        if not _torn(data, start, source.tell()):
            damage = (f"Arrow stream damaged at byte {start} of {len(data)} ({reason(e)}); the "
                      f"{len(batches)} whole batches before it are read")  # fmt: skip
        elif data:
            logger.debug("trainmon: %s: reading stopped after %d whole batches: %s", path, len(batches), e)
    if found_schema is None:
        if damage:
            note(path, damage)
        raise ValueError(f"{path}: no Arrow schema (empty or torn stream) and none given")
    return pa.Table.from_batches(batches, schema=found_schema), damage


# Every message a writer appends starts with this continuation marker (the IPC format since Arrow 0.15).
_MESSAGE_START = b"\xff\xff\xff\xff"


def _torn(data: bytes, start: int, stopped: int) -> bool:
    """Whether a reading that failed on the message starting at ``start``, having read up to ``stopped``, met
    a message cut short at the end of the file (a torn append) rather than damage: the reading ran into the
    end, and what is there starts like a message."""
    head = data[start : start + len(_MESSAGE_START)]
    return stopped >= len(data) and _MESSAGE_START.startswith(head)


_NUMPY_TYPES = {pa.float32(): np.float32, pa.float64(): np.float64, pa.int64(): np.int64,
                pa.int32(): np.int32, pa.int16(): np.int16, pa.int8(): np.int8}  # fmt: skip


def array_numpy(chunk: pa.Array) -> np.ndarray:
    """A chunk's values as numpy: a view of its data buffer when it has no nulls (``to_numpy`` would import
    pandas, a third of a second, on a reader's first call); booleans unpacked, floats with nulls as NaN;
    anything else through pyarrow."""
    if chunk.type == pa.bool_() and not chunk.null_count:
        return _plain(pc.cast(chunk, pa.uint8()), np.uint8).view(np.bool_)
    dtype = _NUMPY_TYPES.get(chunk.type)
    if dtype is not None and chunk.null_count and pa.types.is_floating(chunk.type):
        values = _plain(chunk, dtype).copy()  # the slots of nulls hold anything
        values[_plain(pc.cast(pc.is_valid(chunk), pa.uint8()), np.uint8) == 0] = np.nan
        return values
    if dtype is None or chunk.null_count:
        return chunk.to_numpy(zero_copy_only=False)
    return _plain(chunk, dtype)


def _plain(chunk: pa.Array, dtype: type) -> np.ndarray:
    """A view of a fixed-width chunk's data buffer."""
    return np.frombuffer(
        chunk.buffers()[1], dtype=dtype, count=len(chunk), offset=chunk.offset * np.dtype(dtype).itemsize
    )


def column_numpy(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A column's values as numpy, as :func:`array_numpy` (a view when it is one chunk without nulls)."""
    if isinstance(column, pa.Array):
        return array_numpy(column)
    if column.num_chunks == 1:
        return array_numpy(column.chunk(0))
    parts = [array_numpy(chunk) for chunk in column.chunks]
    return np.concatenate(parts) if parts else np.empty(0, _NUMPY_TYPES.get(column.type, np.float64))


def _sorted_steps(steps: pa.ChunkedArray) -> np.ndarray | None:
    """The step column as numpy (views of its buffers) when it is int64 without nulls and ascending (how a
    writer appends a segment's steps); None otherwise."""
    if steps.type != pa.int64() or steps.null_count:
        return None
    parts = [
        np.frombuffer(c.buffers()[1], dtype=np.int64, count=len(c), offset=c.offset * 8) for c in steps.chunks
    ]
    out = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.empty(0, np.int64)
    return out if bool((out[1:] >= out[:-1]).all()) else None


def _step_filter(table: pa.Table, step_lo: int | None, step_hi: int | None) -> pa.Table:
    if step_lo is None and step_hi is None or not table.num_rows:
        return table
    found = _sorted_steps(table.column("step"))
    if found is not None:  # a slice of ascending steps: no copy, and no pyarrow scalar (which imports pandas)
        lo = 0 if step_lo is None else int(np.searchsorted(found, step_lo, side="left"))
        hi = len(found) if step_hi is None else int(np.searchsorted(found, step_hi, side="right"))
        return table.slice(lo, max(hi - lo, 0))
    steps = table.column("step")
    mask = None
    if step_lo is not None:
        mask = pc.greater_equal(steps, step_lo)
    if step_hi is not None:
        upper = pc.less_equal(steps, step_hi)
        mask = upper if mask is None else pc.and_(mask, upper)
    return table.filter(mask)


def read_segment(
    segment: Segment,
    schema: pa.Schema,
    columns: Sequence[str] | None = None,
    step_lo: int | None = None,
    step_hi: int | None = None,
    mapped: bool = False,
) -> pa.Table:
    """The rows of one segment in a step range (both ends included; None: open), ``columns`` only. A sealed
    segment that cannot be read (cut short, overwritten) is noted damaged (:mod:`trainmon.run.damage`) and
    read as no rows; a stream, up to its damage. ``mapped``: a sealed segment is read through a memory map
    (a large read's first in a process: its bytes are not copied into fresh memory first; sealed segments
    are replaced, never rewritten in place, so a map never sees its file shrink)."""
    need = None if columns is None else list(dict.fromkeys([*columns, "step"]))
    if segment.sealed:
        table = read_or_note(
            segment.path,
            lambda: _read_parquet(segment, need, step_lo, step_hi, mapped),
            lambda: _empty(schema, need),
        )
    else:
        table = read_or_note(segment.path, lambda: read_stream(segment.path, schema), schema.empty_table)
        if need is not None:  # a stream written before a column was added lacks it (Parquet: left out too)
            table = table.select([c for c in need if c in table.column_names])
    inside = (
        segment.sealed
        and (step_lo is None or segment.lo >= step_lo)
        and (
            step_hi is None or segment.hi <= step_hi  # type: ignore[operator]
        )
    )
    if not inside:  # a segment wholly in the range needs no filter (a copy of every column)
        table = _step_filter(table, step_lo, step_hi)
    if columns is not None and "step" not in columns:
        table = table.drop_columns(["step"])
    return table


def _read_parquet(
    segment: Segment, need: list[str] | None, step_lo: int | None, step_hi: int | None, mapped: bool = False
) -> pa.Table:
    pf = pq.ParquetFile(segment.path, memory_map=mapped)
    groups = _row_groups(pf, step_lo, step_hi)
    # pyarrow's thread pool costs more than it saves on small segments (a rank's anomaly records: ~1/3 of the
    # time of reading a thousand of them); large ones decode their columns in parallel
    threads = pf.metadata.num_rows > _THREADED_ROWS
    if groups:
        return pf.read_row_groups(groups, columns=need, use_threads=threads)
    table = pf.schema_arrow.empty_table()
    return table if need is None else table.select([c for c in need if c in table.column_names])


def _empty(schema: pa.Schema, need: list[str] | None) -> pa.Table:
    table = schema.empty_table()
    return table if need is None else table.select([c for c in need if c in table.column_names])


def _row_groups(pf: pq.ParquetFile, step_lo: int | None, step_hi: int | None) -> list[int]:
    md = pf.metadata
    if step_lo is None and step_hi is None:
        return list(range(md.num_row_groups))
    col = pf.schema_arrow.get_field_index("step")
    out = []
    for i in range(md.num_row_groups):
        stats = md.row_group(i).column(col).statistics
        if stats is not None and stats.has_min_max:
            after = step_hi is not None and stats.min > step_hi
            if after or (step_lo is not None and stats.max < step_lo):
                continue
        out.append(i)
    return out


def read_partition(
    partition: Path,
    schema: pa.Schema,
    columns: Sequence[str] | None = None,
    step_lo: int | None = None,
    step_hi: int | None = None,
) -> pa.Table:
    """One rank's rows of a step range, every segment in write order (``columns`` only; None: all)."""
    for attempt in range(3):
        try:
            parts = [
                read_segment(s, schema, columns, step_lo, step_hi)
                for s in segments(partition)
                if s.overlaps(step_lo, step_hi)
            ]
            break
        except FileNotFoundError:  # a stream was sealed (or a segment replaced) between listing and reading
            if attempt == 2:
                raise
    parts = [t for t in parts if t.num_rows]
    if not parts:
        empty = schema.empty_table()
        return empty if columns is None else empty.select(list(columns))
    if len(parts) == 1:
        return parts[0]
    return pa.concat_tables(parts, promote_options="permissive")


# ---------------------------------------------------------------------------------------------- sealing
def _seal(stream: Path, seq: int, schema: pa.Schema, options: ParquetOptions) -> Path | None:
    """Write the whole batches of ``stream`` as the Parquet segment ``seq`` and remove the stream. Returns
    the segment (None when the stream held no whole batch: it is removed)."""
    try:
        table, damage = _read_stream(stream, schema)
    except FileNotFoundError:  # sealed by another writer of the partition (a resumed job's start)
        return None
    if damage:  # what follows the damage cannot be read by anyone: the whole batches before it are kept
        logger.warning("trainmon: sealing %s: %s; the rest of the stream is lost", stream, damage)
    if not table.num_rows:
        stream.unlink(missing_ok=True)
        return None
    steps = table.column("step")
    lo, hi = pc.min(steps).as_py(), pc.max(steps).as_py()
    tmp = stream.parent / sealing_name(seq)
    final = stream.parent / segment_name(seq, lo, hi)
    try:
        pq.write_table(table, tmp, row_group_size=ROW_GROUP_ROWS, **options.kwargs())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    stream.unlink(missing_ok=True)
    return final


class _Sealer:
    """One daemon thread per process sealing streams in the order they were handed over."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(
        self,
        stream: Path,
        seq: int,
        schema: pa.Schema,
        options: ParquetOptions,
        failed: Callable[[Path, int, Exception], None] | None = None,
    ) -> threading.Event:
        """Seal ``stream`` in the background; ``failed`` (on the sealing thread) hears of a seal that failed
        (the stream is then as it was), else the failure is logged."""
        done = threading.Event()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="trainmon-sealer", daemon=True)
                self._thread.start()
        self._jobs.put((stream, seq, schema, options, failed, done))
        return done

    def _run(self) -> None:
        while True:
            stream, seq, schema, options, failed, done = self._jobs.get()
            try:
                _seal(stream, seq, schema, options)
            except Exception as e:  # the stream stays readable as it is and is sealed again later
                if failed is not None:
                    failed(stream, seq, e)
                else:  # a leftover: the next writer start seals it again
                    logger.warning("trainmon: sealing %s into a Parquet segment failed", stream,
                                   exc_info=True)  # fmt: skip
            finally:
                done.set()


_SEALER = _Sealer()


def seal_leftovers(
    partition: Path, schema: pa.Schema, options: ParquetOptions, background: bool = False
) -> tuple[int, list[threading.Event]]:
    """Seal the streams a killed job left in ``partition`` and remove half-sealed files: in this thread, or
    on the sealing thread (``background``; wait for the events returned). Returns the next free ``seq``."""
    try:
        names = os.listdir(partition)
    except FileNotFoundError:
        return 0, []
    pending: list[threading.Event] = []
    for name in names:  # a seal killed before its rename
        if name.startswith("_seal-") and name.endswith(".tmp"):
            (partition / name).unlink(missing_ok=True)
    sealed = {int(m.group(1)) for m in map(SEGMENT_FILE.match, names) if m}
    top = max(sealed, default=-1)
    for name in sorted(names):
        m = STREAM_FILE.match(name)
        if not m:
            continue
        seq = int(m.group(1))
        top = max(top, seq)
        if seq in sealed:  # sealed, but killed before the stream was removed
            (partition / name).unlink(missing_ok=True)
        elif background:
            pending.append(_SEALER.submit(partition / name, seq, schema, options))
        else:
            _seal(partition / name, seq, schema, options)
    return top + 1, pending


def write_segments(
    partition: Path, table: pa.Table, options: ParquetOptions, segment_steps: int = SEGMENT_STEPS
) -> list[Path]:
    """Write ``table`` (rows in step order) into ``partition`` as sealed segments of aligned step ranges,
    after the partition's own (``trainmon migrate``; a live job writes through :class:`SegmentWriter`)."""
    partition.mkdir(parents=True, exist_ok=True)
    seq, _ = seal_leftovers(partition, table.schema, options)
    if not table.num_rows:
        return []
    steps = table.column("step").combine_chunks()
    segment = pc.divide(steps, pa.scalar(max(1, int(segment_steps)), pa.int64()))
    out = []
    for k in pc.unique(segment).to_pylist():
        part = table.filter(pc.equal(segment, k))
        part_steps = part.column("step")
        lo, hi = pc.min(part_steps).as_py(), pc.max(part_steps).as_py()
        tmp, final = partition / sealing_name(seq), partition / segment_name(seq, lo, hi)
        pq.write_table(part, tmp, row_group_size=ROW_GROUP_ROWS, **options.kwargs())
        os.replace(tmp, final)
        out.append(final)
        seq += 1
    return out


# ---------------------------------------------------------------------------------------------- writing
_PANDAS_LOADED = False


def _load_pandas_now() -> None:
    """pyarrow imports pandas (when it is installed) the first time it builds an array: 0.3-0.4 s on two
    cores. Building one when a writer is made (at ``attach``, on the caller's thread) keeps that off the
    writer thread's first step, which would otherwise fall that far behind and drop the steps of a fast loop.
    """
    global _PANDAS_LOADED
    if not _PANDAS_LOADED:
        pa.array(np.zeros(1, dtype=np.int64))
        _PANDAS_LOADED = True


class _Chunks:
    """The in-memory sink the Arrow stream writer serialises into; taken out after each batch."""

    closed = False

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, b) -> int:
        self.data += b
        return len(b)

    def flush(self) -> None:
        pass

    def take(self) -> bytes:
        out = bytes(self.data)
        self.data.clear()
        return out


class SegmentWriter:
    """Appends one rank's record batches (one step each) to its partition of a columnar table.

    Not thread-safe: one writer thread calls :meth:`append`; sealing happens in the background."""

    def __init__(
        self,
        partition: Path,
        schema: pa.Schema,
        options: ParquetOptions,
        segment_steps: int = SEGMENT_STEPS,
        max_rows: int = MAX_SEGMENT_ROWS,
    ) -> None:
        self.partition = Path(partition)
        self.schema = schema
        self.options = options
        self.segment_steps = max(1, int(segment_steps))
        self.max_rows = max(1, int(max_rows))
        _load_pandas_now()
        try:
            self.partition.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise naming(e, self.partition) from e
        # a resumed job: the streams a killed one left are sealed first (in the background)
        self._seq, self._pending = seal_leftovers(self.partition, schema, options, background=True)
        self._fd: int | None = None
        self._path: Path | None = None
        self._open_seq = -1
        self._writer: ipc.RecordBatchStreamWriter | None = None
        self._chunks = _Chunks()
        self._segment = 0  # the aligned segment index of the open stream
        self._rows = 0
        # streams whose seal failed (a full disk), appended to by the sealing thread: sealed again later
        self._unsealed: list[tuple[Path, int]] = []
        self._retry_at = 0.0  # time.monotonic() from which they are tried again
        self._said_unsealed = False
        self.closed = False

    def append(self, batch: pa.RecordBatch, step: int) -> None:
        """Append one step's rows; whole or not at all (a failure is raised, the file left as before)."""
        if self.closed:
            raise ValueError(f"append to a closed writer ({self.partition})")
        segment = int(step) // self.segment_steps
        if self._fd is not None and (segment != self._segment or self._rows + batch.num_rows > self.max_rows):
            self._end_stream()
        elif self._fd is not None and os.fstat(self._fd).st_nlink == 0:  # deleted under us (the run folder)
            self._drop_stream()
        if self._fd is None:
            self._start_stream(step, segment)
        assert self._writer is not None and self._fd is not None
        try:
            self._writer.write_batch(batch)
        except Exception:
            self._chunks.take()
            self._end_stream()
            raise
        self._write(self._chunks.take())
        self._rows += batch.num_rows

    def _start_stream(self, step: int, segment: int) -> None:
        path = self.partition / stream_name(self._seq, step)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC
        try:
            try:
                fd = os.open(path, flags, 0o644)
            except FileNotFoundError:  # the partition was there at the start: deleted under the job
                say_deleted(self.partition)
                self.partition.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, flags, 0o644)
        except OSError as e:
            raise naming(e, path) from e
        self._fd, self._path, self._segment, self._rows, self._open_seq = fd, path, segment, 0, self._seq
        options = ipc.IpcWriteOptions(emit_dictionary_deltas=True)
        self._writer = ipc.new_stream(self._chunks, self.schema, options=options)
        self._seq += 1
        # the schema goes out with the first batch: a stream never holds a schema without a whole batch

    def _write(self, data: bytes) -> None:
        fd, path = self._fd, self._path
        assert fd is not None and path is not None
        end = os.lseek(fd, 0, os.SEEK_END)
        view = memoryview(data)
        try:
            while view:  # one write for a regular file; loop only on a short write
                view = view[os.write(fd, view) :]
        except BaseException as e:
            with contextlib.suppress(OSError):  # cut back to the last whole batch
                os.ftruncate(fd, end)
            self._end_stream()  # the Arrow writer believes it wrote what is not there: start over
            if isinstance(e, OSError):
                raise naming(e, path) from e
            raise

    def _close_stream(self) -> Path | None:
        """Close the open stream's descriptor and Arrow writer; its path."""
        fd, path, writer = self._fd, self._path, self._writer
        self._fd = self._path = self._writer = None
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()  # writes the end-of-stream marker into the chunks, which are dropped
            self._chunks.take()
        if fd is not None:
            os.close(fd)
        return path

    def _end_stream(self, retry_now: bool = False) -> None:
        """Close the open stream and hand it to the sealer, with the streams whose seal failed before (once
        :data:`SEAL_RETRY_S` passed since, or ``retry_now``)."""
        path = self._close_stream()
        self._pending = [e for e in self._pending if not e.is_set()]
        retry = []
        while self._unsealed and (retry_now or time.monotonic() >= self._retry_at):
            retry.append(self._unsealed.pop())  # the sealing thread may append meanwhile: pop, never clear
        for stream, seq in sorted(retry, key=lambda r: r[1]):
            if stream.exists():
                self._submit(stream, seq)
        if path is not None:
            self._submit(path, self._open_seq)

    def _drop_stream(self) -> None:
        """The open stream was deleted (with the run folder): say so once and start anew (no seal)."""
        assert self._path is not None
        say_deleted(self._path)
        self._close_stream()

    def _submit(self, stream: Path, seq: int) -> None:
        self._pending.append(_SEALER.submit(stream, seq, self.schema, self.options, self._seal_failed))

    def _seal_failed(self, stream: Path, seq: int, error: Exception) -> None:
        """Sealing thread: the stream stays as it is, readable; it is sealed again at a later stream end or
        at close (or by the next writer of the partition). Said once a writer."""
        self._retry_at = time.monotonic() + SEAL_RETRY_S
        self._unsealed.append((stream, seq))
        if not self._said_unsealed:
            self._said_unsealed = True
            logger.warning(
                "trainmon: sealing %s into a Parquet segment failed (%s); the stream stays readable as it is "
                "and is sealed later",
                stream,
                error,
                exc_info=not isinstance(error, OSError),
            )
        else:
            logger.debug("trainmon: sealing %s failed again: %s", stream, error)

    def flush(self) -> None:
        """Every append is on disk when :meth:`append` returns; nothing is buffered."""

    def close(self, timeout: float = SEAL_TIMEOUT_S) -> bool:
        """Seal the open stream and wait (bounded) for every seal of this writer. False on timeout."""
        if self.closed:
            return True
        self.closed = True
        self._end_stream(retry_now=True)
        pending, self._pending = self._pending, []
        ok = True
        for done in pending:
            ok &= done.wait(timeout)
        return ok

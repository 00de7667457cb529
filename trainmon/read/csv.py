"""Fast, strict reading of trainmon/msprobe statistics CSV into numeric tables.

Columns: ``vpp_stage,name,step[,micro_step],<stat...>[,shape,dtype]``. ``name`` and ``step`` are required;
every column other than ``vpp_stage``, ``micro_step``, ``shape`` and ``dtype`` is a statistic (a float;
``nan``/``inf``/``-inf`` allowed). ``shape`` and ``dtype`` are not converted (TensorBoard has no place
for them).

How: the field count of every line is checked with numpy over the raw bytes (quote-aware), the lines with
the header's field count go through pandas' C parser in batches of up to :data:`BATCH_BYTES`, and only lines
that fail (or a batch pandas rejects) are read one by one with the :mod:`csv` module, which names the exact
line and reason. pandas alone cannot be trusted with malformed rows: it silently fills short rows and uses
the first column as an index when a row is long.

What a crashed writer leaves is reported and dropped, never an error: an empty file, a file without a
complete header line, a partial last line (no newline at the end). Anything else that is wrong is a bad row:
an error naming file, line and reason, or (``skip_bad``) skipped and counted.

msprobe quirks read as msprobe meant them: rows padded with trailing ``nan`` fields beyond the header, and
its collective-op rows in ``other`` files, which lack the ``vpp_stage`` field and carry ``step`` third
(``all_reduce,<first stat>,<step>,<other stats>,<shape>,<dtype>[,<the next group>...]``).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from trainmon.read.csv_sources import Source

__all__ = ["BATCH_BYTES", "CsvError", "KindTable", "ReadReport", "iter_kind", "read_kind"]

# Bytes of CSV given to pandas at once (bounds memory for big files, amortises small msprobe files).
BATCH_BYTES = 32 << 20
META_COLUMNS = ("vpp_stage", "name", "step", "micro_step", "shape", "dtype")
_INT_COLUMNS = ("vpp_stage", "step", "micro_step")
_NAN_TEXT = ("nan", "NaN", "-nan", "NAN")
_PAD_TEXT = frozenset({"nan", ""})
# Examples of skipped rows kept for the report (the count is always exact).
MAX_EXAMPLES = 5


class CsvError(ValueError):
    """A malformed CSV file or row: ``path``, 1-based ``line`` (None for the whole file) and ``reason``."""

    def __init__(self, path: str | Path, line: int | None, reason: str) -> None:
        self.path, self.line, self.reason = str(path), line, reason
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {reason}")

    def __reduce__(self):  # raised in worker processes: pickle the three fields, not the message
        return (CsvError, (self.path, self.line, self.reason))


@dataclass(frozen=True)
class KindTable:
    """Rows of one kind of one rank with one header, as arrays (one entry per CSV row)."""

    rank: int
    kind: str
    stats: tuple[str, ...]  # statistic columns, in header order
    names: tuple[str, ...]  # distinct names; ``code`` indexes them
    code: np.ndarray  # int32
    vpp: np.ndarray  # int32
    micro: np.ndarray  # int32 (zeros when the file has no micro_step column)
    step: np.ndarray  # int64
    values: np.ndarray  # float32, (rows, len(stats))
    has_micro: bool

    def __len__(self) -> int:
        return len(self.step)


@dataclass
class ReadReport:
    """What reading a kind found besides its rows."""

    rows: int = 0
    skipped: int = 0  # bad rows skipped (skip_bad)
    notes: list[str] = field(default_factory=list)  # dropped partial lines, empty files, skipped examples


@dataclass(frozen=True)
class _Header:
    path: str
    columns: tuple[str, ...]
    stats: tuple[str, ...]
    stat_index: tuple[int, ...]
    has_micro: bool
    n_meta_tail: int  # shape/dtype columns: msprobe repeats them after each group of a collective row

    @classmethod
    def parse(cls, path: Path, line: bytes) -> _Header:
        text = line.decode("utf-8", errors="replace").rstrip("\r\n")
        columns = tuple(c.strip() for c in next(csv.reader([text])))
        seen = set()
        for c in columns:
            if c in seen:
                raise CsvError(path, 1, f"duplicate column {c!r} in the header")
            seen.add(c)
        for required in ("name", "step"):
            if required not in seen:
                raise CsvError(
                    path,
                    1,
                    f"missing column {required!r} (header: {','.join(columns)}; expected "
                    "vpp_stage,name,step[,micro_step],<stats...>[,shape,dtype])",
                )
        stats = tuple(c for c in columns if c not in META_COLUMNS)
        if not stats:
            raise CsvError(path, 1, f"no statistic columns in the header ({','.join(columns)})")
        for s in stats:
            if not s or "/" in s:
                raise CsvError(path, 1, f"bad statistic column name {s!r}")
        return cls(
            str(path),
            columns,
            stats,
            tuple(columns.index(s) for s in stats),
            "micro_step" in seen,
            sum(c in ("shape", "dtype") for c in columns),
        )


@dataclass
class _Row:
    name: str
    vpp: int
    step: int
    micro: int
    values: list[float]


class _Batch:
    """Lines of one header waiting to be parsed together."""

    def __init__(self, header: _Header) -> None:
        self.header = header
        self.bodies: list[bytes] = []
        self.lines: list[tuple[str, np.ndarray]] = []  # (path, line numbers) per body
        self.size = 0


class _Reader:
    def __init__(
        self,
        source: Source,
        steps: tuple[int | None, int | None] | None,
        skip_bad: bool,
        batch_bytes: int = BATCH_BYTES,
    ) -> None:
        self.source = source
        self.batch_bytes = batch_bytes
        self.steps = steps
        self.skip_bad = skip_bad
        self.report = ReadReport()
        self.batches: dict[tuple[str, ...], _Batch] = {}
        self.done: list[KindTable] = []  # parsed, not yet handed out
        self._columns: tuple[str, ...] | None = None  # the header of the file read last

    # -- bad rows ----------------------------------------------------------------------------
    def bad(self, path: str, line: int, reason: str) -> None:
        if not self.skip_bad:
            raise CsvError(path, line, reason + " (use --skip-bad to convert the other rows)")
        self.report.skipped += 1
        if self.report.skipped <= MAX_EXAMPLES:
            self.report.notes.append(f"{path}:{line}: skipped: {reason}")

    # -- files -------------------------------------------------------------------------------
    def read_files(self, paths: tuple[Path, ...]) -> Iterator[list[KindTable]]:
        """Tables as their batches are parsed, in file order then row order."""
        for path in paths:
            yield from self.read_file(path)
        for batch in self.batches.values():
            self.flush(batch)
        if self.done:
            yield self.take()

    def take(self) -> list[KindTable]:
        out, self.done = self.done, []
        return out

    def read_file(self, path: Path) -> Iterator[list[KindTable]]:
        with open(path, "rb") as f:
            head = f.readline()
            if not head:
                self.report.notes.append(f"{path}: empty file (no header line): nothing to convert")
                return
            if not head.endswith(b"\n"):
                self.report.notes.append(
                    f"{path}: no complete header line (the writer was interrupted?): nothing to convert"
                )
                return
            header = _Header.parse(path, head)
            if header.columns != self._columns:
                # rows of earlier files go first: what is pending under another header is parsed now
                for other in self.batches.values():
                    self.flush(other)
                self._columns = header.columns
            batch = self.batches.get(header.columns)
            if batch is None:
                batch = self.batches[header.columns] = _Batch(header)
            else:
                batch.header = header  # the current file's path, for messages
            line = 2
            rest = b""
            while True:
                if self.done:
                    yield self.take()
                chunk = f.read(self.batch_bytes)
                data = rest + chunk
                if not chunk:
                    if data:
                        self.report.notes.append(
                            f"{path}:{line}: partial last line dropped (no newline at the end: the writer "
                            "was interrupted)"
                        )
                    break
                cut = data.rfind(b"\n") + 1
                body, rest = data[:cut], data[cut:]
                if body:
                    line = self.add_body(batch, header, body, line)
        # no flush here: small files (msprobe writes one per step) are parsed together, in batches
        if self.done:
            yield self.take()

    def add_body(self, batch: _Batch, header: _Header, body: bytes, first_line: int) -> int:
        """Check field counts, queue the good lines for pandas, read the others one by one."""
        starts, ends, counts = _lines(body)
        numbers = np.arange(first_line, first_line + len(ends), dtype=np.int64)
        ok = counts == len(header.columns)
        if not ok.all():
            for i in np.flatnonzero(~ok):
                self.slow_line(batch, header, body[starts[i] : ends[i]], int(numbers[i]))
            body = b"".join(body[s : e + 1] for s, e in zip(starts[ok], ends[ok], strict=True))
            numbers = numbers[ok]
        if len(numbers):
            batch.bodies.append(body)
            batch.lines.append((header.path, numbers))
            batch.size += len(body)
            if batch.size >= self.batch_bytes:
                self.flush(batch)
        return first_line + len(ends)

    # -- parsing -----------------------------------------------------------------------------
    def flush(self, batch: _Batch) -> None:
        if not batch.bodies:
            return
        body = b"".join(batch.bodies)
        lines = batch.lines
        batch.bodies, batch.lines, batch.size = [], [], 0
        h = batch.header
        try:
            part = _parse_fast(h, body)
        except (ValueError, OverflowError):  # some value is not a number: find which, line by line
            part = None
        if part is not None:
            bad = part[2] < 0
            for col in (part[1], part[3]):
                bad |= col < 0
            if not bad.any():
                self.add_part(h, part)
                return
        # slow path for this batch: every line through the csv module, exact reasons
        rows: list[_Row] = []
        text_lines = body.split(b"\n")
        k = 0
        for path, numbers in lines:
            for n in numbers.tolist():
                got = self.parse_line(h, text_lines[k], path, n)
                k += 1
                if got is not None:
                    rows.extend(got)
        self.add_rows(batch, rows)

    def slow_line(self, batch: _Batch, header: _Header, raw: bytes, number: int) -> None:
        got = self.parse_line(header, raw, header.path, number)
        if got:
            self.add_rows(batch, got)

    def add_rows(self, batch: _Batch, rows: list[_Row]) -> None:
        if not rows:
            return
        n = len(batch.header.stats)
        self.add_part(
            batch.header,
            (
                np.array([r.name for r in rows], dtype=object),
                np.array([r.vpp for r in rows], dtype=np.int64),
                np.array([r.step for r in rows], dtype=np.int64),
                np.array([r.micro for r in rows], dtype=np.int64),
                np.array([r.values for r in rows], dtype=np.float64).reshape(-1, n),
            ),
        )

    def parse_line(self, h: _Header, raw: bytes, path: str, number: int) -> list[_Row] | None:
        """One line read with the csv module: its rows, or None after reporting it as bad."""
        text = raw.decode("utf-8", errors="replace").rstrip("\r")
        if not text.strip():
            self.bad(path, number, "empty line")
            return None
        try:
            fields = next(csv.reader([text]))
        except csv.Error as e:
            self.bad(path, number, f"cannot split the line: {e}")
            return None
        ncols = len(h.columns)
        if len(fields) > ncols and all(f.strip() in _PAD_TEXT for f in fields[ncols:]):
            fields = fields[:ncols]  # msprobe pads every row of a file when one row is longer
        vpp_at = h.columns.index("vpp_stage") if "vpp_stage" in h.columns else None
        if (
            vpp_at == 0
            and fields
            and not _is_int(fields[0])
            and h.columns[:3] == ("vpp_stage", "name", "step")
        ):
            return self.collective_row(h, fields, path, number)
        if len(fields) != ncols:
            self.bad(path, number, f"expected {ncols} fields (as the header), got {len(fields)}")
            return None
        try:
            values = {c: fields[i] for i, c in enumerate(h.columns)}
            ints = {c: _to_int(c, values[c]) for c in _INT_COLUMNS if c in values}
            stats = [_to_float(c, values[c]) for c in h.stats]
        except ValueError as e:
            self.bad(path, number, str(e))
            return None
        name = values["name"]
        if not name:
            self.bad(path, number, "column 'name' is empty")
            return None
        if not self.in_steps(ints["step"]):
            return []
        return [_Row(name, ints.get("vpp_stage", 0), ints["step"], ints.get("micro_step", 0), stats)]

    def collective_row(self, h: _Header, fields: list[str], path: str, number: int) -> list[_Row] | None:
        """msprobe's collective-op row: ``op,<stat 1>,<step>,<stat 2..n>,<shape>,<dtype>[,group 2...]``."""
        size = len(h.stats) + h.n_meta_tail
        values = [fields[1], *fields[3:]] if len(fields) > 3 else []
        groups = [values[i : i + size] for i in range(0, len(values) - len(values) % size, size)]
        tail = values[len(groups) * size :]
        if not groups or any(v.strip() not in _PAD_TEXT for v in tail):
            self.bad(path, number, f"column 'vpp_stage': {fields[0]!r} is not an integer")
            return None
        while len(groups) > 1 and all(v.strip() in _PAD_TEXT for v in groups[-1]):
            groups.pop()  # padding up to the widest row of the file
        try:
            step = _to_int("step", fields[2])
            stats = [[_to_float(c, g[j]) for j, c in enumerate(h.stats)] for g in groups]
        except ValueError as e:
            self.bad(path, number, f"collective-op row {fields[0]!r}: {e}")
            return None
        if not self.in_steps(step):
            return []
        if len(stats) == 1:
            return [_Row(fields[0], 0, step, 0, stats[0])]
        return [_Row(f"{fields[0]}.{j}", 0, step, 0, s) for j, s in enumerate(stats)]

    def in_steps(self, step: int) -> bool:
        if self.steps is None:
            return True
        lo, hi = self.steps
        return (lo is None or step >= lo) and (hi is None or step <= hi)

    # -- result ------------------------------------------------------------------------------
    def add_part(self, h: _Header, part: tuple[np.ndarray, ...]) -> None:
        """Parsed rows of one header as a table, within ``steps``."""
        names, vpp, step, micro, values = part
        if self.steps is not None:
            lo, hi = self.steps
            keep = np.ones(len(step), dtype=bool)
            if lo is not None:
                keep &= step >= lo
            if hi is not None:
                keep &= step <= hi
            if not keep.all():
                names, vpp, step, micro, values = (a[keep] for a in (names, vpp, step, micro, values))
        if not len(step):
            return
        codes, uniques = pd.factorize(names)
        with np.errstate(over="ignore"):  # beyond float32's range is +-inf, as TensorBoard shows it
            v32 = values.astype(np.float32)
        self.done.append(
            KindTable(
                self.source.rank,
                self.source.kind,
                h.stats,
                tuple(str(u) for u in uniques),
                codes.astype(np.int32),
                vpp.astype(np.int32),
                micro.astype(np.int32),
                step,
                v32,
                h.has_micro,
            )
        )
        self.report.rows += len(step)


def _lines(body: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Start, end (index of the newline) and field count of every line of ``body`` (which ends with a
    newline), honouring double quotes."""
    a = np.frombuffer(body, dtype=np.uint8)
    nl = a == 10
    sep = a == 44
    quote = a == 34
    if quote.any():
        # parity of quotes seen so far (uint8 wraps, parity survives): odd = inside a quoted field
        inside = (np.cumsum(quote, dtype=np.uint8) & 1).astype(bool)
        nl &= ~inside
        sep &= ~inside
    ends = np.flatnonzero(nl)
    counts = np.diff(np.searchsorted(np.flatnonzero(sep), ends), prepend=0) + 1
    starts = np.empty_like(ends)
    starts[:1] = 0
    starts[1:] = ends[:-1] + 1
    return starts, ends, counts


def _parse_fast(h: _Header, body: bytes) -> tuple[np.ndarray, ...]:
    """pandas' C parser over lines known to have the header's field count."""
    cols = list(h.columns)
    wanted = [i for i, c in enumerate(cols) if c not in ("shape", "dtype")]
    dtypes: dict[str, object] = {c: np.float64 for c in h.stats}
    dtypes["name"] = object
    for c in _INT_COLUMNS:
        if c in cols:
            dtypes[c] = np.int64
    df = pd.read_csv(
        io.BytesIO(body),
        header=None,
        names=cols,
        usecols=wanted,
        dtype=dtypes,
        engine="c",
        keep_default_na=False,
        na_values={c: list(_NAN_TEXT) for c in h.stats},
        index_col=False,
        skip_blank_lines=False,
        quotechar='"',
    )
    n = len(df)
    names = df["name"].to_numpy(dtype=object)
    if n and (df["name"] == "").any():
        raise ValueError("empty name")
    zeros = np.zeros(n, dtype=np.int64)
    vpp = df["vpp_stage"].to_numpy(np.int64) if "vpp_stage" in cols else zeros
    micro = df["micro_step"].to_numpy(np.int64) if "micro_step" in cols else zeros
    values = df[list(h.stats)].to_numpy(np.float64)
    return names, vpp, df["step"].to_numpy(np.int64), micro, values


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _to_int(column: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"column {column!r}: {text!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"column {column!r}: {value} is negative")
    return value


def _to_float(column: str, text: str) -> float:
    if not text.strip():
        raise ValueError(f"column {column!r} is empty")
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"column {column!r}: {text!r} is not a number") from None


def iter_kind(
    source: Source,
    steps: tuple[int | None, int | None] | None = None,
    skip_bad: bool = False,
    report: ReadReport | None = None,
    batch_bytes: int = BATCH_BYTES,
) -> Iterator[list[KindTable]]:
    """The rows of one (rank, kind) a batch at a time (about ``batch_bytes`` of text each), in file order then
    row order; what was dropped goes into ``report``. Memory stays bounded by a batch."""
    reader = _Reader(source, steps, skip_bad, batch_bytes)
    if report is not None:
        reader.report = report
    yield from reader.read_files(source.files)


def read_kind(
    source: Source, steps: tuple[int | None, int | None] | None = None, skip_bad: bool = False
) -> tuple[list[KindTable], ReadReport]:
    """Read every file of one (rank, kind): its tables (one per parsed batch), and what was dropped."""
    report = ReadReport()
    tables = [t for batch in iter_kind(source, steps, skip_bad, report) for t in batch]
    return tables, report

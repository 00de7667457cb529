"""msprobe-compatible CSV output: one file per kind, ``rank_dir/<kind>.csv``.

Columns: ``vpp_stage,name,step,micro_step,<ops...>,shape,dtype``; ``infs`` is always present (appended
after the ops when they do not name it). One line per row of the step record (per micro-step), in
record order. Floats are rounded to ``ndigits`` decimal places with Python's :func:`round` semantics
and written as Python writes them (``repr``), so ``nan``/``inf``/``-inf`` appear as such; counts
(``nans``, ``infs``) are integers. Shapes are written like msprobe, ``"[8, 32]"`` (quoted, because of
the comma).

Speed: the text of a step is produced by one ``%``-format over a per-layout template (cached by the
rows tuple, which rarely changes between steps), with values rounded in a vectorised pass. Each file
gets one ``write`` per step (:class:`trainmon.run.append.AppendFile`), so files only ever hold complete lines:
a write that fails (a full disk) is cut back off before the next one, and a partial line left by a kill inside
that write is dropped by a resumed sink before it appends.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from trainmon.run.append import AppendFile
from trainmon.run.records import Derived, Row, StepRecord, kind_name
from trainmon.writer import numtext
from trainmon.writer.layouts import LayoutCache
from trainmon.writer.tensorboard import check_ops

__all__ = ["CsvSink", "exact_round", "format_shape"]

logger = logging.getLogger("trainmon")

COUNT_STATS = frozenset({"nans", "infs"})
_STEP_MARK = "\x00"
_LAYOUT_CACHE = 8


def format_shape(shape) -> str:
    """msprobe's shape text: ``[8, 32]`` (``[]`` for a scalar)."""
    try:
        return "[" + ", ".join(str(int(d)) for d in shape) + "]"
    except TypeError:
        return str(shape)


def _field(value: object) -> str:
    """A CSV field, quoted (RFC 4180) when it holds a separator, quote or line break."""
    s = str(value)
    if any(c in s for c in ',"\n\r'):
        s = '"' + s.replace('"', '""') + '"'
    return s


def exact_round(x: np.ndarray, ndigits: int) -> np.ndarray:
    """``round(v, ndigits)`` for every element, vectorised.

    ``rint(x * 10**n) / 10**n`` gives Python's (correctly rounded) answer except when ``x * 10**n``
    lies within its rounding error of a half-integer, or is too large to hold a fraction; those
    few elements are redone with Python's ``round``.
    """
    x = np.asarray(x, dtype=np.float64)
    scale = 10.0**ndigits
    with np.errstate(over="ignore", invalid="ignore"):
        y = x * scale
        out = np.rint(y) / scale
        frac = y - np.floor(y)
        ay = np.abs(y)
        suspect = ~(ay < 2.0**52) | (np.abs(frac - 0.5) <= ay * 1e-15 + 1e-300)
    suspect &= np.isfinite(x)
    if suspect.any():
        for i in zip(*np.nonzero(suspect), strict=True):
            out[i] = round(float(x[i]), ndigits)
    nonfinite = ~np.isfinite(x)
    if nonfinite.any():
        out[nonfinite] = x[nonfinite]
    return out


class _KindLayout:
    __slots__ = ("kind", "index", "template", "cells", "slow")

    def __init__(
        self, kind: str, index: np.ndarray | slice, template: str, cells: str, slow: list[str]
    ) -> None:
        self.kind = kind
        self.index = index
        self.template = template  # '%'-format of the whole step's text; _STEP_MARK stands for the step
        self.cells = cells  # the same with one '%s' per row for its rendered cells (numtext)
        self.slow = slow  # per-row static parts for the (rare) non-finite-count path: prefix, suffix


class _Layout:
    __slots__ = ("kinds",)

    def __init__(self, rows: Sequence[Row], columns: tuple[str, ...]) -> None:
        by_kind: dict[str, list[int]] = {}
        for i, r in enumerate(rows):
            by_kind.setdefault(kind_name(r.kind), []).append(i)
        slots = ",".join("%d" if c in COUNT_STATS else "%r" for c in columns)
        self.kinds: list[_KindLayout] = []
        for kind, members in by_kind.items():
            lines = []
            cells = []
            slow = []
            for i in members:
                r = rows[i]
                # a NUL would read as the step's place: names are encoded already (run.names), this is a guard
                name = r.name.replace(_STEP_MARK, "\\u0000")
                head = f"{int(r.vpp_stage)},{_field(name)},{_STEP_MARK},{int(r.micro_step)},"
                tail = f",{_field(format_shape(r.shape))},{_field(r.dtype)}\n"
                lines.append(head.replace("%", "%%") + slots + tail.replace("%", "%%"))
                cells.append(head.replace("%", "%%") + "%s" + tail.replace("%", "%%"))
                slow.append(head)
                slow.append(tail)
            if members == list(range(members[0], members[0] + len(members))):
                index: np.ndarray | slice = slice(members[0], members[0] + len(members))
            else:
                index = np.asarray(members, dtype=np.intp)
            self.kinds.append(_KindLayout(kind, index, "".join(lines), "".join(cells), slow))


class CsvSink:
    """Per-kind msprobe-compatible CSV files of one rank. ``announce``: say in the log, once, what the CSV
    costs a step (one rank of the job does)."""

    def __init__(
        self,
        rank_dir: str | os.PathLike[str],
        ops: Sequence[str],
        ndigits: int | None = None,
        announce: bool = False,
    ) -> None:
        self.rank_dir = Path(rank_dir)
        self.ops = check_ops(ops)
        self.columns = self.ops if "infs" in self.ops else (*self.ops, "infs")
        self.ndigits = None if ndigits is None else int(ndigits)
        self.header = "vpp_stage,name,step,micro_step," + ",".join(self.columns) + ",shape,dtype\n"
        self._count_cols = [j for j, c in enumerate(self.columns) if c in COUNT_STATS]
        self._float_cols = [j for j, c in enumerate(self.columns) if c not in COUNT_STATS]
        self._files: dict[str, AppendFile] = {}
        self.paths: dict[str, Path] = {}
        self._layouts = LayoutCache(lambda rows: _Layout(rows, self.columns))
        self._renderer = numtext.Renderer()
        self._announce = announce

    # -- files -------------------------------------------------------------------------------
    def _open(self, kind: str) -> AppendFile:
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        header = self.header.encode("utf-8")
        n = 0
        while True:
            path = self.rank_dir / (f"{kind}.csv" if n == 0 else f"{kind}.{n}.csv")
            try:
                with open(path, "rb") as f:
                    first = f.read(len(header))
                    f.seek(0, os.SEEK_END)
                    size = f.tell()
            except FileNotFoundError:
                first, size = b"", 0
            if size == 0 or (size < len(header) and header.startswith(first)):
                fresh = True  # new, empty, or killed while writing the header
            elif first == header:
                fresh = False
            else:
                n += 1  # a different layout (other ops): never mix two headers in one file
                continue
            break
        if fresh and size:
            os.truncate(path, 0)  # a header cut short by a kill: written again whole
        elif not fresh:
            _drop_partial_last_line(path, size)
        f = AppendFile(path, header)  # the header goes first into an empty (or recreated) file
        self._files[kind] = f
        self.paths[kind] = path
        return f

    # -- sink API ----------------------------------------------------------------------------
    def table(self, derived: Mapping[str, np.ndarray]) -> np.ndarray:
        """(rows, columns) float64 values: floats rounded to ``ndigits`` places when it is set, counts as
        they are."""
        n = len(next(iter(derived.values()))) if derived else 0
        table = np.empty((n, len(self.columns)), dtype=np.float64)
        for j, c in enumerate(self.columns):
            table[:, j] = derived[c]
        if self.ndigits is not None and self._float_cols:
            cols = self._float_cols
            if len(cols) == table.shape[1]:
                table = exact_round(table, self.ndigits)
            else:
                table[:, cols] = exact_round(table[:, cols], self.ndigits)
        return table

    def cell_rows(self, table: np.ndarray) -> list[str]:
        """Each row's statistics as text: floats as the shortest text of their float32, counts as integers."""
        n, width = table.shape
        flat = np.arange(n, dtype=np.intp)[:, None] * width
        floats = np.asarray(self._float_cols, dtype=np.intp)
        counts = np.asarray(self._count_cols, dtype=np.intp)
        dec = numtext.merge(
            [
                (numtext.float32_decimals(table[:, floats]), (flat + floats).ravel()),
                (numtext.int_decimals(table[:, counts]), (flat + counts).ravel()),
            ],
            n * width,
        )
        return self._renderer.rows(dec, width)

    def write(self, record: StepRecord, derived: Derived) -> None:
        rows = tuple(record.rows)
        if not rows:
            return
        layout = self._layouts.get(rows)
        table = self.table(derived.rows)  # one CSV row per record row: micro-steps apart
        step = str(int(record.step))
        cells = self.cell_rows(table) if self.ndigits is None else None
        counts_ok = not self._count_cols or bool(np.isfinite(table[:, self._count_cols]).all())
        failed: OSError | None = None
        written = 0
        for kl in layout.kinds:
            if cells is not None:
                idx = kl.index
                part = cells[idx] if isinstance(idx, slice) else [cells[i] for i in idx.tolist()]
                text = kl.cells.replace(_STEP_MARK, step) % tuple(part)
            elif counts_ok:
                text = kl.template.replace(_STEP_MARK, step) % tuple(table[kl.index].ravel().tolist())
            else:
                text = self._slow_text(kl, table[kl.index], step)
            try:
                f = self._files.get(kl.kind)
                if f is None:
                    f = self._open(kl.kind)
                data = text.encode("utf-8", "backslashreplace")  # names are encoded already (run.names)
                f.append(data)
                written += len(data)
            except OSError as e:  # one file that cannot be written does not keep the step from the others
                failed = failed or e
        if failed is not None:
            raise failed
        if self._announce:
            self._announce = False
            logger.info(
                "trainmon: CSV in %s (format: csv): %d rows, %.1f KB a step on disk (with format tensorboard "
                "the statistics store holds every statistic too, and trainmon export RUN --format csv writes "
                "these files from it)",
                self.rank_dir,
                len(rows),
                written / 1e3,
            )

    def _slow_text(self, kl: _KindLayout, sub: np.ndarray, step: str) -> str:
        counts = set(self._count_cols)
        out = []
        for i, vals in enumerate(sub.tolist()):
            fields = [
                (str(int(v)) if np.isfinite(v) else repr(v)) if j in counts else repr(v)
                for j, v in enumerate(vals)
            ]
            out.append(kl.slow[2 * i].replace(_STEP_MARK, step) + ",".join(fields) + kl.slow[2 * i + 1])
        return "".join(out)

    def flush(self) -> None:
        """Every step is with the OS once written: nothing is buffered here."""

    def close(self) -> None:
        for f in self._files.values():
            f.close()


def _drop_partial_last_line(path: Path, size: int) -> None:
    """Truncate a line left incomplete by a killed writer so appended lines start on their own."""
    with open(path, "r+b") as f:
        pos = size
        while pos > 0:
            start = max(0, pos - 65536)
            f.seek(start)
            chunk = f.read(pos - start)
            if pos == size and chunk.endswith(b"\n"):
                return
            k = chunk.rfind(b"\n")
            if k >= 0:
                f.truncate(start + k + 1)
                return
            pos = start
        f.truncate(0)

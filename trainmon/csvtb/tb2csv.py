"""TensorBoard -> CSV (``trainmon tb2csv``): the scalars of event files back into msprobe-style CSV.

Every directory under INPUT holding event files is one TensorBoard run; its scalars go to
``OUT/<the same relative path>/<kind>.csv`` with columns
``vpp_stage,name,step,micro_step,<stats...>,shape,dtype``.
A tag ``{kind}/{name}/{stat}`` gives the file (kind), the row (name, step) and the column (stat); a
``{vpp}:`` prefix of the name fills ``vpp_stage`` and a ``:micro{m}`` suffix ``micro_step`` (the inverse of
csv2tb's tag rule). ``shape`` and ``dtype`` are not in TensorBoard: they are left empty. The figures of
TensorBoard's summary view (``step/...``, ``{kind}/*/{stat}``, ``{kind}/{layer}.*/norm``: groups of tensors,
:mod:`trainmon.writer.tbview`) are left out, said in a note.

Values are the 32-bit floats TensorBoard stores, written in the shortest text that reads back to the same
float32 (``0.1``, not ``0.10000000149011612``); ``nans``/``infs`` counts as integers.

Event files are read with our own TFRecord framing reader (length and CRC checked with native crc32c) and
TensorBoard's ``Event`` protobuf class; a truncated last record (a killed writer) ends a file quietly.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainmon.read.csv_sources import output_beside
from trainmon.writer.csv import COUNT_STATS
from trainmon.writer.tbview import ALL_TENSORS
from trainmon.writer.tensorboard import masked_crc32c

__all__ = ["EventFileError", "Tb2CsvSummary", "read_scalars", "tb2csv"]

_TAG_NAME = re.compile(r"^(?:(?P<vpp>\d+):)?(?P<name>.+?)(?::micro(?P<micro>\d+))?$")
_HEADER = struct.Struct("<QI")
_DT_FLOAT, _DT_DOUBLE = 1, 2


class EventFileError(ValueError):
    """A corrupt event file (a record whose CRC does not match)."""


@dataclass
class Tb2CsvSummary:
    out: Path
    runs: int = 0
    files: list[Path] = field(default_factory=list)  # CSV files written
    rows: int = 0
    notes: list[str] = field(default_factory=list)


def _records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    pos, n = 0, len(data)
    while pos < n:
        if pos + 12 > n:
            return  # truncated header of the last record
        length, length_crc = _HEADER.unpack_from(data, pos)
        if masked_crc32c(data[pos : pos + 8]) != length_crc:
            raise EventFileError(f"{path}: record at byte {pos}: length CRC mismatch (corrupt file)")
        start, end = pos + 12, pos + 12 + length
        if end + 4 > n:
            return  # truncated last record
        payload = data[start:end]
        (crc,) = struct.unpack_from("<I", data, end)
        if masked_crc32c(payload) != crc:
            raise EventFileError(f"{path}: record at byte {pos}: data CRC mismatch (corrupt file)")
        yield payload
        pos = end + 4


def _tensor_scalar(tensor) -> float | None:
    if tensor.tensor_shape.dim:
        return None
    if tensor.dtype == _DT_FLOAT:
        if tensor.float_val:
            return float(np.float32(tensor.float_val[0]))
        if len(tensor.tensor_content) == 4:
            return float(np.frombuffer(tensor.tensor_content, "<f4")[0])
    if tensor.dtype == _DT_DOUBLE:
        if tensor.double_val:
            return float(tensor.double_val[0])
        if len(tensor.tensor_content) == 8:
            return float(np.frombuffer(tensor.tensor_content, "<f8")[0])
    return None


def read_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the event files directly in ``run_dir`` (files in name order, i.e. creation order):
    ``{tag: {step: value}}``, tags in order of first appearance; a step written twice keeps the later
    value."""
    from tensorboard.compat.proto import event_pb2  # only tb2csv needs protobuf

    out: dict[str, dict[int, float]] = {}
    for path in sorted(p for p in run_dir.iterdir() if "tfevents" in p.name and p.is_file()):
        for payload in _records(path):
            ev = event_pb2.Event.FromString(payload)
            if not ev.HasField("summary"):
                continue
            for v in ev.summary.value:
                kind = v.WhichOneof("value")
                if kind == "simple_value":
                    value = v.simple_value
                elif kind == "tensor":
                    value = _tensor_scalar(v.tensor)
                    if value is None:
                        continue
                else:
                    continue
                series = out.get(v.tag)
                if series is None:
                    series = out[v.tag] = {}
                series[ev.step] = value
    return out


def _format(values: np.ndarray, count: bool) -> list[str]:
    v32 = values.astype(np.float32)
    if count:
        return [str(int(x)) if np.isfinite(x) and x == int(x) else str(x) for x in v32.tolist()]
    return [str(x) for x in v32]


def _field(text: str) -> str:
    return '"' + text.replace('"', '""') + '"' if any(c in text for c in ',"\n\r') else text


def _write_kind(path: Path, kind_series: dict, stats: list[str]) -> int:
    """One kind of one run: ``kind_series`` maps (vpp, name, micro) to {stat: {step: value}}."""
    keys = list(kind_series)
    all_steps = np.array(
        sorted({s for per in kind_series.values() for d in per.values() for s in d}), np.int64
    )
    ns, nk, nst = len(all_steps), len(keys), len(stats)
    vals = np.full((ns, nk, nst), np.nan, dtype=np.float64)
    present = np.zeros((ns, nk), dtype=bool)
    for k, key in enumerate(keys):
        for j, stat in enumerate(stats):
            d = kind_series[key].get(stat)
            if not d:
                continue
            idx = np.searchsorted(all_steps, np.fromiter(d.keys(), np.int64, len(d)))
            vals[idx, k, j] = np.fromiter(d.values(), np.float64, len(d))
            present[idx, k] = True
    si, ki = np.nonzero(present)  # row-major: by step, then series in order of first appearance
    cols = [_format(vals[si, ki, j], stats[j] in COUNT_STATS) for j in range(nst)]
    prefix = [
        f"{vpp},{_field(name)},{step},{micro},"
        for (vpp, name, micro), step in zip(
            (keys[k] for k in ki.tolist()), all_steps[si].tolist(), strict=True
        )
    ]
    lines = [p + ",".join(c) + ",,\n" for p, *c in zip(prefix, *cols, strict=True)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("vpp_stage,name,step,micro_step," + ",".join(stats) + ",shape,dtype\n")
        f.writelines(lines)
    return len(lines)


def _run_dirs(root: Path) -> list[Path]:
    found = []
    for d, _dirs, files in os.walk(root):
        if any("tfevents" in f for f in files):
            found.append(Path(d))
    return sorted(found)


def tb2csv(
    input_dir: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    kinds: set[str] | None = None,
    force: bool = False,
) -> Tb2CsvSummary:
    """Convert every TensorBoard run under ``input_dir`` into CSV under ``out`` (default ``INPUT-tb2csv``,
    beside INPUT: see :func:`output_beside`). Refuses to replace an existing CSV file unless ``force``."""
    root = Path(input_dir)
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory")
    out_dir = Path(out) if out is not None else output_beside(root, "tb2csv")
    runs = _run_dirs(root)
    if not runs:
        raise ValueError(f"{root}: no TensorBoard event files found")
    summary = Tb2CsvSummary(out=out_dir, runs=len(runs))
    plans: list[tuple[Path, dict, list[str]]] = []
    for run in runs:
        by_kind: dict[str, dict] = {}
        stats_of: dict[str, list[str]] = {}
        odd = figures = 0
        for tag, series in read_scalars(run).items():
            parts = tag.split("/")
            if parts[0] == "step" and len(parts) == 2:  # the summary's step figures (trainmon.writer.tbview)
                figures += 1
                continue
            if len(parts) < 3:
                odd += 1
                continue
            kind, middle, stat = parts[0], "/".join(parts[1:-1]), parts[-1]
            if middle.endswith(ALL_TENSORS):  # a figure of a group of tensors, no tensor of its own
                figures += 1
                continue
            if kinds is not None and kind not in kinds:
                continue
            m = _TAG_NAME.match(middle)
            assert m is not None  # the pattern matches any non-empty text
            key = (int(m.group("vpp") or 0), m.group("name"), int(m.group("micro") or 0))
            by_kind.setdefault(kind, {}).setdefault(key, {})[stat] = series
            stats = stats_of.setdefault(kind, [])
            if stat not in stats:
                stats.append(stat)
        if odd:
            summary.notes.append(f"{run}: {odd} tags not of the form kind/name/stat were left out")
        if figures:
            summary.notes.append(
                f"{run}: {figures} figures of TensorBoard's summary (step/..., kind/*/stat, "
                "kind/layer.*/norm) were left out: they are of groups of tensors; trainmon export RUN "
                "--format csv writes every tensor's CSV from the statistics store"
            )
        rel = run.relative_to(root)
        for kind, series in by_kind.items():
            plans.append((out_dir / rel / f"{kind}.csv", series, stats_of[kind]))
    existing = [p for p, _, _ in plans if p.exists()]
    if existing and not force:
        shown = ", ".join(str(p) for p in existing[:3]) + (" ..." if len(existing) > 3 else "")
        raise ValueError(
            f"{len(existing)} CSV files exist already ({shown}); choose another -o or pass --force"
        )
    for path, series, stats in plans:
        summary.rows += _write_kind(path, series, stats)
        summary.files.append(path)
    return summary

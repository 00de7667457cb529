"""A rank's summary: what the cross-rank questions need ("where did the NaN start?", "how far is each rank?")
without reading any record. ``RUN/plugins/trainmon/summary/rank_<r>.json``, replaced at the end of every
collected step so that a reader always finds a whole document of a whole step: the new document is written
to ``.rank_<r>.json.tmp``, the old one removed and the new one renamed into place; a reader that comes
between the two finds the temporary file, whole by then (:func:`read_summary`), and takes it only while the
file is still missing: by then the writer may have put that one in place and written the next step's into
the temporary file, which is ahead of the document a later read finds in place, and a reader must never see
a run go back in time. Not a rename over the old file: ext4 writes a file's data out before renaming it over
another one (1-2 ms a step instead of 0.1 ms)::

    {"v": 1, "rank": 3,
     "steps": 200, "first_step": 0, "last_step": 199, "wall_time": 1764000000.5,
     "grad_norm": 12.5,                     the last step's gradient norm (every step's: the steps table)
     "anomalies": 1234, "suppressed": 56,   records, and anomalies the per-step cap dropped
     "anomaly_steps": [101, 199],           the first and last step with a record (null: none)
     "counts": {"nan": 1200, "inf": 34},    records per rule
     "kinds": {"actv": 800, ...},           records per kind
     "first": {"nan": {...}, "inf": {...}}, each rule's earliest record (Anomaly.order_key)
     "earliest": [{...}, ...],              the rank's EARLIEST earliest records, in order
     "timed": 200, "time": {"step": 8.1, "forward": 2.5, ...}}   timed steps and their times summed (s)

Records are strict JSON as in :mod:`trainmon.run.anomalies` (non-finite floats as strings). A record is
"earliest" by :meth:`~trainmon.run.records.Anomaly.order_key` (:func:`summary_key`); records of equal keys
keep the order they were written in, as ``analyze`` always had it. The summary of a job resumed into the run
continues the counts of the one it finds. Imports no pyarrow: ``trainmon analyze`` answers from summaries
alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from trainmon.run.anomalies import _anomaly_from_dict, anomaly_to_dict
from trainmon.run.append import say_deleted
from trainmon.run.damage import note
from trainmon.run.layout import RANK_JSON, rank_files, summary_dir, summary_file
from trainmon.run.records import SUPPRESSED_RULE, Anomaly

__all__ = [
    "EARLIEST",
    "record_key",
    "RankSummary",
    "SummaryFile",
    "read_summary",
    "summary_key",
    "summary_ranks",
    "write_summary",
]

SUMMARY_VERSION = 1
# How many of a rank's earliest records its summary keeps (``trainmon analyze`` shows 8 by default).
EARLIEST = 8


def summary_key(a: Anomaly) -> tuple:
    """The order of records everywhere summaries are merged: :meth:`Anomaly.order_key`. Records of equal keys
    (one tensor flagged by two rules) keep the order they were written in: every sort is stable."""
    return a.order_key()


@dataclass(frozen=True)
class RankSummary:
    rank: int
    steps: int = 0  # collected steps ended
    first_step: int | None = None
    last_step: int | None = None
    wall_time: float = 0.0  # when the last step ended
    grad_norm: float | None = None  # the last step's gradient norm; None: no gradient collected
    anomalies: int = 0  # records, the cap's "suppressed" records not counted
    suppressed: int = 0  # anomalies the per-step cap dropped
    anomaly_steps: tuple[int, int] | None = None  # first and last step with a record
    counts: Mapping[str, int] = field(default_factory=dict)  # rule -> records
    kinds: Mapping[str, int] = field(default_factory=dict)  # kind -> records
    first: Mapping[str, Anomaly] = field(default_factory=dict)  # rule -> earliest record
    earliest: Sequence[Anomaly] = ()  # the EARLIEST earliest records, by summary_key
    timed: int = 0  # timed steps (trainmon.run.timing)
    time: Mapping[str, float] = field(default_factory=dict)  # time name -> seconds summed over them

    def with_records(self, written: Iterable[Anomaly]) -> RankSummary:
        """This summary with one step's written records added."""
        counts, kinds, first = dict(self.counts), dict(self.kinds), dict(self.first)
        anomalies, suppressed = self.anomalies, self.suppressed
        written = list(written)
        if not written:
            return self
        steps = [a.step for a in written]
        lo, hi = min(steps), max(steps)
        if self.anomaly_steps:
            lo, hi = min(lo, self.anomaly_steps[0]), max(hi, self.anomaly_steps[1])
        new: list[tuple[tuple, Anomaly]] = []
        for a in written:
            if a.rule == SUPPRESSED_RULE:
                if math.isfinite(a.value) and a.value > 0:
                    suppressed += int(a.value)
                continue
            anomalies += 1
            counts[a.rule] = counts.get(a.rule, 0) + 1
            kinds[a.kind] = kinds.get(a.kind, 0) + 1
            new.append((summary_key(a), a))
        new.sort(key=lambda pair: pair[0])
        for key, a in new:  # the earliest of each rule comes first in ``new``
            best = first.get(a.rule)
            if best is None or (best is self.first.get(a.rule) and key < summary_key(best)):
                first[a.rule] = a
        earliest = self.earliest
        if new and (len(earliest) < EARLIEST or new[0][0] < summary_key(earliest[-1])):
            merged = [(summary_key(a), a) for a in earliest] + new[:EARLIEST]
            merged.sort(key=lambda pair: pair[0])
            earliest = tuple(a for _, a in merged[:EARLIEST])
        return replace(
            self,
            anomalies=anomalies,
            suppressed=suppressed,
            anomaly_steps=(lo, hi),
            counts=counts,
            kinds=kinds,
            first=first,
            earliest=earliest,
        )

    def with_step(self, step: int, wall_time: float, grad_norm: float | None) -> RankSummary:
        """This summary with one more collected step ended."""
        return replace(
            self,
            steps=self.steps + 1,
            first_step=step if self.first_step is None else min(self.first_step, step),
            last_step=step if self.last_step is None else max(self.last_step, step),
            wall_time=float(wall_time),
            grad_norm=grad_norm,
        )

    def with_times(self, times: Sequence[float]) -> RankSummary:
        """This summary with one more timed step (``times`` in :data:`trainmon.run.timing.TIMES` order; a
        time it lacks, NaN, adds nothing)."""
        from trainmon.run.timing import TIMES

        total = dict(self.time)
        for name, value in zip(TIMES, times, strict=True):
            value = float(value)
            if math.isfinite(value):
                total[name] = total.get(name, 0.0) + value
        return replace(self, timed=self.timed + 1, time=total)

    def complete(self) -> bool:
        """Whether :attr:`earliest` holds every record of the rank."""
        return len(self.earliest) >= self.anomalies

    def to_dict(self, records: bool = True) -> dict[str, Any]:
        """The JSON-safe document (``records`` False: without ``first`` and ``earliest``)."""
        grad = self.grad_norm
        head = {
            "v": SUMMARY_VERSION,
            "rank": self.rank,
            "steps": self.steps,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "wall_time": self.wall_time,
            "grad_norm": None if grad is None else (grad if math.isfinite(grad) else str(grad)),
            "anomalies": self.anomalies,
            "suppressed": self.suppressed,
            "anomaly_steps": list(self.anomaly_steps) if self.anomaly_steps else None,
            "counts": dict(self.counts),
            "kinds": dict(self.kinds),
        }
        if self.timed:
            head["timed"] = self.timed
            head["time"] = {k: v for k, v in self.time.items() if math.isfinite(v)}
        if records:
            head.update(_records_dict(self))
        return head

    @classmethod
    def from_dict(cls, d: Any) -> RankSummary:
        """Parse a summary document; ``ValueError`` when it is not one."""
        if not isinstance(d, dict) or not isinstance(d.get("rank"), int):
            raise ValueError("not a rank summary (no integer 'rank')")
        try:
            grad = d.get("grad_norm")
            steps = d.get("anomaly_steps")
            return cls(
                rank=int(d["rank"]),
                steps=int(d.get("steps", 0)),
                first_step=None if d.get("first_step") is None else int(d["first_step"]),
                last_step=None if d.get("last_step") is None else int(d["last_step"]),
                wall_time=float(d.get("wall_time", 0.0)),
                grad_norm=None if grad is None else float(grad),
                anomalies=int(d.get("anomalies", 0)),
                suppressed=int(d.get("suppressed", 0)),
                anomaly_steps=(int(steps[0]), int(steps[1])) if steps else None,
                counts={str(k): int(v) for k, v in dict(d.get("counts", {})).items()},
                kinds={str(k): int(v) for k, v in dict(d.get("kinds", {})).items()},
                first=_LazyFirst(dict(d.get("first", {}))),
                earliest=_LazyRecords(list(d.get("earliest", []))),
                timed=int(d.get("timed", 0)),
                time={str(k): float(v) for k, v in dict(d.get("time", {})).items()},
            )
        except (TypeError, KeyError, IndexError, AttributeError) as e:
            raise ValueError(f"malformed rank summary: {e}") from e


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


_KEY_FIELDS = ("step", "rank", "collectives", "micro_step", "pp_stage", "seq")


def _raw_key(d: dict) -> tuple:
    """:func:`summary_key` of a record still in its JSON form; an :class:`Anomaly` made from it (which checks
    every field) where a field of the key is not what it should be."""
    fields = {name: d.get(name, _DEFAULTS.get(name)) for name in _KEY_FIELDS}
    phase = d.get("phase", _DEFAULTS["phase"])
    if all(type(v) is int for v in fields.values()) and isinstance(phase, str):
        return Anomaly.order_key(SimpleNamespace(**fields, phase=phase))  # type: ignore[arg-type]
    return summary_key(_anomaly_from_dict(d))


def record_key(records: Sequence[Anomaly] | Mapping[str, Anomaly], which: int | str) -> tuple:
    """:func:`summary_key` of ``records[which]`` (a summary's ``earliest`` or ``first``), without making the
    record an :class:`Anomaly` when it was read from a file and not used yet."""
    if isinstance(records, (_LazyRecords, _LazyFirst)):
        return records.key(which)  # type: ignore[arg-type]
    return summary_key(records[which])  # type: ignore[index]


class _LazyRecords(Sequence):
    """A summary's records, each made an :class:`Anomaly` when first used: ``analyze`` at 1,000 ranks looks at
    the first record of each rank and at the rest of one or two ranks only."""

    def __init__(self, raw: list) -> None:
        if not all(isinstance(d, dict) for d in raw):
            raise TypeError("records must be JSON objects")
        self._raw = raw
        self._made: list[Anomaly | None] = [None] * len(raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        made = self._made[i]
        if made is None:
            made = self._made[i] = _anomaly_from_dict(self._raw[i])
        return made

    def key(self, i: int) -> tuple:
        made = self._made[i]
        return summary_key(made) if made is not None else _raw_key(self._raw[i])


class _LazyFirst(Mapping):
    """A summary's first record per rule, each made an :class:`Anomaly` when first used."""

    def __init__(self, raw: dict) -> None:
        if not all(isinstance(d, dict) for d in raw.values()):
            raise TypeError("records must be JSON objects")
        self._raw = {str(k): v for k, v in raw.items()}
        self._made: dict[str, Anomaly] = {}

    def __getitem__(self, rule: str) -> Anomaly:
        made = self._made.get(rule)
        if made is None:
            made = self._made[rule] = _anomaly_from_dict(self._raw[rule])
        return made

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def key(self, rule: str) -> tuple:
        made = self._made.get(rule)
        return summary_key(made) if made is not None else _raw_key(self._raw[rule])

    def __len__(self) -> int:
        return len(self._raw)


# Anomaly fields left out of a summary's records when they hold their default (readers restore it): a summary
# is read by every `analyze`, 4,096 of them at 4,096 ranks.
_DEFAULTS = {
    f.name: f.default
    for f in dataclasses.fields(Anomaly)
    if f.default is not dataclasses.MISSING and f.name not in ("v",)
}


def _compact(a: Anomaly) -> dict[str, Any]:
    d = anomaly_to_dict(a)
    for name, default in _DEFAULTS.items():
        if name in d and d[name] == default and type(d[name]) is type(default):
            del d[name]
    return d


def _records_dict(summary: RankSummary) -> dict[str, Any]:
    return {
        "first": {rule: _compact(a) for rule, a in summary.first.items()},
        "earliest": [_compact(a) for a in summary.earliest],
    }


def _dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False, ensure_ascii=False)


class SummaryFile:
    """Writes one rank's summary at every step end; the records' part of the document (``first``,
    ``earliest``) is encoded again only when it changed (it changes on anomalous steps only)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._records: tuple[object, object, str] = (None, None, "")
        self._written = False  # its folder missing after a write: the run folder was deleted under the job

    def write(self, summary: RankSummary) -> None:
        first, earliest, text = self._records
        if first is not summary.first or earliest is not summary.earliest:
            text = _dumps(_records_dict(summary))[1:-1]
            self._records = (summary.first, summary.earliest, text)
        _replace(self.path, _dumps(summary.to_dict(records=False))[:-1] + "," + text + "}", self._written)
        self._written = True


def read_summary(path: str | os.PathLike[str]) -> RankSummary | None:
    """The summary in ``path``; None when there is none. ``ValueError`` names the file when it is damaged (and
    it is noted, :mod:`trainmon.run.damage`).

    Successive reads never go back in time: the temporary file is read only in the writer's gap between
    removing the document and renaming the new one into place, and what it holds is taken only if that gap
    is still open after reading it (see the module's doc)."""
    path = Path(path)
    for _ in range(20):
        try:
            with open(path, "rb") as f:
                return _parse(path, f.read(), damaged=True)
        except FileNotFoundError:  # between the writer's removal and rename: the temporary file
            pass
        try:
            with open(_temporary(path), "rb") as f:
                data = f.read()
        except FileNotFoundError:  # renamed into place meanwhile, or no summary at all
            if not os.path.exists(path):
                return None
            continue
        if os.path.exists(path):  # in place now: the temporary file may hold a later step already
            continue
        try:
            return _parse(path, data)
        except ValueError:  # the next step's document, being written: the gap has closed and opened again
            continue
    return None


def _parse(path: Path, data: bytes, damaged: bool = False) -> RankSummary:
    """``damaged``: ``data`` is the summary in place, not the temporary file being written, so a document that
    does not parse is a damaged file."""
    try:
        return RankSummary.from_dict(json.loads(data))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        if damaged:
            note(path, f"not a rank summary: {e}")
        raise ValueError(f"{path}: {e}") from e


def summary_ranks(run: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(rank, path)`` of the summaries of a run, by rank."""
    return rank_files(summary_dir(run), RANK_JSON)


def write_summary(run: str | os.PathLike[str], summary: RankSummary) -> None:
    """Replace the rank's summary (readers see the previous document or the new one, whole: see the module's
    doc). A kill at any point leaves a whole document: the old one while the new one is written, the new one
    (under the temporary name until the rename) after."""
    _replace(summary_file(run, summary.rank), _dumps(summary.to_dict()))


def _replace(path: Path, data: str, written_before: bool = False) -> None:
    """Replace ``path`` by ``data`` (see the module's doc); its folder is created when missing, and said to
    have been deleted under the job when the file was ``written_before``."""
    tmp = _temporary(path)
    encoded = data.encode("utf-8", "backslashreplace")
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except FileNotFoundError:
            if written_before:
                say_deleted(path.parent)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(encoded)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.rename(tmp, path)

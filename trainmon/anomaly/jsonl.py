"""Anomaly records on disk: one JSON object a line in ``RUN/plugins/trainmon/anomalies/rank_<r>.jsonl``.

The files are strict JSON Lines: non-finite floats are written as the strings ``"nan"``, ``"inf"`` and
``"-inf"`` (``json.loads`` in any language reads them), and read back as floats. Each step's lines are
appended with one ``os.write`` on an ``O_APPEND`` descriptor, so a run killed at any moment leaves every
completed step readable; readers skip a partial last line and warn about (and skip) a malformed one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from trainmon.records import PHASE_ORDER, Anomaly

__all__ = [
    "ANOMALIES_DIR",
    "SUPPRESSED_RULE",
    "AnomalyLog",
    "anomalies_dir",
    "anomaly_from_json",
    "anomaly_to_dict",
    "anomaly_to_json",
    "iter_anomalies",
    "rank_file",
]

logger = logging.getLogger("trainmon")

# Where the anomaly files of a run live, relative to the run directory.
ANOMALIES_DIR = Path("plugins", "trainmon", "anomalies")

# Rule of the one summary line written for a step whose anomalies exceeded the burst cap.
SUPPRESSED_RULE = "suppressed"

_FIELDS = tuple(f.name for f in dataclasses.fields(Anomaly))
_REQUIRED = tuple(
    f.name
    for f in dataclasses.fields(Anomaly)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
)
# Fields holding floats (possibly non-finite, hence possibly written as strings).
_FLOAT_FIELDS = frozenset({"value", "baseline", "wall_time"})
_INT_FIELDS = frozenset({"step", "rank", "seq", "micro_step", "vpp_stage", "pp_stage", "collectives", "v"})
_BOOL_FIELDS = frozenset({"origin", "propagated"})
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "+inf": math.inf}


def anomalies_dir(run_dir: str | os.PathLike[str]) -> Path:
    """The directory holding the anomaly files of the run ``run_dir``."""
    return Path(run_dir) / ANOMALIES_DIR


def rank_file(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """The anomaly file of one rank of the run ``run_dir``."""
    return anomalies_dir(run_dir) / f"rank_{int(rank)}.jsonl"


def _encode_float(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def anomaly_to_dict(a: Anomaly) -> dict[str, Any]:
    """The JSON-safe dict of an anomaly: keys as the dataclass fields, non-finite floats as strings."""
    d: dict[str, Any] = {}
    for name in _FIELDS:
        x = getattr(a, name)
        if name in _FLOAT_FIELDS and x is not None:
            x = _encode_float(float(x))
        d[name] = x
    return d


def anomaly_to_json(a: Anomaly) -> str:
    """One compact line of strict JSON (no trailing newline)."""
    return json.dumps(anomaly_to_dict(a), separators=(",", ":"), allow_nan=False, ensure_ascii=False)


def _decode_float(name: str, x: Any) -> float:
    if isinstance(x, str):
        key = x.strip().lower()
        if key in _NON_FINITE:
            return _NON_FINITE[key]
        raise ValueError(f"field {name!r}: expected a number or 'nan'/'inf'/'-inf', got {x!r}")
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"field {name!r}: expected a number, got {x!r}")
    return float(x)


def _check_type(name: str, x: Any) -> Any:
    if name in _INT_FIELDS:
        if isinstance(x, float) and x.is_integer():
            return int(x)
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"field {name!r}: expected an integer, got {x!r}")
    elif name in _BOOL_FIELDS:
        if not isinstance(x, bool):
            raise ValueError(f"field {name!r}: expected true/false, got {x!r}")
    elif name == "dump":
        if x is not None and not isinstance(x, str):
            raise ValueError(f"field {name!r}: expected a string or null, got {x!r}")
    elif not isinstance(x, str):
        raise ValueError(f"field {name!r}: expected a string, got {x!r}")
    return x


def _anomaly_from_dict(d: Any) -> Anomaly:
    if not isinstance(d, dict):
        raise ValueError(f"expected a JSON object, got {type(d).__name__}")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ValueError(f"missing required key(s): {', '.join(missing)}")
    kwargs: dict[str, Any] = {}
    for name in _FIELDS:  # unknown (future) keys are ignored; missing optional keys take defaults
        if name not in d:
            continue
        x = d[name]
        if name in _FLOAT_FIELDS:
            if not (x is None and name == "baseline"):  # baseline is the one optional float
                x = _decode_float(name, x)
        else:
            x = _check_type(name, x)
        kwargs[name] = x
    return Anomaly(**kwargs)


def anomaly_from_json(line: str | bytes) -> Anomaly:
    """Parse one line written by :func:`anomaly_to_json`. Unknown keys are ignored, missing optional keys
    take their defaults; a line that is not an anomaly raises ``ValueError``."""
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from e
    return _anomaly_from_dict(d)


def _phase_rank(phase: str) -> int:
    return PHASE_ORDER.get(phase, len(PHASE_ORDER))


def _step_order(a: Anomaly) -> tuple[int, int, int]:
    return (_phase_rank(a.phase), a.micro_step, a.seq)


class AnomalyLog:
    """Appends the anomalies of one rank to ``run_dir/plugins/trainmon/anomalies/rank_<rank>.jsonl``.

    Each :meth:`write_step` is one ``os.write`` of complete lines on an ``O_APPEND`` descriptor. At most
    ``max_per_step`` anomalies are kept per step (the first ones in (phase, micro-step, seq) order); the rest
    are replaced by one summary anomaly with rule ``"suppressed"``, name ``"*"`` and the number dropped as
    its value. The earliest anomaly of a step is therefore never dropped.
    """

    def __init__(self, run_dir: str | os.PathLike[str], rank: int, max_per_step: int = 50) -> None:
        if max_per_step < 0:
            raise ValueError(f"max_per_step must be >= 0, got {max_per_step}")
        self.rank = int(rank)
        self.max_per_step = int(max_per_step)
        self.path = rank_file(run_dir, self.rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _cap(self, step: int, anomalies: list[Anomaly]) -> list[Anomaly]:
        if len(anomalies) <= self.max_per_step:
            return sorted(anomalies, key=_step_order)
        ordered = sorted(anomalies, key=_step_order)  # stable: ties keep the caller's order
        kept, dropped = ordered[: self.max_per_step], ordered[self.max_per_step :]
        first = dropped[0]  # the summary sits where the dropping started
        summary = Anomaly(
            step=step,
            rank=self.rank,
            kind="*",
            name="*",
            stat="*",
            value=float(len(dropped)),
            rule=SUPPRESSED_RULE,
            seq=first.seq,
            micro_step=first.micro_step,
            vpp_stage=first.vpp_stage,
            pp_stage=first.pp_stage,
            phase=first.phase,
            collectives=first.collectives,
            wall_time=first.wall_time,
            message=f"{len(dropped)} more anomalies at this step not recorded "
            f"(at most {self.max_per_step} a step)",
        )
        return [*kept, summary]

    def write_step(self, step: int, anomalies: Iterable[Anomaly]) -> list[Anomaly]:
        """Append the anomalies of one step (burst cap applied, in (phase, micro-step, seq) order) and
        return what was written. The anomalies are written as given: no field of them is assigned."""
        written = self._cap(int(step), list(anomalies))
        if not written:
            return written
        data = "".join(anomaly_to_json(a) + "\n" for a in written).encode("utf-8")
        with self._lock:
            if self._fd is None:
                raise ValueError(f"write_step on a closed AnomalyLog ({self.path})")
            view = memoryview(data)
            while view:  # one write for regular files; loop only on a short write (disk full, signal)
                n = os.write(self._fd, view)
                view = view[n:]
        return written

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                os.close(fd)

    @property
    def closed(self) -> bool:
        return self._fd is None

    def __enter__(self) -> AnomalyLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_anomalies(path: str | os.PathLike[str]) -> Iterator[Anomaly]:
    """Stream the anomalies of one file. A partial last line (no trailing newline: the writer was killed
    or is mid-write) is skipped silently; a malformed complete line is skipped with a warning on the
    ``trainmon`` logger naming ``file:line``. Blank lines are ignored."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                logger.debug("trainmon: %s:%d: partial last line skipped", path, lineno)
                return
            if not raw.strip():
                continue
            try:
                yield anomaly_from_json(raw.decode("utf-8"))
            except (ValueError, TypeError) as e:  # UnicodeDecodeError is a ValueError
                logger.warning("trainmon: %s:%d: malformed anomaly line skipped: %s", path, lineno, e)

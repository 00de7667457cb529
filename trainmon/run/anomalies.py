"""Anomaly records on disk: one JSON object a line in ``RUN/plugins/trainmon/anomalies/rank_<r>.jsonl``.

The files are strict JSON Lines: non-finite floats are written as the strings ``"nan"``, ``"inf"`` and
``"-inf"`` (``json.loads`` in any language reads them), and read back as floats. Each step's lines are
appended with one ``os.write`` on an ``O_APPEND`` descriptor, so a run killed at any moment leaves every
completed step readable; readers skip a partial last line, and skip a malformed one, noting the file damaged
(:mod:`trainmon.run.damage`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Iterator
from typing import Any

from trainmon.run.damage import note
from trainmon.run.records import Anomaly

__all__ = ["anomaly_from_json", "anomaly_to_dict", "anomaly_to_json", "iter_anomalies"]

logger = logging.getLogger("trainmon")

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


def iter_anomalies(path: str | os.PathLike[str]) -> Iterator[Anomaly]:
    """Stream the anomalies of one file. A partial last line (no trailing newline: the writer was killed
    or is mid-write) is skipped silently; malformed complete lines are skipped and the file noted damaged
    (:mod:`trainmon.run.damage`, naming its first bad line and how many). Blank lines are ignored."""
    bad: list[tuple[int, str]] = []
    try:
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
                    bad.append((lineno, str(e)))
    finally:
        if bad:
            more = f" ({len(bad)} malformed lines skipped)" if len(bad) > 1 else " (skipped)"
            note(path, f"line {bad[0][0]}: malformed anomaly line: {bad[0][1]}{more}")

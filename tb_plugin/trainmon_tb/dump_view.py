"""What the plugin shows of one dump: the safetensors header and metadata, the tensor's statistics (the same
kernel and definitions as the CSV and TensorBoard values), a histogram of its finite values, and where its
non-finite values are (the first indices, and per row of a 2-D view the rows that hold any).

Dumps are read with safetensors only: nothing a file contains is ever executed."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from trainmon.run.records import STATS
from trainmon_tb.anomaly_index import json_number

logger = logging.getLogger("trainmon")

HISTOGRAM_BINS = 64
FIRST_NON_FINITE = 16  # indices listed
MAX_BAD_ROWS = 256  # rows with non-finite values listed (their total is always given)


# Set once what reading a dump needs is imported: torch and the stats kernel (2 s on two cores), which the
# plugin does not import to list runs and anomalies.
WARM = threading.Event()
_warming = threading.Lock()


def warm_up() -> None:
    """Import what reading a dump needs, in a daemon thread (once): started when the tab first shows a run
    with dumps, so that the first dump opened opens as fast as the next ones."""
    if WARM.is_set() or not _warming.acquire(blocking=False):
        return
    threading.Thread(target=_warm, name="trainmon-dump-warmup", daemon=True).start()


def _warm() -> None:
    try:
        from trainmon.read.dump_contents import prepare

        prepare()
    except Exception:  # never a reason for the tab to fail: the first dump then pays the import
        logger.debug("trainmon: warming up the dump reader failed", exc_info=True)
    finally:
        WARM.set()


def describe(path: Path) -> dict[str, Any]:
    """Statistics, histogram, non-finite locations and metadata of the dump file ``path`` (already
    confined to the run). Raises ``trainmon.run.dumps.DumpError`` for a file that is not a readable dump."""
    from trainmon.read.dump_contents import read_dump  # only here: listing runs and anomalies never needs it

    dump = read_dump(path)
    stats: dict[str, Any] = {"numel": dump.numel}
    for stat in STATS:
        value = dump.stats[stat]
        stats[stat] = int(value) if stat in ("nans", "infs") else json_number(value)
    if dump.finite_values.size:
        counts, edges = np.histogram(dump.finite_values, bins=HISTOGRAM_BINS)
        histogram = {"edges": edges.tolist(), "counts": counts.tolist()}
    else:
        histogram = {"edges": [], "counts": []}
    # the file is read a second time only when it has non-finite values to locate
    classes = _classes(path) if stats["nans"] + stats["infs"] else None
    return {
        "metadata": dump.metadata,
        "tensor": {"dtype": dump.dtype, "shape": list(dump.shape)},
        "stats": stats,
        "histogram": histogram,
        "nonfinite": locate_non_finite(classes, dump.shape),
    }


def _classes(path: Path) -> np.ndarray:
    """Per element, flattened: 0 finite, 1 NaN, 2 +inf, 3 -inf (complex: NaN if a part is NaN, else +inf)."""
    try:
        import torch
    except ImportError:  # a MindSpore-only environment: numpy reads every dtype MindSpore writes
        from safetensors.numpy import load_file

        arrays = load_file(str(path))
        x = arrays["tensor"] if "tensor" in arrays else next(iter(arrays.values()))
        flat = np.asarray(x).reshape(-1)
        if np.iscomplexobj(flat):
            nan = np.isnan(flat.real) | np.isnan(flat.imag)
            return np.where(nan, 1, np.where(np.isinf(flat), 2, 0)).astype(np.int8)
        if not np.issubdtype(flat.dtype, np.floating):
            return np.zeros(flat.size, dtype=np.int8)
        return _float_classes(flat)
    from trainmon.read.dump_contents import load_dump

    tensor, _ = load_dump(path)
    t = tensor.reshape(-1)
    if t.is_complex():
        nan = torch.isnan(t.real) | torch.isnan(t.imag)
        return torch.where(nan, 1, torch.where(torch.isinf(t), 2, 0)).to(torch.int8).numpy()
    if not t.is_floating_point():
        return np.zeros(t.numel(), dtype=np.int8)
    return _float_classes(t.to(torch.float64).numpy())  # bf16/fp8 have no numpy dtype


def _float_classes(flat: np.ndarray) -> np.ndarray:
    out = np.zeros(flat.size, dtype=np.int8)
    out[np.isnan(flat)] = 1
    out[flat == np.inf] = 2
    out[flat == -np.inf] = 3
    return out


_CLASS_NAMES = ("", "nan", "inf", "-inf")


def locate_non_finite(classes: np.ndarray | None, shape: tuple[int, ...]) -> dict[str, Any]:
    """Where the non-finite values are: ``count``; ``first``, the first indices in row-major order with
    their value; ``rows`` for tensors of 2 or more dimensions, viewed as 2-D (the leading dimensions
    flattened into rows, the last one the columns): how many rows hold a non-finite value and, for the
    first of them, how many each holds. ``classes`` None: the tensor has none."""
    rows_shape = [int(np.prod(shape[:-1], dtype=np.int64)), int(shape[-1])] if len(shape) >= 2 else None
    out: dict[str, Any] = {"count": 0, "first": [], "rows": None}
    if rows_shape is not None:
        out["rows"] = {"shape": rows_shape, "flattened": len(shape) > 2, "with_non_finite": 0, "counts": []}
    if classes is None:
        return out
    bad = np.flatnonzero(classes)
    out["count"] = int(bad.size)
    first = bad[:FIRST_NON_FINITE]
    index = np.unravel_index(first, shape) if shape else ()
    out["first"] = [
        {"index": [int(d[i]) for d in index], "value": _CLASS_NAMES[int(classes[f])]}
        for i, f in enumerate(first)
    ]
    if rows_shape is not None and rows_shape[0] and rows_shape[1]:
        per_row = np.count_nonzero(classes.reshape(rows_shape), axis=1)
        rows = np.flatnonzero(per_row)
        out["rows"]["with_non_finite"] = int(rows.size)
        out["rows"]["counts"] = [[int(r), int(per_row[r])] for r in rows[:MAX_BAD_ROWS]]
    return out

"""What the plugin shows of one dump: the safetensors header and metadata, the tensor's statistics (the same
kernel and definitions as the CSV and TensorBoard values) and a histogram of its finite values.

Dumps are read with safetensors only: nothing a file contains is ever executed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from trainmon.records import STATS
from trainmon_tb.anomaly_index import json_number

HISTOGRAM_BINS = 64


def describe(path: Path) -> dict[str, Any]:
    """Statistics, histogram and metadata of the dump file ``path`` (already confined to the run).
    Raises ``trainmon.dumps.DumpError`` for a file that is not a readable dump."""
    from trainmon.dump_contents import read_dump  # only here: listing runs and anomalies never needs it

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
    return {
        "metadata": dump.metadata,
        "tensor": {"dtype": dump.dtype, "shape": list(dump.shape)},
        "stats": stats,
        "histogram": histogram,
    }

"""What the plugin shows of one dump: the safetensors header and metadata, the tensor's statistics (the same
kernel and definitions as the CSV and TensorBoard values) and a histogram of its finite values.

Dumps are read with safetensors only: nothing a file contains is ever executed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from trainmon.records import STATS, derive
from trainmon_tb.anomaly_index import json_number

HISTOGRAM_BINS = 64


def describe(path: Path) -> dict[str, Any]:
    """Statistics, histogram and metadata of the dump file ``path`` (already confined to the run).
    Raises ``trainmon.dumps.DumpError`` for a file that is not a readable dump."""
    import torch  # only here: listing runs and anomalies never needs it

    from trainmon.dumps import load_dump
    from trainmon.stats import partials

    tensor, metadata = load_dump(path)
    derived = derive(partials(tensor).double().cpu().numpy())
    stats: dict[str, Any] = {"numel": int(tensor.numel())}
    for stat in STATS:
        value = float(derived[stat][0])
        stats[stat] = int(value) if stat in ("nans", "infs") else json_number(value)
    values = tensor.detach().reshape(-1).to(torch.float64).numpy()
    values = values[np.isfinite(values)]
    if values.size:
        counts, edges = np.histogram(values, bins=HISTOGRAM_BINS)
        histogram = {"edges": edges.tolist(), "counts": counts.tolist()}
    else:
        histogram = {"edges": [], "counts": []}
    return {
        "metadata": metadata,
        "tensor": {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)},
        "stats": stats,
        "histogram": histogram,
    }

"""The statistics store: every step-level statistic of a rank as fixed-width binary records, for the
TensorBoard plugin's heatmaps (and any script with numpy).

On disk, per rank::

    RUN/plugins/trainmon/stats/rank_<r>.names.jsonl   {"id": 0, "kind": "actv", "name": "layers.0.output"}
    RUN/plugins/trainmon/stats/rank_<r>.bin           records of STAT_RECORD: step, id, 7 float32 stats

A name line is always written before the first record that uses its id, so a reader that reads the names
after the records never meets an unknown id. Each step is one ``os.write`` of whole records on an
``O_APPEND`` descriptor; a reader ignores a trailing partial record. Values are those TensorBoard shows
(micro-steps merged, float32), for all seven statistics whatever ``ops`` says.
"""

from __future__ import annotations

import json
import os

import numpy as np

from trainmon.run.records import STATS

__all__ = ["STAT_RECORD", "encode_name", "read_names", "read_records"]

STAT_RECORD = np.dtype([("step", "<i8"), ("id", "<i4"), ("stats", "<f4", (len(STATS),))])


def read_names(path: str | os.PathLike[str], start_byte: int = 0) -> tuple[list[tuple[int, str, str]], int]:
    """(id, kind, name) of the complete lines from ``start_byte`` on, and the byte offset after them."""
    out: list[tuple[int, str, str]] = []
    try:
        with open(path, "rb") as f:
            f.seek(start_byte)
            data = f.read()
    except FileNotFoundError:
        return out, start_byte
    end = data.rfind(b"\n") + 1  # a partial last line waits for the next read
    for raw in data[:end].splitlines():
        if not raw.strip():
            continue
        try:
            d = json.loads(raw)
            out.append((int(d["id"]), str(d["kind"]), str(d["name"])))
        except (ValueError, KeyError, TypeError):
            continue  # a damaged line costs its name, never the store
    return out, start_byte + end


def read_records(path: str | os.PathLike[str], start: int = 0) -> np.ndarray:
    """The complete records from record index ``start`` on (a memory map; empty when there are none)."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return np.empty(0, dtype=STAT_RECORD)
    count = size // STAT_RECORD.itemsize - start
    if count <= 0:
        return np.empty(0, dtype=STAT_RECORD)
    return np.memmap(path, dtype=STAT_RECORD, mode="r", offset=start * STAT_RECORD.itemsize, shape=(count,))


def encode_name(store_id: int, kind: str, name: str) -> bytes:
    """One line of the names file: the id a tensor's records carry, its kind and its name."""
    line = {"id": store_id, "kind": kind, "name": name}
    # names are encoded already (trainmon.run.names); backslashreplace only keeps a stray one from failing
    text = json.dumps(line, ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8", "backslashreplace") + b"\n"

"""What the previous release wrote, for the tests of the readers that still read it and of ``trainmon
migrate``: the old statistics store's names file (one JSON line per tensor)."""

from __future__ import annotations

import json


def old_names_line(store_id: int, kind: str, name: str) -> bytes:
    """One line of the old store's names file (``stats/rank_<r>.names.jsonl``)."""
    line = {"id": store_id, "kind": kind, "name": name}
    # names are encoded already (trainmon.run.names); backslashreplace only keeps a stray one from failing
    text = json.dumps(line, ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8", "backslashreplace") + b"\n"

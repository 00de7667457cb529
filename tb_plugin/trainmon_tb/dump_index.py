"""The dump index of a run (``plugins/trainmon/dumps/rank_<r>.jsonl``), and the dumps of an anomaly."""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

from trainmon.dumps import DumpEntry, dumps_dir, list_dumps
from trainmon.writer.manifest import read_manifest


class DumpIndex:
    """Dumps by tensor (rank, kind, name); re-read when an index file changed size."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._sizes: dict[str, int] = {}
        self._by_tensor: dict[tuple[int, str, str], list[DumpEntry]] = defaultdict(list)
        self._by_path: dict[str, DumpEntry] = {}
        self._by_request: dict[str, list[DumpEntry]] = defaultdict(list)
        self._world_size: int | None = None
        self._lock = threading.Lock()

    def refresh(self) -> bool:
        try:
            sizes = {
                e.name: e.stat().st_size
                for e in os.scandir(dumps_dir(self.run_dir))
                if e.name.endswith(".jsonl")
            }
        except OSError:
            sizes = {}
        manifest = read_manifest(self.run_dir) or {}
        ws = manifest.get("world_size")
        with self._lock:
            self._world_size = ws if isinstance(ws, int) else None
            if sizes == self._sizes:
                return False
            self._sizes = sizes
            by_tensor: dict[tuple[int, str, str], list[DumpEntry]] = defaultdict(list)
            by_request: dict[str, list[DumpEntry]] = defaultdict(list)
            by_path = {}
            for entry in list_dumps(self.run_dir):
                by_tensor[(entry.rank, entry.kind, entry.name)].append(entry)
                by_path[entry.path] = entry
                words = entry.reason.split()
                if len(words) > 1 and words[0] == "request":
                    by_request[words[1]].append(entry)
            self._by_tensor, self._by_path, self._by_request = by_tensor, by_path, by_request
            return True

    def __len__(self) -> int:
        return len(self._by_path)

    def ranks(self) -> list[int]:
        with self._lock:
            return sorted({rank for rank, _, _ in self._by_tensor})

    def world_size(self) -> int | None:
        return self._world_size

    def entry(self, path: str) -> DumpEntry | None:
        with self._lock:
            return self._by_path.get(path)

    def for_anomaly(self, anomaly: dict[str, Any]) -> list[dict[str, Any]]:
        """The dumps taken for the anomaly's dump request (its own tensor first), then other dumps of its
        tensor at its step."""
        request = anomaly.get("dump") or ""
        tensor = (anomaly["rank"], anomaly["kind"], anomaly["name"])
        with self._lock:
            picked: dict[str, DumpEntry] = {}
            if request.startswith("request:"):
                for e in self._by_request.get(request.split(":", 1)[1], []):
                    picked[e.path] = e
            elif request in self._by_path:
                picked[request] = self._by_path[request]
            for e in self._by_tensor.get(tensor, []):
                if e.step == anomaly["step"]:
                    picked[e.path] = e
            ordered = sorted(
                picked.values(), key=lambda e: ((e.rank, e.kind, e.name) != tensor, e.step, e.path)
            )
            return [e.to_dict() for e in ordered]

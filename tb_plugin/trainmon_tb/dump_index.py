"""The dump index of a run (``plugins/trainmon/dumps/rank_<r>.jsonl``), the dumps of an anomaly, and the
dumps of one module call (its inputs next to its outputs)."""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

from trainmon.read.explain import EXACT_PREFIX, ROLE_ORDER, key_order  # shared with --explain
from trainmon.run.dumps import DumpEntry, list_dumps
from trainmon.run.layout import dumps_dir
from trainmon.run.manifest import read_manifest
from trainmon.run.names import module_call, module_role

# Kinds an exact capture saves for the origin module, and the tracked scalars (a few tensors per step).
_MODULE_KINDS = ("actv", "actv_grad")
_SMALL_KINDS = (*_MODULE_KINDS, "scalar")


class DumpIndex:
    """Dumps by tensor (rank, kind, name) and by (rank, step); re-read when an index file changed size."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._sizes: dict[str, int] = {}
        self._by_tensor: dict[tuple[int, str, str], list[DumpEntry]] = defaultdict(list)
        self._by_path: dict[str, DumpEntry] = {}
        self._by_request: dict[str, list[DumpEntry]] = defaultdict(list)
        self._by_step: dict[tuple[int, int], list[DumpEntry]] = defaultdict(list)
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
            by_step: dict[tuple[int, int], list[DumpEntry]] = defaultdict(list)
            by_path = {}
            for entry in list_dumps(self.run_dir):
                by_tensor[(entry.rank, entry.kind, entry.name)].append(entry)
                by_step[(entry.rank, entry.step)].append(entry)
                by_path[entry.path] = entry
                words = entry.reason.split()
                if len(words) > 1 and words[0] == "request":
                    by_request[words[1]].append(entry)
            self._by_tensor, self._by_path, self._by_request = by_tensor, by_path, by_request
            self._by_step = by_step
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

    def for_anomaly(self, anomaly: dict[str, Any]) -> tuple[list[dict[str, Any]], int | None]:
        """The dumps that explain an anomaly, and the step of the first dump of its own tensor (None when
        its tensor has no dump).

        Dumps of its step come first, then later ones: a request-based dump (``alert.dump``) is taken at
        the tensor's next occurrence, one step or more after the anomaly, while ``alert.capture: exact``
        dumps at the anomaly's step. Picked: the dumps of the anomaly's dump request; its own tensor at its
        step; and from an exact capture at its step on its rank, the module inputs and outputs, the tracked
        scalars and the other kinds of its own tensor (the gradient, parameter and Adam state of a
        parameter). The many other tensors of an exact capture (every gradient, parameter, moment) are
        left to ``trainmon dump ls RUN --step S``. Within a step, the anomaly's micro-step comes before the
        others. Each dump carries ``same_step`` and ``own``."""
        request = anomaly.get("dump") or ""
        step, rank, kind, name = anomaly["step"], anomaly["rank"], anomaly["kind"], anomaly["name"]
        micro = anomaly.get("micro_step", 0)
        tensor = (rank, kind, name)
        with self._lock:
            picked: dict[str, DumpEntry] = {}
            if request.startswith("request:"):
                for e in self._by_request.get(request.split(":", 1)[1], []):
                    picked[e.path] = e
            elif request in self._by_path:
                picked[request] = self._by_path[request]
            for e in self._by_tensor.get(tensor, []):
                if e.step == step:
                    picked[e.path] = e
            for e in self._by_step.get((rank, step), []):
                if e.reason.startswith(EXACT_PREFIX) and (e.kind in _SMALL_KINDS or e.name == name):
                    picked[e.path] = e

        def order(e: DumpEntry) -> tuple:
            own = (e.rank, e.kind, e.name) == tensor
            role = module_role(e.kind, e.name)
            return (
                e.step != step,  # the anomaly's step first, later steps after
                not own,  # within each, the anomaly's own tensor first
                e.step,
                e.micro_step != micro,  # the anomaly's micro-step (where its NaN is) before the others
                e.micro_step,
                e.kind not in _MODULE_KINDS,  # then the module's inputs and outputs
                role[0] if role else e.name,
                ROLE_ORDER[role[1]] if role else 0,
                key_order(role[2]) if role else (0, 0, ""),
                e.kind,
                e.path,
            )

        ordered = sorted(picked.values(), key=order)
        own_steps = [e.step for e in ordered if (e.rank, e.kind, e.name) == tensor]
        out = [
            {**e.to_dict(), "same_step": e.step == step, "own": (e.rank, e.kind, e.name) == tensor}
            for e in ordered
        ]
        return out, (own_steps[0] if own_steps else None)

    def module_call(self, entry: DumpEntry) -> dict[str, Any] | None:
        """The dumps of the module call ``entry`` belongs to (same rank, step, micro-step and call number):
        its inputs next to its outputs, forward then backward; None when ``entry`` is not a module input or
        output.
        Where one tensor was dumped twice at the step (an exact capture and a request), the dump with the
        same reason as ``entry`` is kept."""
        call = module_call(entry.kind, entry.name)
        if call is None:
            return None
        module = call.module
        with self._lock:
            same_call = [
                e
                for e in self._by_step.get((entry.rank, entry.step), [])
                if e.micro_step == entry.micro_step
                and (found := module_call(e.kind, e.name)) is not None
                and (found.module, found.call) == (module, call.call)
            ]

        def preference(e: DumpEntry) -> tuple[bool, bool]:
            return (e.path != entry.path, e.reason != entry.reason)

        chosen: dict[tuple[str, str], DumpEntry] = {}
        for e in same_call:  # in index order: the first of equally preferred dumps stays
            key = (e.kind, e.name)
            if key not in chosen or preference(e) < preference(chosen[key]):
                chosen[key] = e

        def order(e: DumpEntry) -> tuple:
            _, r, k = module_role(e.kind, e.name)  # type: ignore[misc]  # every entry here has a role
            return (ROLE_ORDER[r], key_order(k), e.path)

        tensors = []
        for e in sorted(chosen.values(), key=order):
            _, r, _ = module_role(e.kind, e.name)  # type: ignore[misc]
            side = "input" if r in ("input", "output_grad") else "output"
            tensors.append({**e.to_dict(), "role": r, "side": side})
        return {
            "module": module,
            "step": entry.step,
            "rank": entry.rank,
            "micro_step": entry.micro_step,
            "tensors": tensors,
        }

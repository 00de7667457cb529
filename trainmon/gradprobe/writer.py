"""Writing fingerprints: the per-rank files, and the sink that feeds them from the writer thread."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainmon.config.schema import GradProbe
from trainmon.run.append import AppendFile
from trainmon.run.gradprobe import FORMAT_VERSION, ParamLayout
from trainmon.run.layout import probe_bin_file, probe_index_file
from trainmon.run.records import Derived, StepRecord


def layout_for(
    config: GradProbe, name: str, vpp_stage: int, shape: tuple[int, ...], dtype: str, seed: int, k: int
) -> ParamLayout:
    """The record layout ``config`` (the ``grad_probe`` section) gives a parameter sampled at ``k``
    positions."""
    level = config.grad_level
    return ParamLayout(
        name=name,
        vpp_stage=vpp_stage,
        shape=tuple(shape),
        dtype=dtype,
        level=level,
        bounds=config.bounds if level == "L2" else (),
        seed=seed,
        sample_seed=config.sample_seed,
        k=k if level != "L0" else 0,
        sign_bitmap=config.sign_bitmap and level != "L0",
    )


class FingerprintWriter:
    """Appends step blocks to ``rank_<r>.bin`` and their lines to ``rank_<r>.index.jsonl``.

    Reopening continues the files: layouts already described keep their ids, and a partial last index line
    (a process killed mid-write) is cut off first so that the next line starts clean. Both files are appended
    through :class:`~trainmon.run.append.AppendFile`: a failed write leaves no partial record behind."""

    def __init__(self, run_dir: str | Path, rank: int) -> None:
        self._bin_path = probe_bin_file(run_dir, rank)
        self._index_path = probe_index_file(run_dir, rank)
        self._bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._ids: dict[ParamLayout, int] = {}
        self._recover_index()
        # the header line goes first into an empty (or recreated) index; a recreated one lists every layout
        self._index = AppendFile(self._index_path, self._index_head)
        self._bin = AppendFile(self._bin_path)

    def _index_head(self) -> bytes:
        lines = [{"type": "header", "v": FORMAT_VERSION}]
        lines += [layout.to_json(i) for layout, i in self._ids.items()]
        return b"".join(_line(obj) for obj in lines)

    def _recover_index(self) -> None:
        """Read the ids of an existing index."""
        if not self._index_path.exists() or self._index_path.stat().st_size == 0:
            return
        raw = self._index_path.read_bytes()
        complete = raw[: raw.rfind(b"\n") + 1]
        if len(complete) != len(raw):
            with open(self._index_path, "r+b") as f:
                f.truncate(len(complete))
        for line in complete.decode("utf-8").splitlines():
            entry = json.loads(line)
            if entry.get("type") == "param":
                self._ids[ParamLayout.from_json(entry)] = int(entry["id"])

    def write_step(self, step: int, layouts: Sequence[ParamLayout], data: bytes | memoryview) -> None:
        expected = sum(layout.nbytes for layout in layouts)
        if len(data) != expected:
            raise ValueError(f"step {step}: {len(data)} bytes of fingerprints, the layouts need {expected}")
        ids = []
        new: dict[ParamLayout, int] = {}
        for layout in layouts:
            param_id = self._ids.get(layout, new.get(layout))
            if param_id is None:
                param_id = new[layout] = len(self._ids) + len(new)
            ids.append(param_id)
        if new:  # a failed write takes no id: the next step describes them again
            self._index.append(b"".join(_line(layout.to_json(i)) for layout, i in new.items()))
            self._ids.update(new)
        offset = self._bin.append(data)  # the data is on disk before the line that points at it
        self._index.append(
            _line({"type": "step", "step": int(step), "offset": offset, "bytes": len(data), "params": ids})
        )

    def close(self) -> None:
        self._bin.close()
        self._index.close()


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode("utf-8")


class GradProbeSink:
    """A writer-thread sink: the collector hands it each step's host copy, and the record of that step (or a
    later one) writes it, after the copy has landed. Files open on the first fingerprint and reopen after a
    close (the monitor starts a new writer thread when a reload changes the outputs)."""

    def __init__(self, run_dir: str | Path, rank: int) -> None:
        self._run_dir = Path(run_dir)
        self._rank = rank
        self._file: FingerprintWriter | None = None
        # (step, layouts, host bytes, ready, assemble): appended by the training thread, popped by the writer
        self._pending: deque[tuple[int, tuple[ParamLayout, ...], Any, Callable[[], None] | None, Any]] = (
            deque()
        )

    def submit(
        self,
        step: int,
        layouts: tuple[ParamLayout, ...],
        host: Any,
        ready: Callable[[], None] | None,
        assemble: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        """Queue a step's fingerprints: ``host`` is the step's bytes on the host, a numpy array or a (CPU)
        torch tensor, complete once ``ready()`` (if given) has returned; ``assemble`` (if given) turns it
        into the records first (in the writer thread)."""
        self._pending.append((step, layouts, host, ready, assemble))

    def _drain(self, upto: int | None) -> None:
        pending = self._pending
        while pending and (upto is None or pending[0][0] <= upto):
            step, layouts, host, ready, assemble = pending.popleft()
            if ready is not None:
                ready()
            if self._file is None:
                self._file = FingerprintWriter(self._run_dir, self._rank)
            array = host.numpy() if hasattr(host, "numpy") else np.asarray(host)
            if assemble is not None:
                array = assemble(array)
            self._file.write_step(step, layouts, memoryview(np.ascontiguousarray(array)).cast("B"))

    def write(self, record: StepRecord, derived: Derived) -> None:
        self._drain(record.step)

    def flush(self) -> None:
        self._drain(None)

    def close(self) -> None:
        self._drain(None)
        if self._file is not None:
            self._file.close()
            self._file = None

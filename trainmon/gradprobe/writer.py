"""Writing fingerprints: the per-rank files, and the sink that feeds them from the writer thread."""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from trainmon.config.schema import GradProbe
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
    (a process killed mid-write) is cut off first so that the next line starts clean."""

    def __init__(self, run_dir: str | Path, rank: int) -> None:
        self._bin_path = probe_bin_file(run_dir, rank)
        self._index_path = probe_index_file(run_dir, rank)
        self._bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._ids: dict[ParamLayout, int] = {}
        fresh = self._recover_index()
        self._index: IO[str] = open(self._index_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._bin: IO[bytes] = open(self._bin_path, "ab")  # noqa: SIM115 - closed in close()
        if fresh:
            self._line({"type": "header", "v": FORMAT_VERSION})
            self._index.flush()

    def _recover_index(self) -> bool:
        """Read the ids of an existing index; True when there is none yet."""
        if not self._index_path.exists() or self._index_path.stat().st_size == 0:
            return True
        raw = self._index_path.read_bytes()
        complete = raw[: raw.rfind(b"\n") + 1]
        if len(complete) != len(raw):
            with open(self._index_path, "r+b") as f:
                f.truncate(len(complete))
        for line in complete.decode("utf-8").splitlines():
            entry = json.loads(line)
            if entry.get("type") == "param":
                self._ids[ParamLayout.from_json(entry)] = int(entry["id"])
        return not complete

    def _line(self, obj: dict[str, Any]) -> None:
        self._index.write(json.dumps(obj, separators=(",", ":")) + "\n")

    def write_step(self, step: int, layouts: Sequence[ParamLayout], data: bytes | memoryview) -> None:
        expected = sum(layout.nbytes for layout in layouts)
        if len(data) != expected:
            raise ValueError(f"step {step}: {len(data)} bytes of fingerprints, the layouts need {expected}")
        ids = []
        for layout in layouts:
            param_id = self._ids.get(layout)
            if param_id is None:
                param_id = self._ids[layout] = len(self._ids)
                self._line(layout.to_json(param_id))
            ids.append(param_id)
        self._bin.seek(0, os.SEEK_END)
        offset = self._bin.tell()
        self._bin.write(data)
        self._bin.flush()  # the data is on disk before the line that points at it
        self._line({"type": "step", "step": int(step), "offset": offset, "bytes": len(data), "params": ids})
        self._index.flush()

    def close(self) -> None:
        self._bin.close()
        self._index.close()


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

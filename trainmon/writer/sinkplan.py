"""A rank's format outputs as data: which sinks, writing where, with which statistics. The writer thread opens
them from it, and so does the writer process (:mod:`trainmon.writer.child`), which is sent it as JSON; so
both open the same files the same way. Imports no config and no torch."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmon.writer.thread import RecordSink

__all__ = ["KINDS", "SinkSpec", "describe_outputs", "follow_failed", "open_sinks"]

logger = logging.getLogger("trainmon")

# the sinks a plan may name, in the order format_sinks places them
KINDS = ("tensorboard", "all_ranks", "statstore", "csv")


@dataclass(frozen=True)
class SinkSpec:
    """One format sink: ``kind`` (one of :data:`KINDS`) writing in ``folder`` (the rank's folder for
    ``tensorboard`` and ``csv``, the all_ranks folder for ``all_ranks``, the run folder for ``statstore``) for
    ``rank``; ``tensors``: what a TensorBoard run shows (``tensorboard_tensors``: ``summary``, ``all`` or name
    patterns, :mod:`trainmon.writer.tbview`)."""

    kind: str
    folder: str
    ops: tuple[str, ...] = ()
    multi_chunk: bool = False
    rank: int = 0
    ndigits: int | None = None
    tensors: str | tuple[str, ...] = "all"

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "folder": self.folder,
            "ops": list(self.ops),
            "multi_chunk": self.multi_chunk,
            "rank": self.rank,
            "ndigits": self.ndigits,
            "tensors": self.tensors if isinstance(self.tensors, str) else list(self.tensors),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SinkSpec:
        if d.get("kind") not in KINDS:
            raise ValueError(f"unknown output {d.get('kind')!r}")
        ndigits = d.get("ndigits")
        tensors = d.get("tensors", "all")
        return cls(
            kind=str(d["kind"]),
            folder=str(d["folder"]),
            ops=tuple(str(op) for op in d.get("ops", ())),
            multi_chunk=bool(d.get("multi_chunk", False)),
            rank=int(d.get("rank", 0)),
            ndigits=None if ndigits is None else int(ndigits),
            tensors=str(tensors) if isinstance(tensors, str) else tuple(str(t) for t in tensors),
        )


def _open(spec: SinkSpec, clock: Callable[[], float]) -> RecordSink:
    # imported here: the writer process imports pyarrow only when it writes the statistics store
    announce = spec.rank == 0  # what an output costs is said once in a job: by rank 0
    if spec.kind == "tensorboard":
        from trainmon.writer.tensorboard import TensorBoardSink

        return TensorBoardSink(spec.folder, spec.ops, multi_chunk=spec.multi_chunk, clock=clock,
                               tensors=spec.tensors, announce=announce)  # fmt: skip
    if spec.kind == "all_ranks":
        from trainmon.writer.tensorboard import AllRanksSink

        return AllRanksSink(spec.folder, spec.ops, multi_chunk=spec.multi_chunk, clock=clock,
                            tensors=spec.tensors, announce=announce)  # fmt: skip
    if spec.kind == "statstore":
        from trainmon.writer.statstore import StatStoreSink

        return StatStoreSink(spec.folder, spec.rank, multi_chunk=spec.multi_chunk)
    if spec.kind == "csv":
        from trainmon.writer.csv import CsvSink

        return CsvSink(spec.folder, spec.ops, spec.ndigits, announce=announce)
    raise ValueError(f"unknown output {spec.kind!r}")


def open_sinks(specs: Sequence[SinkSpec], clock: Callable[[], float] = time.time) -> list[RecordSink]:
    """The sinks of ``specs``, in their order. When one cannot be opened, those opened before it are closed
    again and the error is raised."""
    sinks: list[RecordSink] = []
    try:
        for spec in specs:
            sinks.append(_open(spec, clock))
    except BaseException:
        for sink in sinks:
            try:
                sink.close()
            except Exception:  # the first error is the one worth reporting
                logger.debug("trainmon: closing a half-opened output failed", exc_info=True)
        raise
    return sinks


def describe_outputs(
    formats: Sequence[str], ops: Sequence[str], ndigits: int | None, tensors: str | Sequence[str] = "summary"
) -> str:
    """How a config's outputs are named in the log."""
    shown = tensors if isinstance(tensors, str) else "[" + ",".join(tensors) + "]"
    return f"format {','.join(formats)}, ops {','.join(ops)}, ndigits {ndigits}, tensorboard_tensors {shown}"


def follow_failed(run_dir: str | Path, new: str, old: str, error: BaseException) -> None:
    """Say that the outputs of an edited config (``new``, from :func:`describe_outputs`) cannot be opened and
    the previous ones (``old``) go on: the writer thread and the writer process say it alike."""
    logger.warning(
        "trainmon: the outputs of the edited config (%s) cannot be opened in %s (%s); writing on with the "
        "previous ones (%s)",
        new,
        run_dir,
        error,
        old,
    )

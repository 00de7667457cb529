"""The sinks that ``config.format`` asks for, built the same way for every framework's monitor, and how a
config edit replaces them while the run goes on."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainmon.config import MonitorConfig
from trainmon.joblog import rank_note
from trainmon.run.layout import all_ranks_dir, rank_dir, stats_dir
from trainmon.run.manifest import jsonable
from trainmon.run.records import Derived, StepRecord
from trainmon.writer.manifest import ManifestSink
from trainmon.writer.process import CannotStart, ProcessSink, RemoteStepLog, WriterGone, open_session
from trainmon.writer.sinkplan import SinkSpec, describe_outputs, follow_failed, open_sinks
from trainmon.writer.thread import RecordSink, WriterThread

logger = logging.getLogger("trainmon")

# the environment variable that keeps the format outputs in the writer thread: TRAINMON_WRITER=thread
WRITER_ENV = "TRAINMON_WRITER"

# the config keys that decide which files a rank writes, and how
FORMAT_KEYS = ("format", "ops", "ndigits", "tensorboard_ranks", "csv_ranks", "tensorboard_tensors")

# Above this many ranks, ``tensorboard_ranks: auto`` writes the events of rank 0 and the last rank only, plus
# the all_ranks run: TensorBoard keeps every series of every run in memory (~45 MB per rank at 200 steps of
# ~300 tensors), so a run per rank stops loading at a few hundred ranks.
TB_EVERY_RANK_UP_TO = 16


def writes_to_disk(config: MonitorConfig) -> bool:
    """Whether the run has a directory of its own (anomalies, manifest); "api" alone keeps it in memory."""
    return "tensorboard" in config.format or "csv" in config.format


def where_it_goes(config: MonitorConfig, run_dir: Path) -> str | None:
    """The run's first log line: what TensorBoard shows, where every statistic is and how to export it; None
    when nothing is written to disk (format api)."""
    if not writes_to_disk(config):
        return None
    run = str(run_dir)
    csv = f"msprobe CSV in {os.path.join(run, 'rank_<r>', '<kind>.csv')} (format: csv)"
    if "tensorboard" not in config.format:
        return (
            f"trainmon: run {run}: {csv}; no TensorBoard events and no statistics store (add tensorboard to "
            "format for them)"
        )
    view = config.tensorboard_tensors
    shown = {
        "summary": "the summary (loss and tracked scalars, gradient norm, NaN/Inf counts, per-kind and "
        "per-layer figures)",
        "all": "every statistic of every tensor (tensorboard_tensors: all)",
    }.get(view if isinstance(view, str) else "", "the summary and the tensors tensorboard_tensors names")
    return (
        f"trainmon: run {run}: TensorBoard shows {shown} (tensorboard --logdir {run}); every statistic of "
        f"every tensor and step is in {stats_dir(run)} (the trainmon tab; `trainmon export {run} --format "
        "csv` writes msprobe CSV from it, `--format tensorboard` every tensor's TensorBoard scalars)"
        + (f"; {csv}" if "csv" in config.format else "")
    )


def event_ranks(config: MonitorConfig, world: int, aggregates: bool) -> frozenset[int]:
    """The ranks that write their own TensorBoard events. ``aggregates``: the job can write the all_ranks run
    (``auto`` only leaves ranks out when it can, so that a NaN on any rank still shows in TensorBoard)."""
    setting = config.tensorboard_ranks
    world = max(1, world)
    if setting == "all" or (setting == "auto" and (world <= TB_EVERY_RANK_UP_TO or not aggregates)):
        return frozenset(range(world))
    chosen = (0, -1) if setting == "auto" else setting
    return frozenset(r % world for r in chosen if -world <= r < world)


def csv_ranks(config: MonitorConfig, world: int) -> frozenset[int]:
    """The ranks that write CSV files. ``auto``: every rank in a job of up to :data:`TB_EVERY_RANK_UP_TO`
    ranks or without the statistics store (``tensorboard`` not an output: the CSV is the only record);
    above, the ranks that write TensorBoard events: every rank's statistics are in the store (CSV is ~30 KB a
    rank and step for ~300 tensors, twice what a 1024-rank job can afford to keep of everything)."""
    setting = config.csv_ranks
    world = max(1, world)
    if setting == "all" or (
        setting == "auto" and (world <= TB_EVERY_RANK_UP_TO or "tensorboard" not in config.format)
    ):
        return frozenset(range(world))
    if setting == "auto":
        return event_ranks(config, world, aggregates=True)
    return frozenset(r % world for r in setting if -world <= r < world)


def writes_all_ranks(config: MonitorConfig, world: int, aggregates: bool) -> bool:
    """Whether the job writes the all_ranks run: it can, TensorBoard is an output, and the world is above
    :data:`TB_EVERY_RANK_UP_TO` ranks or some rank's own events are left out."""
    if not aggregates or world < 2 or "tensorboard" not in config.format:
        return False
    return world > TB_EVERY_RANK_UP_TO or len(event_ranks(config, world, aggregates)) < world


def plan_sinks(
    config: MonitorConfig,
    run_dir: Path,
    rank: int,
    multi_chunk: bool,
    *,
    world: int,
    aggregates: bool = False,
    all_ranks_writer: bool = False,
) -> tuple[SinkSpec, ...]:
    """The format sinks of one rank, as data (:func:`format_sinks` opens them): TensorBoard events with the
    plugin's stat store, and/or msprobe-compatible CSV; the all_ranks run on ``all_ranks_writer`` (the one
    rank of the job that writes it)."""
    events_dir = str(rank_dir(run_dir, rank))
    ops = tuple(config.ops)
    view = config.tensorboard_tensors
    specs: list[SinkSpec] = []
    if "tensorboard" in config.format:
        if rank in event_ranks(config, world, aggregates):
            specs.append(SinkSpec("tensorboard", events_dir, ops, multi_chunk, rank=rank, tensors=view))
        if all_ranks_writer and writes_all_ranks(config, world, aggregates):
            folder = str(all_ranks_dir(run_dir))
            specs.append(SinkSpec("all_ranks", folder, ops, multi_chunk, rank=rank, tensors=view))
        specs.append(SinkSpec("statstore", str(run_dir), multi_chunk=multi_chunk, rank=rank))
    if "csv" in config.format and rank in csv_ranks(config, world):
        specs.append(SinkSpec("csv", events_dir, ops, rank=rank, ndigits=config.ndigits))
    return tuple(specs)


def format_sinks(
    config: MonitorConfig,
    run_dir: Path,
    rank: int,
    multi_chunk: bool,
    *,
    world: int,
    aggregates: bool = False,
    all_ranks_writer: bool = False,
) -> list[RecordSink]:
    """The sinks of :func:`plan_sinks`, opened here. When one cannot be opened, those opened before it are
    closed again and the error is raised."""
    plan = plan_sinks(
        config,
        run_dir,
        rank,
        multi_chunk,
        world=world,
        aggregates=aggregates,
        all_ranks_writer=all_ranks_writer,
    )
    return open_sinks(plan)


def writer_in_thread() -> bool:
    """``TRAINMON_WRITER=thread``: the format outputs are written by the writer thread, not a process."""
    setting = os.environ.get(WRITER_ENV, "").strip().lower()
    if setting not in ("", "process", "thread"):
        logger.warning(
            "trainmon: %s=%s is not 'process' or 'thread'; using a writer process", WRITER_ENV, setting
        )
    return setting == "thread"


def _describe(config: MonitorConfig) -> str:
    return describe_outputs(config.format, config.ops, config.ndigits, config.tensorboard_tensors)


class Outputs:
    """A rank's format sinks and, on rank 0, the run's manifest, as the config in force asks for them.

    They are written by a writer process (:mod:`trainmon.writer.process`): :meth:`open` starts it at attach,
    and the writer thread gets one sink that hands it every record. With ``TRAINMON_WRITER=thread``, or when
    the process cannot be started (said once), they are written by the writer thread itself: :meth:`open`
    returns them (and :attr:`manifest`, which the caller places among the writer's sinks). Should the writer
    process end unexpectedly, they are opened again in the writer thread (said once).

    After a config edit, :meth:`follow` runs on the writer thread (queued with :meth:`WriterThread.call`, so
    the steps before the edit are written as before), and the writer process follows in order with the steps
    too: the new files are opened before the old ones are closed, and when they cannot be opened (a run folder
    gone read-only, a full disk) the old ones go on and this is said once, so a failed edit never turns the
    monitor off.
    """

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        multi_chunk: bool,
        manifest_payload: Callable[[MonitorConfig], Mapping[str, Any]] | None,
        placement: Callable[[MonitorConfig], Mapping[str, Any]],
    ) -> None:
        self.run_dir, self.rank, self.multi_chunk = run_dir, rank, multi_chunk
        self._placement = placement  # a config -> the world / all_ranks arguments of format_sinks
        self._payload = manifest_payload  # None: this rank keeps no manifest
        self.sinks: list[RecordSink] = []  # the format sinks, when the writer thread writes them
        self.manifest: ManifestSink | None = None  # the manifest, when the writer thread writes it
        self.process: ProcessSink | None = None  # the writer process's sink, while it writes them
        self._writer: WriterThread | None = None

    def _plan(self, config: MonitorConfig) -> tuple[SinkSpec, ...]:
        return plan_sinks(config, self.run_dir, self.rank, self.multi_chunk, **self._placement(config))

    def open(self, config: MonitorConfig) -> list[RecordSink]:
        """The writer thread's sinks for ``config`` (attach, on the training thread): the writer process's
        sink, or the format sinks themselves; :attr:`manifest` too when the writer thread writes it, which the
        caller places among the writer's sinks. An ``OSError`` opening them (here or in the writer process)
        is raised."""
        plan = self._plan(config)
        payload = (
            dict(self._payload(config)) if self._payload is not None and writes_to_disk(config) else None
        )
        if (plan or payload is not None) and not writer_in_thread():
            try:
                session = open_session(
                    plan,
                    jsonable(payload) if payload is not None else None,
                    self.run_dir,
                    steps=self.rank if writes_to_disk(config) else None,
                )
            except CannotStart as e:
                logger.warning(
                    "trainmon: %sthe writer process could not be started (%s); the outputs are written from "
                    "the writer thread, which takes its time from the training loop (%s=thread: meant so)",
                    rank_note(),
                    e,
                    WRITER_ENV,
                )
            else:
                self.process = ProcessSink(session, self._fall_back)
                return [self.process]
        self.sinks = open_sinks(plan)
        if payload is not None:
            self.manifest = ManifestSink(self.run_dir, payload)
        return list(self.sinks)

    def step_log(self) -> RemoteStepLog | None:
        """The rank's step log in the writer process, after :meth:`open`; None when the writer thread writes
        it (the anomaly sink opens it there)."""
        sink = self.process
        if sink is None or sink.session.steps is None:
            return None
        return RemoteStepLog(sink.session)

    def bind(self, writer: WriterThread) -> WriterThread:
        """The writer thread these outputs feed (the writer process's sink hands them back to it when the
        process ends). Returns it."""
        self._writer = writer
        return writer

    @property
    def process_pid(self) -> int | None:
        """The writer process's id while it writes the outputs; None when the writer thread writes them."""
        sink = self.process
        return sink.session.pid if sink is not None else None

    def give_up(self) -> int | None:
        """close() did not finish in time (storage stalled): the writer process goes on alone with what it
        was handed, and a later attach starts a fresh one. Returns its id (None: the writer thread writes)."""
        sink = self.process  # the writer thread may be replacing it: read once
        if sink is None:
            return None
        sink.session.process.retired = True
        return sink.session.pid

    @property
    def unconfirmed(self) -> int:
        """Steps handed to the writer process since it last confirmed a flush."""
        sink = self.process
        found = sink.unconfirmed if sink is not None else None
        return found[2] if found is not None else 0

    def follow(self, writer: WriterThread, old: MonitorConfig, new: MonitorConfig) -> None:
        """Writer thread: after an edit from ``old`` to ``new``, the outputs ``new`` asks for."""
        formats = any(getattr(new, key) != getattr(old, key) for key in FORMAT_KEYS)
        if self.process is not None:
            plan = self._plan(new) if formats else None
            payload = None if self._payload is None else jsonable(dict(self._payload(new)))
            body = {
                "plan": None if plan is None else [spec.to_json() for spec in plan],
                "new": _describe(new),
                "old": _describe(old),
                "manifest": payload,
                "create_manifest": writes_to_disk(new),
            }
            session = self.process.session
            try:
                session.follow(body, plan)
            except WriterGone:
                self.process.lost()  # reopened in the writer thread: follow from there
            else:
                if payload is not None and (session.manifest is not None or writes_to_disk(new)):
                    session.manifest = payload
                return
        if formats:
            try:
                fresh = format_sinks(new, self.run_dir, self.rank, self.multi_chunk, **self._placement(new))
            except Exception as e:
                follow_failed(self.run_dir, _describe(new), _describe(old), e)
                return  # the manifest goes on describing what is written
            writer.replace(self.sinks, fresh)
            self.sinks = fresh
        if self._payload is None:
            return
        if self.manifest is not None:
            self.manifest.manifest.update(**self._payload(new))
        elif writes_to_disk(new):  # a run that kept everything in memory starts writing
            self.manifest = ManifestSink(self.run_dir, self._payload(new))
            writer.replace([], [self.manifest])

    def _fall_back(self, record: StepRecord | None, derived: Derived | None) -> None:
        """Writer thread: the writer process has ended; its outputs are opened here, in its place (and
        closed with the writer's other sinks, should that be why it was found gone)."""
        sink, self.process = self.process, None
        assert sink is not None
        session = sink.session
        sinks: list[RecordSink] = []
        try:
            self.sinks = open_sinks(session.plan)
            sinks = list(self.sinks)
            if session.manifest is not None:
                self.manifest = ManifestSink(self.run_dir, session.manifest, last_step=sink.last_step)
                sinks.append(self.manifest)
        except Exception:
            logger.exception(
                "trainmon: %sthe outputs cannot be opened in the writer thread either; this rank's "
                "statistics are not written from now on (NaN/Inf detection, anomaly records and alerts go "
                "on)",
                rank_note(),
            )
        writer = self._writer
        if writer is not None:
            writer.replace([sink], sinks)
            if record is not None and derived is not None:
                writer.errors.write(sinks, record, derived)


_WHAT_TO_DO = {
    errno.ENOSPC: "free space on its disk (df -h shows how much is left)",
    errno.EDQUOT: "free space within your disk quota",
    errno.EROFS: "its file system is mounted read-only: remount it read-write",
    errno.EACCES: "make it writable for this user",
    errno.EPERM: "make it writable for this user",
}


def unwritable_run_dir(run_dir: Path, error: OSError) -> OSError:
    """The error ``attach`` raises when the run folder cannot be written: which file, why, and what to do
    (the same ``OSError`` subclass and errno, so handlers of the original keep working)."""
    where = f" ({error.filename})" if error.filename else ""
    todo = _WHAT_TO_DO.get(error.errno or 0, "check that it can be written")
    message = (
        f"trainmon.attach: cannot write the run folder {run_dir}: {error.strerror or error}{where}. To go "
        f"on, {todo}, or pass logdir= naming a folder on another disk (format: api writes no files at all)"
    )
    return type(error)(error.errno, message)

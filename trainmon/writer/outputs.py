"""The sinks that ``config.format`` asks for, built the same way for every framework's monitor, and how a
config edit replaces them while the run goes on."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainmon.config import MonitorConfig
from trainmon.run.layout import all_ranks_dir, rank_dir
from trainmon.writer.csv import CsvSink
from trainmon.writer.manifest import ManifestSink
from trainmon.writer.statstore import StatStoreSink
from trainmon.writer.tensorboard import AllRanksSink, TensorBoardSink
from trainmon.writer.thread import RecordSink, WriterThread

logger = logging.getLogger("trainmon")

# the config keys that decide which files a rank writes, and how
FORMAT_KEYS = ("format", "ops", "ndigits", "tensorboard_ranks", "csv_ranks")

# Above this many ranks, ``tensorboard_ranks: auto`` writes the events of rank 0 and the last rank only, plus
# the all_ranks run: TensorBoard keeps every series of every run in memory (~45 MB per rank at 200 steps of
# ~300 tensors), so a run per rank stops loading at a few hundred ranks.
TB_EVERY_RANK_UP_TO = 16


def writes_to_disk(config: MonitorConfig) -> bool:
    """Whether the run has a directory of its own (anomalies, manifest); "api" alone keeps it in memory."""
    return "tensorboard" in config.format or "csv" in config.format


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
    """TensorBoard events with the plugin's stat store, and/or msprobe-compatible CSV, for one rank; the
    all_ranks run on ``all_ranks_writer`` (the one rank of the job that writes it). When one cannot be
    opened, those opened before it are closed again and the error is raised."""
    events_dir = rank_dir(run_dir, rank)
    sinks: list[RecordSink] = []
    try:
        if "tensorboard" in config.format:
            if rank in event_ranks(config, world, aggregates):
                sinks.append(TensorBoardSink(events_dir, config.ops, multi_chunk=multi_chunk))
            if all_ranks_writer and writes_all_ranks(config, world, aggregates):
                sinks.append(AllRanksSink(all_ranks_dir(run_dir), config.ops, multi_chunk=multi_chunk))
            sinks.append(StatStoreSink(run_dir, rank, multi_chunk=multi_chunk))
        if "csv" in config.format and rank in csv_ranks(config, world):
            sinks.append(CsvSink(events_dir, config.ops, config.ndigits))
    except BaseException:
        for sink in sinks:
            try:
                sink.close()
            except Exception:  # the first error is the one worth reporting
                logger.debug("trainmon: closing a half-opened output failed", exc_info=True)
        raise
    return sinks


class Outputs:
    """A rank's format sinks and, on rank 0, the run's manifest, as the config in force asks for them.

    :meth:`open` builds them at attach. After a config edit, :meth:`follow` runs on the writer thread (queued
    with :meth:`WriterThread.call`, so the steps before the edit are written as before): it opens the new
    files before it closes the old ones, and when they cannot be opened (a run folder gone read-only, a full
    disk) it keeps writing with the old ones and says so once, so a failed edit never turns the monitor off.
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
        self.sinks: list[RecordSink] = []
        self.manifest: ManifestSink | None = None

    def open(self, config: MonitorConfig) -> list[RecordSink]:
        """The format sinks for ``config`` (attach, on the training thread); :attr:`manifest` too, which the
        caller places among the writer's sinks."""
        placed = self._placement(config)
        self.sinks = format_sinks(config, self.run_dir, self.rank, self.multi_chunk, **placed)
        if self._payload is not None and writes_to_disk(config):
            self.manifest = ManifestSink(self.run_dir, self._payload(config))
        return list(self.sinks)

    def follow(self, writer: WriterThread, old: MonitorConfig, new: MonitorConfig) -> None:
        """Writer thread: after an edit from ``old`` to ``new``, the outputs ``new`` asks for."""
        if any(getattr(new, key) != getattr(old, key) for key in FORMAT_KEYS):
            try:
                fresh = format_sinks(new, self.run_dir, self.rank, self.multi_chunk, **self._placement(new))
            except Exception as e:
                logger.warning(
                    "trainmon: the outputs of the edited config (format %s, ops %s, ndigits %s) cannot be "
                    "opened in %s (%s); writing on with the previous ones (format %s, ops %s, ndigits %s)",
                    ",".join(new.format), ",".join(new.ops), new.ndigits, self.run_dir, e,
                    ",".join(old.format), ",".join(old.ops), old.ndigits,
                )  # fmt: skip
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

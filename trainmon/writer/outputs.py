"""The sinks that ``config.format`` asks for, built the same way for every framework's monitor, and how a
config edit replaces them while the run goes on."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainmon.config import MonitorConfig
from trainmon.run.layout import rank_dir
from trainmon.writer.csv import CsvSink
from trainmon.writer.manifest import ManifestSink
from trainmon.writer.statstore import StatStoreSink
from trainmon.writer.tensorboard import TensorBoardSink
from trainmon.writer.thread import RecordSink, WriterThread

logger = logging.getLogger("trainmon")

# the config keys that decide which files a rank writes, and how
FORMAT_KEYS = ("format", "ops", "ndigits")


def writes_to_disk(config: MonitorConfig) -> bool:
    """Whether the run has a directory of its own (anomalies, manifest); "api" alone keeps it in memory."""
    return "tensorboard" in config.format or "csv" in config.format


def format_sinks(config: MonitorConfig, run_dir: Path, rank: int, multi_chunk: bool) -> list[RecordSink]:
    """TensorBoard events with the plugin's stat store, and/or msprobe-compatible CSV, for one rank. When
    one cannot be opened, those opened before it are closed again and the error is raised."""
    events_dir = rank_dir(run_dir, rank)
    sinks: list[RecordSink] = []
    try:
        if "tensorboard" in config.format:
            sinks.append(TensorBoardSink(events_dir, config.ops, multi_chunk=multi_chunk))
            sinks.append(StatStoreSink(run_dir, rank, multi_chunk=multi_chunk))
        if "csv" in config.format:
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
    ) -> None:
        self.run_dir, self.rank, self.multi_chunk = run_dir, rank, multi_chunk
        self._payload = manifest_payload  # None: this rank keeps no manifest
        self.sinks: list[RecordSink] = []
        self.manifest: ManifestSink | None = None

    def open(self, config: MonitorConfig) -> list[RecordSink]:
        """The format sinks for ``config`` (attach, on the training thread); :attr:`manifest` too, which the
        caller places among the writer's sinks."""
        self.sinks = format_sinks(config, self.run_dir, self.rank, self.multi_chunk)
        if self._payload is not None and writes_to_disk(config):
            self.manifest = ManifestSink(self.run_dir, self._payload(config))
        return list(self.sinks)

    def follow(self, writer: WriterThread, old: MonitorConfig, new: MonitorConfig) -> None:
        """Writer thread: after an edit from ``old`` to ``new``, the outputs ``new`` asks for."""
        if any(getattr(new, key) != getattr(old, key) for key in FORMAT_KEYS):
            try:
                fresh = format_sinks(new, self.run_dir, self.rank, self.multi_chunk)
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

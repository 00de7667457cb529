"""The sinks that ``config.format`` asks for, built the same way for every framework's monitor."""

from __future__ import annotations

import errno
from pathlib import Path

from trainmon.config import MonitorConfig
from trainmon.run.layout import rank_dir
from trainmon.writer.csv import CsvSink
from trainmon.writer.statstore import StatStoreSink
from trainmon.writer.tensorboard import TensorBoardSink
from trainmon.writer.thread import RecordSink


def writes_to_disk(config: MonitorConfig) -> bool:
    """Whether the run has a directory of its own (anomalies, manifest); "api" alone keeps it in memory."""
    return "tensorboard" in config.format or "csv" in config.format


def format_sinks(config: MonitorConfig, run_dir: Path, rank: int, multi_chunk: bool) -> list[RecordSink]:
    """TensorBoard events with the plugin's stat store, and/or msprobe-compatible CSV, for one rank."""
    events_dir = rank_dir(run_dir, rank)
    sinks: list[RecordSink] = []
    if "tensorboard" in config.format:
        sinks.append(TensorBoardSink(events_dir, config.ops, multi_chunk=multi_chunk))
        sinks.append(StatStoreSink(run_dir, rank, multi_chunk=multi_chunk))
    if "csv" in config.format:
        sinks.append(CsvSink(events_dir, config.ops, config.ndigits))
    return sinks


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

"""The sinks that ``config.format`` asks for, built the same way for every framework's monitor."""

from __future__ import annotations

from pathlib import Path

from trainmon.config import MonitorConfig
from trainmon.run.layout import all_ranks_dir, rank_dir
from trainmon.writer.csv import CsvSink
from trainmon.writer.statstore import StatStoreSink
from trainmon.writer.tensorboard import AllRanksSink, TensorBoardSink
from trainmon.writer.thread import RecordSink

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
    all_ranks run on ``all_ranks_writer`` (the one rank of the job that writes it)."""
    events_dir = rank_dir(run_dir, rank)
    sinks: list[RecordSink] = []
    if "tensorboard" in config.format:
        if rank in event_ranks(config, world, aggregates):
            sinks.append(TensorBoardSink(events_dir, config.ops, multi_chunk=multi_chunk))
        if all_ranks_writer and writes_all_ranks(config, world, aggregates):
            sinks.append(AllRanksSink(all_ranks_dir(run_dir), config.ops, multi_chunk=multi_chunk))
        sinks.append(StatStoreSink(run_dir, rank, multi_chunk=multi_chunk))
    if "csv" in config.format and rank in csv_ranks(config, world):
        sinks.append(CsvSink(events_dir, config.ops, config.ndigits))
    return sinks

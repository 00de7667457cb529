"""Every path under a run directory, spelled once.

::

    RUN/rank_<r>/                                     TensorBoard events and CSV of rank r
    RUN/all_ranks/                                    TensorBoard events of every rank's tensors merged
    RUN/plugins/trainmon/manifest.json                the run: schema version, world size, config, names
    RUN/plugins/trainmon/stats/rank=<r>/              the statistics store of rank r (a columnar table)
    RUN/plugins/trainmon/anomalies/rank=<r>/          anomaly records of rank r (a columnar table)
    RUN/plugins/trainmon/steps/rank=<r>/              one row per collected step of rank r (a columnar table)
    RUN/plugins/trainmon/timing/rank=<r>/             one row per timed step of rank r: its step's parts
    RUN/plugins/trainmon/rank_times/                  one row per timed step: every rank's times
    RUN/plugins/trainmon/summary/rank_<r>.json        rank r's summary: first anomalies, counts, last step
    RUN/plugins/trainmon/dumps/rank_<r>.jsonl         index of rank r's tensor dumps
    RUN/plugins/trainmon/dumps/step_<s>/rank_<r>/     the dump files of one step and rank
    RUN/plugins/trainmon/requests.jsonl               on-demand dump requests, polled by the job
    RUN/plugins/trainmon/gradprobe/rank_<r>.{bin,index.jsonl}  gradient fingerprints (grad_probe)

A columnar table is a hive-partitioned dataset (``rank=<r>`` folders): in each, the Parquet segments sealed
so far, ``part-<seq>-<lo>-<hi>.parquet`` (steps ``lo..hi``), and the Arrow IPC stream being written,
``_open-<seq>-<lo>.arrows`` (:mod:`trainmon.run.columnar`; names starting with ``_`` are skipped by DuckDB,
pandas, Polars and Spark).

The old layout (before the columnar tables) is still read, and ``trainmon migrate RUN`` converts it::

    RUN/plugins/trainmon/stats/rank_<r>.{names.jsonl,bin}      the statistics store as fixed-width records
    RUN/plugins/trainmon/anomalies/rank_<r>.jsonl     anomaly records as JSON lines

A folder is a run when it holds ``plugins/trainmon/``. Writers, readers, the CLI and the TensorBoard plugin
all take these paths from here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

Run = str | os.PathLike[str]

# Relative to the run directory: what marks a folder as a trainmon run.
PLUGIN_DIR = Path("plugins", "trainmon")
MANIFEST_NAME = "manifest.json"
# ``rank_<r>.jsonl``: the per-rank files of the anomaly and dump-index folders
RANK_JSONL = re.compile(r"^rank_(\d+)\.jsonl$")
# ``rank_<r>.bin``: the per-rank record files of the old statistics store
RANK_BIN = re.compile(r"^rank_(\d+)\.bin$")
# ``rank=<r>``: the per-rank partition folders of a columnar table
RANK_PARTITION = re.compile(r"^rank=(\d+)$")
# ``rank_<r>.json``: the per-rank summaries
RANK_JSON = re.compile(r"^rank_(\d+)\.json$")
# the files of a columnar table's partition: sealed Parquet segments and the Arrow IPC stream being written
SEGMENT_FILE = re.compile(r"^part-(\d+)-(-?\d+)-(-?\d+)\.parquet$")
STREAM_FILE = re.compile(r"^_open-(\d+)-(-?\d+)\.arrows$")
SEALING_SUFFIX = ".parquet.tmp"  # a segment being sealed: ``_seal-<seq>.parquet.tmp``, read by nobody


def rank_dir(run: Run, rank: int) -> Path:
    """Where one rank's TensorBoard events and CSV files go: ``RUN/rank_<r>``."""
    return Path(run) / f"rank_{int(rank)}"


ALL_RANKS_RUN = "all_ranks"


def all_ranks_dir(run: Run) -> Path:
    """The TensorBoard run of cross-rank aggregates (``RUN/all_ranks``), written by one rank of the job."""
    return Path(run) / ALL_RANKS_RUN


def plugin_dir(run: Run) -> Path:
    return Path(run) / PLUGIN_DIR


def is_run(path: Run) -> bool:
    """Whether ``path`` is a run directory (it holds ``plugins/trainmon/``)."""
    return plugin_dir(path).is_dir()


def manifest_path(run: Run) -> Path:
    return plugin_dir(run) / MANIFEST_NAME


def manifest_lock_path(run: Run) -> Path:
    """The advisory lock serialising the ranks' rewrites of the manifest."""
    return plugin_dir(run) / "manifest.lock"


def stats_dir(run: Run) -> Path:
    return plugin_dir(run) / "stats"


def partition_dir(table_dir: Path, rank: int) -> Path:
    """One rank's folder of a columnar table: ``TABLE/rank=<r>``."""
    return table_dir / f"rank={int(rank)}"


def segment_name(seq: int, lo: int, hi: int) -> str:
    """A sealed Parquet segment holding steps ``lo..hi``; ``seq`` orders a rank's segments as written."""
    return f"part-{int(seq):05d}-{int(lo)}-{int(hi)}.parquet"


def stream_name(seq: int, lo: int) -> str:
    """The Arrow IPC stream of the segment being written, from step ``lo`` on."""
    return f"_open-{int(seq):05d}-{int(lo)}.arrows"


def sealing_name(seq: int) -> str:
    """Where a segment is written before it is renamed into place."""
    return f"_seal-{int(seq):05d}{SEALING_SUFFIX}"


def stats_rank_dir(run: Run, rank: int) -> Path:
    """Rank r's partition of the statistics store: ``stats/rank=<r>``."""
    return partition_dir(stats_dir(run), rank)


def stats_names_file(run: Run, rank: int) -> Path:
    """The old store's names of rank r (``stats/rank_<r>.names.jsonl``), read for runs written before the
    columnar store."""
    return stats_dir(run) / f"rank_{int(rank)}.names.jsonl"


def stats_records_file(run: Run, rank: int) -> Path:
    """The old store's records of rank r (``stats/rank_<r>.bin``)."""
    return stats_dir(run) / f"rank_{int(rank)}.bin"


def anomalies_dir(run: Run) -> Path:
    return plugin_dir(run) / "anomalies"


def anomalies_rank_dir(run: Run, rank: int) -> Path:
    """Rank r's partition of the anomaly records: ``anomalies/rank=<r>``."""
    return partition_dir(anomalies_dir(run), rank)


def anomalies_file(run: Run, rank: int) -> Path:
    """The old layout's anomaly records of rank r (``anomalies/rank_<r>.jsonl``), read for runs written
    before the columnar tables."""
    return anomalies_dir(run) / f"rank_{int(rank)}.jsonl"


def steps_dir(run: Run) -> Path:
    """The per-step table: one row per collected step and rank (``steps/rank=<r>``)."""
    return plugin_dir(run) / "steps"


def steps_rank_dir(run: Run, rank: int) -> Path:
    return partition_dir(steps_dir(run), rank)


def timing_dir(run: Run) -> Path:
    """The per-rank timing table: one row per timed step and rank (``timing/rank=<r>``,
    trainmon.run.timetable)."""
    return plugin_dir(run) / "timing"


def timing_rank_dir(run: Run, rank: int) -> Path:
    return partition_dir(timing_dir(run), rank)


def rank_times_dir(run: Run) -> Path:
    """Every rank's times, one row per timed step, written by one rank of the job (``rank_times/``)."""
    return plugin_dir(run) / "rank_times"


def summary_dir(run: Run) -> Path:
    return plugin_dir(run) / "summary"


def summary_file(run: Run, rank: int) -> Path:
    """Rank r's summary, rewritten atomically at each step end: ``summary/rank_<r>.json``."""
    return summary_dir(run) / f"rank_{int(rank)}.json"


def dumps_dir(run: Run) -> Path:
    return plugin_dir(run) / "dumps"


def dump_index_file(run: Run, rank: int) -> Path:
    return dumps_dir(run) / f"rank_{int(rank)}.jsonl"


def step_dumps_dir(run: Run, step: int, rank: int) -> Path:
    """The folder of one step's dumps on one rank."""
    return dumps_dir(run) / f"step_{int(step)}" / f"rank_{int(rank)}"


def requests_file(run: Run) -> Path:
    return plugin_dir(run) / "requests.jsonl"


def probe_dir(run: Run) -> Path:
    return plugin_dir(run) / "gradprobe"


def probe_bin_file(run: Run, rank: int) -> Path:
    return probe_dir(run) / f"rank_{int(rank)}.bin"


def probe_index_file(run: Run, rank: int) -> Path:
    return probe_dir(run) / f"rank_{int(rank)}.index.jsonl"


def rank_files(directory: Path, pattern: re.Pattern[str] = RANK_JSONL) -> list[tuple[int, Path]]:
    """``(rank, path)`` of the per-rank files in ``directory`` whose names match ``pattern``, by rank."""
    return _rank_entries(directory, pattern, want_dir=False)


def rank_partitions(table_dir: Path) -> list[tuple[int, Path]]:
    """``(rank, folder)`` of the ``rank=<r>`` partitions of a columnar table, by rank."""
    return _rank_entries(table_dir, RANK_PARTITION, want_dir=True)


def _rank_entries(directory: Path, pattern: re.Pattern[str], want_dir: bool) -> list[tuple[int, Path]]:
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        m = pattern.match(entry.name)
        if m and (entry.is_dir() if want_dir else entry.is_file()):
            found.append((int(m.group(1)), Path(entry.path)))
    return sorted(found)

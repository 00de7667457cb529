"""Every path under a run directory, spelled once.

::

    RUN/rank_<r>/                                     TensorBoard events and CSV of rank r
    RUN/all_ranks/                                    TensorBoard events of every rank's tensors merged
    RUN/plugins/trainmon/manifest.json                the run: schema version, world size, config, names
    RUN/plugins/trainmon/stats/rank_<r>.{names.jsonl,bin}      the statistics store (plugin heatmaps)
    RUN/plugins/trainmon/anomalies/rank_<r>.jsonl     anomaly records
    RUN/plugins/trainmon/dumps/rank_<r>.jsonl         index of rank r's tensor dumps
    RUN/plugins/trainmon/dumps/step_<s>/rank_<r>/     the dump files of one step and rank
    RUN/plugins/trainmon/requests.jsonl               on-demand dump requests, polled by the job
    RUN/plugins/trainmon/gradprobe/rank_<r>.{bin,index.jsonl}  gradient fingerprints (grad_probe)

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
# ``rank_<r>.bin``: the per-rank record files of the statistics store
RANK_BIN = re.compile(r"^rank_(\d+)\.bin$")


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


def stats_names_file(run: Run, rank: int) -> Path:
    return stats_dir(run) / f"rank_{int(rank)}.names.jsonl"


def stats_records_file(run: Run, rank: int) -> Path:
    return stats_dir(run) / f"rank_{int(rank)}.bin"


def anomalies_dir(run: Run) -> Path:
    return plugin_dir(run) / "anomalies"


def anomalies_file(run: Run, rank: int) -> Path:
    return anomalies_dir(run) / f"rank_{int(rank)}.jsonl"


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
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        m = pattern.match(entry.name)
        if m and entry.is_file():
            found.append((int(m.group(1)), Path(entry.path)))
    return sorted(found)

"""The default run directory and a rank's directory in it, shared by the PyTorch and the MindSpore
monitors (no framework import)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def default_run_dir() -> Path:
    """``runs/<date>-<time>``, under ``$MONITOR_OUTPUT_DIR`` when set (as msprobe users expect)."""
    root = Path(os.environ.get("MONITOR_OUTPUT_DIR", "runs"))
    return root / time.strftime("%Y%m%d-%H%M%S")


def rank_dir(run_dir: Path, rank: int) -> Path:
    """Where one rank's TensorBoard events and CSV files go: ``<run>/rank_<r>``."""
    return Path(run_dir) / f"rank_{int(rank)}"

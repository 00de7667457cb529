"""What the commands that read a run say of its damaged files (:mod:`trainmon.run.damage`): one warning line
per file, after the answer, naming the file and why it could not be read; the answer is of the rest of the
run."""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

from trainmon.run.damage import damaged


def warn_damaged(*runs: str | os.PathLike[str], out: TextIO | None = None) -> list[dict[str, Any]]:
    """Print a warning line for each damaged file noted under ``runs`` (each once); return them as
    ``{"path", "why"}`` for a JSON answer."""
    out = sys.stderr if out is None else out
    found: dict[str, str] = {}
    for run in runs:
        for d in damaged(run):
            found.setdefault(str(d.path), d.why)
    for path, why in found.items():
        line = f"trainmon: warning: damaged file {path}: {why.rstrip('.')}"
        print(f"{line}; the rest of the run was read without it", file=out)
    return [{"path": path, "why": why} for path, why in found.items()]

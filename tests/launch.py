"""Launching multi-process test workers: a free loopback port, and a worker script run in a subprocess (so
distributed global state never leaks into pytest, and a hung collective ends with the subprocess timeout)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker_script(source: str, tmp_path: Path, timeout: float = 170) -> None:
    """Write ``source`` to a script and run it as ``script PORT TMP_PATH``; fails on a non-zero exit."""
    script = tmp_path / "worker.py"
    script.write_text(source)
    subprocess.run(
        [sys.executable, str(script), str(free_port()), str(tmp_path)], check=True, timeout=timeout
    )

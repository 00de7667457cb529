"""Launching multi-process test workers: a free loopback port, and a worker script run in a subprocess (so
distributed global state never leaks into pytest, and a hung collective ends with the subprocess timeout)."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
from pathlib import Path


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port nobody listens on, picked at random below the kernel's ephemeral range: a port the
    kernel hands out (bind to 0) is where connecting sockets take theirs too, so under a loaded parallel
    suite another test's connection could take it before the worker's store binds it (EADDRINUSE)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(20000, low) if low > 21000 else rng.randrange(1024, 65535)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker_script(source: str, tmp_path: Path, *args: str, timeout: float = 170) -> None:
    """Write ``source`` to a script and run it as ``script PORT TMP_PATH ARGS...``; fails on a non-zero
    exit."""
    script = tmp_path / "worker.py"
    script.write_text(source)
    subprocess.run(
        [sys.executable, str(script), str(free_port()), str(tmp_path), *args], check=True, timeout=timeout
    )


def run_ranks(
    argv: list[str], world: int, timeout: float = 240, env: dict[str, str] | None = None
) -> list[str]:
    """Run ``argv`` as ``world`` processes on this host (``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` set in
    each one's environment, over ``env``), wait for all of them, and return their output; fails, naming the
    rank and showing the end of its output, when one exits non-zero. Every process is killed on the way out,
    so a hung collective ends here."""
    import os

    base = {**os.environ, **(env or {}), "WORLD_SIZE": str(world)}
    procs = [
        subprocess.Popen(
            argv,
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            proc.kill()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} of {argv[1:]} failed:\n{logs[rank][-6000:]}"
    return logs

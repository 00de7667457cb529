"""A real ``tensorboard`` subprocess on 127.0.0.1 for tests (port chosen by the OS, read from stderr)."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path


def get_json(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode("utf-8"))


@contextlib.contextmanager
def tensorboard_server(
    logdir: Path, tmp_path: Path, load_fast: str, extra_args: Sequence[str] = ()
) -> Iterator[str]:
    """A real ``tensorboard`` on 127.0.0.1 with an OS-chosen port; yields its base URL."""
    err_path = tmp_path / f"tb-{load_fast}.err"
    with open(err_path, "wb") as err, open(tmp_path / f"tb-{load_fast}.out", "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tensorboard.main",
                "--logdir",
                str(logdir),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                f"--load_fast={load_fast}",
                *extra_args,
            ],
            stdout=out,
            stderr=err,
        )
    try:
        deadline = time.monotonic() + 60
        port = None
        while port is None:
            assert proc.poll() is None, err_path.read_text(errors="replace")
            assert time.monotonic() < deadline, "no port in TensorBoard's stderr:\n" + err_path.read_text()
            m = re.search(
                r"TensorBoard .* at http://127\.0\.0\.1:(\d+)/", err_path.read_text(errors="replace")
            )
            if m:
                port = int(m.group(1))
            else:
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

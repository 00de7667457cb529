"""Two MindSpore processes (msrun, CPU collectives over loopback), data parallel: each rank writes its own
``rank_<r>`` outputs with the world size in the manifest; the averaged gradients are the same on both
ranks, the activations are not; a NaN injected in a Cell on rank 1 is named by ``trainmon analyze``
across ranks as the origin."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import NAN_STEP

from trainmon.cli import main
from trainmon.run.manifest import read_manifest
from trainmon.run.records import STATS
from trainmon.run.statstore import read_stats

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_two_ranks_write_their_own_outputs_and_analyze_finds_the_origin(tmp_path, capsys):
    run = tmp_path / "run"
    bindir = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    cmd = [
        shutil.which("msrun", path=bindir) or "msrun",
        "--worker_num=2",
        "--local_worker_num=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        f"--log_dir={tmp_path / 'logs'}",
        "--join=True",
        str(HERE / "dist_worker.py"),
        str(run),
    ]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    logs = "".join(p.read_text(errors="replace")[-3000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:] + logs
    for rank in (0, 1):
        assert json.loads((run / f"identity_rank{rank}.json").read_text()) == {"rank": rank, "world": 2}
        assert (run / f"rank_{rank}").is_dir()
    manifest = read_manifest(run)
    assert manifest["world_size"] == 2 and manifest["framework"] == "mindspore"

    step0 = {}
    for rank in (0, 1):
        frame = read_stats(run, rank, STATS, step_lo=0, step_hi=0)
        step0[rank] = {
            f"{kind}/{name}": np.array([frame.values[stat][0, j] for stat in STATS])
            for j, (kind, name) in enumerate(frame.tensors)
        }
    # the reduced gradients are averaged: identical on both ranks; activations come from each rank's data
    grads = [k for k in step0[0] if k.startswith("grad_reduced/")]
    assert grads and all(np.array_equal(step0[0][k], step0[1][k]) for k in grads)
    assert not np.array_equal(step0[0]["actv/fc1.input"], step0[1]["actv/fc1.input"])

    assert main(["analyze", str(run), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)["first"]
    assert (first["rank"], first["step"], first["name"], first["origin"]) == (1, NAN_STEP, "bad.output", True)

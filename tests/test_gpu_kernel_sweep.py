"""bench/gpu_kernel_sweep.py, which times the statistics kernels' tilings on a GPU, runs end to end on the CPU
under Triton's interpreter (its timings mean nothing there; its sizes and its check of the statistics do)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_sweep_reads_the_yardsticks_parameter_sizes():
    """Its tensors are the GPU yardstick's parameters, one for one, and one layer's activations; scaled down
    for a dry run, none is empty."""
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_kernel_sweep

    params, activations = gpu_kernel_sweep.yardstick_numels(1.0)
    assert len(params) == 197 and sum(params) == 269_699_072  # 16 layers, d=1024, vocab 32768, seq 1024
    assert sum(activations) == 8 * 1024 * 1024 * (6 + 3 + 4 + 4)
    small, _ = gpu_kernel_sweep.yardstick_numels(1e-6)
    assert min(small) == 1 and max(small) == 33 and len(small) == 197


@pytest.mark.timeout(240)
def test_the_sweep_runs_on_the_cpu_and_every_tiling_gives_the_same_statistics(tmp_path):
    out = tmp_path / "sweep.json"
    argv = [sys.executable, str(REPO / "bench" / "gpu_kernel_sweep.py"), "--device", "cpu", "--scale", "2e-5"]
    argv += ["--repeat", "1", "--tilings", "256,1024,4", "512,2048,8", "--json", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=220, cwd=REPO, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    tilings = [(r["block"], r["chunk"], r["warps"]) for r in result["tilings"]]
    assert tilings == [(256, 1024, 4), (512, 2048, 8)]
    assert all(r["same_statistics"] for r in result["tilings"])
    assert all(r["table_ms"] > 0 and r["batch_ms"] > 0 for r in result["tilings"])
    assert result["read_bytes"] == 4 * sum(max(1, int(n * 2e-5)) for n in _params())
    assert "| 512 | 2048 | 8 |" in done.stdout


def test_a_chunk_that_is_not_a_multiple_of_the_block_is_refused():
    argv = [sys.executable, str(REPO / "bench" / "gpu_kernel_sweep.py"), "--tilings", "512,1000,4"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2 and "512,1000,4: the chunk must be a multiple of the block" in done.stderr


def _params() -> list[int]:
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_kernel_sweep

    return gpu_kernel_sweep.yardstick_numels(1.0)[0]

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
    argv += ["--layers", "2", "--repeat", "1", "--tilings", "256,1024,4", "512,2048,8,fast2"]
    argv += ["--json", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=220, cwd=REPO, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    tilings = [(r["kernel"], r["block"], r["chunk"], r["warps"], r["unroll"]) for r in result["tilings"]]
    assert tilings == [("base", 256, 1024, 4, 1), ("fast", 512, 2048, 8, 2)]
    assert all(r["same_statistics"] for r in result["tilings"])
    assert all(r[f"{k}_ms"] > 0 for r in result["tilings"] for k in ("table", "batch", "adam"))
    params = _params(layers=2)
    assert result["read_bytes"] == 4 * sum(max(1, int(n * 2e-5)) for n in params)
    assert result["adam_bytes"] == 2 * result["read_bytes"]  # both moments of every parameter
    assert "| fast | 512 | 2048 | 8 | 2 |" in done.stdout
    assert result["choice"]["tiling"] in ("256,1024,4", "512,2048,8,fast2")
    assert f"choice for cpu: {result['choice']['tiling']}" in done.stdout


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("512,1000,4", "512,1000,4: the chunk must be a multiple of the block"),
        ("512,1024,4,fast3", "512,1024,4,fast3: the fourth part is fast1, fast2 or fast4"),
    ],
)
def test_a_tiling_the_kernels_cannot_take_is_refused(spec, said):
    argv = [sys.executable, str(REPO / "bench" / "gpu_kernel_sweep.py"), "--tilings", spec]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2 and said in done.stderr


def _params(layers: int = 16) -> list[int]:
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_kernel_sweep

    return gpu_kernel_sweep.yardstick_numels(1.0, layers)[0]

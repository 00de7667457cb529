"""bench/gpu_check.sh, the one command that takes every GPU figure, runs end to end on the CPU before a GPU
is at hand: ``--tiny`` runs the same steps under Triton's interpreter on a one-layer model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_gpu_check_dry_run_on_the_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRAINMON_STATS_BACKEND")}
    env["PYTHON"] = sys.executable
    out = tmp_path / "check.json"
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), "--tiny", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = done.stdout
    table = text[text.index("trainmon GPU check -- CPU DRY RUN") :]
    assert "statistics backend: bf16=triton fp32=triton" in table  # the kernels ran, interpreted
    assert "tests/test_cuda.py: 6 skipped" in table
    # the launches of one collected step on the one-layer GPT: 50 single tensors, 4 tables, Adam, stage 2
    assert "Triton 56 (adam_table 1, finalize 1, stats_one 50, stats_table 4)" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| mode")]
    assert [row.split(" | ")[0] for row in rows] == [
        "| off",
        "| full (xy + wg + mv + param)",
        "| wg + mv",
        "| full, step_interval: 10",
        "| full + capture: exact + on_nan: skip",
    ]
    assert rows[0].split(" | ")[2:4] == ["1.000", "1.000"]  # off against itself
    result = json.loads(out.read_text())
    assert result["tiny"] and result["environment"]["triton_unavailable"] is None
    modes = result["overhead"]["modes"]
    assert set(modes) == {"off", "full", "wgmv", "full_interval10", "full_exact_skip"}
    assert all(m["peak_mib"] > 0 and m["ratio_median"] > 0 for m in modes.values())

"""bench/gpu_profile.py, which splits a collected step into host and device time on a GPU, runs end to end on
the CPU (no device to profile there: the host's part and the hot functions only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_gpu_profile_splits_a_step_on_the_cpu(tmp_path):
    out = tmp_path / "profile.json"
    shape = ["--device", "cpu", "--layers", "1", "--d", "32", "--heads", "2", "--seq", "16", "--vocab", "64"]
    argv = [sys.executable, str(REPO / "bench" / "gpu_profile.py"), "--modes", "off", "full", *shape]
    argv += ["--batch", "2", "--steps", "3", "--warmup", "2", "--cprofile", "2", "--top", "40"]
    argv += ["--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=220, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = {r["mode"]: r for r in json.loads(out.read_text())}
    assert list(results) == ["off", "full"]
    for r in results.values():
        assert len(r["host_ms_all"]) == len(r["step_ms_all"]) == 3
        # on the CPU nothing runs after the step returns: issuing it is all of it
        assert all(0 < h <= s for h, s in zip(r["host_ms_all"], r["step_ms_all"], strict=True))
        assert r["device"] is None
    hot = [h["function"] for h in results["full"]["hot"]]
    assert any(f.startswith("trainmon/") for f in hot), hot  # the monitor's own functions, named by path
    assert not any(f.startswith("trainmon/") for f in (h["function"] for h in results["off"]["hot"]))
    assert "| off |" in done.stdout and "| full |" in done.stdout


def test_kernel_summary_tells_the_monitors_kernels_apart():
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_profile

    kernels = [("stats_batch", 300.0), ("nvjet_sm90_tst_256x128", 500.0), ("stats_batch", 100.0)]
    kernels += [("finalize", 20.0), ("void at::native::vectorized_elementwise_kernel", 80.0)]
    summary = gpu_profile.kernel_summary(kernels, top=2)
    assert summary["kernels"] == 5 and summary["busy_ms"] == pytest.approx(1.0)
    assert summary["monitor_kernels"] == 3 and summary["monitor_ms"] == pytest.approx(0.42)
    assert [(k["name"], k["calls"], k["monitor"]) for k in summary["top"]] == [
        ("nvjet_sm90_tst_256x128", 1, False),
        ("stats_batch", 2, True),
    ]

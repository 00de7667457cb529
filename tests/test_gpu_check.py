"""bench/gpu_check.sh, the one command that takes every GPU figure, runs end to end on the CPU before a GPU
is at hand: ``--tiny`` runs the same steps under Triton's interpreter on a one-layer model. Its figures are
checked against the per-step times it keeps (``--json``), and the schedule against the steps the monitor
wrote; the summary's arithmetic and the collector watch are checked on fixed inputs."""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import gpu_overhead  # noqa: E402 - bench/ is not a package
import gpu_stacks  # noqa: E402

TRAINMON_MODES = ["off", "full", "wgmv", "full_interval10", "full_exact_skip"]
ISSUE_HEADER = "| mode | steps | issue ms |"  # where gpu_overhead's second table, the issue's, starts


def _pure_wheel(folder: Path, name: str = "tm_carried_probe", version: str = "1.0") -> Path:
    """A minimal pure-Python wheel (one module), as a lead would carry one in .whl/."""
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": "CARRIED = True\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


@pytest.mark.slow
@pytest.mark.timeout(
    1560
)  # a dry run's steps are fixed and must finish; about 6 minutes on an idle 2-core VM
def test_gpu_check_dry_run_on_the_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRAINMON_STATS_BACKEND")}
    env["PYTHON"] = sys.executable
    wheel = _pure_wheel(tmp_path / "wheels")
    env["TRAINMON_WHEELS"], env["TRAINMON_WHEEL_SITE"] = str(wheel.parent), str(tmp_path / "site")
    out = tmp_path / "check.json"
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), "--tiny", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1530,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = done.stdout
    table = text[text.index("trainmon GPU check -- CPU DRY RUN") :]
    assert "statistics backend: bf16=triton fp32=triton" in table  # the kernels ran, interpreted
    assert "tests/test_cuda.py: 6 skipped" in table
    # the launches of a collected step on the one-layer GPT after the first: the tracked loss, one batch of
    # the tensors taken in hooks and 4 parameter-side tables, Adam's update and ratio, stage 2
    assert "Triton 8 (adam_table 1, finalize 1, stats_batch 1, stats_one 1, stats_table 4)" in table
    assert "step buffer's hot path: native" in table  # the extension imports here: gpu_check.sh built nothing
    assert "building the native extensions" not in text

    # the host cost on this CPU: the yardstick's 1,645 rows, the Triton host side, one pair of blocks
    (host,) = json.loads(out.read_text())["host_cost"]["summary"]
    assert (host["mode"], host["backend"], host["rows"]) == ("full_api", "triton", 1645)
    # one pair of 10-step blocks: on a loaded machine the difference can fall either side of 0, so the
    # figure is checked for being one (and printed as such), not for its sign
    assert isinstance(host["host_us_per_tensor"], float) and math.isfinite(host["host_us_per_tensor"])
    assert (
        f"host cost on this CPU (bench/host_cost.py, full_api, Triton host side, no GPU): "
        f"{host['host_us_per_tensor']:.2f} us a monitored tensor"
    ) in table
    # and where a row's host time goes (--split): each part's own time, the torch ops, the rest
    split = host["split"]
    assert split["steps"] == 20 and split["rows"] == 1645
    assert list(split["us_per_row"]) == ["launcher", "batch staging", "reducer rows", "step buffer"]
    assert all(us >= 0 for us in split["us_per_row"].values()) and split["host_us_per_row"] >= 0
    assert split["rest_us_per_row"] == pytest.approx(
        split["host_us_per_row"] - sum(split["us_per_row"].values())
    )
    assert split["calls_per_step"]["launcher"] > 0 and split["calls_per_step"]["step buffer"] > 0
    assert "full_api / triton: host us per row by part (20 steps, 1645 rows): launcher " in table

    # the environment: crc32c as this interpreter has it, msprobe, the carried wheel installed and on the path
    result = json.loads(out.read_text())
    environment = result["environment"]
    assert environment["crc32c"] == {
        "native": True,
        "version": importlib.metadata.version("crc32c"),
        "error": None,
    }
    assert f"crc32c: native {importlib.metadata.version('crc32c')} (TensorBoard event records)" in table
    site = tmp_path / "site"
    assert (site / "tm_carried_probe.py").read_text() == "CARRIED = True\n"
    assert environment["carried"] == {
        "wheels": [wheel.name],
        "installed": True,
        "site": str(site),
        "on_path": True,
    }
    assert f"carried wheels: {wheel.name}: installed into {site}" in table
    msprobe_here = importlib.util.find_spec("msprobe") is not None
    if not msprobe_here:  # said, not failed
        assert environment["msprobe"] == "not installed"
        assert table.count("msprobe: not installed") == 2  # the environment block and under the table

    overhead_part = table[: table.index("compiled yardstick")]  # the compiled one and the sweep's come after
    overhead_part, issue_part = overhead_part.split(ISSUE_HEADER)  # then the issue table (checked below)
    rows = [line for line in overhead_part.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert header == [
        "mode",
        "mean ms",
        "median ms",
        "p90 ms",
        "longest ms",
        "**mean / off**",
        "median / off",
        "longest / off median",
        "gc collections gen 0/1/2",
        "gc pauses ms gen 0/1/2",
        "syncs added",
        "kernels added",
        "peak MiB (vs off)",
    ]
    labels = [row.split(" | ")[0] for row in rows[1:]]
    expected = [f"| {gpu_overhead.LABELS[m]}" for m in TRAINMON_MODES]
    assert labels[:5] == expected and (msprobe_here or len(labels) == 5)
    off_cells = [cell.strip() for cell in rows[1].strip("|").split("|")]  # off against itself
    assert off_cells[5:7] == ["**1.000**", "1.000"] and off_cells[12].endswith("(+0.0%)")

    overhead = result["overhead"]
    modes = overhead["modes"]
    assert list(modes)[:5] == TRAINMON_MODES and overhead["rounds"] == 1 and overhead["stopped"] is None
    off = modes["off"]
    for name in TRAINMON_MODES:
        m = modes[name]
        (run,) = m["runs"]
        # one warm-up step (0), ten measured (1..10), every one timed
        assert run["window"] == m["window"] == [1, 10] and len(run["step_ms"]) == 11
        window = run["step_ms"][1:]
        assert m["measured_steps"] == 10
        assert m["mean_ms"] == pytest.approx(statistics.fmean(window))
        assert m["median_ms"] == pytest.approx(statistics.median(window))
        assert m["longest_ms"] == max(window) and run["step_ms"][run["longest_step"]] == max(window)
        assert 0 < min(window) <= m["median_ms"] <= m["p90_ms"] <= m["longest_ms"]
        assert min(window) <= m["mean_ms"] <= m["longest_ms"]
        # one round: the ratios are this run's against off's
        assert m["ratio_mean"] == pytest.approx(m["mean_ms"] / off["mean_ms"])
        assert m["ratio_median"] == pytest.approx(m["median_ms"] / off["median_ms"])
        assert m["longest_to_off_median"] == pytest.approx(m["longest_ms"] / off["median_ms"])
        assert m["peak_mib"] > 0 and m["peak_vs_off"] == pytest.approx(m["peak_mib"] / off["peak_mib"] - 1)
        for generation in ("0", "1", "2"):
            collections = m["gc"][generation]
            assert isinstance(collections["count"], int) and collections["count"] >= 0
            assert 0 <= collections["longest_ms"] <= collections["pause_ms"]
            assert collections["count"] > 0 or collections["pause_ms"] == 0
        assert m["syncs_added"] is None and m["kernels_added"] is None  # nothing to count on the CPU

    # the schedule, as the monitor wrote it (its steps table): every mode's first collected step is step 0,
    # in the warm-up and timed apart; the interval mode's window holds only its steady collected step 10
    assert off["first_collected"] is None and off["collected_in_window"] == []
    for name in ("full", "wgmv", "full_exact_skip"):
        assert modes[name]["runs"][0]["collected"] == list(range(11))
        assert modes[name]["collected_in_window"] == list(range(1, 11))
    interval = modes["full_interval10"]
    (run,) = interval["runs"]
    assert run["collected"] == [0, 10] and interval["collected_in_window"] == [10]
    assert interval["first_collected"]["step"] == 0 < interval["window"][0]
    for name in TRAINMON_MODES[1:]:
        first = modes[name]["first_collected"]
        assert first["step"] == 0 and first["ms"] == [modes[name]["runs"][0]["step_ms"][0]]
    line = next(x for x in table.splitlines() if x.startswith("full, step_interval: 10: first collected"))
    assert "step 0 (in the warm-up)" in line and line.endswith("collected steps in the window: 1 (10)")

    # the time to issue each step (before the closing sync), the CPU the training thread and the process
    # spent meanwhile, the rows of the last collected step (the one-layer GPT: 17 parameters; wg + mv 4 rows
    # each, full 6 rows each + 22 activations + 20 activation gradients)
    known_rows = {"off": None, "full": 144, "wgmv": 68, "full_interval10": 144, "full_exact_skip": 144}
    issue_rows = [line for line in issue_part.splitlines() if line.startswith("| ")]  # the header split off
    for name in TRAINMON_MODES:
        m = modes[name]
        (run,) = m["runs"]
        assert run["rows"] == known_rows[name], name
        steps, issue = run["step_ms"], run["issue_ms"]
        thread, process = run["thread_cpu_ms"], run["process_cpu_ms"]
        assert len(issue) == len(thread) == len(process) == 11
        for k in range(11):
            # the CPU clocks are read inside the issue's wall clock, the thread's inside the process's
            assert 0 < thread[k] <= issue[k] + 0.5 and thread[k] <= process[k] + 0.5, (name, k)
            assert 0 < issue[k] <= steps[k], (name, k)
        # on the CPU nothing runs after train_step returns: issuing a step is all of it
        assert statistics.median(s - i for s, i in zip(steps, issue, strict=True)) < 1.0
        chosen = [10] if name == "full_interval10" else list(range(1, 11))  # the collected steps only
        picked = {
            key: [run[key][k] for k in chosen] for key in ("issue_ms", "thread_cpu_ms", "process_cpu_ms")
        }
        figures = m["issue"]
        assert figures["steps"] == len(chosen) and figures["rows"] == known_rows[name]
        assert figures["issue_ms"] == pytest.approx(statistics.median(picked["issue_ms"]))
        assert figures["thread_cpu_ms"] == pytest.approx(statistics.median(picked["thread_cpu_ms"]))
        blocked = [i - t for i, t in zip(picked["issue_ms"], picked["thread_cpu_ms"], strict=True)]
        other = [p - t for p, t in zip(picked["process_cpu_ms"], picked["thread_cpu_ms"], strict=True)]
        assert figures["blocked_ms"] == pytest.approx(statistics.median(blocked))
        assert figures["other_cpu_ms"] == pytest.approx(statistics.median(other))
        if name == "off":
            assert figures["us_per_row"] is None
        else:  # one round: (this run's median issue - off's) over its rows
            off_issue = statistics.median(off["runs"][0]["issue_ms"][1:])
            expected_us = (figures["issue_ms"] - off_issue) * 1e3 / known_rows[name]
            assert figures["us_per_row"] == pytest.approx(expected_us)
        cells = [c.strip() for c in issue_rows[TRAINMON_MODES.index(name)].strip("|").split("|")]
        assert cells == [
            m["label"],
            str(len(chosen)),
            f"{figures['issue_ms']:.1f}",
            f"{figures['thread_cpu_ms']:.1f}",
            f"{figures['blocked_ms']:.1f}",
            f"{figures['other_cpu_ms']:.1f}",
            "-" if name == "off" else str(known_rows[name]),
            "-" if name == "off" else f"{figures['us_per_row']:.2f}",
        ]
    assert gpu_overhead.ISSUE_LEGEND in issue_part
    # the GPU host's own figure per row (full) against host_cost.py's on this CPU, from the JSON's numbers
    per_row = result["host_per_row"]
    measured = modes["full"]["issue"]["us_per_row"]
    assert (per_row["us_per_row"], per_row["rows"], per_row["mode"]) == (measured, 144, "full")
    assert per_row["host_cost_us_per_row"] == host["host_us_per_tensor"]
    assert measured > 0 and per_row["ratio"] == pytest.approx(host["host_us_per_tensor"] / measured)
    assert per_row["within_tolerance"] is (abs(per_row["ratio"] - 1) <= 0.25)
    assert (
        f"GPU host per row: {measured:.2f} us (mode full; issue on - off over 144 rows) against "
        f"host_cost.py's {host['host_us_per_tensor']:.2f} us on this CPU: host_cost / GPU = "
        f"{per_row['ratio']:.2f} -> within 25%: {'yes' if per_row['within_tolerance'] else 'no'}"
    ) in table
    wgmv = per_row["wgmv"]
    assert wgmv["blocked_share"] == pytest.approx(wgmv["blocked_ms"] / wgmv["issue_ms"])
    assert {k: wgmv[k] for k in gpu_overhead.ISSUE_COLUMNS} == {
        k: modes["wgmv"]["issue"][k] for k in gpu_overhead.ISSUE_COLUMNS
    }
    assert wgmv["off"] == {k: off["issue"][k] for k in gpu_overhead.ISSUE_COLUMNS}
    before = off["issue"]
    assert (
        f"wg + mv's issue: {wgmv['issue_ms']:.1f} ms (off {before['issue_ms']:.1f}): training thread "
        f"CPU {wgmv['thread_cpu_ms']:.1f} ms (off {before['thread_cpu_ms']:.1f}), blocked "
        f"{wgmv['blocked_ms']:.1f} ms (off {before['blocked_ms']:.1f}) = {wgmv['blocked_share']:.0%} of "
        "the issue"
    ) in table

    # the kernels' tilings (bench/gpu_kernel_sweep.py), the dry run's two (the base kernels, then the fast
    # variants), both giving the same statistics, all three kernels timed, the choice recorded
    sweep = result["kernel_sweep"]
    tilings = [(r["kernel"], r["block"], r["chunk"], r["warps"], r["unroll"]) for r in sweep["tilings"]]
    assert tilings == [("base", 4096, 4096, 4, 1), ("fast", 2048, 4096, 8, 4)]
    assert all(r["same_statistics"] for r in sweep["tilings"])
    assert all(r[f"{k}_ms"] > 0 for r in sweep["tilings"] for k in ("table", "batch", "adam"))
    assert sweep["choice"]["device"] == "cpu" and sweep["choice"]["tiling"] in (
        "4096,4096,4",
        "2048,4096,8,fast4",
    )
    assert "same statistics: yes, every tiling" in table and "| fast | 2048 | 4096 | 8 | 4 |" in table
    assert f"choice for cpu: {sweep['choice']['tiling']} (" in table

    # the compiled yardstick (step 6): each block compiled in place (aot_eager on the CPU), then attached
    compiled = result["compiled"]
    assert list(compiled["modes"]) == ["off", "wgmv", "full"] and compiled["rounds"] == 1
    assert compiled["args"][-2:] == ["--compile", "aot_eager"]
    assert compiled["modes"]["full"]["runs"][0]["collected"] == list(range(11))
    assert compiled["modes"]["full"]["ratio_mean"] > 0
    start = table.index("compiled yardstick (bench/gpu_overhead.py")
    compiled_part = table[start : table.index("the real stacks")].split(ISSUE_HEADER)[0]
    labels = [line.split(" | ")[0] for line in compiled_part.splitlines() if line.startswith("| ")][1:]
    assert labels == [f"| {gpu_overhead.LABELS[m]}" for m in ("off", "wgmv", "full")]

    # the real stacks (step 7), tiny and on gloo: megatron-core through enable_megatron, DeepSpeed ZeRO-2 and
    # ZeRO-3, FSDP2, each run, every parameter's four wg + mv rows collected in the last step (17
    # parameters: the one-layer GPTs), the losses of every step bitwise those of the unmonitored run
    assert environment["stacks"] == {
        "megatron-core": importlib.metadata.version("megatron-core"),
        "deepspeed": importlib.metadata.version("deepspeed"),
    }
    reports = result["stacks"]["stacks"]
    assert [r["stack"] for r in reports] == gpu_stacks.STACKS
    for r in reports:
        assert "error" not in r, r.get("log")
        assert r["rows"] == {
            "step": 2,  # one warm-up step and two measured ones, numbered from 0
            "expected": 68,
            "present": 68,
            "missing": [],
            "per_kind": dict.fromkeys(gpu_stacks.WGMV_KINDS, 17),
            "parameters": 17,
        }, r["stack"]
        (one,) = r["rounds"]
        assert r["losses_equal"] and one["off"]["losses"] == one["on"]["losses"] == r["losses"]
        assert len(r["losses"]) == 3 and len(set(r["losses"])) == 3  # three steps, training moves
        assert one["off_mean_ms"] == pytest.approx(statistics.fmean(one["off"]["step_ms"][1:]))
        assert r["ratio_mean"] == pytest.approx(one["on_mean_ms"] / one["off_mean_ms"])
    start = table.index("the real stacks, world size 1, wg + mv")
    stack_rows = [x for x in table[start:].splitlines() if x.startswith("| ")][1:5]
    assert [x.split(" | ")[1:4] for x in stack_rows] == [["yes", "68 / 68", "yes"]] * 4


def _run(mean: float, median: float, longest: float, peak: float, gen2: int, kernels=None) -> dict:
    pause = float(gen2 * 100)
    return {
        "window": [2, 5],
        "step_ms": [500.0, 90.0, median, mean, longest, median],
        "mean_ms": mean,
        "median_ms": median,
        "longest_ms": longest,
        "peak_mib": peak,
        "gc": {
            "0": {"count": 3, "pause_ms": 1.5, "longest_ms": 0.5},
            "1": {"count": 1, "pause_ms": 2.0, "longest_ms": 2.0},
            "2": {"count": gen2, "pause_ms": pause, "longest_ms": pause},
        },
        "collected_in_window": [3],
        "first_collected": {"step": 0, "ms": 500.0},
        "kernels": kernels,
        "syncs": None if kernels is None else 0,
    }


def test_summary_pairs_each_run_with_the_off_run_of_its_round():
    offs = [_run(50.0, 48.0, 60.0, 1000.0, 0, kernels=400), _run(52.0, 50.0, 70.0, 1000.0, 0, kernels=400)]
    runs = [_run(60.0, 50.0, 150.0, 1040.0, 1, kernels=450), _run(78.0, 60.0, 100.0, 1030.0, 2)]
    m = gpu_overhead.summarise("full", runs, offs, offs[0])
    assert m["label"] == "full (xy + wg + mv + param)"
    assert m["ratio_mean"] == pytest.approx((60 / 50 + 78 / 52) / 2)  # the median of two rounds
    assert m["ratio_mean_range"] == pytest.approx([1.2, 1.5])
    assert m["ratio_median"] == pytest.approx((50 / 48 + 60 / 50) / 2)
    assert m["longest_to_off_median"] == pytest.approx(150 / 48)  # the worst round
    assert m["peak_mib"] == 1040.0 and m["peak_vs_off"] == pytest.approx(0.04)
    assert m["gc"] == {
        "0": {"count": 6, "pause_ms": 3.0, "longest_ms": 0.5},
        "1": {"count": 2, "pause_ms": 4.0, "longest_ms": 2.0},
        "2": {"count": 3, "pause_ms": 300.0, "longest_ms": 200.0},
    }
    # pooled over both windows: steps 2..5 of each run
    pooled = [50.0, 60.0, 150.0, 50.0, 60.0, 78.0, 100.0, 60.0]
    assert m["measured_steps"] == 8
    assert m["mean_ms"] == pytest.approx(statistics.fmean(pooled))
    assert m["median_ms"] == 60.0 and m["longest_ms"] == 150.0
    assert m["p90_ms"] == pytest.approx(100 + 0.3 * 50)  # 0.9 * 7 = 6.3: between the 7th and 8th of 8
    assert m["kernels_added"] == 50 and m["syncs_added"] == 0
    assert m["first_collected"] == {"step": 0, "ms": [500.0, 500.0]}

    result = {"modes": {"off": gpu_overhead.summarise("off", offs, offs, offs[0]), "full": m}}
    result["msprobe"] = {"status": "not installed", "note": None}
    lines = gpu_overhead.table(result)
    full_row = next(x for x in lines if x.startswith("| full (xy"))
    assert "| 3.12 | 6/2/3 | 3/4/300 | 0 | 50 | 1040 (+4.0%) |" in full_row
    assert "| **1.350** | 1.121 |" in full_row
    assert lines[-1] == "msprobe: not installed"
    warm = next(x for x in lines if x.startswith("full (xy + wg + mv + param): first collected"))
    assert warm == (
        "full (xy + wg + mv + param): first collected step 0 (in the warm-up): 500, 500 ms; "
        "collected steps in the window: 1 (3)"
    )


def _clocked(run: dict, issue, thread, process, rows=None, interval=1, collected=None) -> dict:
    """``run`` with issue times for its window (steps 2..5; the warm-up's 0 and 1 far off, so that a figure
    that took them in would show), the CPU clocks over them, and its rows."""
    warm = [900.0, 90.0]
    return {
        **run,
        "interval": interval,
        "collected_in_window": collected,
        "issue_ms": warm + issue,
        "thread_cpu_ms": warm + thread,
        "process_cpu_ms": [1800.0, 180.0] + process,
        "rows": rows,
    }


def _issue_rounds() -> tuple[list[dict], list[dict], list[dict]]:
    """Two rounds of off, full (100 rows) and wg + mv (40 rows) with fixed issue times."""
    base = _run(50.0, 48.0, 60.0, 1000.0, 0)
    offs = [
        _clocked(base, [20.0, 22.0, 24.0, 26.0], [10.0, 12.0, 10.0, 12.0], [15.0, 20.0, 15.0, 20.0]),
        _clocked(base, [30.0] * 4, [10.0] * 4, [10.0] * 4),
    ]
    full = [
        _clocked(base, [43.0, 45.0, 47.0, 49.0], [20.0, 20.0, 30.0, 30.0], [30.0, 25.0, 40.0, 45.0], 100),
        _clocked(base, [40.0] * 4, [20.0] * 4, [20.0, 22.0, 24.0, 26.0], 100),
    ]
    wgmv = [_clocked(base, [60.0] * 4, [10.0] * 4, [12.0] * 4, 40) for _ in offs]
    return offs, full, wgmv


def test_issue_figures_split_the_issue_and_pair_each_run_with_the_off_run_of_its_round():
    import gpu_check

    offs, full, wgmv = _issue_rounds()
    off_summary = gpu_overhead.summarise("off", offs, offs, offs[0])
    m = gpu_overhead.summarise("full", full, offs, offs[0])
    # pooled over both windows (steps 2..5 of each run; the warm-up left out): issue 40 x 4, 43, 45, 47, 49;
    # thread CPU 20 x 6, 30, 30; blocked (issue - thread) 23 25 17 19 20 20 20 20; other threads' CPU
    # (process - thread) 10 5 10 15 0 2 4 6
    assert m["issue"] == {
        "steps": 8,
        "issue_ms": 41.5,
        "thread_cpu_ms": 20.0,
        "blocked_ms": 20.0,
        "other_cpu_ms": 5.5,
        "rows": 100,
        # per round: (the run's median issue - off's of its round) / 100 rows: (46 - 23) and (40 - 30) ms
        "us_per_row": pytest.approx((230.0 + 100.0) / 2),
        "us_per_row_rounds": [pytest.approx(230.0), pytest.approx(100.0)],
    }
    assert off_summary["issue"]["us_per_row"] is None and off_summary["issue"]["rows"] is None
    assert off_summary["issue"]["issue_ms"] == 28.0 and off_summary["issue"]["blocked_ms"] == 17.0
    w = gpu_overhead.summarise("wgmv", wgmv, offs, offs[0])
    assert w["issue"]["us_per_row_rounds"] == [pytest.approx(37e3 / 40), pytest.approx(30e3 / 40)]

    result = {"modes": {"off": off_summary, "full": m, "wgmv": w}, "msprobe": {"status": "not installed"}}
    lines = gpu_overhead.table(result)
    start = lines.index(
        "| mode | steps | issue ms | training thread CPU ms | blocked ms | other threads' CPU ms "
        "| rows | host us a row |"
    )
    assert lines[start + 2 : start + 5] == [
        "| off | 8 | 28.0 | 10.0 | 17.0 | 2.5 | - | - |",
        "| full (xy + wg + mv + param) | 8 | 41.5 | 20.0 | 20.0 | 5.5 | 100 | 165.00 |",
        "| wg + mv | 8 | 60.0 | 10.0 | 50.0 | 2.0 | 40 | 837.50 |",
    ]
    assert lines[start + 5] == gpu_overhead.ISSUE_LEGEND and lines[-1] == "msprobe: not installed"

    # gpu_check's lines: the GPU host's own figure against host_cost.py's on the same machine's CPU
    host = {"summary": [{"mode": "full_api", "host_us_per_tensor": 150.0}]}
    figures = gpu_check.host_per_row(result, host)
    assert figures["ratio"] == pytest.approx(150.0 / 165.0) and figures["within_tolerance"] is True
    assert (figures["us_per_row"], figures["rows"], figures["host_cost_mode"]) == (165.0, 100, "full_api")
    assert figures["wgmv"]["blocked_share"] == pytest.approx(50.0 / 60.0)
    assert figures["wgmv"]["off"] == {
        "issue_ms": 28.0,
        "thread_cpu_ms": 10.0,
        "blocked_ms": 17.0,
        "other_cpu_ms": 2.5,
    }
    assert gpu_check.host_per_row_lines(figures) == [
        "",
        "GPU host per row: 165.00 us (mode full; issue on - off over 100 rows) against host_cost.py's "
        "150.00 us on this CPU: host_cost / GPU = 0.91 -> within 25%: yes",
        "wg + mv's issue: 60.0 ms (off 28.0): training thread CPU 10.0 ms (off 10.0), blocked 50.0 ms "
        "(off 17.0) = 83% of the issue, other threads' CPU 2.0 ms (off 2.5)",
    ]
    # 25% either way: 124 us is 0.75 of 165 and within; 123 is not, nor 207 (1.25 x 165 = 206.25)
    for predicted, within in ((124.0, True), (123.0, False), (206.0, True), (207.0, False)):
        host["summary"][0]["host_us_per_tensor"] = predicted
        assert gpu_check.host_per_row(result, host)["within_tolerance"] is within, predicted
    assert gpu_check.host_per_row(result, None)["ratio"] is None
    assert gpu_check.host_per_row_lines(gpu_check.host_per_row(result, None))[1].endswith(
        "host_cost.py's - us on this CPU: host_cost / GPU = - -> within 25%: unknown"
    )
    # runs kept before issue times were: no issue figures, no second table, and the check says so
    plain = [_run(50.0, 48.0, 60.0, 1000.0, 0)]
    old = {"modes": {name: gpu_overhead.summarise(name, plain, plain, plain[0]) for name in ("off", "full")}}
    assert old["modes"]["full"]["issue"] is None
    assert not any(line.startswith("| mode | steps | issue ms") for line in gpu_overhead.table(old))
    assert gpu_check.host_per_row_lines(gpu_check.host_per_row(old, host))[1] == (
        "GPU host per row: not measured (bench/gpu_overhead.py kept no issue times for full and off)"
    )


def test_an_interval_modes_issue_counts_its_collected_steps_only():
    base = _run(50.0, 48.0, 60.0, 1000.0, 0)  # window 2..5
    issue, thread, process = [60.0, 10.0, 80.0, 10.0], [5.0] * 4, [6.0] * 4
    run = _clocked(base, issue, thread, process, rows=10, interval=2, collected=[2, 4])
    assert gpu_overhead.issue_steps(run) == [2, 4]
    assert gpu_overhead.issue_columns(run)["issue_ms"] == [60.0, 80.0]
    # the steps table unread: the schedule (steps numbered from 0) picks the same steps
    assert gpu_overhead.issue_steps({**run, "collected_in_window": None}) == [2, 4]
    # the steps table, where read, is what counts
    assert gpu_overhead.issue_steps({**run, "collected_in_window": [3]}) == [3]
    off = _clocked(base, [20.0, 22.0, 24.0, 26.0], thread, process)
    assert gpu_overhead.host_us_per_row(run, off) == pytest.approx((70.0 - 23.0) * 1e3 / 10)
    # every step of the window where the mode collects every step
    assert gpu_overhead.issue_steps(off) == [2, 3, 4, 5]
    assert gpu_overhead.host_us_per_row(off, off) is None  # no rows: no monitor


def _tiling(kernel: str, block: int, warps: int, unroll: int, gb_s: tuple, same: bool = True) -> dict:
    table, batch, adam = gb_s
    return {
        "kernel": kernel,
        "block": block,
        "chunk": 65536,
        "warps": warps,
        "unroll": unroll,
        "table_ms": 1.0,
        "table_gb_s": table,
        "batch_ms": 1.0,
        "batch_gb_s": batch,
        "adam_ms": 2.0,
        "adam_gb_s": adam,
        "same_statistics": same,
    }


def test_the_sweep_line_names_each_kernels_fastest_tiling_against_the_one_in_use():
    import gpu_check
    import gpu_kernel_sweep

    sweep = {
        "device": "NVIDIA H200",
        "read_bytes": 3.2e9,
        "batch_bytes": 1.0e9,
        "adam_bytes": 6.4e9,
        "sum_ms": 0.8,
        "sum_gb_s": 4000.0,
        "tilings": [
            _tiling("base", 2048, 8, 1, (2300.0, 2100.0, 900.0)),
            _tiling("fast", 2048, 8, 4, (3100.0, 1900.0, 2000.0)),
            _tiling("base", 1024, 4, 1, (1500.0, 2600.0, 800.0), same=False),
        ],
        "not_timed": ["4096,65536,8,fast2"],
    }
    sweep["choice"] = gpu_kernel_sweep.choice(sweep)
    line, blank, *table = gpu_check.sweep_lines(sweep)
    assert line == (
        "kernel tilings (bench/gpu_kernel_sweep.py, block,chunk,warps[,fastU]): "
        "stats_table 3100 GB/s at 2048,65536,8,fast4 (in use 2048,65536,8: 2300 GB/s); "
        "stats_batch 2600 GB/s at 1024,65536,4 (in use 2048,65536,8: 2100 GB/s); "
        "adam_table 2000 GB/s at 2048,65536,8,fast4 (in use 2048,65536,8: 900 GB/s); "
        "torch.sum 4000 GB/s; same statistics: NO for 1024,65536,4"
    )
    assert blank == ""
    assert table[-4] == (
        "| base | 1024 | 65536 | 4 | 1 | 1.000 | 1500 | 0.38 | 1.000 | 2600 | 0.65 | 2.000 | 800 | 0.20 "
        "| NO |"
    )
    # the choice: least time for the three kernels among the tilings with the same statistics (all take 4 ms
    # here, the first of them wins), said with each kernel's share of torch.sum's speed
    assert sweep["choice"]["tiling"] == "2048,65536,8" and sweep["choice"]["step_ms"] == 4.0
    assert sweep["choice"]["Tiling"] == {
        "kernel": "base",
        "block": 2048,
        "chunk": 65536,
        "warps": 8,
        "unroll": 1,
    }
    assert table[-2] == (
        "choice for NVIDIA H200: 2048,65536,8 (4.000 ms for the three kernels; the tiling in use 4.000 ms); "
        "of torch.sum's read speed: table 0.57, batch 0.53, adam 0.23"
    )
    assert table[-1] == "not timed (past --time-budget): 4096,65536,8,fast2"
    assert gpu_check.sweep_lines({"skipped": "--no-sweep"}) == [
        "kernel tilings: bench/gpu_kernel_sweep.py skipped: --no-sweep"
    ]
    assert gpu_check.sweep_lines(None) == [
        "kernel tilings: bench/gpu_kernel_sweep.py not run or failed (see above)"
    ]


def test_percentile_interpolates_between_order_statistics():
    values = [float(v) for v in range(1, 11)]
    assert gpu_overhead.percentile(values, 0.9) == pytest.approx(9.1)
    assert gpu_overhead.percentile(values[::-1], 0.5) == pytest.approx(statistics.median(values))
    assert gpu_overhead.percentile([7.0], 0.9) == 7.0
    assert gpu_overhead.percentile([1.0, 3.0], 1.0) == 3.0


def test_gc_watch_counts_only_what_runs_while_on():
    enabled = gc.isenabled()
    gc.disable()  # no collection but the ones asked for below
    try:
        watch = gpu_overhead.GcWatch()
        gc.collect()  # off: not counted
        watch.on = True
        gc.collect(2)
        gc.collect(0)
        gc.collect(0)
        watch.on = False
        gc.collect(1)
        watch.close()
        gc.collect()  # removed: not seen
    finally:
        if enabled:
            gc.enable()
    report = watch.report()
    assert {g: r["count"] for g, r in report.items()} == {"0": 2, "1": 0, "2": 1}
    assert report["1"]["pause_ms"] == 0 and report["2"]["pause_ms"] == report["2"]["longest_ms"] > 0
    assert 0 < report["0"]["longest_ms"] <= report["0"]["pause_ms"]


def test_the_carried_crc32c_wheel_is_the_pinned_version():
    """bench/gpu_wheels.sh (which performance.md names) fetches crc32c's wheel for a GPU machine at the
    version constraints.txt pins, and .whl/ is never committed."""
    (pin,) = re.findall(r"^crc32c==(\S+)$", (REPO / "constraints.txt").read_text(), re.MULTILINE)
    named = re.findall(r"^fetch crc32c==(\S+)$", (REPO / "bench" / "gpu_wheels.sh").read_text(), re.MULTILINE)
    assert named == [pin]
    assert "bench/gpu_wheels.sh" in (REPO / "docs" / "performance.md").read_text()
    assert ".whl/" in (REPO / ".gitignore").read_text().splitlines()

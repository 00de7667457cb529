"""``alert.on_nan: skip`` under DeepSpeed 0.19.8 on the CPU (gloo), at every ZeRO stage.

The worker (tests/skip_ds_worker.py) makes one activation NaN at step ``NAN_STEP`` on rank 0 only and
masks it right after, so the gradients stay finite: DeepSpeed alone would apply that step's update (the
control case shows it does). With ``on_nan: skip`` the monitor's check, agreed over the ranks, sends the
step down DeepSpeed's overflow path on every rank: model parameters, fp32 master copies and Adam moments
after step NAN_STEP are bitwise those after NAN_STEP - 1, the engine counts a skipped step and holds its LR
scheduler back, and the next step trains again.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launch import free_port

from tests.test_deepspeed import run_torchrun  # the teardown-abort retry of the DeepSpeed tests
from trainmon.run.anomaly_table import read_anomalies

WORKER = Path(__file__).with_name("skip_ds_worker.py")
NAN_STEP, STEPS = 2, 4
PARAMS = ("fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.weight", "fc2.bias")


def _env() -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _args(tmp_path: Path, *args: str) -> list[str]:
    return [
        str(WORKER), "--logdir", str(tmp_path / "run"), "--out", str(tmp_path / "report"),
        "--steps", str(STEPS), "--nan-step", str(NAN_STEP), *args,
    ]  # fmt: skip


def _reports(tmp_path: Path, ranks: int) -> list[dict]:
    return [json.loads((tmp_path / f"report.rank{r}.json").read_text()) for r in range(ranks)]


def run_one_process(tmp_path: Path, *args: str) -> dict:
    env = {
        **_env(),
        **{"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"},
        "MASTER_PORT": str(free_port()),
    }
    command = [sys.executable, *_args(tmp_path, *args)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {**_reports(tmp_path, 1)[0], "log": proc.stdout + proc.stderr}


def run_two_processes(tmp_path: Path, *args: str) -> list[dict]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        *_args(tmp_path, *args),
    ]  # fmt: skip
    proc = run_torchrun(command, [tmp_path / "run"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return _reports(tmp_path, 2)


def assert_skipped_exactly_at_nan_step(report: dict) -> None:
    steps = report["steps"]
    before, skipped, after = (steps[NAN_STEP + d]["weights"] for d in (-1, 0, 1))
    assert set(before) >= {f"param/{name}" for name in PARAMS}
    # every parameter, master copy and Adam moment as it was before the poisoned step, bit for bit
    assert skipped == before
    # ... and training goes on: the next step updates every parameter again, with a finite loss
    changed = {key for key in PARAMS if after[f"param/{key}"] != skipped[f"param/{key}"]}
    assert changed == set(PARAMS)
    assert math.isfinite(steps[NAN_STEP + 1]["loss"])
    # the steps before were updates too (the comparison above is not between two frozen states)
    assert steps[NAN_STEP - 1]["weights"] != steps[NAN_STEP - 2]["weights"]
    # the engine saw DeepSpeed's overflow flag: one skipped step, the LR scheduler held back once
    assert [s["skipped_steps"] for s in steps] == [0] * NAN_STEP + [1] * (STEPS - NAN_STEP)
    assert [s["lr_steps"] for s in steps] == [0, 1, 1, 2]
    assert [s["record_step"] for s in steps] == list(range(STEPS))
    assert [s["record_skipped"] for s in steps] == [s == NAN_STEP for s in range(STEPS)]


def skipped_records(tmp_path: Path, rank: int) -> list:
    anomalies = list(read_anomalies(tmp_path / "run", rank))
    return anomalies, [a for a in anomalies if a.rule == "step_skipped"]


# ------------------------------------------------------------------------------------------ one process

SINGLE = {
    "zero0": (["--zero", "0"], "AdamW"),
    "zero1": (["--zero", "1"], "DeepSpeedZeroOptimizer"),
    "zero3": (["--zero", "3"], "DeepSpeedZeroOptimizer_Stage3"),
    "bf16-zero1-fp32-accum": (["--zero", "1", "--dtype", "bf16", "--fp32-grad-accum"], "BF16_Optimizer"),
    "bf16-zero0": (["--zero", "0", "--dtype", "bf16"], "FP16_UnfusedOptimizer"),
    "fp16-zero2": (["--zero", "2", "--dtype", "fp16"], "DeepSpeedZeroOptimizer"),
}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(SINGLE))
def test_one_process_skip_keeps_every_stage_bitwise_at_the_nan_step(tmp_path, case):
    args, optimizer = SINGLE[case]
    report = run_one_process(tmp_path, *args)
    assert report["optimizer"] == optimizer and report["skips_steps"]
    assert_skipped_exactly_at_nan_step(report)
    assert [s["record_reason"] for s in report["steps"]] == [
        "nan in actv poison.output" if s == NAN_STEP else "" for s in range(STEPS)
    ]
    anomalies, skipped = skipped_records(tmp_path, 0)
    assert [a.step for a in skipped] == [NAN_STEP]
    # a skip the monitor made through DeepSpeed's overflow flag is a NaN alarm, never a loss-scale overflow
    assert {(a.kind, a.name, a.rule) for a in anomalies if a.rule != "step_skipped"} == {
        ("actv", "poison.output", "nan")
    }
    # close() gives the optimizer back as it was: its own step, no overflow flag added to a torch optimizer
    assert not report["step_wrapped_after_close"]
    if optimizer == "AdamW":
        assert not report["overflow_attr_after_close"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_without_skip_deepspeed_applies_the_masked_nan_step(tmp_path):
    """The control: the gradients of the poisoned step are finite, so DeepSpeed's own checks let it land."""
    steps = run_one_process(tmp_path, "--zero", "2", "--no-skip")["steps"]
    before, landed = steps[NAN_STEP - 1]["weights"], steps[NAN_STEP]["weights"]
    assert {name for name in PARAMS if landed[f"param/{name}"] != before[f"param/{name}"]} == set(PARAMS)
    assert [s["skipped_steps"] for s in steps] == [0] * STEPS


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_fp16_loss_scale_overflows_stay_deepspeeds_and_do_not_use_up_max_skips(tmp_path, zero):
    """fp16: at steps 1 and 2 every gradient is NaN, so DeepSpeed's loss scaler skips them itself (the
    monitor's skip goes down the same path and changes nothing): they are reported as loss-scale overflows
    and not counted, so with max_skips 1 the monitor's own skip at step 3 still happens."""
    args = ("--zero", str(zero), "--dtype", "fp16", "--steps", "5", "--nan-step", "3")
    report = run_one_process(tmp_path, *args, "--overflow-steps", "1,2", "--max-skips", "1")
    steps = report["steps"]
    assert [s["skipped_steps"] for s in steps] == [0, 1, 2, 3, 3]
    assert [s["record_skipped"] for s in steps] == [False, True, True, True, False]
    assert [s["record_reason"] for s in steps] == ["", "", "", "nan in actv poison.output", ""]
    weights = [s["weights"] for s in steps]
    assert weights[0] == weights[1] == weights[2] == weights[3] != weights[4]
    anomalies, skipped = skipped_records(tmp_path, 0)
    assert [a.step for a in skipped] == [3]
    by_step = {step: {(a.kind, a.rule) for a in anomalies if a.step == step} for step in range(5)}
    for overflow in (1, 2):  # gradients, activation gradients: every non-finite value is the loss scaler's
        assert ("grad_reduced", "loss_scale_overflow") in by_step[overflow]
        assert {rule for _, rule in by_step[overflow]} == {"loss_scale_overflow"}
    assert by_step[3] == {("actv", "nan"), ("*", "step_skipped")}
    assert by_step[0] == by_step[4] == set()
    # the skip warning is for the monitor's own skip only, not for the loss scaler's overflow steps
    warned = [line for line in report["log"].splitlines() if "the update is skipped" in line]
    assert len(warned) == 1 and "step 3: nan in actv poison.output" in warned[0], warned


# ------------------------------------------------------------------------------------------ two processes


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("zero", [2, 3])
def test_two_processes_nan_on_rank_0_only_every_rank_skips_the_same_step(tmp_path, zero):
    reports = run_two_processes(tmp_path, "--zero", str(zero), "--poison-rank", "0")
    for rank, report in enumerate(reports):
        assert_skipped_exactly_at_nan_step(report)
        reason = "nan in actv poison.output" if rank == 0 else "NaN/Inf on another rank"
        assert [s["record_reason"] for s in report["steps"]] == [
            reason if s == NAN_STEP else "" for s in range(STEPS)
        ]
        anomalies, skipped = skipped_records(tmp_path, rank)
        assert [(a.step, a.rank) for a in skipped] == [(NAN_STEP, rank)]
        assert skipped[0].message == f"update skipped (alert.on_nan: skip): {reason}"
        others = {(a.kind, a.name, a.rule) for a in anomalies if a.rule != "step_skipped"}
        assert others == ({("actv", "poison.output", "nan")} if rank == 0 else set())
    # the model is the same on both ranks at every step (data parallelism kept in step through the skip)
    for s0, s1 in zip(reports[0]["steps"], reports[1]["steps"], strict=True):
        assert {k: v for k, v in s0["weights"].items() if k.startswith("param/")} == {
            k: v for k, v in s1["weights"].items() if k.startswith("param/")
        }


# ------------------------------------------------------------------ on_nan: raise / exit (issue 22, point 3)


def assert_stopped_before_the_update(report: dict, raised: str) -> None:
    """Training stopped at the NaN step, with every parameter, fp32 master copy and Adam moment as after
    the step before it, bit for bit."""
    stopped = report["stopped"]
    assert (stopped["step"], stopped["raised"]) == (NAN_STEP, raised)
    assert [s["step"] for s in report["steps"]] == list(range(NAN_STEP))
    before = report["steps"][NAN_STEP - 1]["weights"]
    assert set(before) >= {f"param/{name}" for name in PARAMS}
    assert stopped["weights"] == before


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("zero", "action"), [(0, "raise"), (2, "raise"), (3, "exit")])
def test_one_process_raise_and_exit_leave_the_state_before_the_nan_step(tmp_path, zero, action):
    report = run_one_process(tmp_path, "--zero", str(zero), "--on-nan", action)
    assert_stopped_before_the_update(report, "TrainingNaNError" if action == "raise" else "SystemExit")
    detail = report["stopped"]["detail"]
    if action == "raise":
        assert detail.startswith(
            f"nan in actv poison.output (nans=1) at step {NAN_STEP} on rank 0; the update of step {NAN_STEP} "
            "was not applied (parameters and optimizer state are as before it)"
        )
    else:
        assert detail == 5  # alert.exit_code
    _, skipped = skipped_records(tmp_path, 0)
    assert [(a.step, a.message) for a in skipped] == [
        (NAN_STEP, f"update skipped (alert.on_nan: {action}): nan in actv poison.output")
    ]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_processes_nan_on_rank_0_only_every_rank_raises_before_the_update(tmp_path):
    reports = run_two_processes(tmp_path, "--zero", "2", "--poison-rank", "0", "--on-nan", "raise")
    for rank, report in enumerate(reports):
        assert_stopped_before_the_update(report, "TrainingNaNError")
        what = "nan in actv poison.output (nans=1)" if rank == 0 else "NaN/Inf on another rank"
        assert report["stopped"]["detail"].startswith(f"{what} at step {NAN_STEP} on rank {rank}; ")

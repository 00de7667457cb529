"""``alert.on_nan: skip`` under Megatron. A NaN made by one module's forward at step 1 of a tiny
megatron-core GPTModel (tests/megatron_worker.py ``run_nan``, the CPU harness of tests/test_megatron.py):
the update of step 1 does not land (parameters and Adam state bitwise as after step 0, ``optimizer.step()``
returned what Megatron returns on an fp16 overflow), step 2 trains again with a finite loss, and the
anomalies name the origin module and record the skipped step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_megatron import run_worker

from trainmon.adapters.megatron import MegatronOptimizerAdapter, _Layout, _StepWrap
from trainmon.run.anomaly_table import read_anomalies

NAN_AT = 1
SKIP = json.dumps({"on_nan": "skip"})


def _check_skipped_once(got: dict) -> None:
    losses = [float.fromhex(x) for x in got["losses"]]
    steps = got["steps"]
    assert math.isnan(losses[NAN_AT]) and math.isfinite(losses[NAN_AT + 1])
    assert [s["ok"] for s in steps] == [True, False, True]
    assert steps[NAN_AT]["grad_norm"] is None  # Megatron's own overflow result: (False, None, None)
    # the skipped update left parameters and optimizer state bitwise as they were after step 0
    assert steps[NAN_AT]["params"] == steps[NAN_AT - 1]["params"]
    assert steps[NAN_AT]["optimizer"] == steps[NAN_AT - 1]["optimizer"]
    # and training goes on: step 0 and step 2 both moved the parameters
    assert steps[0]["params"] != got["before"]["params"]
    assert steps[NAN_AT + 1]["params"] != steps[NAN_AT]["params"]
    assert steps[NAN_AT + 1]["optimizer"] != steps[NAN_AT]["optimizer"]


def _anomalies(run: Path, rank: int) -> list:
    return list(read_anomalies(run, rank))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fp32_optimizer_skips_the_nan_step(tmp_path):
    got = run_worker(tmp_path, "skip", "--nan-at", str(NAN_AT), "--alert", SKIP)[0]
    _check_skipped_once(got)
    anomalies = _anomalies(tmp_path / "run_skip", 0)
    assert {a.step for a in anomalies} == {NAN_AT}
    skipped = [a for a in anomalies if a.rule == "step_skipped"]
    assert len(skipped) == 1 and skipped[0].step == NAN_AT
    assert skipped[0].message == (
        "update skipped (alert.on_nan: skip): nan in actv decoder.layers.1.mlp.output_0"
    )
    origin = [a for a in anomalies if a.origin]
    assert origin and origin[0].name.startswith("decoder.layers.1.mlp.")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_without_skip_the_nan_update_lands(tmp_path):
    """The control: the same run with the default alert section poisons the parameters at step 1."""
    got = run_worker(tmp_path, "noskip", "--nan-at", str(NAN_AT))[0]
    assert [s["ok"] for s in got["steps"]] == [True, True, True]
    assert got["steps"][NAN_AT]["params"] != got["steps"][NAN_AT - 1]["params"]
    assert math.isnan(float.fromhex(got["losses"][NAN_AT + 1]))
    assert not any(a.rule == "step_skipped" for a in _anomalies(tmp_path / "run_noskip", 0))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_distributed_optimizer_two_ranks_skip_together(tmp_path):
    """DP=2 with the distributed optimizer: the NaN is made on rank 0 only; both ranks skip step 1 (they
    must take the same path through the sharded step, else its collectives hang)."""
    ranks = run_worker(
        tmp_path, "dist", "--optimizer", "dist", "--nan-at", str(NAN_AT), "--alert", SKIP, nproc=2
    )
    for got in ranks:
        _check_skipped_once(got)
    # the same model on both ranks (each holds its own shard of the optimizer state)
    keep = ("ok", "grad_norm", "params")
    assert [{k: s[k] for k in keep} for s in ranks[0]["steps"]] == [
        {k: s[k] for k in keep} for s in ranks[1]["steps"]
    ]
    for rank in (0, 1):
        skipped = [a for a in _anomalies(tmp_path / "run_dist", rank) if a.rule == "step_skipped"]
        assert [a.step for a in skipped] == [NAN_AT]


# -------------------------------------------------------------------------------------------- no Megatron
def _stand_in(name: str, **attrs) -> object:
    return type(name, (), attrs)()


def _float16_optimizer(grad_scaler: object) -> object:
    """A stand-in with the attributes of megatron-core's Float16OptimizerWithFloat16Params."""
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = _stand_in(
        "Float16OptimizerWithFloat16Params",
        optimizer=torch.optim.Adam([param]),
        float16_groups=[],
        fp32_from_float16_groups=[],
        fp32_from_fp32_groups=[[param]],
        grad_scaler=grad_scaler,
    )
    optimizer.calls = []
    optimizer.step = lambda: optimizer.calls.append("step") or (True, 1.0, None)
    return optimizer


NO_LAYOUT = _Layout(0, None, 1, None, 0)


def test_dynamic_loss_scale_leaves_nan_steps_to_megatron():
    """fp16: Megatron's DynamicGradScaler skips inf/NaN steps itself and must see them to lower the scale;
    bf16 without a scaler, or a constant scale, can be skipped by the monitor."""
    dynamic = MegatronOptimizerAdapter(_float16_optimizer(_stand_in("DynamicGradScaler")), NO_LAYOUT)
    assert not dynamic.skips_steps and "Megatron itself skips" in dynamic.skip_unsupported
    for scaler in (None, _stand_in("ConstantGradScaler")):
        adapter = MegatronOptimizerAdapter(_float16_optimizer(scaler), NO_LAYOUT)
        assert adapter.skips_steps and adapter.skip_unsupported == ""


def test_step_wrap_skip_returns_the_overflow_result_without_stepping():
    optimizer = _float16_optimizer(None)
    adapter = MegatronOptimizerAdapter(optimizer, NO_LAYOUT)
    skip = SimpleNamespace(now=True)
    ended: list[bool] = []
    wrap = _StepWrap(adapter, lambda: skip.now, lambda: ended.append(adapter.step_skipped()))
    assert optimizer.step() == (False, None, None) and optimizer.calls == []
    skip.now = False
    assert optimizer.step() == (True, 1.0, None) and optimizer.calls == ["step"]
    assert ended == [False, False]  # a forced skip is not Megatron's overflow: the monitor knows why
    wrap.remove()
    assert "step" in vars(optimizer)  # the stand-in's own instance attribute is back


# ---------------------------------------------------------- on_nan: raise / exit (issue 22, point 3)


def _check_stopped_before_the_update(got: dict, raised: str) -> dict:
    stopped = got["stopped"]
    assert (stopped["step"], stopped["raised"]) == (NAN_AT, raised)
    assert len(got["steps"]) == NAN_AT  # optimizer.step() of the NaN step raised: no result came back
    # parameters and optimizer state (main parameters, Adam moments, step counts) as after step 0
    assert stopped["params"] == got["steps"][NAN_AT - 1]["params"]
    assert stopped["optimizer"] == got["steps"][NAN_AT - 1]["optimizer"]
    assert got["steps"][NAN_AT - 1]["params"] != got["before"]["params"]  # step 0 did update
    return stopped


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fp32_optimizer_raise_and_exit_leave_the_state_before_the_nan_step(tmp_path):
    got = run_worker(tmp_path, "raise", "--nan-at", str(NAN_AT), "--alert", json.dumps({"on_nan": "raise"}))
    stopped = _check_stopped_before_the_update(got[0], "TrainingNaNError")
    assert stopped["detail"].startswith(
        f"nan in actv decoder.layers.1.mlp.output_0 (nans=1024) at step {NAN_AT} on rank 0; the update of "
        f"step {NAN_AT} was not applied"
    )
    exit_alert = json.dumps({"on_nan": "exit", "exit_code": 9})
    got = run_worker(tmp_path, "exit", "--nan-at", str(NAN_AT), "--alert", exit_alert)
    assert _check_stopped_before_the_update(got[0], "SystemExit")["detail"] == 9
    skipped = [a for a in _anomalies(tmp_path / "run_exit", 0) if a.rule == "step_skipped"]
    assert [a.message for a in skipped] == [
        "update skipped (alert.on_nan: exit): nan in actv decoder.layers.1.mlp.output_0"
    ]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_distributed_optimizer_two_ranks_raise_together_before_the_update(tmp_path):
    """The NaN is made on rank 0 only: rank 1 raises at the same step (else it would enter the sharded
    step's collectives alone), both with the state before the NaN step."""
    raise_alert = json.dumps({"on_nan": "raise"})
    ranks = run_worker(
        tmp_path, "dist", "--optimizer", "dist", "--nan-at", str(NAN_AT), "--alert", raise_alert, nproc=2
    )
    for rank, got in enumerate(ranks):
        stopped = _check_stopped_before_the_update(got, "TrainingNaNError")
        where = f"at step {NAN_AT} on rank {rank}; the update of step {NAN_AT} was not applied"
        assert where in stopped["detail"]

"""torchtitan's way all at once (tests/titan_worker.py): FSDP2 x tensor parallelism on a 2x2 gloo mesh, each
block compiled, bf16 mixed precision, two micro-batches a step, every kind of statistic on. The monitored jobs
equal the same jobs without the monitor bitwise; their statistics equal those of the whole tensors; a NaN
planted on one rank or one tensor-parallel group behaves as docs/alerts.md says under ``continue``, ``raise``
and ``skip`` (never a collective mismatch); ``analyze --explain`` names the rank and the module that made it;
``compare`` finds no divergence between fp32 and bf16 and finds a planted epsilon change."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch import free_port, run_ranks

# the module's two launches (every job of a kind in one start of the four ranks) take minutes on 2 cores
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WORKER = Path(__file__).with_name("titan_worker.py")
TRAINMON = [sys.executable, "-m", "trainmon"]
RTOL = 1e-5
NAN_STEP = 1

COMPILED = {
    "on": "compile,bf16,steps=3",
    "off": "compile,bf16,steps=3,off",
    "nan": f"compile,bf16,steps=3,nan={NAN_STEP}@2",
    "raise": f"compile,bf16,steps=3,nan={NAN_STEP}@2,on_nan=raise",
    "group_skip": f"compile,bf16,steps=3,nan={NAN_STEP}@2+3,on_nan=skip",
}
EAGER = {
    "on": "bf16,steps=3",
    "off": "bf16,steps=3,off",
    "sp": "bf16,sp,steps=3",
    "sp_off": "bf16,sp,steps=3,off",
    "fp32": "steps=3",
    "eps": "bf16,steps=3,eps=layers.1.ffn_norm@1.0",
    "fp32_nosync": "nosync,steps=3",
    "bf16_nosync": "bf16,nosync,steps=3",
    "nan": f"bf16,steps=3,nan={NAN_STEP}@2",
}
PIPELINED = {"on": "pp,bf16,steps=3", "off": "pp,bf16,steps=3,off"}
# inductor: the parameter side adds nothing to the graph (docs/compile.md says what activations change there)
INDUCTOR = {"params": "inductor,bf16,steps=3,params", "off": "inductor,bf16,steps=3,off"}


def train(out: Path, jobs: dict[str, str], world: int = 4) -> dict[str, list[dict]]:
    """Run ``jobs`` in turn on ``world`` ranks; returns each job's ranks' results (tests/titan_worker.py)."""
    args = [f"{name}:{options}" for name, options in jobs.items()]
    run_ranks([sys.executable, str(WORKER), str(out), str(free_port()), *args], world, timeout=600)
    return {
        name: [json.loads((out / name / f"rank_{r}.json").read_text()) for r in range(world)] for name in jobs
    }


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    out = tmp_path_factory.mktemp("compiled")
    return out, train(out, COMPILED)


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    out = tmp_path_factory.mktemp("eager")
    return out, train(out, EAGER)


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    out = tmp_path_factory.mktemp("pipelined")
    return out, train(out, PIPELINED, world=8)


@pytest.fixture(scope="module")
def inductor(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    out = tmp_path_factory.mktemp("inductor")
    return out, train(out, INDUCTOR)


def same(a: list[float], b: list[float]) -> bool:
    """Bitwise equal floats, NaN equal to NaN."""
    pairs = zip(a, b, strict=True) if len(a) == len(b) else ()
    return len(a) == len(b) and all(x == y or math.isnan(x) and math.isnan(y) for x, y in pairs)


def assert_bitwise(on: list[dict], off: list[dict]) -> None:
    for rank, (a, b) in enumerate(zip(on, off, strict=True)):
        assert same(a["losses"], b["losses"]), f"rank {rank}: losses differ"
        assert a["after"] == b["after"], f"rank {rank}: parameters or Adam state differ after a step"


def assert_whole_tensors(ranks: list[dict]) -> int:
    """Every rank's statistics of every parameter-side tensor equal those of the whole tensor."""
    checked = 0
    for rank, result in enumerate(ranks):
        for step, (truth, got) in enumerate(zip(result["truth"], result["monitor"], strict=True)):
            for key, want in truth.items():
                assert key in got, f"rank {rank} step {step}: {key} not recorded"
                for stat in ("min", "max", "norm"):
                    x, y = got[key][stat], want[stat]
                    assert abs(x - y) <= RTOL * max(abs(y), 1e-12), (rank, step, key, stat, x, y)
                    checked += 1
    return checked


def test_compiled_2x2_with_mixed_precision_is_bitwise_and_exact(compiled, eager):
    """Each block compiled (aot_eager) between TP and FSDP2, bf16 parameters, 2 micro-batches: every loss,
    parameter and Adam state bitwise those of the same job without the monitor; every parameter-side
    statistic that of the whole tensor; every row the eager job records, or named in one warning line per
    reason."""
    _, runs = compiled
    assert_bitwise(runs["on"], runs["off"])
    assert assert_whole_tensors(runs["on"]) > 3 * 4 * 21 * 3
    left_out: dict[str, int] = {}
    for line in runs["on"][0]["log"]:
        found = re.match(r"trainmon: (\d+) activation rows are not recorded: they are (.*?) \(docs", line)
        if found:
            left_out[found[2]] = int(found[1])
    assert set(left_out) == {
        "DTensors, whose placements compiled code does not keep",
        "tensor subclasses (such as tensor parallelism's AsyncCollectiveTensor) entering compiled code, "
        "whose gradient an autograd function in the graph would cut off from the model",
    }
    eager_rows = {r.split("#")[0] for r in eager[1]["on"][0]["rows"][-1]}
    compiled_rows = set(runs["on"][0]["rows"][-1])
    assert compiled_rows <= eager_rows
    missing = eager_rows - compiled_rows
    assert all(key.startswith(("actv/", "actv_grad/")) for key in missing), missing
    assert len(missing) == sum(left_out.values())


def test_eager_2x2_with_and_without_sequence_parallelism_is_bitwise(eager):
    _, runs = eager
    assert_bitwise(runs["on"], runs["off"])
    assert_bitwise(runs["sp"], runs["sp_off"])
    assert assert_whole_tensors(runs["on"]) > 0
    assert assert_whole_tensors(runs["sp"]) > 0


def test_3d_with_a_pipeline_stage_is_bitwise_and_exact(pipelined):
    """(pp, dp, tp) = (2, 2, 2) on 8 ranks: torchtitan's split of the model into two pipeline stages under the
    GPipe schedule (2 micro-batches), each stage tensor-parallel inside FSDP2 with bf16 parameters."""
    _, runs = pipelined
    assert_bitwise(runs["on"], runs["off"])
    assert assert_whole_tensors(runs["on"]) > 0
    for rank, result in enumerate(runs["on"]):
        last_stage = rank >= 4
        assert len(result["losses"]) == (2 * 3 if last_stage else 0)
        rows = set(result["rows"][-1])
        # each stage records its own modules: the embedding on the first, the output on the last
        assert ("actv/tok_embeddings.output" in rows) != last_stage
        assert ("actv/output.output" in rows) == last_stage
        assert f"grad_unreduced/layers.{int(last_stage)}.attention.wq.weight" in rows


def test_inductor_blocks_with_parameter_side_statistics_are_bitwise(inductor):
    """Blocks compiled with inductor (C++ kernels): gradients, parameters and Adam state statistics leave
    the compiled code as it is, so the job is bitwise the one without the monitor, and exact."""
    _, runs = inductor
    assert_bitwise(runs["params"], runs["off"])
    assert assert_whole_tensors(runs["params"]) > 0


def test_a_nan_on_one_rank_lets_the_job_run_to_its_end(compiled):
    """``continue``: the job runs to its end as it would without the monitor (the same losses up to the NaN,
    NaN on rank 2's tensor-parallel group at the NaN step, NaN everywhere after the poisoned update), and the
    anomaly names rank 2's attention_norm as the origin."""
    _, runs = compiled
    for rank in range(4):
        losses = runs["nan"][rank]["losses"]
        assert same(losses[: 2 * NAN_STEP], runs["off"][rank]["losses"][: 2 * NAN_STEP])
        assert math.isnan(losses[2 * NAN_STEP]) == (rank in (2, 3))
        assert all(math.isnan(loss) for loss in losses[2 * (NAN_STEP + 1) :])
        assert len(runs["nan"][rank]["after"]) == 3
    assert any(
        f"NaN at step {NAN_STEP} rank 2: actv layers.0.attention_norm.output (origin, forward)" in line
        for line in runs["nan"][2]["log"]
    )


@pytest.mark.parametrize("job", ["raise", "group_skip"])
def test_a_nan_step_is_kept_from_landing_on_every_rank(compiled, job):
    """``raise`` (NaN on rank 2) and ``skip`` (NaN on ranks 2 and 3: a tensor-parallel group) keep the NaN
    step's update from landing on all four ranks (parameters and Adam state bitwise as before it); ``raise``
    then raises on every rank at that step, ``skip`` trains on."""
    _, runs = compiled
    for rank, result in enumerate(runs[job]):
        before, after = result["before"][NAN_STEP], result["after"][NAN_STEP]
        assert after == before, f"rank {rank}: the NaN step's update landed"
        earlier = zip(result["before"][:NAN_STEP], result["after"][:NAN_STEP], strict=True)
        assert all(b != a for b, a in earlier)
        if job == "raise":
            assert result["raised"]["step"] == NAN_STEP
            message = result["raised"]["message"]
            assert f"the update of step {NAN_STEP} was not applied" in message
            if rank == 2:
                assert message.startswith("nan in actv layers.0.attention_norm.output")
        else:
            assert "raised" not in result and len(result["after"]) == 3
            assert result["after"][NAN_STEP + 1] != result["before"][NAN_STEP + 1]
            assert all(math.isfinite(loss) for loss in result["losses"][2 * (NAN_STEP + 1) :])


def test_explain_names_the_rank_and_module_that_made_the_nan(compiled):
    out, _ = compiled
    run = out / "nan" / "run"
    text = subprocess.run(
        [*TRAINMON, "analyze", str(run), "--explain"], capture_output=True, text=True, check=True
    ).stdout
    assert f"FIRST NaN/Inf in {run}: step {NAN_STEP}, rank 2: actv layers.0.attention_norm.output" in text
    assert "the NaN/Inf was made inside layers.0.attention_norm, by its own computation" in text


def test_explain_names_the_rank_that_made_the_nan_when_statistics_are_merged_over_tp(eager):
    """Eager, the activations inside tensor parallelism are recorded whole (merged over the TP group): rank
    3's merged rows carry rank 2's NaN, yet the origin is rank 2's attention_norm, and rank 3 says it
    received the NaN from another rank."""
    out, _ = eager
    run = out / "nan" / "run"
    text = subprocess.run(
        [*TRAINMON, "analyze", str(run), "--explain"], capture_output=True, text=True, check=True
    ).stdout
    assert f"FIRST NaN/Inf in {run}: step {NAN_STEP}, rank 2: actv layers.0.attention_norm.output" in text
    assert "the NaN/Inf was made inside layers.0.attention_norm" in text
    partner = subprocess.run(
        [*TRAINMON, "analyze", str(run), "--explain", "--rank", "3"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "another rank" in partner and "made inside layers.0.attention.wq" not in partner


def compare(a: Path, b: Path) -> str:
    return subprocess.run(
        [*TRAINMON, "compare", str(a), str(b), "--no-report"], capture_output=True, text=True
    ).stdout


def test_fp32_and_bf16_runs_agree_and_a_changed_epsilon_is_found(eager):
    """No divergence between fp32 and bf16 mixed precision (with FSDP2 reducing every micro-batch, and
    reducing only the last: grad_unreduced is each micro-batch's own gradient in both dtypes); an RMSNorm's
    epsilon changed in the bf16 run is found where it is: that norm, forward."""
    out, _ = eager
    run = {name: out / name / "run" for name in EAGER}
    for a, b in (("fp32", "on"), ("fp32_nosync", "bf16_nosync"), ("fp32", "bf16_nosync")):
        assert "no divergence" in compare(run[a], run[b]).splitlines()[1], (a, b)
    found = compare(run["fp32"], run["eps"]).splitlines()
    assert found[1].startswith("DIVERGED at step 0, rank 0, phase forward: actv layers.1.ffn_norm.output")
    assert found[2].startswith("  cause [forward]: layers.1.ffn_norm's forward")

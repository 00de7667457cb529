"""``trainmon analyze RUN --explain``: what the run's files say about its first NaN/Inf.

End to end on a real tiny torch run with ``alert.capture: exact`` (test_plugin_exact_run.py: module
``layers.1`` makes a NaN and an Inf from two clean inputs at step 4), with the loss scale and learning rate
tracked or not; then runs written by hand (statistics CSV in the documented columns, anomalies through
``AnomalyLog``) for the verdicts a tiny float32 run cannot reach: an input near float16's max, an input
already bad, a parameter already bad, skipped steps, no statistics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from acc_runs import NAN_STEP as ACC_NAN_STEP
from acc_runs import write_acc_run
from test_plugin_exact_run import INPUTS, NAN_STEP, ORIGIN, ORIGIN_MODULE, REASON, write_exact_torch_run

import trainmon
from trainmon.anomaly.log import AnomalyLog
from trainmon.cli import main
from trainmon.read.dump_contents import load_dump
from trainmon.read.explain import NEAR_MAX_FRACTION, explain
from trainmon.run.dumps import list_dumps
from trainmon.run.records import Anomaly

pytestmark = pytest.mark.timeout(120)


def run_cli(capsys, *args: str) -> str:
    assert main(["analyze", *args]) == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def tracked(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("explain") / "run"
    # both double at step 4: the loss scale grew and the learning rate rose at the NaN step
    write_exact_torch_run(run, lr=0.01, loss_scale=65536.0)
    return run


@pytest.fixture(scope="module")
def untracked(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("explain_plain") / "run"
    write_exact_torch_run(run)
    return run


def table(out: str) -> dict[str, list[str]]:
    """The statistics table: name -> its other cells."""
    body = out.split("STATISTICS AT STEP", 1)[1].split("  =>", 1)[0].splitlines()[2:]
    return {cells[1]: [cells[0], *cells[2:]] for cells in (line.split() for line in body)}


def test_explain_names_the_origin_its_clean_inputs_and_the_exact_dumps(tracked, capsys):
    out = run_cli(capsys, str(tracked), "--explain")
    lines = out.splitlines()
    assert lines[0] == f"FIRST NaN/Inf in {tracked}: step {NAN_STEP}, rank 0: actv {ORIGIN} [nan]"
    assert lines[1] == f"  origin: actv {ORIGIN} (origin, forward, micro-step 0, rank 0)"
    assert f"STATISTICS AT STEP {NAN_STEP} (module {ORIGIN_MODULE}, rank 0, micro-step 0)" in lines
    exact = {e.name: e for e in list_dumps(tracked) if e.step == NAN_STEP and e.kind == "actv"}
    rows = table(out)
    assert list(rows) == [*INPUTS, ORIGIN, f"{ORIGIN_MODULE}.lin.bias", f"{ORIGIN_MODULE}.lin.weight"]
    for name in (*INPUTS, ORIGIN):  # the CSV's statistics are those of the dumped tensors
        x, _ = load_dump(tracked / exact[name].path)
        finite = x[torch.isfinite(x)]
        max_abs = finite.abs().max().item()
        bad = name == ORIGIN
        assert rows[name] == [
            "output" if bad else "input",
            "float32",
            "NO" if bad else "yes",
            "1" if bad else "0",
            "1" if bad else "0",
            f"{max_abs:.6g}",
            f"{max_abs / torch.finfo(torch.float32).max:.2g}",
        ]
    assert rows[f"{ORIGIN_MODULE}.lin.weight"][:3] == ["param", "float32", "yes"]
    x0, _ = load_dump(tracked / exact[INPUTS[0]].path)
    x1, _ = load_dump(tracked / exact[INPUTS[1]].path)
    biggest = max(x0.abs().max().item(), x1.abs().max().item())
    assert (
        f"  => the inputs of {ORIGIN_MODULE} were finite and far from float32's largest value (|x| up to "
        f"{biggest:.6g}): the NaN/Inf was made inside {ORIGIN_MODULE}, by its own computation or its "
        "parameters"
    ) in lines
    assert f"LOSS SCALE, LEARNING RATE, SKIPPED STEPS (steps 0-{NAN_STEP}, rank 0)" in lines
    assert "  loss scale (loss_scale): 131072 at step 4; changed at step 4: 65536 -> 131072" in lines
    assert "  learning rate (lr): 0.02 at step 4; changed at step 4: 0.01 -> 0.02" in lines
    assert "  skipped steps: none recorded in steps 0-3" in lines

    # the dumps: the exact capture of step 4, the module call first, then the scalars, then the module's
    # parameters with their gradient and Adam state; the rest of that capture counted
    files = [line.strip() for line in lines if line.strip().endswith(".safetensors")]
    step4 = [e for e in list_dumps(tracked) if e.step == NAN_STEP]
    assert all(e.reason == REASON for e in step4)
    by_key = {(e.kind, e.name): str(tracked / e.path) for e in step4}
    params = [
        (kind, f"{ORIGIN_MODULE}.lin.{p}")
        for p in ("bias", "weight")
        for kind in ("param_origin", "grad_reduced", "exp_avg", "exp_avg_sq")
    ]
    expected = [
        ("actv", INPUTS[0]),
        ("actv", INPUTS[1]),
        ("actv", ORIGIN),
        ("scalar", "loss"),
        ("scalar", "loss_scale"),
        ("scalar", "lr"),
        *params,
    ]
    assert files == [by_key[k] for k in expected]
    assert f"  at step {NAN_STEP} (alert.capture: exact), the origin module's call first:" in lines
    more = len(step4) - len(expected)
    assert more == 16  # layers.0 and layers.2: 2 parameters each, 4 tensors a parameter
    assert (
        f"  + {more} more of that capture (other parameters, gradients, Adam moments): "
        f"trainmon dump ls {tracked} --step {NAN_STEP}"
    ) in lines


def test_explain_says_not_recorded_for_what_was_not_tracked(untracked, capsys):
    lines = run_cli(capsys, str(untracked), "--explain").splitlines()
    assert '  loss scale: not recorded (track it: monitor.track("loss_scale", scale))' in lines
    assert '  learning rate: not recorded (track it: monitor.track("lr", lr))' in lines


def test_explain_json(tracked, capsys):
    doc = json.loads(run_cli(capsys, str(tracked), "--explain", "--json"))
    assert (doc["first"]["step"], doc["origin"]["name"], doc["module"]) == (NAN_STEP, ORIGIN, ORIGIN_MODULE)
    assert [(t["role"], t["name"], t["finite"], t["near_max"]) for t in doc["tensors"][:3]] == [
        ("input", INPUTS[0], True, False),
        ("input", INPUTS[1], True, False),
        ("output", ORIGIN, False, False),
    ]
    assert doc["loss_scale"] == [
        {
            "name": "loss_scale",
            "values": [[0, 65536.0], [1, 65536.0], [2, 65536.0], [3, 65536.0], [4, 131072.0]],
            "changes": [[4, 65536.0, 131072.0]],
        }
    ]
    assert [d["name"] for d in doc["exact_dumps"][:3]] == [*INPUTS, ORIGIN]
    assert doc["exact_dumps"][0]["file"] == str(tracked / doc["exact_dumps"][0]["path"])
    assert doc["more_exact_dumps"] == 16 and doc["other_dumps"] == [] and doc["skipped"] == []


# ----------------------------------------------------------------------------- runs written by hand

HEADER = "vpp_stage,name,step,micro_step,min,max,mean,norm,zeros,nans,infs,shape,dtype\n"


def csv_row(name: str, step: int, lo: float, hi: float, nans: int = 0, infs: int = 0, dtype="float16") -> str:
    return f'0,{name},{step},0,{lo},{hi},0.0,1.0,0.0,{nans},{infs},"[4, 8]",torch.{dtype}\n'


def hand_run(tmp_path: Path, actv: list[str], params: list[str] = (), anomalies: list[Anomaly] = ()) -> Path:
    run = tmp_path / "run"
    (run / "rank_0").mkdir(parents=True)
    (run / "rank_0" / "actv.csv").write_text(HEADER + "".join(actv))
    if params:
        (run / "rank_0" / "param_origin.csv").write_text(HEADER + "".join(params))
    origin = Anomaly(step=9, kind="actv", name="blk.attn.output", value=3.0, rule="inf", seq=4, stat="infs",
                     rank=0, micro_step=0, phase="forward", origin=True)  # fmt: skip
    by_step: dict[int, list[Anomaly]] = {}
    for a in [*anomalies, origin]:
        by_step.setdefault(a.step, []).append(a)
    with AnomalyLog(run, 0) as log:
        for step, items in sorted(by_step.items()):
            log.write_step(step, items)
    return run


def verdict(run: Path) -> str:
    e = explain(run)
    assert e is not None
    return e.verdict


def test_an_input_near_float16_max_is_named_as_a_likely_overflow(tmp_path, capsys):
    run = hand_run(
        tmp_path,
        [
            csv_row("blk.attn.input", 9, -1.5, 2.0),
            csv_row("blk.attn.input_mask", 9, -31000.0, 0.0),  # 31000 / 65504 = 0.47 of float16's max
            csv_row("blk.attn.output", 9, -2.0, 2.0, infs=3),
            csv_row("blk.attn.input", 8, -70000.0, 2.0),  # another step: not read
        ],
    )
    assert 31000 / 65504 >= NEAR_MAX_FRACTION > 2.0 / 65504
    assert verdict(run) == (
        "input blk.attn.input_mask reaches 0.47 of float16's largest value (|x| up to 31000): an overflow "
        "inside blk.attn is likely"
    )
    rows = table(run_cli(capsys, str(run), "--explain"))
    assert rows["blk.attn.input_mask"] == ["input", "float16", "yes", "0", "0", "31000", "0.47", "(near)"]
    assert rows["blk.attn.input"] == ["input", "float16", "yes", "0", "0", "2", "3.1e-05"]


def test_a_bad_input_points_upstream_and_a_bad_parameter_to_an_earlier_update(tmp_path):
    bad_input = hand_run(
        tmp_path / "a",
        [csv_row("blk.attn.input", 9, -1.0, 1.0, nans=2), csv_row("blk.attn.output", 9, 0.0, 1.0, infs=3)],
    )
    assert verdict(bad_input) == (
        "input blk.attn.input of blk.attn was already non-finite: the NaN/Inf came from upstream"
    )
    bad_param = hand_run(
        tmp_path / "b",
        [csv_row("blk.attn.input", 9, -1.0, 1.0), csv_row("blk.attn.output", 9, 0.0, 1.0, infs=3)],
        [
            csv_row("blk.attn.qkv.weight", 9, -1.0, 1.0, nans=1),
            csv_row("blk.other.weight", 9, 0.0, 1.0, nans=1),
        ],
    )
    assert verdict(bad_param) == (
        "parameter blk.attn.qkv.weight of blk.attn was already non-finite before this step's update: an "
        "earlier update wrote it"
    )


def test_skipped_steps_before_the_nan_are_listed(tmp_path, capsys):
    skips = [
        Anomaly(step=s, kind="grad_unreduced", name="w", value=1.0, rule=rule, seq=0, stat="nans", rank=0,
                micro_step=0, phase="backward")
        for s, rule in ((2, "loss_scale_overflow"), (7, "loss_scale_overflow"), (8, "step_skipped"))
    ]  # fmt: skip
    run = hand_run(tmp_path, [csv_row("blk.attn.input", 9, -1.0, 1.0)], anomalies=skips)
    lines = run_cli(capsys, str(run), "--explain").splitlines()
    assert "  skipped steps: 2 (loss_scale_overflow), 7 (loss_scale_overflow), 8 (step_skipped)" in lines
    assert (
        "  none at step 9: with alert.capture: exact the monitor dumps the origin module's inputs and "
        "outputs at the step it happens"
    ) in lines
    # the loss-scale overflows are not NaN anomalies: the first NaN/Inf is still the one of step 9
    assert lines[0] == f"FIRST NaN/Inf in {run}: step 9, rank 0: actv blk.attn.output [inf]"


def test_without_statistics_or_without_nan_it_says_so(tmp_path, capsys):
    run = hand_run(tmp_path, [])
    for p in (run / "rank_0").iterdir():
        p.unlink()
    out = run_cli(capsys, str(run), "--explain")
    assert f"  no statistics CSV in {run / 'rank_0'} (format without csv?)" in out.splitlines()
    assert re.search(r"=> no statistics to judge by: no statistics CSV in", out)

    clean = tmp_path / "clean"
    with AnomalyLog(clean, 0) as log:
        log.write_step(
            1,
            [
                Anomaly(
                    step=1,
                    kind="scalar",
                    name="loss",
                    value=9.0,
                    rule="turbulence",
                    seq=0,
                    stat="mean",
                    rank=0,
                )
            ],
        )
    assert run_cli(capsys, str(clean), "--explain") == f"no NaN/Inf anomaly recorded in {clean}\n"
    assert json.loads(run_cli(capsys, str(clean), "--explain", "--json")) is None


# ------------------------------------------------------------- gradient accumulation (issue 22, points 1, 5)


@pytest.fixture(scope="module")
def acc_runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("explain_acc")
    runs = {"parent": root / "parent", "leaf": root / "leaf"}
    write_acc_run(runs["parent"], micro_steps=2, nan_micro=1, where="parent")
    write_acc_run(runs["leaf"], micro_steps=4, nan_micro=2, where="leaf")
    return runs


@pytest.mark.parametrize(
    ("where", "module", "micro"), [("parent", "1", 1), ("leaf", "1.v", 2)], ids=["parent", "leaf"]
)
def test_explain_with_gradient_accumulation_starts_at_the_origins_micro_step(
    acc_runs, capsys, where, module, micro
):
    run = acc_runs[where]
    out = run_cli(capsys, str(run), "--explain")
    lines = out.splitlines()
    assert lines[1] == f"  origin: actv {module}.output (origin, forward, micro-step {micro}, rank 0)"
    assert f"STATISTICS AT STEP {ACC_NAN_STEP} (module {module}, rank 0, micro-step {micro})" in lines
    assert re.search(rf"=> the inputs of {re.escape(module)} were finite", out)
    # the dumps to open: the origin module's call at the origin's micro-step first, then its other calls
    dumps_part = out.split("DUMPS TO OPEN", 1)[1].splitlines()
    listed = [line.strip() for line in dumps_part if ".safetensors" in line]
    assert [Path(p).name for p in listed[:2]] == [
        f"actv__{module}.input__m{micro}.safetensors",
        f"actv__{module}.output__m{micro}.safetensors",
    ]
    others = [Path(p).name for p in listed[2:] if Path(p).name.startswith(f"actv__{module}.")]
    assert others[:2] == [f"actv__{module}.input__m0.safetensors", f"actv__{module}.output__m0.safetensors"]
    doc = json.loads(run_cli(capsys, str(run), "--explain", "--json"))
    assert doc["origin"]["micro_step"] == micro
    assert [(d["name"], d["micro_step"]) for d in doc["exact_dumps"][:2]] == [
        (f"{module}.input", micro),
        (f"{module}.output", micro),
    ]


# ------------------------------------------------------------------ the verdict knows autocast (issue 22, 6)


def test_the_verdict_judges_an_input_by_the_dtype_its_module_computes_in_under_autocast(tmp_path, capsys):
    """A float32 input with |x| up to 170168 (2.6 x float16's largest value) into a Linear that computes in
    float16 under autocast: its float16 output is Inf/NaN. Far from float32's largest value, yet beyond the
    range of the dtype the Linear computes in."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    config = {"xy_distribution": True, "format": "csv", "targets": {"0": {}}}
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run"):
        for step in range(2):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            if step == 1:
                x[0, 0] = 170168.0
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    e = explain(tmp_path / "run")
    assert (e.origin.name, e.module) == ("0.output", "0")
    assert [(t.role, t.dtype, t.finite) for t in e.tensors] == [
        ("input", "float32", True),
        ("output", "float16", False),
    ]
    assert e.verdict == (
        "input 0.input (|x| up to 170168, float32) exceeds float16's range under autocast (float16's largest "
        "value is 65504, and 0 computes in float16): the overflow happened inside 0, casting it down"
    )
    out = run_cli(capsys, str(tmp_path / "run"), "--explain")
    assert f"  => {e.verdict}" in out.splitlines()


# -------------------------------------------------- --step and --rule are honoured or refused (issue 22, 7)


def test_explain_honours_step_and_rule_and_refuses_what_it_cannot_do(tracked, capsys):
    later = run_cli(capsys, str(tracked), "--explain", "--step", str(NAN_STEP + 1)).splitlines()
    assert later[0].startswith(f"FIRST NaN/Inf in {tracked}: step {NAN_STEP + 1}, rank 0: ")
    assert run_cli(capsys, str(tracked), "--explain", "--step", "100") == (
        f"no NaN/Inf anomaly recorded in {tracked} at step 100\n"
    )
    assert json.loads(run_cli(capsys, str(tracked), "--explain", "--step", "100", "--json")) is None
    inf = run_cli(capsys, str(tracked), "--explain", "--rule", "inf").splitlines()
    assert inf[0] == f"FIRST NaN/Inf in {tracked}: step {NAN_STEP}, rank 0: actv {ORIGIN} [inf]"
    refused = {
        ("--rule", "turbulence"): "error: --explain explains a NaN/Inf anomaly; --rule turbulence names "
        "neither inf nor nan",
        ("--rule", "nan,turbulence"): "error: --explain explains a NaN/Inf anomaly; give --rule nan without "
        "turbulence",
        ("--top", "3"): "error: --top lists the K earliest anomalies; --explain explains one: give one of "
        "them",
    }
    for args, message in refused.items():
        assert main(["analyze", str(tracked), "--explain", *args]) == 2
        assert capsys.readouterr() == ("", message + "\n")


def test_a_rank_without_csv_is_explained_from_the_statistics_store(tmp_path, capsys, monkeypatch):
    """Above 16 ranks only the ranks with TensorBoard events write CSV (csv_ranks): --explain then takes the
    origin module's statistics from the statistics store, the same numbers (micro-steps merged), and says
    so."""
    import test_plugin_exact_run

    monkeypatch.setitem(test_plugin_exact_run.CONFIG, "format", ["tensorboard", "csv"])  # with the store
    run = tmp_path / "run"
    write_exact_torch_run(run)
    want = table(run_cli(capsys, str(run), "--explain"))
    for path in (run / "rank_0").glob("*.csv"):
        path.unlink()
    out = run_cli(capsys, str(run), "--explain")
    assert "(statistics from the statistics store: rank 0 wrote no CSV (format, csv_ranks)" in out
    got = table(out)
    assert list(got) == list(want)
    # role, dtype (the store keeps each tensor's: no "?"), finite, counts, max |x|: the same as from the CSV
    assert got == want and all(cells[1] != "?" for cells in got.values())
    assert "inputs of layers.1 were finite" in out

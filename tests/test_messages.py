"""Messages that say what happened (issue 22, point 10): each one named a wrong cause, stayed silent, or read
badly, and each test here failed with the old message. (``alert.on_nan: exit`` naming its key:
test_on_nan_before_update.py.)"""

from __future__ import annotations

import datetime
import logging
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import trainmon
from trainmon.anomaly.alerts import AlertDispatcher, CallbackSink
from trainmon.cli import main
from trainmon.run.records import Anomaly
from trainmon.writer.dumps import DumpWriter


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_adam_state_message_names_the_real_cause_no_target_matched(tmp_path, caplog):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    config = {"targets": {"nothing.here": {}}, "mv_distribution": True}
    with caplog.at_level(logging.WARNING, "trainmon"), trainmon.attach(model, optimizer, config=config,
                                                                        logdir=tmp_path / "run"):  # fmt: skip
        one_step(model, optimizer)
    said = warnings_of(caplog)
    assert "trainmon: no target matches a parameter that AdamW updates; mv/ur statistics record nothing " \
           "(targets choose the parameters, as for wg_distribution)" in said  # fmt: skip
    assert not any("keeps no exp_avg" in m for m in said)  # AdamW does keep them


def test_all_xy_without_xy_distribution_says_it_records_no_activation(tmp_path, caplog, capsys):
    model = nn.Sequential(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    note = (
        "all_xy: true records no activation without xy_distribution: true (as in msprobe, xy_distribution "
        "turns activations on; all_xy widens them to every module)"
    )
    with caplog.at_level(logging.WARNING, "trainmon"), trainmon.attach(
        model, optimizer, config={"all_xy": True}, logdir=tmp_path / "run"
    ):
        one_step(model, optimizer)
    assert f"trainmon: {note}" in warnings_of(caplog)
    path = tmp_path / "c.json"
    path.write_text('{"all_xy": true}')
    assert main(["config", "check", str(path)]) == 0
    assert f"  note: {note}" in capsys.readouterr().out.splitlines()


def test_a_target_of_the_inner_model_under_ddp_suggests_its_wrapped_name(tmp_path, caplog):
    with tempfile.NamedTemporaryFile() as store:
        dist.init_process_group(
            "gloo", init_method=f"file://{store.name}", rank=0, world_size=1,
            timeout=datetime.timedelta(seconds=30),
        )  # fmt: skip
        try:
            model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            with caplog.at_level(logging.WARNING, "trainmon"), trainmon.attach(
                model, optimizer, config={"targets": {"0": {}}, "wg_distribution": True},
                logdir=tmp_path / "run",
            ):  # fmt: skip
                one_step(model, optimizer)
        finally:
            dist.destroy_process_group()
    assert (
        "trainmon: target '0' matches no module or parameter of the model; closest names: 'module.0'"
        in warnings_of(caplog)
    )


def test_counts_of_one_are_singular(tmp_path, capsys):
    run = tmp_path / "run"
    (entry,) = [DumpWriter(run, rank=0).write(1, 0, "scalar", "loss", torch.tensor(2.0), "exact: x")]
    assert main(["dump", "show", str(run / entry.path)]) == 0
    assert "tensor: float32 [] (1 element)" in capsys.readouterr().out.splitlines()
    (run / "rank_0").mkdir()
    (run / "rank_0" / "scalar.csv").write_text(
        "vpp_stage,name,step,micro_step,min,max,mean,norm,zeros,nans,infs,shape,dtype\n"
        "0,loss,1,0,2,2,2,2,0,0,0,[],torch.float32\n"
    )
    assert main(["csv2tb", str(run), "-o", str(tmp_path / "tb")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1 row (7 scalars, 1 rank-step) from 1 file of 1 rank -> "), out


def test_explain_without_dumps_offers_none_to_open(tmp_path, capsys):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with trainmon.attach(model, optimizer, config={"xy_distribution": True, "format": "csv"},
                         logdir=tmp_path / "run"):  # fmt: skip
        with torch.no_grad():
            model[1].weight[0, 0] = float("nan")
        one_step(model, optimizer)
    assert main(["analyze", str(tmp_path / "run"), "--explain"]) == 0
    out = capsys.readouterr().out
    assert "  none at step 0: with alert.capture: exact the monitor dumps" in out
    assert "open one with" not in out


def test_under_the_rate_limit_the_burst_line_still_names_its_origin():
    """Step 10: origin A, B bad too. Step 20: origin A again (held back by the rate limit) and a new tensor
    C: the line goes out for C, and names A, the origin, first."""
    got = []
    d = AlertDispatcher([CallbackSink(got.append)], rate_limit_s=300, clock=lambda: 1_000.0)

    def nan(step, name, seq, origin=False):
        return Anomaly(step=step, rank=0, kind="actv", name=name, stat="nans", value=4.0, rule="nan", seq=seq,
                       origin=origin, propagated=not origin)  # fmt: skip

    d.notify([nan(10, "A.output", 0, origin=True), nan(10, "B.output", 1)], run="r", rank=0)
    d.notify([nan(20, "A.output", 0, origin=True), nan(20, "C.output", 1)], run="r", rank=0)
    assert d.close(3)
    assert [a.lines for a in got] == [
        ("NaN at step 10 rank 0: actv A.output (origin, forward), 4 NaN; +1 more tensor",),
        ("NaN at step 20 rank 0: actv A.output (origin, forward), 4 NaN; +1 more tensor",),
    ]
    assert d.suppressed == 0

"""``trainmon export`` (issue 33): a run written with CSV and every tensor's TensorBoard scalars, exported
from its statistics store, gives the same bytes: every CSV file, and every record of the event files after
the first (which holds the time its writer opened the file). Also across sealed segments, a layout that
changes and a job resumed into the run; filtered by rank, step and name; with what the store cannot hold said.
CSV is written when a config asks for it: an msprobe config keeps its CSV."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FULL_OUTPUTS
from poison_model import make_model, train_step

import trainmon
from trainmon.anomaly.sink import AnomalySink
from trainmon.cli import main
from trainmon.config import load_config
from trainmon.csvtb.export import ExportError, _dtype_text, export
from trainmon.csvtb.tb2csv import _records
from trainmon.run.columnar import segments
from trainmon.run.layout import is_run, rank_dir, stats_rank_dir
from trainmon.run.records import N_PARTIALS, Row, StepRecord
from trainmon.writer.manifest import ManifestSink
from trainmon.writer.outputs import format_sinks
from trainmon.writer.thread import WriterThread

KINDS = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "mv_distribution": True,
         "param_distribution": True, "ur_distribution": True}  # fmt: skip


def _events(directory: Path) -> list[bytes]:
    """Every record of the event files of a folder, in file order, without each file's first record."""
    out: list[bytes] = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        out += list(_records(path))[1:]
    return out


def _same_files(written: Path, exported: Path, ranks) -> int:
    """Asserts that every CSV file and event record of ``ranks`` is the same; returns the files compared."""
    compared = 0
    for r in ranks:
        mine = sorted(p.name for p in rank_dir(written, r).glob("*.csv"))
        assert mine == sorted(p.name for p in rank_dir(exported, r).glob("*.csv")), r
        for name in mine:
            got = (rank_dir(exported, r) / name).read_bytes()
            assert got == (rank_dir(written, r) / name).read_bytes(), name
            compared += 1
    return compared


class Chunk(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.timeout(120)
@pytest.mark.parametrize("chunks", [1, 2])
def test_export_gives_the_bytes_the_writer_wrote(tmp_path, chunks):
    torch.manual_seed(0)
    model = [Chunk() for _ in range(chunks)]
    optimizer = torch.optim.AdamW([p for m in model for p in m.parameters()], lr=1e-2)
    run = tmp_path / "run"
    with trainmon.attach(model if chunks > 1 else model[0], optimizer, config={**KINDS, **FULL_OUTPUTS},
                         logdir=run) as mon:  # fmt: skip
        for step in range(5):
            x = torch.randn(3, 6)
            if step == 3:
                x[0, 1] = float("nan")  # NaN and Inf counts, NaN statistics
            for m in model:
                x = m(x)
            loss = x.square().mean()
            mon.track("loss", loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for fmt in ("csv", "tensorboard"):
        assert main(["export", str(run), "--format", fmt]) == 0
    assert _same_files(run, tmp_path / "run-csv", [0]) == 11
    written, exported = _events(rank_dir(run, 0)), _events(rank_dir(tmp_path / "run-tensorboard", 0))
    # each step's statistics, then its times (time/*_ms from the timing table)
    assert len(written) == 10 and exported == written
    assert [b"time/step_ms" in e for e in written] == [False, True] * 5
    if chunks > 1:
        text = (rank_dir(run, 0) / "actv.csv").read_text()
        assert "\n1,layers.0.output," in text  # the second chunk's vpp_stage


DTYPES = ("torch.float32", "torch.bfloat16")


def _layout(step: int) -> tuple[Row, ...]:
    """20 tensors, and from step 1500 on one more in the middle (a layout that changes)."""
    rows = [
        Row(kind, f"layers.{i}.{part}", 0, 0, "forward", (4, 8 + i), DTYPES[i % 2])
        for kind in ("actv", "grad_reduced")
        for i in range(5)
        for part in ("fc.output", "fc.input")
    ]
    if step >= 1500:
        rows.insert(7, Row("actv", "late.output", 0, 0, "forward", (3,), "torch.float16"))
    return tuple(rows)


def _partials(step: int, rows: tuple[Row, ...]) -> np.ndarray:
    rng = np.random.default_rng(step)
    n = len(rows)
    p = np.empty((n, N_PARTIALS))
    p[:, 0] = [np.prod(r.shape) for r in rows]
    p[:, 1:4] = 0
    p[:, 4] = -rng.lognormal(size=n)
    p[:, 5] = rng.lognormal(size=n) * 10.0 ** rng.integers(-8, 8, n)
    p[:, 6] = rng.normal(size=n)
    p[:, 7] = p[:, 5] ** 2 * p[:, 0] * rng.uniform(0.1, 0.9, n)
    if step % 700 == 5:
        p[3, 1] = 2  # NaNs now and then
    return p


def _write(run: Path, steps: range, config, began: float = 1.75e9) -> None:
    """Steps through the sinks the monitor builds (rank 0 of one), as a job writes them."""
    sinks = format_sinks(config, run, 0, False, world=1)
    sinks.append(AnomalySink(config.alert, 0, run.name, run))  # the steps table: each step's wall time
    sinks.append(ManifestSink(run, {"world_size": 1, "config": config.to_dict(), "chunks": 1}))
    writer = WriterThread(sinks, max_pending=64)
    for step in steps:
        rows = _layout(step)
        while writer.pending >= 60:
            writer.flush(10)
        writer.submit(StepRecord(step, 0, rows, _partials(step, rows), began + step * 0.25))
    assert writer.close(120)


@pytest.mark.timeout(300)
def test_export_across_segments_a_new_layout_and_a_resumed_job(tmp_path):
    config = load_config({**FULL_OUTPUTS, "alert": {"rate_limit_s": 0}})
    run = tmp_path / "run"
    _write(run, range(0, 2300), config)
    _write(run, range(2100, 2600), config, 1.76e9)  # resumed from step 2100: steps written twice, later
    found = segments(stats_rank_dir(run, 0))
    assert len(found) >= 4 and all(s.sealed for s in found)
    assert len(list(rank_dir(run, 0).glob("events.out.tfevents.*"))) == 2
    summary = export(run, tmp_path / "csv", fmt="csv")
    assert summary.steps == 2800 and not summary.notes
    assert _same_files(run, tmp_path / "csv", [0]) == 2
    export(run, tmp_path / "tb", fmt="tensorboard")
    written = _events(rank_dir(run, 0))
    assert len(written) == 2800 and _events(rank_dir(tmp_path / "tb", 0)) == written


@pytest.mark.timeout(120)
def test_ranks_steps_and_names_narrow_the_export_to_those_lines(tmp_path):
    config = load_config({**FULL_OUTPUTS, "alert": {"rate_limit_s": 0}})
    run = tmp_path / "run"
    _write(run, range(0, 30), config)
    out = tmp_path / "some"
    argv = ["export", str(run), "--format", "csv", "-o", str(out), "--ranks", "0", "--steps", "10:19",
            "--names", "layers.1.*", "grad_reduced/layers.4.fc.input"]  # fmt: skip
    assert main(argv) == 0
    for kind in ("actv", "grad_reduced"):
        lines = (rank_dir(run, 0) / f"{kind}.csv").read_text().splitlines(keepends=True)
        keep = [
            line for line in lines[1:]
            if 10 <= int(line.split(",")[2]) <= 19
            and (line.split(",")[1].startswith("layers.1.")
                 or (kind == "grad_reduced" and line.split(",")[1] == "layers.4.fc.input"))
        ]  # fmt: skip
        assert len(keep) == 10 * (2 + (kind == "grad_reduced"))
        assert (rank_dir(out, 0) / f"{kind}.csv").read_text() == lines[0] + "".join(keep)


@pytest.mark.timeout(120)
def test_merged_micro_steps_are_said_and_exported_once_a_step(tmp_path, capsys):
    model, optimizer = make_model()
    run = tmp_path / "run"
    with trainmon.attach(model, optimizer, config={"xy_distribution": True, "all_xy": True, **FULL_OUTPUTS},
                         logdir=run, grad_acc_steps=2):  # fmt: skip
        for _ in range(3):
            optimizer.zero_grad()
            for _ in range(2):
                model(torch.randn(4, 8)).square().mean().backward()
            optimizer.step()
    assert main(["export", str(run), "--format", "csv"]) == 0
    assert "trainmon export: note: some tensors had several micro-steps a step" in capsys.readouterr().err
    written = (rank_dir(run, 0) / "actv.csv").read_text().splitlines()
    exported = (rank_dir(tmp_path / "run-csv", 0) / "actv.csv").read_text().splitlines()
    assert written[0] == exported[0] and len(written) - 1 == 2 * (len(exported) - 1)
    assert {line.split(",")[3] for line in exported[1:]} == {"0"}


def test_what_export_refuses(tmp_path, capsys):
    model, optimizer = make_model()
    csv_only = tmp_path / "csv_only"
    config = {"wg_distribution": True, "format": "csv"}
    with trainmon.attach(model, optimizer, config=config, logdir=csv_only):
        train_step(model, optimizer, 0)
    assert main(["export", str(csv_only), "--format", "tensorboard"]) == 2
    assert "no statistics store" in capsys.readouterr().err
    run = tmp_path / "run"
    model, optimizer = make_model()
    with trainmon.attach(model, optimizer, config={"wg_distribution": True}, logdir=run):
        train_step(model, optimizer, 0)
    assert main(["export", str(run), "--format", "csv", "-o", str(tmp_path / "out")]) == 0
    assert main(["export", str(run), "--format", "csv", "-o", str(tmp_path / "out")]) == 2
    assert "holds 2 csv file(s) already" in capsys.readouterr().err
    assert main(["export", str(run), "--format", "csv", "-o", str(tmp_path / "out"), "--force"]) == 0
    assert main(["export", str(run), "--format", "csv", "--ranks", "3"]) == 2
    assert "no statistics store of rank(s) [3]" in capsys.readouterr().err
    with pytest.raises(ExportError, match="unknown statistic"):
        export(run, fmt="csv", ops=["norm", "mode"])
    assert not is_run(tmp_path / "out")  # the export writes beside the run, never a run of its own


def test_dtypes_are_spelled_as_each_framework_wrote_them():
    assert _dtype_text("bfloat16", "pytorch") == "torch.bfloat16"
    assert _dtype_text("bfloat16", "mindspore") == "BFloat16"
    assert _dtype_text("uint8", "mindspore") == "UInt8"
    assert _dtype_text("float32", "mindspore") == "Float32"
    assert _dtype_text(None, "pytorch") == ""


MSPROBE_CONFIG = {
    "targets": {"fc1": {}},
    "xy_distribution": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "format": "csv",
    "ops": ["min", "max", "norm", "zeros", "nans"],
    "ndigits": 12,
    "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": False},
}


@pytest.mark.timeout(120)
def test_an_msprobe_config_keeps_writing_its_csv(tmp_path):
    path = tmp_path / "monitor_config.json"
    path.write_text(json.dumps(MSPROBE_CONFIG, indent=4))
    run = tmp_path / "run"
    model, optimizer = make_model()
    with trainmon.attach(model, optimizer, config=str(path), logdir=run):
        for step in range(3):
            train_step(model, optimizer, step)
    files = sorted(p.name for p in rank_dir(run, 0).iterdir())
    assert files == ["actv.csv", "actv_grad.csv", "exp_avg.csv", "exp_avg_sq.csv", "grad_reduced.csv",
                     "grad_unreduced.csv"]  # fmt: skip
    header = "vpp_stage,name,step,micro_step,min,max,norm,zeros,nans,infs,shape,dtype\n"
    text = (rank_dir(run, 0) / "actv.csv").read_text()
    assert text.startswith(header) and text.count("\n") == 1 + 3 * 2  # fc1's input and output, 3 steps

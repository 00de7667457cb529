"""csv2tb / tb2csv: monitor runs and msprobe-format CSV to TensorBoard and back, values exact; bad input."""

from __future__ import annotations

import io
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tbparse import SummaryReader
from torch import nn

import trainmon
from trainmon.cli import main
from trainmon.csvtb import ConvertError, CsvError, convert, tb2csv
from trainmon.csvtb.tb2csv import read_scalars
from trainmon.run.timing import TIMES

pytestmark = pytest.mark.filterwarnings("ignore:The inplace keyword")  # tbparse on pandas 3

STATS = ["min", "max", "mean", "norm", "zeros", "nans"]


def f32(x: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def tb_values(directory: Path) -> dict[tuple[str, str, int], float]:
    """{(run, tag, step): value} of every scalar under ``directory`` read with tbparse."""
    df = SummaryReader(str(directory), extra_columns={"dir_name"}).scalars
    out = {}
    for run, tag, step, value in zip(df.dir_name, df.tag, df.step, df.value, strict=True):
        key = (str(run), str(tag), int(step))
        assert key not in out, f"two values for {key}"
        out[key] = float(value)
    return out


def assert_same_values(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected), (sorted(set(actual) ^ set(expected)))[:10]
    for key, want in expected.items():
        got = actual[key]
        assert (math.isnan(got) and math.isnan(want)) or got == want, (key, got, want)


# ---------------------------------------------------------------------------------------------
# trainmon run -> CSV -> csv2tb == what the monitor wrote to TensorBoard


class Chunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


@pytest.mark.parametrize("chunks", [1, 2])
def test_monitor_csv_converted_equals_monitor_tensorboard(tmp_path, chunks):
    torch.manual_seed(0)
    model = [Chunk() for _ in range(chunks)]
    params = [p for m in model for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    config = {
        "xy_distribution": True,
        "all_xy": True,
        "wg_distribution": True,
        "mv_distribution": True,
        "param_distribution": True,
        # both outputs this test compares, every tensor's scalars in TensorBoard (not defaults since issue 33)
        "format": ["tensorboard", "csv"],
        "tensorboard_tensors": "all",
        # the default ndigits: the shortest text that reads back as the float32 TensorBoard holds. (20
        # decimal places keep only ~15 significant digits of a 1e-5 value, which can round to the other
        # float32 neighbour when the value lies near the midpoint of two.)
    }
    run = tmp_path / "run"
    with trainmon.attach(model if chunks > 1 else model[0], opt, config=config, logdir=run) as mon:
        for _ in range(4):
            x = torch.randn(3, 4)
            for m in model:
                x = m(x)
            loss = F.mse_loss(x, torch.zeros_like(x))
            mon.track("loss", loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    out = tmp_path / "tb"
    assert main(["csv2tb", str(run), "-o", str(out)]) == 0
    direct = tb_values(run / "rank_0")
    # the step times (time/*_ms) are not statistics: msprobe CSV has no place for them (timing tables have)
    times = {k: v for k, v in direct.items() if k[1].startswith("time/")}
    direct = {k: v for k, v in direct.items() if k not in times}
    assert {tag for _, tag, _ in times} == {f"time/{t}_ms" for t in TIMES}
    converted = tb_values(out / "rank_0")
    assert len(direct) > 100
    if chunks > 1:
        assert any("/1:" in tag for _, tag, _ in direct)
    assert_same_values(converted, direct)


def test_micro_steps_kept_in_the_tag_and_merge_to_the_monitor_value(tmp_path):
    """With gradient accumulation the monitor merges micro-steps; csv2tb keeps one tag per micro-step
    (``:micro{m}``), and the max over them is the monitor's max."""
    torch.manual_seed(1)
    model = Chunk()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    cfg = {"xy_distribution": True, "all_xy": True, "ndigits": 20, "format": ["tensorboard", "csv"],
           "tensorboard_tensors": "all"}  # fmt: skip
    with trainmon.attach(model, opt, config=cfg, logdir=run, grad_acc_steps=2):
        for _ in range(2):
            for _ in range(2):
                model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    convert([run], tmp_path / "tb", workers=1)
    direct = tb_values(run / "rank_0")
    conv = tb_values(tmp_path / "tb" / "rank_0")
    for step in (0, 1):
        want = direct[("", "actv/fc.output/max", step)]
        parts = [conv[("", f"actv/fc.output:micro{m}/max", step)] for m in (0, 1)]
        assert max(parts) == want
    assert not any(tag.startswith("actv/fc.output/") for _, tag, _ in conv)


# ---------------------------------------------------------------------------------------------
# msprobe's documented format


def msprobe_fixture(root: Path, *, ranks=(0, 1), steps=6, per_file=2, seed=0) -> dict:
    """msprobe monitor output: ``<time>-rank<R>-<id>/<kind>_<a>-<b>.csv``; returns {(run, tag, step): f32}
    with csv2tb's tag rule (vpp prefix: rank 1 has two chunks; micro suffix: actv has two micro-steps)."""
    rnd = random.Random(seed)
    expected = {}
    for rank in ranks:
        d = root / f"Dec03_21-34-4{rank}-rank{rank}-ab12cd3{rank}"
        d.mkdir(parents=True)
        vpps = (0, 1) if rank == 1 else (0,)
        for kind, micro in (("actv", True), ("grad_reduced", False), ("exp_avg", False), ("other", False)):
            names = (
                ["layers.0.mlp.output", "layers.1.attn.input_0"] if kind == "actv" else ["a.weight", "b.bias"]
            )
            header = "vpp_stage,name,step" + (",micro_step" if micro else "") + "," + ",".join(STATS)
            for a in range(0, steps, per_file):
                lines = [header + ",shape,dtype"]
                for step in range(a, min(a + per_file, steps)):
                    for vpp in vpps:
                        for m in (0, 1) if micro else (None,):
                            for name in names:
                                vals = [round(rnd.uniform(-5, 5), 6) for _ in STATS]
                                if rnd.random() < 0.1:
                                    vals[0] = float("nan")
                                vals[-1] = rnd.randint(0, 3)
                                cells = [str(vpp), name, str(step)] + ([str(m)] if micro else [])
                                cells += [str(v) for v in vals] + ['"[8, 32]"', "torch.bfloat16"]
                                lines.append(",".join(cells))
                                label = f"{vpp}:{name}" if rank == 1 else name
                                if micro:
                                    label += f":micro{m}"
                                for s, v in zip(STATS, vals, strict=True):
                                    expected[(f"rank_{rank}", f"{kind}/{label}/{s}", step)] = f32(v)
                    if kind == "other":  # msprobe's collective-op row: no vpp_stage, step third
                        vals = [1.0, 2.0, 1.5, 3.25, 0.0, 0.0]
                        lines.append(
                            "all_reduce,"
                            + str(vals[0])
                            + f",{step},"
                            + ",".join(map(str, vals[1:]))
                            + ",nan,nan"
                        )
                        label = "0:all_reduce" if rank == 1 else "all_reduce"  # chunk 0 on a 2-chunk rank
                        for s, v in zip(STATS, vals, strict=True):
                            expected[(f"rank_{rank}", f"other/{label}/{s}", step)] = f32(v)
                (d / f"{kind}_{a}-{a + per_file - 1}.csv").write_text("\n".join(lines) + "\n")
        (d / "stack_info.csv").write_text("module_name,stack_info\nx,y\n")  # not statistics: ignored
    (root / "anomaly_detected").mkdir()
    return expected


def test_msprobe_layout_every_value_preserved(tmp_path):
    expected = msprobe_fixture(tmp_path / "monitor_output")
    s = convert([tmp_path / "monitor_output"], tmp_path / "tb", workers=2)
    assert s.ranks == [0, 1] and s.skipped == 0 and s.duplicates == 0
    assert s.scalars == len(expected)
    assert_same_values(tb_values(tmp_path / "tb"), expected)


def test_workers_give_the_same_files_content(tmp_path):
    expected = msprobe_fixture(tmp_path / "in", ranks=(0, 1, 2, 3), steps=4)
    for w in (1, 3):
        convert([tmp_path / "in"], tmp_path / f"tb{w}", workers=w)
        assert_same_values(tb_values(tmp_path / f"tb{w}"), expected)


def test_round_trip_csv_tb_csv(tmp_path):
    expected = msprobe_fixture(tmp_path / "in")
    convert([tmp_path / "in"], tmp_path / "tb", workers=1)
    assert main(["tb2csv", str(tmp_path / "tb"), "-o", str(tmp_path / "csv")]) == 0
    # the CSV written back converts to the same values again: csv -> tb -> csv -> tb is lossless
    convert([tmp_path / "csv"], tmp_path / "tb2", workers=1)
    assert_same_values(tb_values(tmp_path / "tb2"), expected)
    # and the CSV itself holds the float32 values, shape/dtype empty, counts as integers
    import pandas as pd

    df = pd.read_csv(tmp_path / "csv" / "rank_1" / "actv.csv", keep_default_na=False, na_values=["nan"])
    assert list(df.columns) == ["vpp_stage", "name", "step", "micro_step", *STATS, "shape", "dtype"]
    assert (df["shape"] == "").all() and (df["dtype"] == "").all()
    for row in df.itertuples():
        tag = f"actv/{row.vpp_stage}:{row.name}:micro{row.micro_step}/norm"
        assert f32(row.norm) == expected[("rank_1", tag, row.step)]
    assert df["nans"].dtype == np.int64


def test_steps_kinds_ranks_select(tmp_path):
    expected = msprobe_fixture(tmp_path / "in")
    s = convert(
        [tmp_path / "in"], tmp_path / "tb", steps=(1, 4), kinds={"actv", "other"}, ranks={1}, workers=1
    )
    want = {
        k: v
        for k, v in expected.items()
        if k[0] == "rank_1" and 1 <= k[2] <= 4 and k[1].split("/")[0] in ("actv", "other")
    }
    assert s.files == 6  # files of steps 0-1, 2-3, 4-5 for two kinds; 6-7 does not exist
    assert_same_values(tb_values(tmp_path / "tb"), want)


def test_duplicate_steps_keep_the_last_row(tmp_path):
    d = tmp_path / "run" / "rank_0"
    d.mkdir(parents=True)
    (d / "grad_reduced.csv").write_text(
        "vpp_stage,name,step,micro_step,norm,shape,dtype\n0,w,0,0,1.0,[2],x\n0,w,1,0,2.0,[2],x\n0,w,1,0,5.0,[2],x\n"
    )
    s = convert([tmp_path / "run"], tmp_path / "tb", workers=1)
    assert s.duplicates == 1
    assert tb_values(tmp_path / "tb" / "rank_0") == {
        ("", "grad_reduced/w/norm", 0): 1.0,
        ("", "grad_reduced/w/norm", 1): 5.0,
    }


# ---------------------------------------------------------------------------------------------
# bad input

HEADER = "vpp_stage,name,step,micro_step,min,max,shape,dtype\n"
GOOD = '0,w,0,0,1.5,2.5,"[2, 3]",torch.float32\n'


def one_file(tmp_path: Path, body: str) -> Path:
    d = tmp_path / "run" / "rank_0"
    d.mkdir(parents=True)
    (d / "actv.csv").write_text(body)
    return tmp_path / "run"


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ('0,w,1,0,abc,2.5,"[2, 3]",torch.float32\n', "column 'min': 'abc' is not a number"),
        ('0,w,1,0,1.5,"[2, 3]",torch.float32\n', "expected 8 fields (as the header), got 7"),
        ('0,w,1,0,1.5,2.5,"[2, 3]",torch.float32,x\n', "expected 8 fields (as the header), got 9"),
        ('0,w,-1,0,1.5,2.5,"[2, 3]",torch.float32\n', "column 'step': -1 is negative"),
        ('0,w,1.5,0,1.5,2.5,"[2, 3]",torch.float32\n', "column 'step': '1.5' is not an integer"),
        ('0,w,1,0,,2.5,"[2, 3]",torch.float32\n', "column 'min' is empty"),
        ("\n", "empty line"),
    ],
)
def test_bad_row_stops_with_file_line_reason_or_is_skipped(tmp_path, bad_line, reason, capsys):
    run = one_file(
        tmp_path, HEADER + GOOD + GOOD.replace(",0,0,", ",1,0,") + bad_line + GOOD.replace(",0,0,", ",2,0,")
    )
    path = run / "rank_0" / "actv.csv"
    with pytest.raises(CsvError) as e:
        convert([run], tmp_path / "tb", workers=1)
    assert (e.value.path, e.value.line) == (str(path), 4)
    assert str(e.value).startswith(f"{path}:4: {reason}")
    assert not (tmp_path / "tb").exists()  # nothing left behind
    assert main(["csv2tb", str(run), "-o", str(tmp_path / "tb")]) == 2
    assert f"{path}:4: {reason}" in capsys.readouterr().err
    s = convert([run], tmp_path / "tb", skip_bad=True, workers=1)
    assert s.skipped == 1 and s.rows == 3
    assert s.notes == [f"{path}:4: skipped: {reason}"]
    assert sorted(k[2] for k in tb_values(tmp_path / "tb") if k[1] == "actv/w/max") == [0, 1, 2]


def test_bad_row_reported_from_a_worker_process(tmp_path):
    run = one_file(tmp_path, HEADER + GOOD + '0,w,1,0,x,2.5,"[2, 3]",t\n')
    (run / "rank_1").mkdir()
    (run / "rank_1" / "actv.csv").write_text(HEADER + GOOD)
    with pytest.raises(CsvError, match=r"actv.csv:3: column 'min': 'x' is not a number"):
        convert([run], tmp_path / "tb", workers=2)
    assert not (tmp_path / "tb").exists()


@pytest.mark.parametrize(
    "header, message",
    [
        ("vpp_stage,name,micro_step,min,shape,dtype\n", "actv.csv:1: missing column 'step'"),
        ("vpp_stage,step,min\n", "actv.csv:1: missing column 'name'"),
        ("vpp_stage,name,step,shape,dtype\n", "actv.csv:1: no statistic columns in the header"),
        ("vpp_stage,name,step,min,min\n", "actv.csv:1: duplicate column 'min'"),
    ],
)
def test_missing_columns(tmp_path, header, message):
    run = one_file(tmp_path, header + "0,w,0,1\n")
    with pytest.raises(CsvError, match=message):
        convert([run], tmp_path / "tb", workers=1)


def test_empty_file_and_partial_lines_are_reported_and_dropped(tmp_path):
    run = one_file(tmp_path, HEADER + GOOD + '0,w,1,0,1.5,2.5,"[2,')  # killed while writing a line
    (run / "rank_0" / "grad_reduced.csv").write_text("")  # killed before the header
    (run / "rank_0" / "exp_avg.csv").write_text("vpp_stage,na")  # killed inside the header
    s = convert([run], tmp_path / "tb", workers=1)
    d = run / "rank_0"
    assert sorted(s.notes) == sorted(
        [
            f"{d / 'actv.csv'}:3: partial last line dropped "
            "(no newline at the end: the writer was interrupted)",
            f"{d / 'exp_avg.csv'}: no complete header line (the writer was interrupted?): nothing to convert",
            f"{d / 'grad_reduced.csv'}: empty file (no header line): nothing to convert",
        ]
    )
    assert tb_values(tmp_path / "tb" / "rank_0") == {("", "actv/w/min", 0): 1.5, ("", "actv/w/max", 0): 2.5}


def test_msprobe_padding_and_collapsed_collective_rows(tmp_path):
    """msprobe pads every row with trailing nan when a collective row carries pre and post groups."""
    d = tmp_path / "out" / "Nov22_11-22-17-rank0-bac17251"
    d.mkdir(parents=True)
    (d / "other_0-1.csv").write_text(
        "vpp_stage,name,step,min,max,shape,dtype\n"
        "0,0.weight,0,1.0,2.0,[],torch.float32,nan,nan,nan,nan\n"
        "all_reduce,1.0,0,3.0,nan,nan,4.0,5.0,nan,nan\n"
    )
    convert([tmp_path / "out"], tmp_path / "tb", workers=1)
    assert tb_values(tmp_path / "tb" / "rank_0") == {
        ("", "other/0.weight/min", 0): 1.0,
        ("", "other/0.weight/max", 0): 2.0,
        ("", "other/all_reduce.0/min", 0): 1.0,
        ("", "other/all_reduce.0/max", 0): 3.0,
        ("", "other/all_reduce.1/min", 0): 4.0,
        ("", "other/all_reduce.1/max", 0): 5.0,
    }


def test_existing_output_never_overwritten(tmp_path, capsys):
    run = one_file(tmp_path, HEADER + GOOD)
    out = tmp_path / "tb"
    convert([run], out, workers=1)
    before = sorted((out / "rank_0").iterdir())
    with pytest.raises(ConvertError, match="already holds event files"):
        convert([run], out, workers=1)
    assert sorted((out / "rank_0").iterdir()) == before
    assert main(["csv2tb", str(run), "-o", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    convert([run], out, workers=1, force=True)
    assert len(list((out / "rank_0").iterdir())) == 1
    assert tb_values(out / "rank_0") == {("", "actv/w/min", 0): 1.5, ("", "actv/w/max", 0): 2.5}
    # tb2csv: the same rule
    tb2csv(out, tmp_path / "csv")
    with pytest.raises(ValueError, match="exist already"):
        tb2csv(out, tmp_path / "csv")


def test_default_out_and_no_input(tmp_path, capsys):
    run = one_file(tmp_path, HEADER + GOOD)
    assert main(["csv2tb", str(run)]) == 0
    # beside the run, never inside it (where `tensorboard --logdir run` would see every value twice)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run-csv2tb"]
    assert sorted(p.name for p in run.iterdir()) == ["rank_0"]
    assert tb_values(tmp_path / "run-csv2tb" / "rank_0")
    assert main(["csv2tb", str(run / "rank_0" / "actv.csv")]) == 0  # a file or rank directory: its run's
    assert (tmp_path / "run-rank_0-csv2tb" / "rank_0").is_dir()
    assert sorted(p.name for p in run.iterdir()) == ["rank_0"]
    # tb2csv the same way: the CSV it writes lands beside the TensorBoard run it reads
    assert main(["tb2csv", str(tmp_path / "run-csv2tb")]) == 0
    assert (tmp_path / "run-csv2tb-tb2csv" / "rank_0" / "actv.csv").is_file()
    assert sorted(p.name for p in (tmp_path / "run-csv2tb").iterdir()) == ["rank_0"]
    capsys.readouterr()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["csv2tb", str(empty)]) == 2
    assert "no CSV files found" in capsys.readouterr().err
    assert main(["csv2tb", str(run), str(empty)]) == 2
    assert "-o OUT is required" in capsys.readouterr().err


def test_progress_bar(tmp_path):
    msprobe_fixture(tmp_path / "in", ranks=(0,), steps=2)
    stream = io.StringIO()
    convert([tmp_path / "in"], tmp_path / "tb", workers=1, progress=stream)
    text = stream.getvalue()
    assert text.startswith("\rcsv2tb [") and text.endswith("\n")
    assert "100.0%" in text.splitlines()[-1].rsplit("\r", 1)[-1]


def test_tb2csv_truncated_event_file(tmp_path):
    run = one_file(tmp_path, HEADER + GOOD + GOOD.replace(",0,0,", ",1,0,"))
    convert([run], tmp_path / "tb", workers=1)
    (ev,) = (tmp_path / "tb" / "rank_0").iterdir()
    data = ev.read_bytes()
    ev.write_bytes(data[:-7])  # the last step's record is cut
    assert read_scalars(tmp_path / "tb" / "rank_0") == {"actv/w/min": {0: 1.5}, "actv/w/max": {0: 2.5}}

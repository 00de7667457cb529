"""CSV sink: msprobe-compatible header and lines, formatting, resume, pandas round trip."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from trainmon.run import records
from trainmon.run.records import Row, StepRecord
from trainmon.writer.csv import CsvSink, exact_round, format_shape

OPS = ["min", "max", "mean", "norm", "zeros", "nans"]
HEADER = "vpp_stage,name,step,micro_step,min,max,mean,norm,zeros,nans,infs,shape,dtype"


def row(kind, name, vpp=0, micro=0, shape=(2, 3), dtype=torch.float32):
    return Row(kind, name, vpp, micro, "forward", torch.Size(shape), dtype)


def golden_record(step=3) -> StepRecord:
    rows = (
        row("actv", "layers.0.input"),
        row("actv", "layers.0.output", vpp=1, micro=1),
        row("grad_reduced", "layers.0.weight", shape=(4,), dtype=torch.bfloat16),
        row("actv", "big", shape=(), dtype="torch.float16"),
    )
    p = np.array([
        [6, 0, 0, 1, -2.13456, 2.82, 3.0, 2.0],
        [6, 2, 1, 0, -1e-9, 1234567.123456789, 1.0, 4.0],
        [4, 4, 0, 0, np.inf, -np.inf, 0.0, 0.0],
        [1, 0, 0, 0, 1.0, 2.0, -np.inf, np.inf],
    ])
    return StepRecord(step, 0, rows, p, 1.0)


def write(sink: CsvSink, rec: StepRecord) -> None:
    sink.write(rec, records.Derived(rec))


def test_golden_lines(tmp_path):
    sink = CsvSink(tmp_path, OPS, 4)
    write(sink, golden_record())
    sink.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actv.csv", "grad_reduced.csv"]
    assert (tmp_path / "actv.csv").read_text().splitlines() == [
        HEADER,
        '0,layers.0.input,3,0,-2.1346,2.82,0.5,1.4142,0.1667,0,0,"[2, 3]",torch.float32',
        '1,layers.0.output,3,1,-0.0,1234567.1235,0.3333,2.0,0.0,2,1,"[2, 3]",torch.float32',
        '0,big,3,0,1.0,2.0,-inf,inf,0.0,0,0,[],torch.float16',
    ]
    assert (tmp_path / "grad_reduced.csv").read_text().splitlines() == [
        HEADER,
        '0,layers.0.weight,3,0,nan,nan,nan,nan,0.0,4,0,[4],torch.bfloat16',  # minimal quoting, like pandas
    ]


def test_msprobe_example_line(tmp_path):
    # the layout msprobe writes (research notes, section 3.2), ops min,max,mean,norm,zeros,nans
    sink = CsvSink(tmp_path, ["min", "max", "mean", "norm", "zeros", "nans"], 4)
    numel = 8 * 32
    p = np.array([[numel, 0, 0, 0, -2.13, 2.82, 0.1 * numel, 0.0]])
    p[0, records.SUMSQ] = 14.86**2
    rec = StepRecord(0, 0, (row("actv", "layers.0.input", shape=(8, 32)),), p, 1.0)
    write(sink, rec)
    sink.close()
    line = (tmp_path / "actv.csv").read_text().splitlines()[1]
    assert line == '0,layers.0.input,0,0,-2.13,2.82,0.1,14.86,0.0,0,0,"[8, 32]",torch.float32'


def test_infs_not_duplicated_and_op_order_kept(tmp_path):
    sink = CsvSink(tmp_path, ["infs", "norm", "nans"], 6)
    assert sink.header == "vpp_stage,name,step,micro_step,infs,norm,nans,shape,dtype\n"
    write(sink, StepRecord(0, 0, (row("actv", "x"),), np.array([[4, 1, 2, 0, 0.0, 0.0, 0.0, 9.0]]), 1.0))
    sink.close()
    assert (tmp_path / "actv.csv").read_text().splitlines()[1] == '0,x,0,0,2,3.0,1,"[2, 3]",torch.float32'


def test_rows_in_record_order_with_interleaved_kinds_and_micro_steps(tmp_path):
    sink = CsvSink(tmp_path, ["max"], 6)
    rows = (row("actv", "a", micro=0), row("actv_grad", "a", micro=0), row("actv", "b", micro=0),
            row("actv", "a", micro=1), row("actv_grad", "a", micro=1))
    p = np.zeros((5, 8))
    p[:, records.NUMEL] = 1
    p[:, records.MAX] = np.arange(5)
    for step in (10, 11):
        q = p.copy()
        q[:, records.MAX] += step
        write(sink, StepRecord(step, 0, rows, q, 1.0))
    sink.close()
    actv = pd.read_csv(tmp_path / "actv.csv")
    assert list(actv[["name", "step", "micro_step", "max"]].itertuples(index=False, name=None)) == [
        ("a", 10, 0, 10.0), ("b", 10, 0, 12.0), ("a", 10, 1, 13.0),
        ("a", 11, 0, 11.0), ("b", 11, 0, 13.0), ("a", 11, 1, 14.0),
    ]
    grad = pd.read_csv(tmp_path / "actv_grad.csv")
    assert list(grad["max"]) == [11.0, 14.0, 12.0, 15.0]


def test_pandas_reads_it_back(tmp_path):
    sink = CsvSink(tmp_path, OPS, 4)
    write(sink, golden_record(3))
    write(sink, golden_record(4))
    sink.close()
    df = pd.read_csv(tmp_path / "actv.csv")
    assert list(df.columns) == HEADER.split(",")
    assert list(df["step"]) == [3, 3, 3, 4, 4, 4]
    assert df["nans"].dtype.kind == "i" and df["infs"].dtype.kind == "i"
    assert df["min"].iloc[0] == -2.1346 and df["max"].iloc[1] == 1234567.1235
    assert df["mean"].iloc[2] == -math.inf and df["norm"].iloc[2] == math.inf
    assert df["shape"].iloc[0] == "[2, 3]" and df["dtype"].iloc[2] == "torch.float16"


def test_names_needing_quotes(tmp_path):
    sink = CsvSink(tmp_path, ["max"], 6)
    names = ['odd,name', 'say "hi"', "100%"]
    rows = tuple(row("actv", n) for n in names)
    p = np.zeros((3, 8))
    p[:, 0] = 1
    write(sink, StepRecord(0, 0, rows, p, 1.0))
    sink.close()
    assert list(pd.read_csv(tmp_path / "actv.csv")["name"]) == names


def test_non_finite_count_does_not_break_the_step(tmp_path):
    sink = CsvSink(tmp_path, ["max", "nans"], 6)
    p = np.array([[1, np.nan, 0, 0, 0.0, 1.0, 0.0, 0.0], [1, 0, 0, 0, 0.0, 2.0, 0.0, 0.0]])
    write(sink, StepRecord(0, 0, (row("actv", "a"), row("actv", "b")), p, 1.0))
    sink.close()
    lines = (tmp_path / "actv.csv").read_text().splitlines()
    assert lines[1].startswith("0,a,0,0,") and ",nan," in lines[1]
    assert lines[2] == '0,b,0,0,2.0,0,0,"[2, 3]",torch.float32'


def test_resume_appends_without_second_header(tmp_path):
    a = CsvSink(tmp_path, OPS, 4)
    write(a, golden_record(1))
    a.close()
    # a kill in the middle of a write left a partial line: the resumed sink drops it
    with open(tmp_path / "actv.csv", "a") as f:
        f.write("0,layers.0.inp")
    b = CsvSink(tmp_path, OPS, 4)
    write(b, golden_record(2))
    b.close()
    lines = (tmp_path / "actv.csv").read_text().splitlines()
    assert lines.count(HEADER) == 1 and lines[0] == HEADER
    assert len(lines) == 1 + 3 + 3
    assert list(pd.read_csv(tmp_path / "actv.csv")["step"]) == [1, 1, 1, 2, 2, 2]


def test_differing_header_starts_new_file(tmp_path):
    write_with = lambda ops, step: (lambda s: (write(s, golden_record(step)), s.close(), s)[2])(  # noqa: E731
        CsvSink(tmp_path, ops, 4))
    first = write_with(OPS, 1)
    other = write_with(["max"], 2)
    again = write_with(OPS, 3)
    other2 = write_with(["max"], 4)
    assert first.paths["actv"].name == "actv.csv" and again.paths["actv"].name == "actv.csv"
    assert other.paths["actv"].name == "actv.1.csv" and other2.paths["actv"].name == "actv.1.csv"
    assert list(pd.read_csv(tmp_path / "actv.csv")["step"].unique()) == [1, 3]
    df = pd.read_csv(tmp_path / "actv.1.csv")
    assert list(df.columns) == ["vpp_stage", "name", "step", "micro_step", "max", "infs", "shape", "dtype"]
    assert list(df["step"].unique()) == [2, 4]
    assert not any("tfevents" in p.name for p in tmp_path.iterdir())


def test_empty_or_header_only_file_is_reused(tmp_path):
    (tmp_path / "actv.csv").write_text("vpp_stage,na")  # killed while writing the header
    s = CsvSink(tmp_path, OPS, 4)
    write(s, golden_record(1))
    s.close()
    assert (tmp_path / "actv.csv").read_text().splitlines()[0] == HEADER
    assert not (tmp_path / "actv.1.csv").exists()


def test_each_step_flushed(tmp_path):
    s = CsvSink(tmp_path, OPS, 4)
    write(s, golden_record(1))
    assert len((tmp_path / "actv.csv").read_text().splitlines()) == 4  # visible before close
    s.close()


def test_default_golden_lines_keep_every_digit_of_the_float32(tmp_path):
    sink = CsvSink(tmp_path, OPS)  # no ndigits: shortest text that reads back as the same float32
    write(sink, golden_record())
    sink.close()
    assert (tmp_path / "actv.csv").read_text().splitlines() == [
        HEADER,
        '0,layers.0.input,3,0,-2.13456,2.82,0.5,1.4142135,0.16666667,0,0,"[2, 3]",torch.float32',
        '1,layers.0.output,3,1,-1e-09,1234567.1,0.33333334,2.0,0.0,2,1,"[2, 3]",torch.float32',
        '0,big,3,0,1.0,2.0,-inf,inf,0.0,0,0,[],torch.float16',
    ]
    assert (tmp_path / "grad_reduced.csv").read_text().splitlines()[1] == (
        '0,layers.0.weight,3,0,nan,nan,nan,nan,0.0,4,0,[4],torch.bfloat16')


def test_default_keeps_small_gradient_statistics(tmp_path):
    # ndigits=6 wrote these as -0.001456, 0.0, 0.0 and -0.0: every digit of a bf16 gradient's statistics lost
    sink = CsvSink(tmp_path, ["min", "max", "mean", "norm", "nans"])
    p = np.array([[1e6, 0, 0, 0, -0.0014557711, 7.3e-05, 3.6e-15 * 1e6, 2.5e-17]])
    write(sink, StepRecord(0, 0, (row("grad_reduced", "w"),), p, 1.0))
    sink.close()
    line = (tmp_path / "grad_reduced.csv").read_text().splitlines()[1]
    # -0.0014557711 and -0.0014557712 read as the same float32; ...712 is the nearer of the two
    assert line == '0,w,0,0,-0.0014557712,7.3e-05,3.6e-15,5e-09,0,0,"[2, 3]",torch.float32'


def test_default_text_reads_back_as_the_same_float32(tmp_path):
    rng = np.random.default_rng(15)
    n = 4000
    vals = (rng.standard_normal((n, 3)) * 10.0 ** rng.uniform(-44, 38, (n, 3))).astype(np.float32)
    specials = np.array([0.0, -0.0, 1.0, 100.0, 1e16, 1e15, 1e-45, 3.4028235e38, 2.0**-126, 2.0**-96, 2.0**90,
                         2.0**87, 0.0001, 1e-05, 123456790.0, 1.17549435e-38, 9.999999e-05], dtype=np.float32)
    vals[: specials.size, 0] = specials
    vals[: specials.size, 1] = -specials
    vals[: specials.size, 2] = np.nextafter(specials, np.float32(0))
    p = np.zeros((n, records.N_PARTIALS))
    p[:, records.NUMEL] = 1
    p[:, records.MIN], p[:, records.MAX], p[:, records.SUM] = vals.T  # mean = sum / 1
    rows = tuple(row("actv", f"t{i}") for i in range(n))
    sink = CsvSink(tmp_path, ["min", "max", "mean"])
    write(sink, StepRecord(0, 0, rows, p, 1.0))
    sink.close()
    lines = (tmp_path / "actv.csv").read_text().splitlines()[1:]
    cells = [line.split(",")[4:7] for line in lines]
    got = np.array([[float(c) for c in r] for r in cells]).astype(np.float32)
    assert np.array_equal(got, vals) and np.array_equal(np.signbit(got), np.signbit(vals))
    # the shortest such text (numpy's Dragon4 digits), laid out as Python's repr lays out a float
    want = [[repr(float(np.format_float_scientific(v, unique=True))) for v in r] for r in vals]
    assert cells == want


def test_default_non_finite_counts_and_odd_names(tmp_path):
    sink = CsvSink(tmp_path, ["max", "mean", "nans"])
    rows = (row("actv", "a"), row("actv_grad", "100%"), row("actv", 'odd,"name"'))
    p = np.array([[10, np.nan, 0, 0, 0.0, 1.0, 0.0, 0.0], [10, 0, np.inf, 0, 0.0, 0.1, 0.0, 0.0],
                  [10, 3, 0, 0, -np.inf, -np.inf, -0.7, 0.0]])
    write(sink, StepRecord(5, 0, rows, p, 1.0))
    sink.close()
    assert (tmp_path / "actv.csv").read_text().splitlines()[1:] == [
        '0,a,5,0,nan,nan,nan,0,"[2, 3]",torch.float32',
        '0,"odd,""name""",5,0,-inf,-0.1,3,0,"[2, 3]",torch.float32',
    ]
    assert (tmp_path / "actv_grad.csv").read_text().splitlines()[1] == (
        '0,100%,5,0,nan,nan,0,inf,"[2, 3]",torch.float32')


def test_format_shape():
    assert format_shape(torch.Size([8, 32])) == "[8, 32]"
    assert format_shape(()) == "[]"
    assert format_shape((5,)) == "[5]"


@pytest.mark.parametrize("ndigits", [0, 1, 2, 4, 6, 8, 12])
def test_exact_round_matches_python_round(ndigits):
    rng = np.random.default_rng(ndigits)
    x = rng.standard_normal(20000) * 10.0 ** rng.integers(-12, 18, 20000)
    # exact ties and near-ties in binary, huge and tiny values, signed zeros
    tricky = [2.675, 0.125, 0.375, 2.5, -2.5, 1.0000005, 0.285, 1.005, 5e-324, -1e-9, 1e300, -1e308,
              2.0**52 + 0.5, 4503599627370497.0, 0.0, -0.0, 123456.7890125]
    x = np.concatenate([x, tricky, np.nextafter(tricky, np.inf), np.nextafter(tricky, -np.inf)])
    got = exact_round(x, ndigits)
    want = np.array([round(v, ndigits) for v in x.tolist()])
    assert np.array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))
    shaped = exact_round(x[:100].reshape(10, 10), ndigits)
    assert np.array_equal(shaped.ravel(), want[:100])


def test_exact_round_keeps_non_finite():
    got = exact_round(np.array([np.nan, np.inf, -np.inf, 1.26]), 1)
    assert math.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf and got[3] == 1.3


def test_enum_kinds_name_files_by_value(tmp_path):
    s = CsvSink(tmp_path, ["max"], 6)
    rows = (Row(records.Kind.ACTV, "a", 0, 0, records.Phase.FORWARD, (1,), torch.float32),)
    write(s, StepRecord(0, 0, rows, np.array([[1, 0, 0, 0, 0, 1, 0, 0]]), 1.0))
    s.close()
    assert [p.name for p in tmp_path.iterdir()] == ["actv.csv"]

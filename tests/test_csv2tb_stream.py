"""csv2tb streams: a rank is read a batch of each kind at a time and the steps every kind has read past are
written, so memory stays bounded whatever the run's length; the result equals converting the whole rank in
memory (the last row of a repeated (tag, step) wins, names get the chunk prefix and micro-step suffix the
whole rank calls for), also when the rule is only known late or steps go back."""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader

from trainmon.csvtb import convert
from trainmon.read.csv import read_kind
from trainmon.read.csv_sources import find_sources

# the module (the package's name ``convert`` is the function)
convert_module = importlib.import_module("trainmon.csvtb.convert")
HEADER = "vpp_stage,name,step,micro_step,min,max,mean,norm,zeros,nans,infs,shape,dtype\n"


def events(directory: Path) -> dict[tuple[str, int], float]:
    """{(tag, step): value} of the one event file in ``directory``; a (tag, step) twice is an error."""
    files = sorted(directory.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    out: dict[tuple[str, int], float] = {}
    from tensorboard.compat.proto import event_pb2

    for raw in RawEventFileLoader(str(files[0])).Load():
        ev = event_pb2.Event.FromString(raw)
        for v in ev.summary.value:
            key = (v.tag, ev.step)
            assert key not in out, key
            out[key] = v.simple_value
    return out


def in_memory(run: Path, out: Path) -> dict[tuple[str, int], float]:
    """The reference: every table of the rank read at once and written by ``write_rank``."""
    tables = [t for s in find_sources([run]) for t in read_kind(s)[0]]
    convert_module.write_rank(tables, out, 1.0)
    return events(out)


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    for k, v in a.items():
        assert v == b[k] or (math.isnan(v) and math.isnan(b[k])), (k, v, b[k])


def row(vpp: int, name: str, step: int, micro: int, x: float) -> str:
    return f"{vpp},{name},{step},{micro},{x},{x + 1},{x / 2},{abs(x)},0.0,0,0,[4],torch.float32\n"


def write_kind(path: Path, rows: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HEADER + "".join(rows))


def long_run(root: Path, steps: int, names: int = 20) -> Path:
    run = root / "run"
    for k, kind in enumerate(("actv", "grad_reduced", "exp_avg")):
        rows = [
            row(0, f"layers.{i}.{kind}", s, 0, s * 0.25 + i - k) for s in range(steps) for i in range(names)
        ]
        write_kind(run / "rank_0" / f"{kind}.csv", rows)
    return run


# the peak RSS of this process (VmHWM: ru_maxrss would include the parent's at the fork)
PEAK = """
import importlib, re, sys
from pathlib import Path
convert_module = importlib.import_module("trainmon.csvtb.convert")
convert_module.STREAM_BATCH_BYTES = 64 << 10
root = Path(sys.argv[1])
summary = convert_module.convert([root / "run"], root / "tb", workers=1)
status = Path("/proc/self/status").read_text()
print(summary.scalars, re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_memory_stays_bounded_by_a_batch_whatever_the_run_length(tmp_path):
    peak = {}
    for steps in (1000, 8000):
        root = tmp_path / str(steps)
        long_run(root, steps, names=10)
        out = subprocess.run(
            [sys.executable, "-c", PEAK, str(root)], check=True, capture_output=True, text=True
        ).stdout.split()
        assert int(out[0]) == steps * 10 * 3 * 7
        peak[steps] = int(out[1]) << 10
    # 8000 steps: 30 MB of CSV, 1.7M values, which in memory took ~100 MB more than 1000 steps; the stream's
    # peak does not grow with the steps
    assert peak[8000] < peak[1000] + (12 << 20), peak
    same(events(tmp_path / "1000" / "tb" / "rank_0"), in_memory(tmp_path / "1000" / "run", tmp_path / "ref"))


def test_kinds_of_different_lengths_and_sparse_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "STREAM_BATCH_BYTES", 4 << 10)
    run = tmp_path / "run"
    actv = [row(0, f"m{i}", s, 0, s + i) for s in range(300) for i in range(3)]
    write_kind(run / "rank_0" / "actv.csv", actv)
    write_kind(run / "rank_0" / "grad_reduced.csv", [row(0, "w", s, 0, -s) for s in range(0, 300, 97)])
    write_kind(run / "rank_0" / "exp_avg.csv", [row(0, "w", s, 0, 2 * s) for s in range(250, 260)])
    write_kind(run / "rank_0" / "param_origin.csv", [row(0, "w", s, 0, 3 * s) for s in range(0, 5)])
    s = convert([run], tmp_path / "tb", workers=1)
    assert s.steps == 300
    same(events(tmp_path / "tb" / "rank_0"), in_memory(run, tmp_path / "ref"))


def test_repeated_rows_in_a_batch_keep_the_last(tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "STREAM_BATCH_BYTES", 1 << 10)
    run = tmp_path / "run"
    rows = []
    for s in range(100):
        rows += [row(0, "w", s, 0, s), row(0, "w", s, 0, s + 0.5)]  # a (tag, step) twice: the second wins
    write_kind(run / "rank_0" / "actv.csv", rows)
    s = convert([run], tmp_path / "tb", workers=1)
    assert s.duplicates == 100 * 7
    got = events(tmp_path / "tb" / "rank_0")
    assert got[("actv/w/min", 42)] == 42.5
    same(got, in_memory(run, tmp_path / "ref"))


@pytest.mark.parametrize("late", ["vpp", "micro"])
def test_a_name_rule_met_late_converts_the_rank_again(tmp_path, monkeypatch, late):
    monkeypatch.setattr(convert_module, "STREAM_BATCH_BYTES", 2 << 10)
    run = tmp_path / "run"
    rows = [row(0, "w", s, 0, s) for s in range(200)]
    rows.append(row(1, "w", 200, 0, 7.0) if late == "vpp" else row(0, "w", 200, 1, 7.0))
    write_kind(run / "rank_0" / "actv.csv", rows)
    write_kind(run / "rank_0" / "exp_avg.csv", [row(0, "v", s, 0, -s) for s in range(201)])
    convert([run], tmp_path / "tb", workers=1)
    got = events(tmp_path / "tb" / "rank_0")
    # every point of the rank (of the kind) carries the rule the whole rank (kind) calls for
    if late == "vpp":
        assert ("actv/0:w/min", 0) in got and ("actv/1:w/min", 200) in got and ("exp_avg/0:v/min", 3) in got
    else:
        assert ("actv/w:micro0/min", 0) in got and ("actv/w:micro1/min", 200) in got
        assert ("exp_avg/v/min", 3) in got
    same(got, in_memory(run, tmp_path / "ref"))


def test_steps_going_back_below_what_was_written_convert_the_rank_in_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "STREAM_BATCH_BYTES", 2 << 10)
    run = tmp_path / "run"
    # a job resumed from step 100 into the same folder wrote steps 100..149 again, with other values
    rows = [row(0, "w", s, 0, s) for s in range(150)] + [row(0, "w", s, 0, 1000 + s) for s in range(100, 180)]
    write_kind(run / "rank_0" / "actv.csv", rows)
    s = convert([run], tmp_path / "tb", workers=1)
    assert any("steps go back" in n and "converted in memory" in n for n in s.notes), s.notes
    got = events(tmp_path / "tb" / "rank_0")
    assert got[("actv/w/min", 120)] == 1120.0 and got[("actv/w/min", 99)] == 99.0
    assert s.duplicates == 50 * 7
    same(got, in_memory(run, tmp_path / "ref"))


def test_a_bad_row_late_in_a_stream_leaves_no_event_file(tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "STREAM_BATCH_BYTES", 1 << 10)
    run = tmp_path / "run"
    rows = [row(0, "w", s, 0, s) for s in range(300)]
    rows[250] = "0,w,250,0,abc,1,1,1,0,0,0,[4],torch.float32\n"
    write_kind(run / "rank_0" / "actv.csv", rows)
    with pytest.raises(ValueError, match=r"actv.csv:252: column 'min': 'abc' is not a number"):
        convert([run], tmp_path / "tb", workers=1)
    assert not list((tmp_path / "tb").rglob("events.out.tfevents.*"))


def test_workers_stream_ranks_in_parallel(tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "STREAM_BATCH_BYTES", 4 << 10)
    run = tmp_path / "run"
    for r in range(3):
        write_kind(run / f"rank_{r}" / "actv.csv", [row(0, "w", s, 0, s * (r + 1)) for s in range(200)])
    s = convert([run], tmp_path / "tb", workers=2)
    assert s.ranks == [0, 1, 2] and len(s.event_files) == 3
    assert events(tmp_path / "tb" / "rank_2")[("actv/w/max", 10)] == np.float32(31.0)

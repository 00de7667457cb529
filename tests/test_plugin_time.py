"""The plugin's time views, in process through TensorBoard's WSGI application, on runs with known per-rank
times written through the monitor's own log (tests/time_runs.py): the time heat map (``/time_heatmap``: each
cell the median and the maximum of its ranks' and steps' values, and the rank of the maximum, from
``rank_times/``, or from each rank's own table when the job exchanged nothing), a rank's time beside its
numerics (``/rank_steps``), the straggler episodes on the timeline (phase, factor, where), and that the time
data is read only when a heat map asks for it (never at startup or for the first view) and then only what was
written since."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from test_plugin_routes import make_client
from time_runs import STRAGGLER_MS, exchanged_rows, grad_norm, write_timed_run
from trainmon_tb.anomaly_index import bin_edges

from trainmon.anomaly.log import AnomalyLog
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.timetable import TIMING_COLUMNS, read_rank_times, read_timing
from trainmon.run.timing import TIMES, StepTiming, rank_times

SMALL, SMALL_STEPS, SMALL_STRAGGLER, SMALL_FROM = 6, 40, 4, 20
BIG, BIG_STEPS, BIG_STRAGGLER, BIG_FROM = 256, 20, 137, 8
T = {name: j for j, name in enumerate(TIMES)}


def get(client, url: str, status: int = 200) -> dict:
    resp = client.get(f"/data/plugin/trainmon/{url}")
    assert resp.status_code == status, resp.get_data(as_text=True)
    return json.loads(resp.get_data(as_text=True))


def decode(text: str, dtype: str, shape: tuple[int, int]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=dtype).reshape(shape)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("time")
    known = {
        "small": write_timed_run(root / "small", SMALL, SMALL_STEPS, SMALL_STRAGGLER, SMALL_FROM),
        "big": write_timed_run(root / "big", BIG, BIG_STEPS, BIG_STRAGGLER, BIG_FROM),
        "one": write_timed_run(root / "one", 1, 30),
        # every 5th step collected (step_interval 5), step 50 missing
        "sparse": write_timed_run(root / "sparse", 3, 150, timed=[s for s in range(0, 150, 5) if s != 50]),
    }
    return root, known


@pytest.fixture(scope="module")
def client(logdir):
    return make_client(logdir[0])


def expected_cells(values: np.ndarray, rows: list[list[int]], edges: list[int]) -> tuple[np.ndarray, ...]:
    """(median, max, rank of the max) per row (its ranks) and bin of ``values`` (steps x ranks, float32 s),
    in ms as float32, computed here cell by cell."""
    median = np.full((len(rows), len(edges) - 1), np.nan, np.float32)
    top, top_rank = median.copy(), np.full(median.shape, -1)
    for i, ranks in enumerate(rows):
        for b in range(len(edges) - 1):
            cell = values[edges[b] : edges[b + 1]][:, ranks]
            finite = cell[np.isfinite(cell)]
            if not finite.size:
                continue
            median[i, b] = np.float32(np.median(finite)) * np.float32(1e3)
            top[i, b] = finite.max() * np.float32(1e3)
            at = np.argmax(np.where(np.isfinite(cell), cell, -np.inf))
            top_rank[i, b] = ranks[np.unravel_index(at, cell.shape)[1]]
    return median, top, top_rank


def test_the_tables_hold_the_known_times(logdir):
    """The run under test: what rank_times/ and a rank's table hold are the times the rows give."""
    root, known = logdir
    table = read_rank_times(root / "small", ["step", "forward"])
    assert table.column("step").to_pylist() == list(range(SMALL_STEPS))
    forward = np.asarray(table.column("forward").to_pylist(), dtype=np.float32)
    np.testing.assert_array_equal(forward, known["small"][:, :, T["forward"]].astype(np.float32))
    mine = read_timing(root / "small", 2, ["step", *TIMING_COLUMNS])
    for name, column in zip(TIMES, TIMING_COLUMNS, strict=True):
        np.testing.assert_array_equal(mine.column(column).to_numpy(), known["small"][:, 2, T[name]])


@pytest.mark.parametrize("time", ["step", "forward", "wait", "gc"])
@pytest.mark.parametrize("bins", [SMALL_STEPS, 13, 5, 1])
def test_each_cell_is_the_median_and_the_max_of_its_rank_and_steps(client, logdir, time, bins):
    _, known = logdir
    d = get(client, f"time_heatmap?run=small&time={time}&bins={bins}")
    assert (d["time"], d["unit"], d["source"], d["group_size"]) == (time, "ms", "rank_times", 1)
    assert d["rows"] == [str(r) for r in range(SMALL)] and d["row_kinds"] == ["rank"] * SMALL
    assert (d["step_lo"], d["step_hi"]) == (0, SMALL_STEPS - 1)
    width = -(-SMALL_STEPS // bins)  # every bin the same number of steps, the last fewer
    assert d["edges"] == [*range(0, SMALL_STEPS, width), SMALL_STEPS]
    shape = (SMALL, d["bins"])
    values = known["small"][:, :, T[time]].astype(np.float32)
    median, top, top_rank = expected_cells(values, [[r] for r in range(SMALL)], d["edges"])
    np.testing.assert_array_equal(decode(d["median"], "<f4", shape), median)
    np.testing.assert_array_equal(decode(d["max"], "<f4", shape), top)
    np.testing.assert_array_equal(decode(d["max_rank"], "<i4", shape), top_rank)
    np.testing.assert_array_equal(decode(d["flags"], "u1", shape), np.isfinite(top).astype(np.uint8))
    finite = top[np.isfinite(top)]
    assert d["ranges"]["max"][1] == pytest.approx(float(finite.max()))


def test_the_straggler_stands_out_in_its_forward_and_the_others_in_their_wait(client, logdir):
    """Rank 4 sleeps 40 ms in its forward from step 20: its forward cells are about 40 ms above the others',
    and every other rank waits about that long at the step's collective (less its own garbage collection);
    before step 20 nobody does."""
    _, known = logdir
    d = get(client, f"time_heatmap?run=small&time=forward&bins={SMALL_STEPS}")
    forward = decode(d["max"], "<f4", (SMALL, SMALL_STEPS))
    others = np.delete(forward, SMALL_STRAGGLER, axis=0)
    late = forward[SMALL_STRAGGLER, SMALL_FROM:] - others[:, SMALL_FROM:].max(axis=0)
    assert (late > STRAGGLER_MS - 2).all()
    assert (np.abs(forward[SMALL_STRAGGLER, :SMALL_FROM] - others[:, :SMALL_FROM].mean(axis=0)) < 2).all()
    d = get(client, f"time_heatmap?run=small&time=wait&bins={SMALL_STEPS}")
    wait = decode(d["max"], "<f4", (SMALL, SMALL_STEPS))
    assert (wait[SMALL_STRAGGLER, SMALL_FROM:] < 2).all()
    gc = known["small"][:, :, T["gc"]].T * 1e3
    waited = np.delete(wait + gc, SMALL_STRAGGLER, axis=0)[:, SMALL_FROM:]
    assert (np.abs(waited - STRAGGLER_MS) < 4).all()


def test_grouped_rows_over_200_ranks_and_an_expanded_group(client, logdir):
    """256 ranks: rows of 2 ranks (the timeline's groups); a cell is the median and maximum over its 2 ranks
    and its bin's steps, with the rank of the maximum; an expanded group is followed by its ranks."""
    _, known = logdir
    values = known["big"][:, :, T["forward"]].astype(np.float32)
    d = get(client, "time_heatmap?run=big&time=forward&bins=5")
    assert (d["group_size"], d["rows_total"], len(d["rows"])) == (2, BIG, BIG // 2)
    assert d["rows"][:2] == ["0-1", "2-3"] and set(d["row_kinds"]) == {"group"}
    assert d["edges"] == [0, 4, 8, 12, 16, 20]
    shape = (BIG // 2, 5)
    median, top, top_rank = expected_cells(values, [[2 * i, 2 * i + 1] for i in range(BIG // 2)], d["edges"])
    np.testing.assert_array_equal(decode(d["median"], "<f4", shape), median)
    np.testing.assert_array_equal(decode(d["max"], "<f4", shape), top)
    got_rank = decode(d["max_rank"], "<i4", shape)
    np.testing.assert_array_equal(got_rank, top_rank)
    row = d["rows"].index("136-137")
    assert (got_rank[row, 2:] == BIG_STRAGGLER).all()  # from step 8 on, the straggler is its group's max

    d = get(client, f"time_heatmap?run=big&time=forward&bins=5&expand={BIG_STRAGGLER}")
    assert len(d["rows"]) == BIG // 2 + 2
    at = d["rows"].index("136-137")
    assert d["rows"][at : at + 3] == ["136-137", "136", "137"]
    assert d["row_kinds"][at : at + 3] == ["open", "member", "member"]
    shape = (len(d["rows"]), 5)
    median, top, top_rank = expected_cells(values, [[136, 137], [136], [137]], d["edges"])
    np.testing.assert_array_equal(decode(d["median"], "<f4", shape)[at : at + 3], median)
    np.testing.assert_array_equal(decode(d["max"], "<f4", shape)[at : at + 3], top)
    np.testing.assert_array_equal(decode(d["max_rank"], "<i4", shape)[at : at + 3], top_rank)


def test_cells_computed_a_few_rows_at_a_time_are_the_same(logdir, monkeypatch):
    """The cells' values are laid out and sorted a few rank rows at a time (bounded memory): one row at a
    time gives the same cells."""
    from trainmon_tb import time_index
    from trainmon_tb.time_index import TimeIndex

    root, known = logdir
    monkeypatch.setattr(time_index, "CELL_CHUNK", 50)  # 50 values: a row at a time, 2 ranks x 4 steps a cell
    hm = TimeIndex(root / "big").heatmap("forward", None, None, 5, expand=[BIG_STRAGGLER])
    rows = []
    for label in hm.labels:
        a, _, b = label.partition("-")
        rows.append(list(range(int(a), int(b or a) + 1)))
    values = known["big"][:, :, T["forward"]].astype(np.float32)
    median, top, top_rank = expected_cells(values, rows, hm.edges)
    np.testing.assert_array_equal(hm.median, median)
    np.testing.assert_array_equal(hm.max, top)
    np.testing.assert_array_equal(hm.max_rank, top_rank)


@pytest.mark.parametrize(("lo", "hi", "bins"), [(5, 5, 10), (3, 17, 4), (10, 39, 7), (0, 39, 3)])
def test_a_zoomed_heat_map_covers_its_steps(client, logdir, lo, hi, bins):
    _, known = logdir
    d = get(client, f"time_heatmap?run=small&time=step&step_lo={lo}&step_hi={hi}&bins={bins}")
    width = -(-(hi - lo + 1) // bins)
    assert d["edges"] == [*range(lo, hi + 1, width), hi + 1]
    assert (d["step_lo"], d["step_hi"]) == (lo, hi)
    values = known["small"][:, :, T["step"]].astype(np.float32)
    median, top, _ = expected_cells(values, [[r] for r in range(SMALL)], d["edges"])
    np.testing.assert_array_equal(decode(d["median"], "<f4", (SMALL, d["bins"])), median)
    np.testing.assert_array_equal(decode(d["max"], "<f4", (SMALL, d["bins"])), top)


@pytest.mark.parametrize("bins", [30, 10, 4])
def test_collected_steps_every_few_steps_and_a_step_missing(client, logdir, bins):
    """Steps collected every 5 steps: a bin holds the same number of collected steps (5 steps each); step 50,
    missing on every rank, leaves its cell empty when alone in it and is left out of a wider one."""
    _, known = logdir
    d = get(client, f"time_heatmap?run=sparse&time=step&bins={bins}")
    width = 5 * -(-30 // bins)
    assert d["edges"] == [*range(0, 150, width), 146] and (d["step_lo"], d["step_hi"]) == (0, 145)
    values = known["sparse"][:, :, T["step"]].astype(np.float32)
    median, top, top_rank = expected_cells(values, [[0], [1], [2]], d["edges"])
    shape = (3, d["bins"])
    np.testing.assert_array_equal(decode(d["median"], "<f4", shape), median)
    np.testing.assert_array_equal(decode(d["max"], "<f4", shape), top)
    np.testing.assert_array_equal(decode(d["max_rank"], "<i4", shape), top_rank)
    empty = decode(d["flags"], "u1", shape) == 0
    assert empty.sum() == (3 if bins == 30 else 0)  # step 50's cells, when a cell is one step


def test_one_process_is_read_from_its_own_table(client, logdir):
    """A job of one process exchanges nothing (no rank_times/): its table is read; it waited for nobody."""
    root, known = logdir
    assert not (root / "one" / "plugins" / "trainmon" / "rank_times").exists()
    d = get(client, "time_heatmap?run=one&time=step&bins=30")
    assert (d["source"], d["rows"]) == ("timing", ["0"])
    want = known["one"][:, 0, T["step"]].astype(np.float32) * np.float32(1e3)
    np.testing.assert_array_equal(decode(d["max"], "<f4", (1, 30))[0], want)
    d = get(client, "time_heatmap?run=one&time=wait&bins=30")
    assert decode(d["flags"], "u1", (1, 30)).sum() == 0 and d["ranges"]["max"] == [None, None]
    d = get(client, "rank_steps?run=one&rank=0")
    assert d["times"]["wait"] == ["nan"] * 30
    np.testing.assert_allclose(d["times"]["step"], known["one"][:, 0, T["step"]] * 1e3, rtol=1e-12)


def test_a_rank_row_gives_its_times_and_its_gradient_norm_per_step(client, logdir):
    _, known = logdir
    d = get(client, f"rank_steps?run=small&rank={SMALL_STRAGGLER}&points=1000")
    assert d["steps"] == list(range(SMALL_STEPS)) and d["edges"] is None and d["timed_steps"] == SMALL_STEPS
    mine = known["small"][:, SMALL_STRAGGLER]
    for name in TIMES:
        np.testing.assert_allclose(d["times"][name], mine[:, T[name]] * 1e3, rtol=1e-12)
    num = d["numerics"]
    assert num["steps"] == list(range(SMALL_STEPS))
    assert num["grad_norm"] == [grad_norm(SMALL_STRAGGLER, s) for s in range(SMALL_STEPS)]
    anomalies = [s for s, n in zip(num["steps"], num["anomalies"], strict=True) if n]
    assert len(anomalies) == 1 and SMALL_FROM <= anomalies[0] < SMALL_FROM + 10  # the episode's record

    # binned: each part's mean over the bin's steps (they add up to the mean step), the largest norm
    d = get(client, f"rank_steps?run=small&rank={SMALL_STRAGGLER}&points=7&step_lo=5&step_hi=30")
    _, edges = bin_edges(5, 30, 7)
    assert d["edges"] == edges and d["steps"] == edges[:-1]
    for name in TIMES:
        want = [mine[a:b, T[name]].mean() * 1e3 for a, b in zip(edges, edges[1:], strict=False)]
        np.testing.assert_allclose(d["times"][name], want, rtol=1e-12)
    parts = sum(np.asarray(d["times"][p]) for p in ("data", "forward", "backward", "optimizer", "comm", "gc",
                                                   "monitor", "other"))  # fmt: skip
    np.testing.assert_allclose(parts, d["times"]["step"], rtol=1e-9)
    assert d["numerics"]["grad_norm"] == [grad_norm(SMALL_STRAGGLER, b - 1) for b in edges[1:]]


def test_the_straggler_episode_is_on_the_timeline_with_its_phase_and_factor(client, logdir):
    root, known = logdir
    d = get(client, "timeline?run=small&bins=40")
    assert len(d["episodes"]) == 1
    e = d["episodes"][0]
    record = next(a for a in read_anomalies(root / "small", SMALL_STRAGGLER) if a.rule == "straggler")
    assert (e["rank"], e["step"], e["phase"]) == (SMALL_STRAGGLER, record.step, "forward")
    assert SMALL_FROM <= e["step"] < SMALL_FROM + 10
    assert e["factor"] == pytest.approx(record.value / record.baseline, rel=1e-12)
    assert e["time_ms"] == pytest.approx(record.value * 1e3)
    assert e["median_ms"] == pytest.approx(record.baseline * 1e3)
    assert 1.8 < e["factor"] < 2.6  # 30 ms forwards, one of 70
    assert d["rows"][e["row"]] == str(SMALL_STRAGGLER) and d["edges"][e["bin"]] == e["step"]
    # grouped: on the group's row, and on the rank's own row once the group is expanded
    d = get(client, "timeline?run=big&bins=20")
    (e,) = d["episodes"]
    assert (e["rank"], e["phase"], d["rows"][e["row"]]) == (BIG_STRAGGLER, "forward", "136-137")
    d = get(client, f"timeline?run=big&bins=20&expand={BIG_STRAGGLER}")
    assert sorted(d["rows"][x["row"]] for x in d["episodes"]) == ["136-137", str(BIG_STRAGGLER)]
    # the filters apply: another rank, or rules without straggler, and there is none
    assert get(client, "timeline?run=small&bins=40&ranks=0")["episodes"] == []
    assert get(client, "timeline?run=small&bins=40&rules=nan")["episodes"] == []


def test_time_is_read_when_asked_for_and_then_only_what_was_written_since(tmp_path):
    """Startup, the run list and the timeline read no time; the first heat map of a time reads it, the next
    one answers from memory; steps written since are read alone and appear."""
    run = tmp_path / "logs" / "live"
    write_timed_run(run, 3, 10)
    client = make_client(tmp_path / "logs")
    get(client, "runs")
    get(client, "timeline?run=live&bins=10")
    plugin = next(p for p in client.application._plugins if p.plugin_name == "trainmon")
    times = plugin.registry.get("live").times
    assert times.reads == 0 and times.cached() == []
    assert next(r for r in get(client, "runs")["runs"] if r["run"] == "live")["timed"] is True
    d = get(client, "time_heatmap?run=live&time=step&bins=100")
    assert times.reads == 1 and times.cached() == ["step"] and d["bins"] == 10
    get(client, "time_heatmap?run=live&time=step&bins=3")
    assert times.reads == 1
    # live: the tab sends its last answer's key; nothing written since: "unchanged", nothing computed
    assert get(client, f"time_heatmap?run=live&time=step&bins=100&since={d['key']}") == {
        "run": "live", "unchanged": True, "key": d["key"]
    }

    # two more steps, written by the ranks' logs as a job resumed into the run writes them
    for rank in range(3):
        log = AnomalyLog(run, rank)
        for step in (10, 11):
            rows = exchanged_rows(3, step, None, 0)
            log.end_step(step, 1.7e9 + step, 1.0, 0.0, 4, timing=StepTiming(step, rank, rows[rank], rows))
        log.close()
    key = d["key"]
    d = get(client, f"time_heatmap?run=live&time=step&bins=100&since={key}")
    assert times.reads == 2 and d["bins"] == 12 and d["edges"][-1] == 12 and d["key"] != key
    last = decode(d["max"], "<f4", (3, 12))[:, 11]
    want = rank_times(exchanged_rows(3, 11, None, 0))[:, T["step"]].astype(np.float32) * np.float32(1e3)
    np.testing.assert_array_equal(last, want)


def test_bad_requests_name_what_is_wrong(client, tmp_path):
    assert "'time'" in get(client, "time_heatmap?run=small&time=bogus", 400)["error"]
    assert "step_hi" in get(client, "time_heatmap?run=small&step_lo=9&step_hi=3", 400)["error"]
    assert "'rank'" in get(client, "rank_steps?run=small", 400)["error"]
    assert "rank 99" in get(client, "rank_steps?run=small&rank=99", 404)["error"]


def test_a_run_without_timing_says_so(tmp_path):
    run = tmp_path / "logs" / "untimed"
    with AnomalyLog(run, 0) as log:
        log.end_step(0, 1.7e9, 1.0, 0.0, 4)
    client = make_client(tmp_path / "logs")
    assert next(r for r in get(client, "runs")["runs"] if r["run"] == "untimed")["timed"] is False
    assert "no timing tables" in get(client, "time_heatmap?run=untimed", 404)["error"]


def test_analyze_names_the_first_nan_not_an_earlier_straggler_and_points_at_the_episodes(tmp_path):
    """A straggler episode before a NaN: ``trainmon analyze RUN`` is about the statistics (its first anomaly
    is the NaN) and says how many straggler episodes there are and where to read them."""
    import json
    import subprocess
    import sys

    from trainmon.anomaly.log import AnomalyLog
    from trainmon.run.layout import summary_file
    from trainmon.run.records import Anomaly
    from trainmon.run.summary import read_summary

    run = tmp_path / "run"
    write_timed_run(run, 4, 30, straggler=2, straggler_from=3)
    episode = read_summary(summary_file(run, 2)).first["straggler"]
    assert episode.step < 20
    log = AnomalyLog(run, 0)  # rank 0 goes on: a NaN at step 30
    nan = Anomaly(30, 0, "actv", "layers.1.output", "nans", 3.0, "nan", origin=True, wall_time=1.7e9 + 30)
    log.write_step(30, [nan])
    log.end_step(30, 1.7e9 + 30, float("nan"), 0.0, 4)
    log.close()

    def analyze(*extra: str) -> str:
        command = [sys.executable, "-m", "trainmon", "analyze", str(run), *extra]
        return subprocess.run(command, check=True, capture_output=True, text=True, timeout=60).stdout

    text = analyze()
    assert "FIRST ANOMALY\n  step 30, rank 0: actv layers.1.output nans = 3 [nan]" in text
    said = f"and 1 straggler episode (slow ranks): trainmon analyze {run} --rule straggler"
    assert text.rstrip().endswith(said)
    doc = json.loads(analyze("--json"))
    assert doc["first"]["step"] == 30 and doc["anomalies"] == 1 and doc["left_out"] == {"straggler": 1}
    assert json.loads(analyze("--json", "--rule", "straggler"))["stragglers"][0]["step"] == episode.step


def test_the_time_table_is_written_for_a_whole_read(logdir):
    """``rank_times/`` is what a time heat map reads whole (82 MB a time at 1,024 ranks x 20,000 steps): its
    segments are uncompressed and its lists' items never null, so a reader decodes neither (the first read of
    a time took twice as long with zstd and nullable items: bench/HISTORY.md)."""
    import pyarrow.parquet as pq

    from trainmon.run.layout import rank_times_dir

    root, _ = logdir
    files = sorted(rank_times_dir(root / "small").glob("*.parquet"))
    assert files
    for path in files:
        meta = pq.ParquetFile(path).metadata
        groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
        chunks = [group.column(c) for group in groups for c in range(meta.num_columns)]
        assert {c.compression for c in chunks if c.path_in_schema.endswith(".element")} == {"UNCOMPRESSED"}
        schema = pq.read_schema(path)
        assert all(not schema.field(name).type.value_field.nullable for name in TIMING_COLUMNS)


def test_a_time_table_of_an_earlier_release_reads_the_same(logdir, tmp_path):
    """A run written before the time table was uncompressed (zstd, nullable items) gives the same heat map."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainmon.run.layout import rank_times_dir

    root, _ = logdir
    old = tmp_path / "logs" / "old"
    shutil.copytree(root / "small", old)
    rewritten = 0
    for path in rank_times_dir(old).glob("*.parquet"):
        table = pq.read_table(path)
        fields = [pa.field(f.name, pa.list_(pa.float32()), False) if f.name in TIMING_COLUMNS else f
                  for f in table.schema]  # fmt: skip
        pq.write_table(table.cast(pa.schema(fields)), path, compression="zstd")
        rewritten += 1
    assert rewritten and pq.read_schema(path).field("step_time").type.value_field.nullable
    earlier = make_client(tmp_path / "logs")
    now = make_client(root)
    for time in ("step", "wait"):
        a = get(earlier, f"time_heatmap?run=old&time={time}&bins=7")
        b = get(now, f"time_heatmap?run=small&time={time}&bins=7")
        for key in ("median", "max", "max_rank", "flags", "edges", "rows"):
            assert a[key] == b[key], key


def test_reading_a_time_imports_no_pandas(logdir):
    """pyarrow imports pandas (a third of a second) for ``to_numpy`` and Python scalars; a time's first heat
    map must not pay for it."""
    import subprocess
    import sys

    root, _ = logdir
    repo = Path(__file__).resolve().parents[1]
    code = (
        "import sys\n"
        "from trainmon_tb.time_index import TimeIndex\n"
        f"index = TimeIndex({str(root / 'big')!r})\n"
        f"hm = index.heatmap('forward', None, None, 600, expand=[{BIG_STRAGGLER}])\n"
        "assert hm is not None and hm.ranks == 256, hm\n"
        "print('pandas' in sys.modules)\n"
    )
    env = {"PYTHONPATH": f"{repo / 'tb_plugin'}:{repo}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_time_table_cut_in_half_is_named_and_read_around(logdir, tmp_path):
    """The time table is read through a memory map: a segment cut short is noted damaged, as every reader
    does, and the heat map is answered from the rest (here: no steps left, so no timing table), without a
    traceback."""
    import shutil

    from trainmon.run import damage
    from trainmon.run.layout import rank_times_dir

    root, _ = logdir
    cut = tmp_path / "logs" / "cut"
    shutil.copytree(root / "small", cut)
    (segment,) = sorted(rank_times_dir(cut).glob("*.parquet"))
    data = segment.read_bytes()
    segment.write_bytes(data[: len(data) // 2])
    d = get(make_client(tmp_path / "logs"), "time_heatmap?run=cut&time=step&bins=5", 404)
    assert "no timing tables" in d["error"] and f"damaged: {segment.relative_to(cut)}: " in d["error"]
    assert [x.path for x in damage.damaged(cut)] == [segment]

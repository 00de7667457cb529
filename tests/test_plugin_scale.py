"""The plugin at scale, in process through TensorBoard's WSGI application: the timeline groups ranks beyond
200 rows (an expanded group is followed by its ranks; a group's name is a valid ``ranks`` filter), and a
refresh with nothing new costs nothing."""

from __future__ import annotations

import json

import pytest
from test_plugin_routes import expand_cells, make_client
from trainmon_tb.rank_rows import GROUP, MEMBER, OPEN, RANK, rank_rows

from trainmon.anomaly.log import AnomalyLog
from trainmon.run.records import Anomaly

WORLD = 300
NAN_RANK = 137


def get(client, url: str, status: int = 200) -> dict:
    resp = client.get(f"/data/plugin/trainmon/{url}")
    assert resp.status_code == status, resp.get_data(as_text=True)
    return json.loads(resp.get_data(as_text=True))


def write_world(run, world: int = WORLD) -> None:
    """One record on every rank (step = rank % 40, a turbulence), and the NaN: rank 137 at step 3, origin."""
    for rank in range(world):
        records = [Anomaly(rank % 40, rank, "grad_reduced", "w", "norm", 9.0, "turbulence")]
        if rank == NAN_RANK:
            records.append(Anomaly(3, rank, "actv", "layers.2.output", "nans", 4.0, "nan", origin=True))
        with AnomalyLog(run, rank) as log:
            for step in sorted({a.step for a in records}):
                log.write_step(step, [a for a in records if a.step == step])


# The walk of issue 32 (bench/scale.py build --ranks 256 --nan-rank 150 --nan-step 120), shortened: rank 150's
# NaN starts at step NAN_STEP, every other rank's at the next step, and stays (the parameters are NaN), each
# step's records marked `origin` by the monitor as it marks every step's first non-finite module.
RANKS_256, STEPS_256, NAN_RANK_256, NAN_STEP_256 = 256, 40, 150, 24


def write_persisting_nan(run, ranks: int = RANKS_256, steps: int = STEPS_256, nan_rank: int = NAN_RANK_256,
                         nan_step: int = NAN_STEP_256, back_at: int | None = None) -> None:  # fmt: skip
    """A loss spike on every rank at step 0, then the NaN: from ``nan_step`` on rank ``nan_rank``, from the
    step after on every other rank, in every step after it (but the steps of ``back_at``: ``(clean, again)``,
    a stretch without NaN on rank ``nan_rank`` and its return)."""
    from trainmon.run.manifest import write_manifest

    write_manifest(run, {"world_size": ranks, "config": {"step_interval": 1}})
    for rank in range(ranks):
        start = nan_step + (rank != nan_rank)
        with AnomalyLog(run, rank) as log:
            log.write_step(0, [Anomaly(0, rank, "scalar", "loss", "mean", 9.0, "turbulence")])
            for step in range(start, steps):
                if back_at is not None and rank == nan_rank and back_at[0] <= step < back_at[1]:
                    continue
                nan = {"stat": "nans", "value": 8.0, "rule": "nan"}
                log.write_step(step, [
                    Anomaly(step, rank, "actv", "layers.2.output", seq=5, origin=True, **nan),
                    Anomaly(step, rank, "actv", "layers.3.output", seq=7, propagated=True, **nan),
                    Anomaly(step, rank, "grad_reduced", "layers.3.weight", seq=40, phase="optimizer", **nan),
                ])  # fmt: skip


@pytest.fixture(scope="module")
def persisting(tmp_path_factory):
    root = tmp_path_factory.mktemp("persisting")
    write_persisting_nan(root / "r256")
    return make_client(root)


def test_origins_mark_where_a_nan_starts_not_where_it_persists(persisting):
    t = get(persisting, f"timeline?run=r256&bins=440&step_lo=0&step_hi={STEPS_256 - 1}")
    assert t["bins"] == STEPS_256 and t["group_size"] == 2 and len(t["rows"]) == 128
    origins = sorted(zip([t["rows"][r] for r in t["origins"]["row"]], t["origins"]["bin"], strict=True))
    group = f"{NAN_RANK_256}-{NAN_RANK_256 + 1}"
    # rank 150 at its step, every rank (151 in 150's group too) at the next: 129 cells, none where it persists
    expected = [(group, NAN_STEP_256)] + [(f"{r}-{r + 1}", NAN_STEP_256 + 1) for r in range(0, RANKS_256, 2)]
    assert origins == sorted(expected)
    # the first NaN across ranks, and its cell
    assert (t["first"]["rank"], t["first"]["step"], t["first"]["rule"]) == (NAN_RANK_256, NAN_STEP_256, "nan")
    assert t["first_cell"] == {"row": t["rows"].index(group), "bin": NAN_STEP_256}
    # the steps where the NaN persists are one run a row: 128 rows of a spike, an onset (two in 150's group)
    # and a run, not 128 x 16 cells
    runs = {(r, b) for r, b in zip(t["cells"]["row"], t["cells"]["bin"], strict=True)}
    assert len(runs) == 128 * 3 + 1
    per_rank = 1 + 3 * (STEPS_256 - NAN_STEP_256 - 1)  # the spike, then 3 records a NaN step
    assert sum(n for *_, n in expand_cells(t)) == t["total"] == RANKS_256 * per_rank + 3
    assert len(json.dumps(t)) < 20_000
    # a zoom after the onsets marks nothing: the NaN persists there
    zoomed = get(persisting, f"timeline?run=r256&bins=440&step_lo={NAN_STEP_256 + 4}&step_hi={STEPS_256 - 1}")
    assert zoomed["origins"] == {"row": [], "bin": []} and zoomed["total"] > 0
    # tensors as rows: the origin module at its two onset steps
    m = get(persisting, f"timeline?run=r256&axis=module&bins=440&step_lo=0&step_hi={STEPS_256 - 1}")
    marked = sorted(zip([m["rows"][r] for r in m["origins"]["row"]], m["origins"]["bin"], strict=True))
    assert marked == [("layers.2.output", NAN_STEP_256), ("layers.2.output", NAN_STEP_256 + 1)]


@pytest.mark.parametrize(
    "extra", ["", "&expand=150", "&expand=0,150,254", f"&step_lo={NAN_STEP_256 - 3}&step_hi=30"]
)
@pytest.mark.parametrize("bins", [440, 17, 1])
def test_the_first_views_timeline_from_counts_equals_the_one_from_records(persisting, bins, extra):
    """The unfiltered rank timeline (the first view's) is drawn from the records counted by rank, step and
    kind beforehand (issue 45: 25 times fewer entries at 256 ranks); a filter every record passes takes the
    records themselves: the same answer, cell for cell, origins, first cell and counts."""
    url = f"timeline?run=r256&bins={bins}{extra}"
    counted = get(persisting, url)
    every_kind = get(persisting, f"{url}&kinds=scalar,actv,grad_reduced")
    for answer in (counted, every_kind):
        answer.pop("key")
    assert counted == every_kind
    assert counted["total"] > 0 and counted["first_cell"] is not None


def test_the_ranks_filter_shows_those_ranks_only(persisting):
    t = get(persisting, f"timeline?run=r256&bins=440&ranks={NAN_RANK_256}")
    assert t["rows"] == [str(NAN_RANK_256)] and t["rows_total"] == 1 and t["group_size"] == 1
    assert t["first_cell"] == {"row": 0, "bin": t["first"]["step"] - t["step_lo"]}
    assert [t["rows"][r] for r in t["origins"]["row"]] == [str(NAN_RANK_256)]
    t = get(persisting, "timeline?run=r256&bins=440&ranks=4-7,300")  # ranges; a rank the run lacks: no row
    assert t["rows"] == ["4", "5", "6", "7"]


def test_a_nan_that_comes_back_after_clean_steps_starts_again(tmp_path):
    write_persisting_nan(tmp_path / "back", ranks=4, steps=20, nan_rank=1, nan_step=5, back_at=(9, 12))
    t = get(make_client(tmp_path), "timeline?run=back&bins=20&step_lo=0&step_hi=19")
    origins = sorted(zip([t["rows"][r] for r in t["origins"]["row"]], t["origins"]["bin"], strict=True))
    assert origins == [("0", 6), ("1", 5), ("1", 12), ("2", 6), ("3", 6)]


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    write_world(root / "big")
    return make_client(root)


def test_rank_rows_group_by_powers_of_two_and_expand():
    rows = rank_rows(range(10), max_rows=200)
    assert rows.group_size == 1 and rows.kinds == [RANK] * 10 and rows.labels[3] == "3"
    rows = rank_rows(range(1024), expand=[70], max_rows=200)
    assert rows.group_size == 8  # 128 rows: a node of 8 GPUs per row
    i = rows.labels.index("64-71")
    assert rows.kinds[i] == OPEN and rows.labels[i + 1 : i + 9] == [str(r) for r in range(64, 72)]
    assert rows.kinds[i + 1 : i + 9] == [MEMBER] * 8 and rows.kinds[i + 9] == GROUP
    assert len(rows.labels) == 128 + 8
    assert rows.base[70] == i and rows.member[70] == i + 7 and rows.member[72] == -1
    assert rank_rows(range(16384), max_rows=200).group_size == 128


def test_timeline_groups_ranks_beyond_200_rows(big):
    t = get(big, "timeline?run=big&bins=40&step_lo=0&step_hi=39")
    assert t["group_size"] == 2 and len(t["rows"]) == 150 and t["rows_total"] == WORLD
    assert t["rows"][:3] == ["0-1", "2-3", "4-5"] and set(t["row_kinds"]) == {GROUP}
    assert t["total"] == WORLD + 1
    # every rank's record counts in its group's row; the NaN's group holds the origin
    counts = {}
    for r, b, _, c in expand_cells(t):
        counts[(t["rows"][r], b)] = counts.get((t["rows"][r], b), 0) + c
    assert sum(counts.values()) == WORLD + 1
    assert counts[("136-137", 3)] == 1 + (137 % 40 == 3)
    assert counts[("136-137", 137 % 40)] >= 1
    origin_rows = [t["rows"][r] for r in t["origins"]["row"]]
    assert origin_rows == ["136-137"] and t["origins"]["bin"] == [3]
    assert t["first"]["rank"] == NAN_RANK and t["first"]["step"] == 3
    # the answer stays small whatever the world (here: 150 rows of 300 ranks)
    assert len(json.dumps(t)) < 20_000


def test_an_expanded_group_is_followed_by_its_ranks(big):
    t = get(big, f"timeline?run=big&bins=40&step_lo=0&step_hi=39&expand={NAN_RANK}")
    i = t["rows"].index("136-137")
    assert t["row_kinds"][i : i + 3] == [OPEN, MEMBER, MEMBER] and t["rows"][i + 1 : i + 3] == ["136", "137"]
    assert len(t["rows"]) == 152 and t["total"] == WORLD + 1  # no record counted twice in the total
    cells = {(t["rows"][r], b): n for r, b, _, n in expand_cells(t)}
    assert cells[("137", 3)] == 1 and cells[("136", 136 % 40)] == 1
    assert [t["rows"][r] for r in t["origins"]["row"]] == ["136-137", "137"]


def test_a_group_name_filters_its_ranks(big):
    got = get(big, "events?run=big&step_lo=0&step_hi=39&ranks=136-137")
    assert got["total"] == 3 and {e["rank"] for e in got["events"]} == {136, 137}
    assert got["events"][0]["origin"] and got["events"][0]["rank"] == NAN_RANK
    assert "ranges a-b" in get(big, "events?run=big&ranks=9-3", 400)["error"]


# ---------------------------------------------------------------------------------------------------------
# refreshing: nothing new costs nothing, new records are merged in, requests never wait for the poller


def _write(run, rank: int, steps, kind: str = "actv") -> None:
    with AnomalyLog(run, rank) as log:
        for step in steps:
            record = Anomaly(step, rank, kind, f"m{step % 3}", "nans", 1.0, "nan", seq=step % 5)
            log.write_step(step, [record])


def _write_varied(run, ranks: int = 24, steps: int = 6) -> None:
    """Records of every column's cases: per-rank names (each rank's files have their own dictionaries),
    several kinds, rules and phases, origins, pipeline stages, collectives, a straggler with its baseline and
    records without one, two records of one step (their place ``k``)."""
    for rank in range(ranks):
        with AnomalyLog(run, rank) as log:
            for step in range(rank % 3, steps):
                phase = ("forward", "backward", "optimizer")[(rank + step) % 3]
                records = [
                    Anomaly(step, rank, "actv", f"layers.{rank % 5}.output", "nans", 8.0 + rank, "nan",
                            seq=step + rank, origin=step == rank % 3, pp_stage=rank % 2, phase=phase,
                            collectives=step * 2, micro_step=step % 2),
                    Anomaly(step, rank, "grad_reduced", f"w{rank}", "norm", 1.5 * step, "turbulence",
                            seq=3, baseline=None if rank % 2 else 0.25),
                ]  # fmt: skip
                if rank == 5 and step == 4:
                    slow = Anomaly(step, rank, "scalar", "forward", "time", 0.9, "straggler", baseline=0.3)
                    records.append(slow)
                log.write_step(step, records)


def test_the_first_reading_holds_every_record_as_written(tmp_path):
    """The index a first load builds (ranks read in batches by threads, each rank's dictionaries looked up
    apart, columns converted without pyarrow's to_numpy) holds every record's fields as the records read back
    one by one, in each rank's write order."""
    import math

    from trainmon_tb import anomaly_index

    from trainmon.run.anomaly_table import read_anomalies
    from trainmon.run.records import PHASE_ORDER

    _write_varied(tmp_path)
    index = anomaly_index.AnomalyIndex(tmp_path)
    index.refresh()
    snap = index._snap
    c = snap.cols
    got: dict[int, list[tuple]] = {}
    for i in range(snap.n):
        baseline = float(c["baseline"][i])
        got.setdefault(int(c["rank"][i]), []).append((
            int(c["step"][i]), index.kinds.values[c["kind"][i]], index.names.values[c["name"][i]],
            index.stats.values[c["stat"][i]], float(c["value"][i]),
            None if math.isnan(baseline) else baseline, index.rules.values[c["rule"][i]],
            bool(c["origin"][i]), int(c["collectives"][i]), int(c["phase"][i]),
            int(c["micro_step"][i]), int(c["stage"][i]), int(c["seq"][i]), int(c["k"][i]),
        ))  # fmt: skip
    expected: dict[int, list[tuple]] = {}
    for rank in range(24):
        places: dict[int, int] = {}
        for a in read_anomalies(tmp_path, rank):
            k = places[a.step] = places.get(a.step, -1) + 1
            stage = -a.pp_stage if a.phase == "backward" else a.pp_stage
            expected.setdefault(rank, []).append((
                a.step, a.kind, a.name, a.stat, a.value, a.baseline, a.rule, a.origin, a.collectives,
                PHASE_ORDER[a.phase], a.micro_step, stage, a.seq, k,
            ))  # fmt: skip
    assert got == expected and snap.n == 8 * (6 + 5 + 4) * 2 + 1
    # strings interned in the order the ranks' files' dictionaries first list them (rank 1's: w1 first)
    assert index.kinds.values == ["actv", "grad_reduced", "scalar"]
    assert index.names.values[:4] == ["layers.0.output", "w0", "w1", "layers.1.output"]


def test_the_plugin_and_its_first_reading_import_no_pandas(tmp_path):
    """pandas costs half a second to import: at TensorBoard's start when a module the plugin imports imports
    it, in the first load when pyarrow's ``to_numpy`` is called (its first call imports it, the GIL held,
    while TensorBoard serves its page). Neither happens."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    _write_varied(tmp_path)
    code = (
        "import sys; from pathlib import Path; import trainmon_tb.plugin; "
        "from trainmon_tb.anomaly_index import AnomalyIndex; "
        f"i = AnomalyIndex(Path({str(tmp_path)!r})); i.refresh(); i.prepare(1); "
        "print(len(i), 'pandas' in sys.modules)"
    )
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{repo / 'tb_plugin'}:{repo}"}  # this checkout's plugin
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env=env
    )
    assert out.stdout.split() == [str(8 * (6 + 5 + 4) * 2 + 1), "False"]


def test_a_refresh_with_nothing_new_reads_nothing(tmp_path, monkeypatch):
    from trainmon_tb import anomaly_index

    for rank in range(16):
        _write(tmp_path, rank, [rank, rank + 1])
    index = anomaly_index.AnomalyIndex(tmp_path)
    assert index.refresh() and len(index) == 32
    version = index.version
    monkeypatch.setattr(anomaly_index, "_SETTLED_NS", 0)  # the folders' times count as settled at once
    index.refresh()  # notes the folders' times
    calls = []
    monkeypatch.setattr(anomaly_index, "read_anomaly_rows", lambda *a, **k: calls.append(a))
    real_scandir = anomaly_index.os.scandir
    monkeypatch.setattr(anomaly_index.os, "scandir", lambda *a: calls.append(a) or real_scandir(*a))
    assert index.refresh() is False and index.version == version
    assert calls == []  # no folder listed, no record read: one stat of each of two folders


def test_new_records_are_merged_in_collection_order(tmp_path, monkeypatch):
    from trainmon_tb import anomaly_index

    sorted_sizes = []
    real = anomaly_index.AnomalyIndex._sort_keys

    def sort_keys(self, cols, idx):
        sorted_sizes.append(len(idx))
        return real(self, cols, idx)

    monkeypatch.setattr(anomaly_index.AnomalyIndex, "_sort_keys", sort_keys)
    index = anomaly_index.AnomalyIndex(tmp_path)
    # ranks write at different paces: rank 2 lags, so its records land among steps already indexed
    _write(tmp_path, 0, range(0, 20))
    _write(tmp_path, 1, range(0, 20))
    index.refresh()
    _write(tmp_path, 2, range(0, 10))
    _write(tmp_path, 0, range(20, 30))
    index.refresh()
    _write(tmp_path, 2, range(10, 30))
    _write(tmp_path, 1, range(20, 30))
    index.refresh()
    total, events = index.events(0, 29, limit=5000)
    assert total == 90
    got = [(e["step"], e["seq"], e["rank"]) for e in events]
    assert got == sorted(got)  # collection order: step, ..., seq, rank (no origin here)
    # each refresh orders its new records, then those with the steps they share with the index: 40 first;
    # then 20 new (rank 2's steps 0-9, rank 0's 20-29) and 20 + 20 of steps 0-9; then 30 new and 30 + 30 of
    # steps 10-29. Steps nobody shares are never ordered again
    assert sorted_sizes == [40, 20, 40, 30, 60]
    full = anomaly_index.AnomalyIndex(tmp_path)
    full.refresh()
    assert full.events(0, 29, limit=5000) == (total, events)
    assert full.timeline("module", 0, 29, 30).cells == index.timeline("module", 0, 29, 30).cells


def test_requests_answer_while_the_poller_reads(tmp_path, monkeypatch):
    import threading
    import time

    from trainmon_tb import anomaly_index

    _write(tmp_path / "logs" / "live", 0, range(5))
    client = make_client(tmp_path / "logs")
    first = get(client, "timeline?run=live")
    assert first["total"] == 5
    reading, release = threading.Event(), threading.Event()
    real = anomaly_index.read_anomaly_rows

    def slow(*args, **kwargs):
        reading.set()
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(anomaly_index, "read_anomaly_rows", slow)
    _write(tmp_path / "logs" / "live", 0, range(5, 8))
    registry = next(p for p in client.application._plugins if p.plugin_name == "trainmon").registry
    poller = threading.Thread(target=lambda: registry.get("live").refresh())
    poller.start()
    assert reading.wait(10)
    t0 = time.monotonic()
    during = get(client, "timeline?run=live")  # answered from the index as it was
    assert time.monotonic() - t0 < 2 and during["total"] == 5
    assert get(client, f"timeline?run=live&since={during['key']}") == {
        "run": "live",
        "unchanged": True,
        "key": during["key"],
    }
    release.set()
    poller.join(10)
    after = get(client, f"timeline?run=live&since={during['key']}")
    assert after["total"] == 8 and after["key"] != during["key"]


# ---------------------------------------------------------------------------------------------------------
# statistics on demand


def _store(run, ranks, steps, tensors: int = 5, nan_at: tuple[int, int, int] | None = None) -> None:
    """A statistics store written by the writer's own sink: tensor j of rank r at step s has max
    ``(s + 1) * (j + 1) + r`` (and min its negative); ``nan_at`` = (rank, step, tensor) holds a NaN element
    and no finite one."""
    import numpy as np

    from trainmon.run import records
    from trainmon.run.records import Row, StepRecord
    from trainmon.writer.statstore import StatStoreSink

    rows = tuple(Row("actv", f"layers.{j}.output", 0, 0, "forward", (4,), "float32") for j in range(tensors))
    for rank in ranks:
        sink = StatStoreSink(run, rank)
        for step in steps:
            top = (step + 1) * (np.arange(tensors) + 1.0) + rank
            p = np.zeros((tensors, 8))
            p[:, 0] = 4
            p[:, 4], p[:, 5], p[:, 6], p[:, 7] = -top, top, 0.0, 2 * top * top
            if nan_at is not None and (rank, step) == nan_at[:2]:
                p[nan_at[2]] = [4, 4, 0, 0, np.inf, -np.inf, 0, 0]
            rec = StepRecord(step=step, rank=rank, rows=rows, partials=p, wall_time=1.0)
            sink.write(rec, records.Derived(rec))
        sink.close()


def _expected_max(rank: int, steps, edges, tensors: int = 5):
    import numpy as np

    out = np.full((tensors, len(edges) - 1), np.nan, dtype=np.float32)
    for b in range(len(edges) - 1):
        inside = [s for s in steps if edges[b] <= s < edges[b + 1]]
        if inside:
            out[:, b] = (max(inside) + 1) * (np.arange(tensors) + 1.0) + rank
    return out


def test_a_rank_is_read_when_looked_at_and_kept_least_recently_used(tmp_path, monkeypatch):
    import numpy as np
    from trainmon_tb import stat_index

    _store(tmp_path, range(12), range(30))
    index = stat_index.StatIndex(tmp_path)
    index.refresh()
    assert index.summary()["ranks"] == list(range(12)) and index.reads == 0  # listing reads no statistic
    hm = index.heatmap(7, "actv", "max", None, None, 30)
    assert index.reads == 1 and index.cached() == [(7, "max")]
    np.testing.assert_array_equal(hm.values, _expected_max(7, range(30), hm.edges))
    monkeypatch.setattr(stat_index, "CACHE_ENTRIES", 3)
    for rank in (1, 2, 7, 3):
        index.heatmap(rank, "actv", "max", None, None, 30)
    assert index.cached() == [(2, "max"), (7, "max"), (3, "max")]  # rank 7 was used again: kept
    assert index.reads == 4
    index.series(7, "actv", "layers.2.output", "max")
    assert index.reads == 4  # served from the cache


def test_a_cached_rank_reads_only_the_steps_written_since(tmp_path):
    import numpy as np
    from trainmon_tb import stat_index

    _store(tmp_path, [0], range(10))
    index = stat_index.StatIndex(tmp_path)
    index.refresh()
    index.heatmap(0, "actv", "max", None, None, 100)
    _store(tmp_path, [0], range(10, 25))  # a resumed writer appends steps 10..24
    hm = index.heatmap(0, "actv", "max", None, None, 100)
    assert hm.step_hi == 24 and index.reads == 2
    np.testing.assert_array_equal(hm.values, _expected_max(0, range(25), hm.edges))
    steps, values = index.series(0, "actv", "layers.1.output", "max")
    assert steps.tolist() == list(range(25)) and values.tolist() == [2.0 * (s + 1) for s in range(25)]


@pytest.mark.parametrize("bins", [7, 64, 100, 999, 2000])
def test_zoomed_out_heatmaps_from_blocks_equal_every_step(tmp_path, bins):
    import numpy as np
    from trainmon_tb import stat_index

    steps = [s for s in range(3000) if s % 7 != 3]  # steps missing here and there
    _store(tmp_path, [0], steps, nan_at=(0, 1500, 2))
    index = stat_index.StatIndex(tmp_path)
    index.refresh()
    for lo, hi in ((0, 2999), (250, 2712)):
        hm = index.heatmap(0, "actv", "max", lo, hi, bins)
        want = _expected_max(0, steps, hm.edges)
        nan_bin = int(np.searchsorted(hm.edges, 1500, side="right")) - 1
        if lo <= 1500 <= hi:
            # the NaN step has no finite max for tensor 2: its bin's max comes from the bin's other steps
            inside = [s for s in steps if hm.edges[nan_bin] <= s < hm.edges[nan_bin + 1] and s != 1500]
            want[2, nan_bin] = (max(inside) + 1) * 3.0 if inside else np.nan
            assert hm.flags[2, nan_bin] == stat_index.HAS_DATA | stat_index.HAS_NAN
        np.testing.assert_array_equal(hm.values, want)
        hm_min = index.heatmap(0, "actv", "min", lo, hi, bins)
        last = [
            max((s for s in steps if hm.edges[b] <= s < hm.edges[b + 1]), default=None)
            for b in range(hm.bins)
        ]
        lowest = [np.nan if s is None else -(s + 1.0) for s in last]
        np.testing.assert_array_equal(hm_min.values[0], np.asarray(lowest, dtype=np.float32))

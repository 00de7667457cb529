"""The plugin at scale, in process through TensorBoard's WSGI application: the timeline groups ranks beyond
200 rows (an expanded group is followed by its ranks; a group's name is a valid ``ranks`` filter), and a
refresh with nothing new costs nothing."""

from __future__ import annotations

import json

import pytest
from test_plugin_routes import make_client
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
    for r, b, c in zip(t["cells"]["row"], t["cells"]["bin"], t["cells"]["count"], strict=True):
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
    c = t["cells"]
    cells = {(t["rows"][r], b): n for r, b, n in zip(c["row"], c["bin"], c["count"], strict=True)}
    assert cells[("137", 3)] == 1 and cells[("136", 136 % 40)] == 1
    assert [t["rows"][r] for r in t["origins"]["row"]] == ["136-137", "137"]


def test_a_group_name_filters_its_ranks(big):
    got = get(big, "events?run=big&step_lo=0&step_hi=39&ranks=136-137")
    assert got["total"] == 3 and {e["rank"] for e in got["events"]} == {136, 137}
    assert got["events"][0]["origin"] and got["events"][0]["rank"] == NAN_RANK
    assert "ranges a-b" in get(big, "events?run=big&ranks=9-3", 400)["error"]

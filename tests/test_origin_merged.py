"""Where a NaN started when statistics are merged over ranks (issue 50, point 3).

Under tensor parallelism a sharded activation's row holds the whole tensor's statistics on every rank of the
group, so a NaN made on one rank shows in its partners' rows too. The origin is judged on what each rank
computed itself: the rank's own NaN/Inf counts, kept before the merge (``StepRecord.own_nonfinite``). Fixed
rows first (the rule, the marks, the step buffer, the writer's wire), then ``--explain`` on runs written by
hand, then real runs: the torchtitan-style Llama with tensor parallelism on 2 gloo ranks, rank 1 (or both)
making the NaN in ``layers.0.attention_norm`` (tests/tp_nan_worker.py), and the issue's FSDP2 over tensor
parallelism on a 2x2 mesh, rank 2 making it, read back with the real CLI."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from launch import free_port, run_ranks
from test_origin import record_of

from trainmon.adapters import Shard
from trainmon.anomaly.log import AnomalyLog
from trainmon.anomaly.origin import Overflow, Received, bad_rows, locate_overflow, mark, peer_rows
from trainmon.cli import main
from trainmon.run import records
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.records import Anomaly, StepRecord
from trainmon.step.buffer import StepBuffer
from trainmon.writer import wire

NAN, F32 = math.nan, "torch.float32"
WORKER = Path(__file__).with_name("tp_nan_worker.py")


def run_cli(capsys, *args: str) -> str:
    assert main(["analyze", *args]) == 0
    return capsys.readouterr().out


def with_own(record: StepRecord, own: list[float]) -> StepRecord:
    return StepRecord(
        record.step, record.rank, record.rows, record.partials, 0.0, own_nonfinite=np.array(own)
    )


def nan_anomalies(record: StepRecord) -> list[Anomaly]:
    """One nan anomaly per row whose whole tensor holds NaN (what the rules flag), with the rule's message."""
    nans = records.derive(record.partials)["nans"]
    return [
        Anomaly(
            1, 0, r.kind, r.name, "nans", float(nans[i]), "nan", seq=i, message=f"{r.kind}/{r.name} has NaN"
        )
        for i, r in enumerate(record.rows)
        if nans[i] > 0
    ]


# The clean partner (rank 0) of a rank whose attention_norm made a NaN: wq's output is sharded over the TP
# group and merged, so it holds the partner's NaN; wo's input too; wo's all-reduce hands it on, whole.
PARTNER = [
    ("actv", "attention_norm.input", 1, F32), ("actv", "attention_norm.output", 1, F32),
    ("actv", "attention.wq.input", 1, F32), ("actv", "attention.wq.output", NAN, F32),  # merged
    ("actv", "attention.wo.input", NAN, F32),  # merged
    ("actv", "attention.wo.output", NAN, F32),  # replicated after wo's all-reduce: its own values
    ("actv", "attention.input_0", 1, F32), ("actv", "attention.output", NAN, F32),
    ("actv_grad", "attention.output_grad", NAN, F32), ("actv_grad", "attention.input_grad", NAN, F32),
]  # fmt: skip
PARTNER_OWN = [0, 0, 0, 0, 0, 1, 0, 1, 1, 1]


def test_a_partner_whose_own_pieces_were_finite_names_no_origin_of_its_own():
    whole = record_of(PARTNER)
    assert locate_overflow(whole, records.Derived(whole)).module == "attention.wq"  # the issue's answer
    record = with_own(whole, PARTNER_OWN)
    derived = records.Derived(record)
    assert list(np.flatnonzero(bad_rows(record, derived))) == [5, 7, 8, 9]
    assert list(np.flatnonzero(peer_rows(record, derived))) == [3, 4]
    received = locate_overflow(record, derived)
    assert received == Received(peer_seqs=frozenset({3, 4}), propagated_seqs=frozenset({3, 5, 7, 9}))
    marked = mark(nan_anomalies(record), received)
    assert not any(a.origin for a in marked)
    assert [a.name for a in marked if a.propagated] == [
        "attention.wq.output", "attention.wo.output", "attention.output", "attention.input_grad"
    ]  # fmt: skip
    wq = next(a for a in marked if a.name == "attention.wq.output")
    assert wq.value == 1.0  # the record keeps the whole tensor's count
    assert wq.message == (
        "actv/attention.wq.output has NaN (the whole tensor's, merged over ranks: rank 0's own piece has "
        "none, they came from another rank)"
    )
    assert [a.seq for a in marked] == [a.seq for a in nan_anomalies(record)]  # nothing moves


def test_the_rank_that_made_the_nan_keeps_its_origin():
    rows = [("actv", "attention_norm.input", 1, F32), *[(k, n, NAN, d) for k, n, _, d in PARTNER[1:6]]]
    record = with_own(record_of(rows), [0, 1, 1, 1, 1, 1])  # its own pieces hold the NaN
    overflow = locate_overflow(record, records.Derived(record))
    assert isinstance(overflow, Overflow) and overflow.module == "attention_norm"
    assert (overflow.origin_seqs, overflow.peer_seqs) == ({1}, frozenset())


def test_an_origin_before_another_ranks_nan_stands_and_a_peer_inflow_alone_blocks_later_ones():
    rows = [
        ("actv", "a.input", 1, F32), ("actv", "a.output", NAN, F32),  # this rank's own NaN
        ("actv", "b.input", 1, F32), ("actv", "b.output", NAN, F32),  # merged: another rank's NaN only
    ]  # fmt: skip
    record = with_own(record_of(rows), [0, 4, 0, 0])
    overflow = locate_overflow(record, records.Derived(record))
    assert (overflow.module, overflow.origin_seqs, overflow.peer_seqs, overflow.propagated_seqs) == (
        "a",
        {1},
        {3},
        {3},
    )
    marked = mark(nan_anomalies(record), overflow)
    assert "rank 0's own piece has none" in marked[1].message and marked[1].propagated

    # the other rank's NaN shows first in an inflowing row (a row-wise layer's sharded input): the layer's
    # all-reduce makes this rank's output bad, and nothing after is this rank's origin
    inflow = with_own(record_of([
        ("actv", "wo.input", NAN, F32), ("actv", "wo.output", NAN, F32),
        ("actv", "c.input", 1, F32), ("actv", "c.output", NAN, F32),
    ]), [0, 4, 0, 4])  # fmt: skip
    assert locate_overflow(inflow, records.Derived(inflow)) == Received(frozenset({0}), frozenset({1, 3}))


def test_without_merged_rows_nothing_changes():
    record = record_of(PARTNER)
    assert record.own_nonfinite is None
    derived = records.Derived(record)
    assert not peer_rows(record, derived).any()
    # own counts equal to the whole tensor's (no row merged, or merged over finite pieces) change nothing
    same = with_own(record, list(records.derive(record.partials)["nans"]))
    assert locate_overflow(same, records.Derived(same)) == locate_overflow(record, derived)


def test_the_step_buffer_keeps_the_own_counts_from_before_the_merge(monkeypatch):
    buffer = StepBuffer(eps=0.0)
    piece = torch.tensor([1.0, float("nan"), 2.0, float("inf")])
    buffer.add("actv", "plain.output", 0, 0, "forward", torch.ones(4))
    buffer.add_pieces("actv", [(0, "wq.output")], [Shard(piece, None, (8,))], 0, "forward")
    buffer.add("actv", "after.output", 0, 0, "forward", torch.tensor([float("nan")]))

    def merge() -> None:  # what the partner's pieces add over the group: 5 NaN of its own
        store = next(iter(buffer._stores.values()))
        store.data[1, records.NANS] += 5

    monkeypatch.setattr(buffer, "_merge_shards", merge)
    record, ready = buffer.finish(step=1, rank=0)
    if ready is not None:
        ready()
    assert record.partials[:, records.NANS].tolist() == [0, 6, 1]  # the whole tensors'
    assert record.own_nonfinite.tolist() == [0, 2, 1]  # this rank's own
    assert len(record.partials) == 3  # the own counts rode in the copy, after the rows
    buffer.add("actv", "plain.output", 0, 0, "forward", torch.ones(4))
    assert buffer.finish(step=2, rank=0)[0].own_nonfinite is None  # nothing merged


def test_own_counts_of_rows_on_two_devices_are_placed_as_their_partials(monkeypatch):
    """Rows in two stores (on a GPU machine: activations on the GPU, parameters offloaded to the CPU): each
    store's own counts come back in a copy of their own and land at their rows' places. A second CPU store
    (``cpu:0``) stands in for the second device."""
    buffer = StepBuffer(eps=0.0)
    buffer.add("actv", "a.output", 0, 0, "forward", torch.ones(4))
    piece = torch.tensor([1.0, float("nan")])
    buffer.add_pieces("actv", [(0, "wq.output")], [Shard(piece, None, (4,))], 0, "forward")
    first = buffer._stores[torch.device("cpu")]
    second = buffer._store_for(torch.device("cpu", 0))
    second.data[second.reserve(1)] = torch.tensor([3, 0, 1, 0, -1, 1, 0, 2], dtype=torch.float64)
    buffer._append_rows([records.Row("actv", "b.output", 0, 0, "forward", (3,), torch.float32)], second)

    def merge() -> None:
        first.data[1, records.NANS] += 5

    monkeypatch.setattr(buffer, "_merge_shards", merge)
    record, ready = buffer.finish(step=1, rank=0)
    assert ready is not None
    ready()
    assert [r.name for r in record.rows] == ["a.output", "wq.output", "b.output"]
    assert record.partials[:, records.NANS].tolist() == [0, 6, 0]
    assert record.own_nonfinite.tolist() == [0, 1, 1]


def test_the_own_counts_cross_the_writers_pipe():
    record = with_own(record_of(PARTNER), PARTNER_OWN)
    body = b"".join(bytes(b) for b in wire.encode_step(record, 1, 0, -1))[wire.FRAME.size :]
    back, _ = wire.decode_step(bytearray(body), lambda _: record.rows, lambda _: ())
    assert back.own_nonfinite.tolist() == PARTNER_OWN
    assert np.array_equal(back.partials, record.partials)
    plain = record_of(PARTNER)
    body = b"".join(bytes(b) for b in wire.encode_step(plain, 1, 0, -1))[wire.FRAME.size :]
    assert wire.decode_step(bytearray(body), lambda _: plain.rows, lambda _: ())[0].own_nonfinite is None


# ----------------------------------------------------------------------------- --explain, runs by hand


def write_records(run: Path, by_rank: dict[int, list[Anomaly]]) -> Path:
    for rank, anomalies in by_rank.items():
        with AnomalyLog(run, rank) as log:
            log.write_step(3, anomalies)
    return run


def nan(rank: int, name: str, seq: int, **flags: bool) -> Anomaly:
    return Anomaly(step=3, rank=rank, kind="actv", name=name, stat="nans", value=4.0, rule="nan", seq=seq,
                   message=f"actv/{name} has 4 NaN element(s)", **flags)  # fmt: skip


def test_the_origin_label_follows_the_records_flag(tmp_path, capsys):
    """No module call turned finite inputs into NaN (the NaN was in an input already): the record says
    ``origin`` no, and so does the explanation."""
    run = write_records(tmp_path / "run", {0: [nan(0, "blk.norm.input", 2), nan(0, "blk.norm.output", 3)]})
    lines = run_cli(capsys, str(run), "--explain").splitlines()
    assert lines[1] == (
        "  no origin marked at step 3 (no module call turned finite inputs into a non-finite output); "
        "explained: actv blk.norm.input (forward, micro-step 0, rank 0)"
    )
    assert not any(line.lstrip().startswith("origin:") for line in lines)
    assert json.loads(run_cli(capsys, str(run), "--explain", "--json"))["received"] is False


def test_a_rank_that_received_the_nan_without_any_origin_says_so(tmp_path, capsys):
    run = write_records(tmp_path / "run", {0: [nan(0, "attn.wq.output", 5, propagated=True)]})
    out = run_cli(capsys, str(run), "--explain", "--rank", "0")
    assert (
        "  rank 0 made no NaN/Inf of its own at step 3: it came from another rank (no origin marked), first "
        "seen in statistics merged over ranks whose own piece on rank 0 was finite"
    ) in out.splitlines()
    assert "=> rank 0 received the NaN/Inf from another rank (its own pieces held none)" in out
    assert "made inside attn.wq" not in out


# --------------------------------------------------------------------------- real tensor-parallel runs


def launch(out: Path, world: int, *plantings: str) -> Path:
    """tests/tp_nan_worker.py on ``world`` gloo ranks, one run per planting."""
    argv = [sys.executable, str(WORKER), str(out), str(world), str(free_port()), *plantings]
    run_ranks(argv, world, env={"OMP_NUM_THREADS": "1"})
    return out


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory) -> Path:
    """Two runs of 2 gloo ranks: rank 1 makes the NaN (``nan_1``), both ranks do (``nan_0_1``)."""
    return launch(tmp_path_factory.mktemp("tp_nan"), 2, "1", "0,1")


ORIGIN_LINE = "  origin: actv layers.0.attention_norm.output (origin, forward, micro-step 0, rank {})"
MADE_IN_NORM = "the NaN/Inf was made inside layers.0.attention_norm, by its own computation or its parameters"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_explain_names_the_rank_and_module_that_made_the_nan(tp_runs, capsys):
    run = tp_runs / "nan_1"
    lines = run_cli(capsys, str(run), "--explain").splitlines()
    assert lines[1] == ORIGIN_LINE.format(1)
    assert any(line.endswith(MADE_IN_NORM) for line in lines)
    # the partner's records: no origin, its first rows are another rank's NaN (the whole tensor's counts)
    partner = [a for a in read_anomalies(run, 0, 1, 1) if a.rule == "nan"]
    assert partner and not any(a.origin for a in partner)
    wq = next(a for a in partner if a.name == "layers.0.attention.wq.output")
    assert wq.propagated and wq.value == 256 and "rank 0's own piece has none" in wq.message
    maker = [a for a in read_anomalies(run, 1, 1, 1) if a.origin]
    assert {a.name for a in maker} == {"layers.0.attention_norm.output"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_partners_explanation_says_the_nan_came_from_another_rank(tp_runs, capsys):
    run = tp_runs / "nan_1"
    out = run_cli(capsys, str(run), "--explain", "--rank", "0")
    lines = out.splitlines()
    assert lines[0] == f"FIRST NaN/Inf in {run}: step 1, rank 0: actv layers.0.attention.wq.output [nan]"
    assert lines[1] == ORIGIN_LINE.format(1)
    assert lines[3].startswith("  rank 0 made no NaN/Inf of its own at step 1: it came from another rank")
    assert any(line.endswith(MADE_IN_NORM) for line in lines)
    assert "inside layers.0.attention.wq" not in out and "origin: actv layers.0.attention.wq" not in out
    doc = json.loads(run_cli(capsys, str(run), "--explain", "--rank", "0", "--json"))
    assert doc["received"] is True and (doc["first"]["rank"], doc["origin"]["rank"]) == (0, 1)
    assert doc["module"] == "layers.0.attention_norm"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_with_the_nan_on_both_ranks_each_is_its_own_origin(tp_runs, capsys):
    run = tp_runs / "nan_0_1"
    for rank in (0, 1):
        lines = run_cli(capsys, str(run), "--explain", "--rank", str(rank)).splitlines()
        assert lines[1] == ORIGIN_LINE.format(rank)
        assert not any("came from another rank" in line for line in lines)
        assert any(line.endswith(MADE_IN_NORM) for line in lines)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_issues_2x2_mesh_fsdp2_over_tensor_parallelism(tmp_path, capsys):
    """The issue's layout: (dp, tp) = (2, 2), FSDP2 over tensor parallelism, rank 2 makes the NaN; rank 3,
    its tensor-parallel partner, blamed layers.0.attention.wq."""
    run = launch(tmp_path, 4, "2") / "nan_2"
    assert run_cli(capsys, str(run), "--explain").splitlines()[1] == ORIGIN_LINE.format(2)
    out = run_cli(capsys, str(run), "--explain", "--rank", "3")
    lines = out.splitlines()
    assert lines[1] == ORIGIN_LINE.format(2)
    assert lines[3].startswith("  rank 3 made no NaN/Inf of its own at step 1: it came from another rank")
    assert "inside layers.0.attention.wq" not in out
    assert not any(a.origin for a in read_anomalies(run, 3, 1, 1))

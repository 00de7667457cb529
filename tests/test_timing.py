"""Per-rank time (trainmon.step.timing, trainmon.run.timing): where a step's time goes, measured at a handful
of points without a synchronising call, and what the records, tables, wire and TensorBoard carry of it.

Single-process runs with sleeps placed in known parts of the step (the parts add up to the step, each sleep
lands in its part); device events through a stand-in backend that completes them when told (what a GPU's
events would say, read only once completed); the cost rules: nothing on the host read, nothing left behind
for the garbage collector per step, nothing but two clock readings on steps that are not collected; and the
exchange of the ranks' times in a real 2-process gloo job with no all_ranks run (its own all-reduce on the
monitor's own group, not on the job's)."""

from __future__ import annotations

import gc
import json
import math
import textwrap
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from launch import run_worker_script
from test_host_reads import HostReadCounter
from test_no_pauses import Loop
from torch import nn

import trainmon
from trainmon.anomaly.straggler import StragglerEngine
from trainmon.config import ConfigError, load_config
from trainmon.config.rules import StragglerRule
from trainmon.run.layout import summary_file, timing_rank_dir
from trainmon.run.records import StepRecord
from trainmon.run.summary import read_summary
from trainmon.run.timetable import read_timing
from trainmon.run.timing import FIELD, SLOT0, SLOTS, TIMES, WIDTH, StepTiming, rank_times
from trainmon.step.timing import LAG, StepTimer
from trainmon.writer import wire

T = {name: i for i, name in enumerate(TIMES)}


def mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


class Clock:
    """The timer's and the monitor's clock, advanced by the test's "sleeps" only: every part comes out
    exact."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    from trainmon import monitor as monitor_module
    from trainmon.step import timing as timing_module

    fake = Clock()
    monkeypatch.setattr(monitor_module, "perf_counter", fake)
    monkeypatch.setattr(timing_module, "perf_counter", fake)
    return fake


def sleepy_steps(model, optimizer, steps, *, sleep=time.sleep, data=0.0, forward=0.0, other=0.0,
                 after_backward=0.0, collect=False, micro=1):  # fmt: skip
    """Training steps with sleeps in known places: before the forward (data), in it, between its end and the
    backward (the loss: other), after the backward (other), and a full collection inside the forward."""
    if forward:
        model[1].register_forward_hook(lambda *_: sleep(forward))
    if collect:

        def collect_now(*_):
            gc.collect()  # and return None: the module's output stays

        model[2].register_forward_hook(collect_now)
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(micro):
            sleep(data)
            out = model(torch.randn(8, 16))
            sleep(other)
            F.mse_loss(out, torch.zeros(8, 4)).backward()
        sleep(after_backward)
        optimizer.step()


def timing_rows(run, rank=0):
    return read_timing(run, rank).to_pydict()


# ---------------------------------------------------------------------------------------------------------
# where the time goes, on the CPU


def test_each_sleep_lands_in_its_part_and_the_parts_add_up(tmp_path, clock):
    model, optimizer = mlp()
    clock.sleep(5.0)  # before attach: no step's
    with trainmon.attach(model, optimizer, logdir=tmp_path / "run"):
        clock.sleep(0.5)  # after attach: the first step's data
        sleepy_steps(model, optimizer, 6, sleep=clock.sleep, data=0.02, forward=0.03, other=0.01,
                     after_backward=0.015)  # fmt: skip
    rows = timing_rows(tmp_path / "run")
    assert rows["step"] == list(range(6))
    exact = {"abs": 1e-9, "rel": 0}
    assert rows["data"] == pytest.approx([0.52] + [0.02] * 5, **exact)
    assert rows["forward"] == pytest.approx([0.03] * 6, **exact)
    assert rows["other"] == pytest.approx([0.025] * 6, **exact)  # the loss's sleep and the one after backward
    assert rows["step_time"] == pytest.approx([0.575] + [0.075] * 5, **exact)
    for part in ("backward", "optimizer", "comm", "gc", "monitor"):
        assert rows[part] == pytest.approx([0.0] * 6, **exact), part
    assert all(math.isnan(w) for w in rows["wait"])  # one process: nobody to wait for
    summary = read_summary(summary_file(tmp_path / "run", 0))
    assert summary.timed == 6 and summary.time["forward"] == pytest.approx(0.18)


def test_the_parts_add_up_on_the_real_clock(tmp_path):
    model, optimizer = mlp()
    with trainmon.attach(model, optimizer, config={"wg_distribution": True}, logdir=tmp_path / "run"):
        sleepy_steps(model, optimizer, 4, data=0.01, forward=0.01)
    rows = timing_rows(tmp_path / "run")
    parts = ("data", "forward", "backward", "optimizer", "comm", "gc", "monitor", "other")
    for i in range(4):
        assert sum(rows[p][i] for p in parts) == pytest.approx(rows["step_time"][i], abs=1e-9)
        assert rows["data"][i] >= 0.01 and rows["forward"][i] >= 0.01 and rows["monitor"][i] > 0
        assert min(rows[p][i] for p in parts) >= 0


def test_micro_batches_each_add_their_data_forward_and_backward(tmp_path, clock):
    model, optimizer = mlp()
    with trainmon.attach(model, optimizer, logdir=tmp_path / "run", grad_acc_steps=3):
        sleepy_steps(model, optimizer, 3, sleep=clock.sleep, data=0.01, forward=0.02, other=0.005, micro=3)
    rows = timing_rows(tmp_path / "run")
    assert rows["data"] == pytest.approx([0.03] * 3)  # before each micro-batch's forward
    assert rows["forward"] == pytest.approx([0.06] * 3)
    assert rows["other"] == pytest.approx([0.015] * 3)


def test_a_collection_inside_the_forward_is_gc_time_not_forward_time(tmp_path):
    model, optimizer = mlp()
    junk = [[i] for i in range(200_000)]  # a full collection of tens of milliseconds
    with trainmon.attach(model, optimizer, logdir=tmp_path / "run"):
        sleepy_steps(model, optimizer, 3, collect=True)
    del junk
    rows = timing_rows(tmp_path / "run")
    for i in range(3):
        assert rows["gc_count"][i] >= 1 and rows["gc"][i] > 0.005
        assert rows["forward"][i] < rows["gc"][i] / 2


def test_only_collected_steps_are_timed_each_from_the_step_before(tmp_path, clock):
    model, optimizer = mlp()
    with trainmon.attach(model, optimizer, config={"step_interval": 3}, logdir=tmp_path / "run") as mon:
        sleepy_steps(model, optimizer, 7, sleep=clock.sleep, data=0.01, forward=0.002)
        assert mon._clock.timer.active is False  # step 7 is not collected
    rows = timing_rows(tmp_path / "run")
    assert rows["step"] == [0, 3, 6]
    assert rows["data"] == pytest.approx([0.01] * 3, abs=1e-9)
    assert rows["step_time"] == pytest.approx([0.012] * 3, abs=1e-9)


def test_timing_off_records_nothing_and_leaves_gc_alone(tmp_path):
    model, optimizer = mlp()
    callbacks = list(gc.callbacks)
    off = {"timing": {"enable": False}}
    with trainmon.attach(model, optimizer, config=off, logdir=tmp_path / "run") as mon:
        sleepy_steps(model, optimizer, 2)
        mon.flush()
        assert mon._latest[0].timing is None and gc.callbacks == callbacks
    assert not timing_rank_dir(tmp_path / "run", 0).exists()
    with trainmon.attach(model, optimizer, logdir=tmp_path / "on") as mon:
        sleepy_steps(model, optimizer, 1)
        assert len(gc.callbacks) == len(callbacks) + 1  # while a timed step runs
    assert gc.callbacks == callbacks


def test_a_config_edit_switches_timing_off_between_two_steps(tmp_path):
    from test_reload import write

    model, optimizer = mlp()
    path = tmp_path / "config.json"
    write(path, {"timing": {"enable": True}}, bump=False)
    with trainmon.attach(model, optimizer, config=str(path), logdir=tmp_path / "run") as mon:
        sleepy_steps(model, optimizer, 2)
        write(path, {"timing": {"enable": False}})
        deadline = time.monotonic() + 20
        while mon._clock.timer is not None and time.monotonic() < deadline:
            sleepy_steps(model, optimizer, 1)
            time.sleep(0.02)
        assert mon._clock.timer is None and mon.buffer.timer is None and mon._counter.timer is None
        last = mon.step - 1  # the last step timed
        sleepy_steps(model, optimizer, 2)
    assert timing_rows(tmp_path / "run")["step"] == list(range(last + 1))


# ---------------------------------------------------------------------------------------------------------
# what a timed step costs: no host read, nothing left for the collector, no work on steps not collected


def test_timing_reads_nothing_on_the_host(tmp_path):
    def reads(config):
        model, optimizer = mlp()
        with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / str(len(config))):
            sleepy_steps(model, optimizer, 2)
            with HostReadCounter() as counter:
                sleepy_steps(model, optimizer, 2)
        return counter.reads

    assert reads({"timing": {"enable": True}, "wg_distribution": True}) == reads(
        {"timing": {"enable": False}, "wg_distribution": True, "format": ["tensorboard"]}
    ) == []  # fmt: skip


def test_a_timed_step_leaves_no_more_objects_behind_than_an_untimed_one(tmp_path):
    """The no-pauses rule (tests/test_no_pauses.py) with timing on and off: the points allocate nothing that
    outlives the step; the record carries one small object more."""
    from tests.conftest import FULL_COVERAGE

    counts = {}
    for on in (True, False):
        loop = Loop()
        config = {**FULL_COVERAGE, "format": ["api"], "timing": {"enable": on}}
        with trainmon.attach(loop.model, loop.optimizer, config=config, logdir=tmp_path / str(on)) as mon:
            counts[on] = loop.objects(mon)
    (in_flight_on, left_on), (in_flight_off, left_off) = counts[True], counts[False]
    assert left_on - left_off <= 3, counts
    assert in_flight_on - in_flight_off <= 1, counts  # the queued engine callback: nothing per tensor


def test_a_step_not_collected_costs_two_clock_readings(tmp_path, monkeypatch):
    from trainmon import monitor as monitor_module
    from trainmon.step import timing as timing_module

    model, optimizer = mlp()
    calls = {"monitor": 0, "timer": 0}

    def counted(which, real):
        def clock():
            calls[which] += 1
            return real()

        return clock

    monkeypatch.setattr(monitor_module, "perf_counter", counted("monitor", time.perf_counter))
    monkeypatch.setattr(timing_module, "perf_counter", counted("timer", time.perf_counter))
    with trainmon.attach(model, optimizer, config={"start_step": 10**9}, logdir=tmp_path / "run"):
        calls.update(monitor=0, timer=0)
        sleepy_steps(model, optimizer, 5)
        assert calls == {"monitor": 10, "timer": 0}, calls


# ---------------------------------------------------------------------------------------------------------
# the ranks' rows: the wait at collectives, absent ranks


def _row(comm_slots, present=1.0, **times) -> np.ndarray:
    row = np.zeros(WIDTH)
    for name, value in times.items():
        row[FIELD[name]] = value
    row[SLOT0 : SLOT0 + len(comm_slots)] = comm_slots
    row[FIELD["comm_count"]] = len(comm_slots)
    row[FIELD["comm"]] = sum(comm_slots)
    row[FIELD["present"]] = present
    return row


def test_the_wait_is_the_time_a_rank_spent_in_a_collective_beyond_the_rank_that_arrived_last():
    rows = np.stack(
        [
            _row([0.040, 0.002], step=0.1),  # arrived 38 ms before the last rank at the first collective
            _row([0.002, 0.012], step=0.1),  # arrived last at the first, 10 ms early at the second
            _row([0.010], step=0.1),  # issued one collective only: the second slot is others' alone
            np.zeros(WIDTH),  # a rank that sent nothing
        ]
    )
    table = rank_times(rows)
    np.testing.assert_allclose(table[:3, T["wait"]], [0.038, 0.010, 0.008])
    assert np.isnan(table[3]).all()
    assert math.isnan(rank_times(rows[:1])[0, T["wait"]])  # alone: nobody to wait for
    many = _row([0.001] * SLOTS)
    many[FIELD["comm_count"]] = 3 * SLOTS  # beyond the slots: collective k adds to slot k % SLOTS
    assert rank_times(np.stack([many, many]))[:, T["wait"]].tolist() == [0.0, 0.0]


def test_the_wire_carries_the_times(tmp_path):
    own = _row([0.01], step=0.2, forward=0.05)
    ranks = np.stack([own, _row([0.03], step=0.2, forward=0.01)])
    record = StepRecord(7, 0, (), np.zeros((0, 8)), 1.5, timing=StepTiming(5, 0, own, ranks))
    body = b"".join(bytes(b) for b in wire.encode_step(record, 1, 0, -1))[wire.FRAME.size :]
    back, _ = wire.decode_step(bytearray(body), lambda _: (), lambda _: ())
    assert back.timing.step == 5 and back.timing.index == 0
    np.testing.assert_array_equal(back.timing.own, own)
    np.testing.assert_array_equal(back.timing.ranks, ranks)
    assert back.timing.mine()[T["wait"]] == pytest.approx(0.0)
    alone = StepRecord(7, 0, (), np.zeros((0, 8)), 1.5, timing=StepTiming(7, 0, own))
    body = b"".join(bytes(b) for b in wire.encode_step(alone, 1, 0, -1))[wire.FRAME.size :]
    back, _ = wire.decode_step(bytearray(body), lambda _: (), lambda _: ())
    assert back.timing.ranks is None and back.timing.mine()[T["forward"]] == 0.05


# ---------------------------------------------------------------------------------------------------------
# device events: read LAG steps later, only once completed


class Events:
    """What a device's event pool answers: an event's time is the fake device clock when recorded; it has
    completed once the device has run past it (``run_to``)."""

    def __init__(self) -> None:
        self.clock = 0.0
        self.done_until = -1.0
        self.points: dict[tuple[int, int], float] = {}
        self.colls: dict[tuple[int, int], float] = {}

    def record(self, slot, i):
        self.points[slot, i] = self.clock

    def record_collective(self, slot, i):
        self.colls[slot, i] = self.clock

    def done(self, slot, i):
        return self.points[slot, i] <= self.done_until

    def collective_done(self, slot, i):
        return self.colls[slot, i] <= self.done_until

    def elapsed_s(self, slot, i, j):
        assert self.done(slot, i) and self.done(slot, j), "read before completion"
        return self.points[slot, j] - self.points[slot, i]

    def collective_elapsed_s(self, slot, i, j):
        assert self.collective_done(slot, i) and self.collective_done(slot, j), "read before completion"
        return self.colls[slot, j] - self.colls[slot, i]


def _device_step(timer: StepTimer, events: Events, step: int) -> None:
    """One step: the device spends 5 s in forward, 7 s in backward (2 of them in a collective), 3 s in the
    optimizer (its clock; the host's is what the host takes)."""
    timer.start(True)
    timer.resume(time.perf_counter())
    timer.forward_start()
    events.clock += 5
    timer.forward_end()
    timer.backward_start()
    events.clock += 2
    started = timer.collective_start()
    events.clock += 2
    timer.collective_end(started)
    events.clock += 3
    timer.backward_end()
    timer.optimizer_start()
    events.clock += 3
    assert timer.end(time.perf_counter(), step)


def test_device_times_come_from_completed_events_lag_steps_later():
    events = Events()
    timer = StepTimer(events=events)
    assert timer.lag == LAG
    got = []
    for step in range(5):
        _device_step(timer, events, step)
        events.done_until = events.clock if step != 3 else -1  # step 3: the device is behind, nothing done
        slot = timer.ready_row()
        got.append(None if slot is None else timer.timing(slot))
    assert got[:LAG] == [None] * LAG
    for timing in (got[2], got[4]):  # steps 0 and 2: the device's own times
        own = timing.own
        assert (own[FIELD["forward"]], own[FIELD["backward"]], own[FIELD["optimizer"]]) == (5, 5, 3)
        assert own[FIELD["comm"]] == 2 and own[FIELD["comm_count"]] == 1
    assert [t.step for t in got[2:]] == [0, 1, 2]
    late = got[3].own  # events not completed when it went: the host's clock, never a wait
    assert late[FIELD["forward"]] < 0.01 and timer.late == 1


# ---------------------------------------------------------------------------------------------------------
# the straggler rule, on given times


def _times(world: int, slow: dict[int, dict[str, float]] | None = None, stages=None) -> np.ndarray:
    rows = np.stack([_row([0.01], step=0.1, forward=0.02, data=0.001) for _ in range(world)])
    for r, parts in (slow or {}).items():
        for name, extra in parts.items():
            rows[r, FIELD[name]] += extra
            rows[r, FIELD["step"]] += extra
    if stages is not None:
        rows[:, FIELD["pp_stage"]] = stages
    return rows


def _judge(engine: StragglerEngine, rank: int, series: list[np.ndarray]) -> list[tuple[int, str]]:
    found = []
    for step, rows in enumerate(series):
        timing = StepTiming(step, rank, rows[rank], rows)
        record = StepRecord(step, rank, (), np.zeros((0, 8)), 0.0, timing=timing)
        found += [(a.step, a.name) for a in engine.evaluate(record)]
    return found


def test_one_record_per_episode_after_the_window_and_a_new_one_after_a_quiet_window():
    rule = StragglerRule(window=4, warmup=0)
    slow = _times(8, {3: {"forward": 0.05}})
    series = [_times(8)] * 6 + [slow] * 8 + [_times(8)] * 8 + [slow] * 4
    # named once two of the window's steps (the slowest left out) make it slow; again after a quiet window
    assert _judge(StragglerEngine([rule]), 3, series) == [(8, "forward"), (24, "forward")]
    assert _judge(StragglerEngine([rule]), 2, series) == []  # the others wait: not named


def test_one_hiccup_is_no_straggler_but_a_pause_every_few_steps_is():
    rule = StragglerRule(window=5, warmup=0)
    hiccup = [_times(8)] * 5 + [_times(8, {2: {"gc": 0.5}})] + [_times(8)] * 5
    assert _judge(StragglerEngine([rule]), 2, hiccup) == []
    pauses = [_times(8, {2: {"gc": 0.12}}) if s % 3 == 0 else _times(8) for s in range(12)]
    assert _judge(StragglerEngine([rule]), 2, pauses) == [(4, "gc")]  # two pauses in the first window


def test_time_in_collectives_that_is_the_same_on_every_rank_names_nobody_however_the_waits_vary():
    """A collective takes as long on every rank once the last one has arrived; what differs is the wait. The
    ``comm`` the rule judges (time in collectives not waiting) is taken step by step, so no rank is named
    for it whichever step the window leaves out. The window: a real 6-process job's (tests/test_straggler.py,
    ``mixed``) ms in its one collective, steps 6-10; the rank in 330 ms at step 10 was descheduled."""
    comm_ms = [
        [19.7, 27.3, 25.2, 14.9, 15.1, 18.1],
        [21.0, 20.0, 10.6, 10.8, 21.5, 16.6],
        [37.0, 48.2, 14.0, 45.1, 38.4, 34.4],
        [17.4, 5.2, 16.0, 8.7, 15.7, 21.7],
        [330.1, 61.5, 87.1, 89.3, 85.2, 90.1],
    ]
    series = [np.stack([_row([t / 1e3], step=0.01 + t / 1e3, forward=0.005) for t in ms]) for ms in comm_ms]
    assert np.allclose([rank_times(rows)[:, TIMES.index("comm")] - rank_times(rows)[:, TIMES.index("wait")]
                        for rows in series], np.min(comm_ms, axis=1)[:, None] / 1e3)  # fmt: skip
    rule = StragglerRule(window=5, warmup=0, phase=("comm",))
    # (the typical comm minus the typical wait, each leaving out its own slowest step, named rank 1: 19.7 ms
    # against the ranks' 11.2)
    assert [_judge(StragglerEngine([rule]), r, series) for r in range(6)] == [[]] * 6


def test_ranks_are_compared_within_their_pipeline_stage_and_only_the_chosen_phases():
    stages = [0, 0, 0, 0, 1, 1, 1, 1]
    busy_stage = _times(8, {r: {"forward": 0.05} for r in (4, 5, 6, 7)}, stages)
    assert _judge(StragglerEngine([StragglerRule(window=2, warmup=0)]), 5, [busy_stage] * 4) == []
    one_slow = _times(8, {5: {"forward": 0.05, "data": 0.05}}, stages)
    rule = StragglerRule(window=2, warmup=0, phase=("data",))
    assert _judge(StragglerEngine([rule]), 5, [one_slow] * 4) == [(1, "data")]
    assert _judge(StragglerEngine([StragglerRule(window=2, warmup=3)]), 5, [one_slow] * 4) == []


def test_the_rule_is_config():
    def rules(*entries):
        return load_config({"alert": {"rules": list(entries)}}).alert.rules

    (rule,) = rules({"rule": "straggler", "phase": "gc", "factor": 2})
    assert rule == StragglerRule(phase=("gc",), factor=2.0)
    assert rules({"rule": "straggler", "phase": "all"})[0].phase == StragglerRule().phase
    with pytest.raises(ConfigError, match=r"alert\.rules\[0\]\.phase\[1\].*unknown phase 'wait'"):
        load_config({"alert": {"rules": [{"rule": "straggler", "phase": ["data", "wait"]}]}})
    with pytest.raises(ConfigError, match=r"alert\.rules\[0\]\.factor"):
        load_config({"alert": {"rules": [{"rule": "straggler", "factor": 0.5}]}})
    with pytest.raises(ConfigError, match=r"alert\.rules\[0\]\.stats"):
        load_config({"alert": {"rules": [{"rule": "straggler", "stats": ["norm"]}]}})


# ---------------------------------------------------------------------------------------------------------
# two ranks, no all_ranks run: the times go in an all-reduce of the monitor's own


WORKER = textwrap.dedent(
    """
    import datetime, json, sys, time
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import trainmon


    def worker(rank, port, out):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        group = dist.distributed_c10d._get_default_group()
        deltas, seen = [], []
        config = {"format": ["api"], "timing": {"collectives": True}}
        with trainmon.attach(model, optimizer, config=config, logdir=out + "/run") as mon:
            for step in range(4):
                if rank == 1:
                    time.sleep(0.1)  # rank 1's batch is late: rank 0 waits at the all_reduce below
                loss = model(torch.randn(4, 4)).square().mean()
                loss.backward()
                before = group._get_sequence_number_for_group()
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                optimizer.step()
                optimizer.zero_grad()
                deltas.append(group._get_sequence_number_for_group() - before)
                latest = mon._latest
                latest[1]() if latest[1] else None
                timing = latest[0].timing
                seen.append([timing.step, timing.table().tolist()])
        json.dump({"deltas": deltas, "seen": seen}, open(f"{out}/rank{rank}.json", "w"))
        dist.barrier()
        dist.destroy_process_group()


    if __name__ == "__main__":
        mp.spawn(worker, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
    """
)


@pytest.mark.timeout(240)
def test_two_ranks_exchange_their_times_off_the_jobs_process_group(tmp_path):
    run_worker_script(WORKER, tmp_path)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in (0, 1):
        assert got[r]["deltas"] == [4, 4, 4, 4]  # the job's four all_reduces: nothing of the monitor's
        assert [s for s, _ in got[r]["seen"]] == [0, 1, 2, 3]
    for step in range(1, 4):
        table = np.asarray(got[0]["seen"][step][1])
        assert table.shape == (2, len(TIMES))
        assert np.array_equal(table, np.asarray(got[1]["seen"][step][1]))  # both ranks hold the same table
        # a late rank waits for nobody; the other waits for it (the margins: two loaded cores' jitter)
        assert table[0, T["wait"]] == pytest.approx(0.1, abs=0.05) and table[1, T["wait"]] < 0.04
        assert table[1, T["data"]] > 0.09


def test_the_timing_cost_bench_counts_each_timer_call_once():
    """bench/timing_cost.py wraps the step timer's methods: every call is counted under its method, a call
    made from inside another wrapped one only in its caller's time, and the typical figure is each method's
    median call times its calls."""
    import importlib.util
    import statistics as stats
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "timing_cost.py"
    spec = importlib.util.spec_from_file_location("timing_cost_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    class Timer:
        def outer(self):
            return self.inner() + 1

        def inner(self):
            return 1

    clock = bench._Clock()
    Timer.outer, Timer.inner = clock.wrap(Timer.outer), clock.wrap(Timer.inner)
    timer = Timer()
    for _ in range(3):
        assert timer.outer() == 2
    assert timer.inner() == 1
    assert [len(clock.each["outer"]), len(clock.each["inner"]), len(clock.outer)] == [3, 1, 4]
    typical, mean = clock.per_step(2)
    want = (stats.median(clock.each["outer"]) * 3 + clock.each["inner"][0]) / 2
    assert typical == pytest.approx(want) and mean == pytest.approx(sum(clock.outer) / 2)
    clock.reset()
    assert clock.outer == [] and clock.each == {"outer": [], "inner": []}

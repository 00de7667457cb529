"""TensorBoard at scale: the ranks that write their own events (``tensorboard_ranks``) and the ``all_ranks``
run of every tensor merged over the job, computed with two asynchronous all-reduces at the step end.

The end-to-end test is a real 3-process gloo job whose ranks hold different tensors (rank 2 has an extra
layer; rank 0 tracks a scalar from step 3 on): TensorBoard's own reader finds rank 0's run and the all_ranks
run only, the all_ranks values equal the statistics of all ranks' tensors taken together, a NaN put into
rank 1's weight shows in all_ranks at its step, and a collected step costs exactly two collectives (plus
the name exchanges of the two agreements on the table of tensors)."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from launch import run_worker_script
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainmon.config import ConfigError, load_config
from trainmon.run import records
from trainmon.run.records import RankAggregate, Row, StepRecord
from trainmon.writer.outputs import TB_EVERY_RANK_UP_TO, event_ranks, format_sinks, writes_all_ranks
from trainmon.writer.tensorboard import AllRanksSink, TensorBoardSink

STEPS = 7
NAN_STEP = 2


def f32(x: float) -> float:
    return float(np.float32(x))


# ---------------------------------------------------------------------------------------------------------
# which ranks write what


@pytest.mark.parametrize(
    ("setting", "world", "aggregates", "ranks", "all_ranks"),
    [
        ("auto", 8, True, set(range(8)), False),
        ("auto", TB_EVERY_RANK_UP_TO, True, set(range(16)), False),
        ("auto", 17, True, {0, 16}, True),
        ("auto", 1024, True, {0, 1023}, True),
        # no process group to merge over: auto never hides a rank's events
        ("auto", 1024, False, set(range(1024)), False),
        ("all", 1024, True, set(range(1024)), True),
        ([0, -1, 5, 99], 8, True, {0, 7, 5}, True),
        ([], 4, True, set(), True),
        ("all", 1, True, {0}, False),
    ],
)
def test_event_ranks_and_the_all_ranks_run(setting, world, aggregates, ranks, all_ranks):
    config = load_config({"tensorboard_ranks": setting})
    assert event_ranks(config, world, aggregates) == ranks
    assert writes_all_ranks(config, world, aggregates) is all_ranks


def test_sinks_of_a_rank_left_out_and_of_the_all_ranks_writer(tmp_path):
    # CSV asked for (no longer a default since issue 33): csv_ranks: auto follows the ranks with events
    config = load_config({"tensorboard_ranks": "auto", "format": ["tensorboard", "csv"]})
    names = lambda sinks: [type(s).__name__ for s in sinks]  # noqa: E731
    left_out = format_sinks(config, tmp_path, 5, False, world=64, aggregates=True)
    writer = format_sinks(config, tmp_path, 0, False, world=64, aggregates=True, all_ranks_writer=True)
    last = format_sinks(config, tmp_path, 63, False, world=64, aggregates=True)
    try:
        assert names(left_out) == ["StatStoreSink"]  # the store stays on every rank (csv_ranks: auto follows)
        assert names(writer) == ["TensorBoardSink", "AllRanksSink", "StatStoreSink", "CsvSink"]
        assert names(last) == ["TensorBoardSink", "StatStoreSink", "CsvSink"]
        assert writer[1].events.path.parent == tmp_path / "all_ranks"
    finally:
        for s in left_out + writer + last:
            s.close()


@pytest.mark.parametrize("bad", ["some", True, [0.5], {"a": 1}, "0,x"])
def test_tensorboard_ranks_is_validated(bad):
    with pytest.raises(ConfigError, match="tensorboard_ranks"):
        load_config({"tensorboard_ranks": bad})


def test_tensorboard_ranks_forms_and_round_trip():
    assert load_config({}).tensorboard_ranks == "auto"
    assert load_config({"tensorboard_ranks": "0,-1"}).tensorboard_ranks == (0, -1)
    assert load_config({"tensorboard_ranks": 3}).tensorboard_ranks == (3,)
    config = load_config({"tensorboard_ranks": [0, -1]})
    assert load_config(config.to_dict()) == config


# ---------------------------------------------------------------------------------------------------------
# the all_ranks sink


def test_all_ranks_sink_writes_present_tensors_with_the_ranks_tags(tmp_path):
    keys = (("actv", 0, "a"), ("grad_reduced", 1, "w"), ("actv", 0, "gone"))
    a = [4, 1, 0, 1, -2.0, 3.0, 2.0, 14.0]
    w = [2, 0, 1, 0, 0.5, 0.5, 0.5, 0.25]
    absent = [0, 0, 0, 0, np.inf, -np.inf, 0, 0]
    partials = np.asarray([a, w, absent, [9] * 8], dtype=np.float64)[:-1]
    sink = AllRanksSink(tmp_path, ("max", "nans", "norm", "mean"), multi_chunk=True)
    record = StepRecord(3, 0, (), np.empty((0, 8)), 1.0, all_ranks=RankAggregate(keys, partials))
    sink.write(record, records.Derived(record))
    sink.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    got = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    assert got == {
        "actv/0:a/max": [(3, 3.0)],
        "actv/0:a/nans": [(3, 1.0)],
        "actv/0:a/norm": [(3, f32(14**0.5))],
        "actv/0:a/mean": [(3, f32(2.0 / 3))],
        "grad_reduced/1:w/max": [(3, 0.5)],
        "grad_reduced/1:w/nans": [(3, 0.0)],
        "grad_reduced/1:w/norm": [(3, 0.5)],
        "grad_reduced/1:w/mean": [(3, 0.5)],
    }


def test_rank_sink_ignores_the_aggregate(tmp_path):
    keys = (("actv", 0, "a"),)
    record = StepRecord(
        1,
        0,
        (Row("actv", "a", 0, 0, "forward", (2,), "float32"),),
        np.asarray([[2, 0, 0, 0, 1.0, 2.0, 3.0, 5.0]]),
        1.0,
        all_ranks=RankAggregate(keys, np.asarray([[8, 0, 0, 0, -1.0, 9.0, 3.0, 99.0]])),
    )
    sink = TensorBoardSink(tmp_path, ("max",))
    sink.write(record, records.Derived(record))
    sink.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.value for e in acc.Scalars("actv/a/max")] == [2.0]


# ---------------------------------------------------------------------------------------------------------
# a real 3-rank job

WORKER = textwrap.dedent(
    f"""
    import datetime
    import json
    import sys

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainmon import stats
    from trainmon.adapters import Resolved
    from trainmon.adapters.torch_optim import TorchOptimizerAdapter
    from trainmon.config import load_config
    from trainmon.monitor import Monitor
    from trainmon.step import buffer as buffer_module

    STEPS, NAN_STEP = {STEPS}, {NAN_STEP}


    class ScalarReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("_local_scalar_dense"):
                self.count += 1
            return func(*args, **(kwargs or {{}}))


    def worker(rank, port, out):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=3,
                                timeout=datetime.timedelta(seconds=60))
        torch.manual_seed(rank)
        layers = [torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)]
        if rank == 2:
            layers.append(torch.nn.Linear(2, 2))  # a tensor only rank 2 has
        model = torch.nn.Sequential(*layers)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        config = load_config({{"param_distribution": True, "tensorboard_ranks": [0],
                              "format": ["tensorboard"], "tensorboard_tensors": "all"}})
        mon = Monitor(Resolved((model,), TorchOptimizerAdapter(optimizer)), config, out + "/run")
        group = dist.distributed_c10d._get_default_group()
        copies = []
        original = buffer_module.copy_to_host
        buffer_module.copy_to_host = lambda t: (copies.append(tuple(t.shape)), original(t))[1]
        expected, deltas, reads = {{}}, [], []
        for step in range(STEPS):
            x = torch.randn(5, 3)
            model(x).pow(2).mean().backward()
            if rank == 0 and step >= 3:
                mon.track("late", torch.tensor([float(step), 2.0]))
            if rank == 1 and step == NAN_STEP:
                with torch.no_grad():
                    model[0].weight.grad[1, 2] = float("nan")
            before = group._get_sequence_number_for_group()
            counter = ScalarReads()
            with counter:
                optimizer.step()  # the step ends here: the merge over the ranks runs inside
            reads.append(counter.count)
            deltas.append(group._get_sequence_number_for_group() - before)
            optimizer.zero_grad()
            step_expected = {{}}
            for name, p in model.named_parameters():
                step_expected["param_updated/" + name] = stats.partials(p.detach()).double().tolist()
            if rank == 0 and step >= 3:
                step_expected["scalar/late"] = [2, 0, 0, 0, 2.0, float(step), 2.0 + step, 4.0 + step * step]
            expected[step] = step_expected
        mon.close()
        with open(f"{{out}}/rank{{rank}}.json", "w") as f:
            json.dump({{"expected": expected, "deltas": deltas, "reads": reads, "copies": len(copies),
                       "agreements": mon.buffer.all_ranks.agreements if mon.buffer.all_ranks else 0}}, f)
        dist.barrier()
        dist.destroy_process_group()


    if __name__ == "__main__":
        mp.spawn(worker, args=(int(sys.argv[1]), sys.argv[2]), nprocs=3)
    """
)


def _scalars(directory) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_three_ranks_write_rank_0_and_all_ranks_with_merged_values(tmp_path):
    run_worker_script(WORKER, tmp_path)
    run = tmp_path / "run"
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    # TensorBoard runs: rank 0's own and all_ranks; ranks 1 and 2 wrote no events (their CSV-free, store-only)
    event_dirs = sorted(p.parent.name for p in run.rglob("events.out.tfevents.*"))
    assert event_dirs == ["all_ranks", "rank_0"]
    # two all-reduces a collected step; the table is agreed at the first step and, for the scalar rank 0
    # tracks from step 3, at step 5 (its flag is read LAG=2 collected steps later); each agreement is two
    # all_gather_object calls of two collectives each
    for r in range(3):
        assert got[r]["deltas"] == [6, 2, 2, 2, 2, 6, 2], r
        assert got[r]["agreements"] == 2
        assert got[r]["reads"][1:5] == [0, 0, 0, 0]  # no value read on the host between agreements
        assert got[r]["copies"] == STEPS  # the merged table rides in the step's one host copy
    merged = _scalars(run / "all_ranks")
    checked = 0
    for step in range(STEPS):
        tensors: dict[str, list[list[float]]] = {}
        for r in range(3):
            for key, p in got[r]["expected"][str(step)].items():
                tensors.setdefault(key, []).append(p)
        for key, pieces in tensors.items():
            if key == "scalar/late" and step < 5:
                assert f"{key}/max" not in merged or step not in merged[f"{key}/max"]
                continue
            want = records.derive(records.merge(np.asarray(pieces)))
            for stat in records.STATS:
                value = merged[f"{key}/{stat}"][step]
                expected = f32(want[stat][0])
                if np.isnan(expected):
                    assert np.isnan(value), (step, key, stat)
                else:
                    assert value == pytest.approx(expected, rel=1e-6, abs=1e-12), (step, key, stat)
                checked += 1
    assert checked == (STEPS * 6 + 2) * 7  # 4 parameters everywhere, rank 2's 2, and late at steps 5, 6
    # the NaN put into rank 1's gradient shows in all_ranks at its step (the weight went NaN there)
    nans = merged["param_updated/0.weight/nans"]
    assert nans[NAN_STEP - 1] == 0 and nans[NAN_STEP] == 1
    # the extra layer of rank 2 is in all_ranks; rank 0's own run has only its tensors
    assert "param_updated/3.weight/norm" in merged
    assert "param_updated/3.weight/norm" not in _scalars(run / "rank_0")

"""The schedule: which steps are collected (counted in collected steps, so resumed runs still collect)."""

from trainmon.step.schedule import Schedule


def test_grid_from_start_step_and_collect_times():
    schedule = Schedule(start_step=10, step_interval=5, collect_times=3)
    collected = []
    for step in range(40):
        if schedule.is_collect_step(step):
            collected.append(step)
            schedule.collected += 1
    assert collected == [10, 15, 20]


def test_resumed_run_joins_the_grid_and_still_collects_collect_times_steps():
    schedule = Schedule(start_step=0, step_interval=10, collect_times=2)
    collected = []
    for step in range(1000, 1040):  # start_iteration=1000
        if schedule.is_collect_step(step):
            collected.append(step)
            schedule.collected += 1
    assert collected == [1000, 1010]


def test_module_ranks():
    assert Schedule(module_ranks=(1, 3), rank=3).is_collect_step(0)
    assert not Schedule(module_ranks=(1, 3), rank=0).is_collect_step(0)
    assert Schedule(rank=7).is_collect_step(0)

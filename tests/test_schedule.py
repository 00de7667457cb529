"""The schedule: which steps are collected (counted in collected steps, so resumed runs still collect)."""

import pytest

from trainmon.step.schedule import Schedule


def _collected(schedule: Schedule, steps: range) -> list[int]:
    return [step for step in steps if schedule.start(step)]


def test_grid_from_start_step_and_collect_times():
    schedule = Schedule(start_step=10, step_interval=5, collect_times=3)
    assert _collected(schedule, range(40)) == [10, 15, 20]
    assert schedule.collected == 3


def test_resumed_run_joins_the_grid_and_still_collects_collect_times_steps():
    schedule = Schedule(start_step=0, step_interval=10, collect_times=2)
    assert _collected(schedule, range(1000, 1040)) == [1000, 1010]  # start_iteration=1000


def test_only_start_counts_and_the_count_is_the_schedules_own():
    schedule = Schedule(collect_times=2)
    assert [schedule.is_collect_step(0) for _ in range(5)] == [True] * 5  # asking counts nothing
    assert schedule.collected == 0
    with pytest.raises(AttributeError):
        schedule.collected += 1  # type: ignore[misc]  # counted by start() alone, never from outside
    assert _collected(schedule, range(5)) == [0, 1]


def test_module_ranks():
    assert Schedule(module_ranks=(1, 3), rank=3).is_collect_step(0)
    assert not Schedule(module_ranks=(1, 3), rank=0).is_collect_step(0)
    assert Schedule(rank=7).is_collect_step(0)
    left_out = Schedule(module_ranks=(1,), rank=0)
    assert _collected(left_out, range(3)) == [] and left_out.collected == 0

"""No pauses: a collected step leaves (almost) nothing behind for Python's garbage collector.

Every object a step allocates that is still alive at a collection of the young generations is promoted, and
enough promotions trigger a full collection of the whole process (200-250 ms on a GPU training process).
The monitor keeps its rows as objects reused from step to step, so a step leaves the record's containers
behind, not one object per row; the hooks' in-flight objects (autograd's hook dictionaries) are bounded by
the activations they hook. Counted with the collector off, so nothing is collected in between: the
figures are exact and the same on every run.
"""

from __future__ import annotations

import collections
import gc
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import trainmon
from tests.conftest import FULL_COVERAGE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from gpt_cuda import GPT  # noqa: E402  (the GPU yardstick's model, at a tiny width)


def graph_nodes(output: torch.Tensor) -> int:
    """The autograd nodes of the graph built so far (walked after the count: the walk makes their Python
    objects)."""
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(after for after, _ in node.next_functions)
    return len(seen)


class Loop:
    """Two layers of the GPU yardstick's model on the CPU, with a probe of the objects in flight at the end
    of the forward pass (the most a step holds at once)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = GPT(vocab=64, d=32, h=2, layers=2, T=16)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.tokens = torch.randint(0, 64, (1, 17))
        self.in_flight = 0
        self.model.register_forward_hook(self._probe)

    def _probe(self, module, args, output) -> None:
        self.in_flight = gc.get_count()[0]  # with the collector off: objects allocated and alive since
        self.nodes = graph_nodes(output)

    def step(self, monitor=None) -> None:
        logits = self.model(self.tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 64), self.tokens[:, 1:].reshape(-1))
        if monitor is not None:
            monitor.track("loss", loss)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def objects(self, monitor=None) -> tuple[int, int]:
        """(objects in flight at the end of forward, objects created by the step and alive after it), after
        warm-up steps; the writer has written the step when they are counted."""
        for _ in range(3):
            self.step(monitor)
        if monitor is not None:
            monitor.flush()
        gc.collect()
        gc.disable()
        try:
            self.step(monitor)
            if monitor is not None:
                monitor.flush()
            return self.in_flight, len(gc.get_objects(0))
        finally:
            gc.enable()


@pytest.mark.parametrize("outputs", [["api"], ["tensorboard", "csv"]])
def test_a_collected_step_leaves_no_object_per_row_behind(tmp_path, outputs):
    loop = Loop()
    in_flight_off, left_off = loop.objects()
    config = {**FULL_COVERAGE, "format": outputs}
    with trainmon.attach(loop.model, loop.optimizer, config=config, logdir=tmp_path / "run") as monitor:
        in_flight_on, left_on = loop.objects(monitor)
        rows = monitor._latest[0].rows
    kinds = collections.Counter(row.kind for row in rows)
    assert len(rows) > 200
    # the step's record (its containers) and the writer's few; one object per row would be > 200
    assert left_on - left_off <= 40, (left_on, left_off, len(rows))
    # what the step holds in flight: autograd's hook dictionaries of the hooked activations (at most ~2 per
    # activation row) and the Python objects of the graph's nodes that the walk to each module's input
    # reads (each node at most once; they go with the graph), not the rows themselves
    activations = kinds["actv"] + kinds["actv_grad"]
    bound = 2 * activations + loop.nodes
    assert in_flight_on - in_flight_off <= bound, (in_flight_on, in_flight_off, loop.nodes, kinds)


def test_rows_are_the_same_objects_step_after_step(tmp_path):
    """The records of two collected steps share their row descriptions (nothing rebuilt per step)."""
    loop = Loop()
    with trainmon.attach(loop.model, loop.optimizer, config=FULL_COVERAGE, logdir=tmp_path / "run") as mon:
        loop.step(mon)
        first = mon._latest[0].rows
        loop.step(mon)
        second = mon._latest[0].rows
    assert first == second
    assert all(a is b for a, b in zip(first, second, strict=True))


def test_arming_a_collected_step_again_makes_no_new_hooks(tmp_path):
    """A schedule that collects every other step disarms the hooks after each collected step and arms them
    again before the next: the hooks are put back, not made again, so arming leaves no objects behind (it
    left a handle, weak references and closures per hook, which lived through the step and were promoted)."""
    loop = Loop()
    _, left_off = loop.objects()
    config = {**FULL_COVERAGE, "step_interval": 2}
    with trainmon.attach(loop.model, loop.optimizer, config=config, logdir=tmp_path / "run") as monitor:
        hooks = {id(m): dict(m._forward_hooks) for m in loop.model.modules()}
        # steps 0-2 warm up (0 and 2 collected); step 3 is not, and arms the hooks for step 4 at its end
        _, left_on = loop.objects(monitor)
        assert monitor.step == 4 and monitor.state.collecting
        again = {id(m): dict(m._forward_hooks) for m in loop.model.modules()}
    assert left_on - left_off <= 40, (left_on, left_off)
    assert sum(map(len, hooks.values())) > 10
    assert all(again[k][i] is hook for k, table in hooks.items() for i, hook in table.items())

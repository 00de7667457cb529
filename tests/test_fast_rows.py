"""The step buffer's native hot path (``trainmon.step._fastrows``) against the Python path it stands in for:
the same rows, batches, descriptors and statistics, row for row, and it takes the usual rows itself.

The Triton kernels run under the interpreter on CPU tensors (tests/conftest.py), as in test_stats_triton.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import trainmon
from tests.conftest import FULL_COVERAGE
from trainmon import stats
from trainmon.device import no_collectives
from trainmon.stats import triton_path
from trainmon.step import buffer as buffer_module
from trainmon.step.buffer import StepBuffer

pytestmark = pytest.mark.skipif(buffer_module.FastRows is None, reason="the _fastrows extension is not built")


@pytest.fixture
def triton_backend(triton_tiling):
    previous = stats.get_backend()
    stats.set_backend("triton")
    yield
    stats.set_backend(previous)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 5, generator=g)
    a[0, 0], a[1, 1], a[2, 2] = float("nan"), float("inf"), 0.0
    return {
        "a": a,
        "b": torch.randn(7, generator=g, dtype=torch.float64),
        "half": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "ids": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "t": torch.randn(4, 3, generator=g).t(),  # not contiguous: the Python path copies it
        "empty": torch.empty(0, 3),
        "int16": torch.ones(3, dtype=torch.int16),  # no kernel reads it: torch ops
    }


def _step(buffer: StepBuffer, xs: dict[str, torch.Tensor], step: int) -> list:
    """One step's adds (shared tensors, every dtype, the Python path's cases) and the state after each add."""
    seen = []
    order = [
        ("actv", "m0.input", "a"),
        ("actv", "m0.output", "b"),
        ("actv", "m1.input", "b"),  # the same tensor again: read once, shared
        ("actv", "m1.output", "half"),
        ("actv", "m2.input", "ids"),
        ("actv", "m2.output", "t"),
        ("actv", "m3.output", "empty"),
        ("actv", "m4.output", "int16"),
        ("actv_grad", "m1.output_grad", "a"),  # a tensor of another kind seen again
        ("grad_unreduced", "w", "half"),  # shareable without a process group
        ("param_origin", "p", "a"),  # not shareable: launched at once
    ]
    if step == 2:  # a row first seen in a later step
        order.append(("actv", "late.output", "a"))
    # the two runs hold different tensors: objects and addresses are compared by the name of the tensor
    ident = {id(t): key for key, t in xs.items()}
    where = {t.data_ptr(): key for key, t in xs.items() if t.numel()}
    for kind, name, key in order:
        buffer.add(kind, name, 0, 0, "forward", xs[key])
        if step == 1 and name == "m0.output":  # changed in place after its hook: read at its hook after this
            xs[key].add_(1.0)
        reducer = buffer._cpu.reducer
        batch = reducer._batch
        seen.append(
            (
                list(buffer.rows),
                list(buffer._placement),
                list(buffer._collectives),
                buffer._cpu.count,
                [list(getattr(batch, c)) for c in ("rows", "versions", "numels", "codes")],
                [where.get(a, "a copy") for a in batch.addresses],
                [ident.get(id(t), "a copy") for t in batch.tensors],
                list(batch.sites),
                {where.get(a, "a copy"): j for a, j in batch.by_address.items()},
                list(batch.shared_from),
                list(batch.shared_rows),
                batch.nbytes,
                reducer._eps,
                reducer.pending_descriptors().tolist(),
            )
        )
    record, ready = buffer.finish(step, 0)
    if ready is not None:
        ready()
    return seen + [(record.rows, record.partials.copy())]


def _count_defers(monkeypatch) -> list[int]:
    """A one-element list counting the rows the Python path's ``_defer`` takes from now on."""
    deferred = [0]
    original = triton_path.TritonReducer._defer

    def counting(self, *args):
        deferred[0] += 1
        return original(self, *args)

    monkeypatch.setattr(triton_path.TritonReducer, "_defer", counting)
    return deferred


def _run(monkeypatch, native: bool, batch_tensors: int) -> tuple[list, int]:
    """Four steps on one buffer; with ``native`` the hot path is on. Returns the states and how many rows the
    Python path's _defer took in the steps after the learning step."""
    monkeypatch.setattr(triton_path, "BATCH_TENSORS", batch_tensors)
    deferred = _count_defers(monkeypatch)
    buffer = StepBuffer(1e-8)
    xs = _tensors()
    states = []
    for step in range(4):
        if step == 1:
            deferred[0] = 0
        buffer.add("actv", "first.input", 0, 0, "forward", xs["a"])  # makes the store
        if not native:
            buffer._fast = None
        assert (buffer._fast is not None) == native
        states.append(_step(buffer, xs, step))
    return states, deferred[0]


@pytest.mark.parametrize("batch_tensors", [256, 2])
def test_the_native_hot_path_leaves_the_state_the_python_path_leaves(
    triton_backend, monkeypatch, batch_tensors
):
    """Row for row: the buffer's rows, placement and collective counts, the store's count, every column of
    the batch, its shared rows and bytes, the descriptors, and each step's record and statistics; with a
    batch launched every two tensors too. The native path takes the usual rows itself (the Python _defer
    runs only for the tensors it leaves: the transpose it copies, the empty tensor, the row first seen in
    step 2; a tensor read at its hook is launched there, not deferred)."""
    native, native_deferred = _run(monkeypatch, True, batch_tensors)
    python, python_deferred = _run(monkeypatch, False, batch_tensors)
    for step, (got, want) in enumerate(zip(native, python, strict=True)):
        *got_states, (got_rows, got_partials) = got
        *want_states, (want_rows, want_partials) = want
        for i, (g, w) in enumerate(zip(got_states, want_states, strict=True)):
            assert g == w, (step, i)
        assert got_rows == want_rows
        np.testing.assert_array_equal(got_partials, want_partials)
    assert python_deferred > 20
    # steps 1-3: the transpose and the empty tensor each step, the late row once (then known)
    assert native_deferred == 3 + 3 + 1


def test_rows_the_native_path_cannot_take_go_the_python_way(triton_backend, monkeypatch):
    """Captured steps, held tensors, tensor subclasses, another device's tensors, a read that fails and the
    kernels turned off all take the Python path: the native one returns False and changes nothing."""
    buffer = StepBuffer(0.0)
    x = torch.ones(4)
    buffer.add("actv", "m.output", 0, 0, "forward", x)
    buffer.discard()
    reducer = buffer._cpu.reducer
    buffer.add("actv", "m.output", 0, 0, "forward", x)  # the learning step ends at the next reset
    buffer.discard()
    assert reducer._learnt
    fast = buffer._fast
    assert fast("actv", "m.output", 0, 0, "forward", x) is True
    assert len(buffer.rows) == 1 and reducer._batch.tensors == [x]
    buffer.discard()

    def untouched(*args) -> None:
        before = (len(buffer.rows), buffer._cpu.count, len(reducer._batch.tensors))
        assert fast(*args) is False
        assert (len(buffer.rows), buffer._cpu.count, len(reducer._batch.tensors)) == before

    buffer.capture = object()
    untouched("actv", "m.output", 0, 0, "forward", x)
    buffer.capture, buffer.hold = None, object()
    untouched("actv", "m.output", 0, 0, "forward", x)
    buffer.hold = None
    untouched("actv", "m.output", 0, 0, "forward", torch.nn.Parameter(torch.ones(4)))  # a subclass
    untouched("actv", "m.output", 0, 0, "forward", torch.ones(4, device="meta"))
    untouched("actv", "unseen.output", 0, 0, "forward", x)  # no Row yet
    untouched("param_origin", "m.output", 0, 0, "forward", x)  # not shareable

    def failing_counter() -> int:
        raise RuntimeError("a collective counter that fails")

    buffer.count_collectives = failing_counter  # read before anything is written: nothing half-written
    untouched("actv", "m.output", 0, 0, "forward", x)
    buffer.count_collectives = no_collectives
    monkeypatch.setattr(triton_path, "_unavailable", "a test turned the kernels off")
    untouched("actv", "m.output", 0, 0, "forward", x)
    monkeypatch.setattr(triton_path, "_unavailable", None)
    assert fast("actv", "m.output", 0, 0, "forward", x) is True


@pytest.mark.parametrize(
    ("value", "native", "warned"),
    [("python", False, False), ("", True, False), ("Native", True, False), ("pyhton", True, True)],
)
def test_the_python_path_is_chosen_by_the_environment(
    triton_backend, monkeypatch, caplog, value, native, warned
):
    """TRAINMON_HOT_PATH=python keeps every row in Python; a value it does not know is said and ignored."""
    monkeypatch.setenv("TRAINMON_HOT_PATH", value)
    with caplog.at_level("WARNING", logger="trainmon"):
        buffer = StepBuffer(0.0)
        buffer.add("actv", "m.output", 0, 0, "forward", torch.ones(3))
    assert (buffer._fast is not None) == native
    said = [r.getMessage() for r in caplog.records if "TRAINMON_HOT_PATH" in r.getMessage()]
    assert said == (
        ["trainmon: ignoring TRAINMON_HOT_PATH='pyhton' (expected native or python)"] if warned else []
    )


def _monitored_run(logdir, hot_path: str, monkeypatch) -> tuple[torch.Tensor, list]:
    """Losses and every step's record of a seeded run at full coverage (a ReLU that rewrites its input in
    place, a module called twice, integer token ids), with ``TRAINMON_HOT_PATH=hot_path``."""
    monkeypatch.setenv("TRAINMON_HOT_PATH", hot_path)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.fc1, self.act, self.fc2 = nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 4)

        def forward(self, ids):
            h = self.fc1(self.embed(ids))
            return self.fc2(self.act(self.fc1(h)))  # fc1 twice: call-numbered rows

    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    losses, records = [], []
    with trainmon.attach(model, optimizer, config=FULL_COVERAGE, logdir=logdir) as mon:
        for _ in range(4):
            ids = torch.randint(0, 16, (6, 3), generator=data)
            loss = model(ids).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
            record = mon._latest[0]
            records.append((record.rows, record.partials.copy()))
    return torch.stack(losses), records


def test_a_monitored_run_records_the_same_on_either_path(triton_backend, monkeypatch, tmp_path):
    """End to end: the same losses (bitwise) and every step's rows and partials equal, bit for bit."""
    deferred = _count_defers(monkeypatch)
    native_losses, native = _monitored_run(tmp_path / "native", "native", monkeypatch)
    native_deferred, deferred[0] = deferred[0], 0
    python_losses, python = _monitored_run(tmp_path / "python", "python", monkeypatch)
    # the Python path defers every hooked tensor of steps 1-3; the native one takes them all itself
    assert deferred[0] > 3 * 20 and native_deferred == 0
    assert torch.equal(native_losses, python_losses)
    assert len(native) == len(python) == 4
    for (got_rows, got), (want_rows, want) in zip(native, python, strict=True):
        assert got_rows == want_rows and len(got_rows) > 40
        np.testing.assert_array_equal(got, want)


def test_rows_taken_under_a_torch_function_mode_are_the_python_paths(triton_backend):
    """Under a __torch_function__ mode (a user's, active while hooks run) torch's getters call into Python;
    the native path reads through the same getters (the mode sees them: ``data_ptr``, ``_version``...), takes
    the row as usual, and leaves the state the Python path leaves."""
    from torch.overrides import TorchFunctionMode

    class Reads(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[str] = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.add(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    def under_a_mode(native: bool) -> tuple[set[str], list, list]:
        buffer = StepBuffer(0.0)
        x, y = torch.ones(4), torch.arange(6.0)
        for _ in range(2):  # the rows known, the learning step over
            buffer.add("actv", "m.output", 0, 0, "forward", x)
            buffer.add("actv", "n.output", 0, 0, "forward", y)
            buffer.discard()
        if not native:
            buffer._fast = None
        add = buffer._fast if native else buffer.add  # the native path itself: it must take both rows
        with Reads() as mode:
            taken = [add("actv", "m.output", 0, 0, "forward", x), add("actv", "n.output", 0, 0, "forward", y)]
        assert taken == ([True, True] if native else [None, None])
        batch = buffer._cpu.reducer._batch
        state = [list(getattr(batch, c)) for c in ("rows", "versions", "numels", "codes", "sites")]
        return mode.seen, state, list(buffer.rows)

    native_seen, native_state, native_rows = under_a_mode(True)
    python_seen, python_state, python_rows = under_a_mode(False)
    assert {"data_ptr", "is_contiguous"} <= native_seen and {"data_ptr", "is_contiguous"} <= python_seen
    assert native_state == python_state and native_rows == python_rows and len(native_rows) == 2


def test_a_build_for_other_code_is_said_and_the_python_path_runs(triton_backend, monkeypatch, caplog):
    """State the extension does not find (an attribute renamed since it was built) is found at once, when the
    store is made: one warning naming it, and every row on the Python path."""
    buffer = StepBuffer(0.0)
    del buffer.__dict__["capture"]  # as if the Python code had renamed it, while the store is made
    with caplog.at_level("WARNING", logger="trainmon"):
        buffer._store_for(torch.device("cpu"))
    buffer.capture = None
    for _ in range(3):
        buffer.add("actv", "m.output", 0, 0, "forward", torch.ones(3))  # the Python path
        buffer.discard()
    assert buffer._fast is None and buffer._cpu.reducer._learnt
    said = [r.getMessage() for r in caplog.records if "Python path" in r.getMessage()]
    assert len(said) == 1 and "step buffer has no attribute 'capture'" in said[0], said
    assert "pip install -e ." in said[0]

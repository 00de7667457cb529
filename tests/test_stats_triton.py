"""The Triton backend beyond the golden cases of test_stats.py (which run every case through it too): tensor
tables, the fused Adam update/ratio, merged rows, determinism, grad_probe fingerprints, launches per step,
no host writes during a step, and an ahead-of-time compile for real GPUs.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1); with one, on CUDA tensors (see test_cuda.py for what needs a real device).
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import trainmon
from tests.conftest import FULL_COVERAGE, assert_matches, reference_partials
from trainmon import stats
from trainmon.run.records import MAX, MIN, N_PARTIALS, SUM, SUMSQ
from trainmon.stats import triton_path
from trainmon.stats.direct import AdamItem, DirectReducer

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INF, NAN = float("inf"), float("nan")


@pytest.fixture
def triton_backend(triton_tiling):
    previous = stats.get_backend()
    stats.set_backend("triton")
    yield triton_tiling
    stats.set_backend(previous)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().float().numpy() if t.dtype != torch.float64 else t.detach().cpu().numpy()


class CountingKernels:
    """Stands in for the kernel module: counts launches per kernel, launches the real ones (outside any
    dispatch mode: Triton's interpreter copies arguments with torch ops that a GPU launch does not issue)."""

    def __init__(self, real) -> None:
        self._real = real
        self.launches: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name):
        value = getattr(self._real, name)
        if not hasattr(value, "__getitem__") or name == "triton":
            return value
        counter = self.launches

        class Launcher:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    counter[name] += 1
                    with _disable_current_modes():
                        return value[grid](*args, **kwargs)

                return launch

        return Launcher()


@pytest.fixture
def launches(triton_backend, monkeypatch):
    counting = CountingKernels(triton_path.kernels())
    monkeypatch.setattr(triton_path, "_kernels", counting)
    return counting.launches


def sizes(chunk: int) -> list[int]:
    return [0, 1, 5, chunk - 1, chunk, chunk + 1, 3 * chunk + 17]


# ---------------------------------------------------------------------------------------------------------
# rows


def test_table_of_mixed_sizes_and_dtypes_is_one_launch_per_dtype(launches, triton_backend):
    torch.manual_seed(0)
    tensors = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in sizes(triton_backend.chunk):
            x = torch.randn(n, device=DEVICE) * 3 + 0.5
            if n > 20:
                x[[2, 9, 11, 13]] = torch.tensor([NAN, INF, -INF, 0.0], device=DEVICE)
            tensors.append(x.to(dtype))
    tensors += [
        torch.arange(7, device=DEVICE),
        torch.randn(33, dtype=torch.float64, device=DEVICE),
    ]  # torch path
    out = torch.full((len(tensors) + 2, N_PARTIALS), -7.0, dtype=torch.float64, device=DEVICE)
    reducer = stats.reducer_for(DEVICE)
    reducer.rows(tensors, out, 1, 1e-8)
    reducer.complete(out)
    assert launches == {"stats_table": 3, "finalize": 1}
    assert (out[0] == -7).all() and (out[-1] == -7).all()
    for i, t in enumerate(tensors):
        a = to_numpy(t)
        assert_matches(out[1 + i], reference_partials(a), a)


def test_equal_input_gives_bit_equal_rows(triton_backend):
    torch.manual_seed(1)
    x = (torch.randn(5 * triton_backend.chunk + 3, device=DEVICE) * 1e3).to(torch.bfloat16)
    first, second = stats.partials(x), stats.partials(x.clone())
    assert torch.equal(first, second)
    out = torch.zeros(4, N_PARTIALS, dtype=torch.float64, device=DEVICE)
    stats.partials_many_into([x, x.float(), x, x.float()], out, 0)
    assert torch.equal(out[0], out[2]) and torch.equal(out[1], out[3]) and torch.equal(out[0], first)


def test_rows_of_one_step_from_every_entry_point_finish_in_one_launch(launches, triton_backend):
    torch.manual_seed(2)
    chunk = triton_backend.chunk
    acts = [torch.randn(n, device=DEVICE).to(torch.bfloat16) for n in (3, chunk + 5, 2 * chunk)]
    params = [torch.randn(n, device=DEVICE) for n in (10, chunk + 1)]
    m = [torch.randn(n, device=DEVICE) * 1e-3 for n in (10, chunk + 1)]
    v = [torch.rand(n, device=DEVICE) * 1e-6 for n in (10, chunk + 1)]
    out = torch.zeros(16, N_PARTIALS, dtype=torch.float64, device=DEVICE)
    reducer = stats.reducer_for(DEVICE)
    for i, a in enumerate(acts):
        reducer.row(a, out, i, 1e-8)
    reducer.rows(params, out, 3, 1e-8)
    reducer.adam_rows(
        [AdamItem(m[i], v[i], 0.1 * (i + 1), 0.01, 1e-8, 5 + 2 * i, 6 + 2 * i) for i in range(2)], out, 1e-8
    )
    reducer.merged_row(acts, out, 9, 1e-8)
    assert launches == {"stats_one": 3, "stats_table": 2, "adam_table": 1}  # nothing finished yet
    reducer.complete(out)
    assert launches["finalize"] == 1
    direct = DirectReducer(use_native=DEVICE.type == "cpu")
    want = torch.zeros_like(out)
    for i, a in enumerate(acts):
        direct.row(a.cpu() if DEVICE.type == "cpu" else a, want, i, 1e-8)
    direct.rows(params, want, 3, 1e-8)
    direct.adam_rows(
        [AdamItem(m[i], v[i], 0.1 * (i + 1), 0.01, 1e-8, 5 + 2 * i, 6 + 2 * i) for i in range(2)], want, 1e-8
    )
    direct.merged_row(acts, want, 9, 1e-8)
    got, ref = out.cpu().numpy(), want.cpu().numpy()
    np.testing.assert_array_equal(got[:, :MIN], ref[:, :MIN])  # counts
    np.testing.assert_allclose(got[:, MIN : MAX + 1], ref[:, MIN : MAX + 1], rtol=1e-6)
    scale = np.sqrt(np.maximum(ref[:, SUMSQ], 0) * np.maximum(ref[:, 0], 1))  # bound on sum|x|
    assert np.all(np.abs(got[:, SUM] - ref[:, SUM]) <= 1e-6 * scale + 1e-300)
    np.testing.assert_allclose(got[:, SUMSQ], ref[:, SUMSQ], rtol=2e-6)
    assert (got[10:] == 0).all()


@pytest.mark.skipif(not triton_path.interpreting(), reason="Triton's interpreter only (no GPU)")
def test_the_interpreter_sets_a_launch_up_once_and_computes_the_same(launches, monkeypatch):
    """trainmon.stats.triton_interpreter: the helpers' calls inside a launch skip the language patching the
    launch did already (inspect.getmembers over the language modules, counted here); every kernel of a step
    gives the same bits with and without the skip."""
    import inspect

    from triton.runtime import interpreter

    torch.manual_seed(4)
    chunk = triton_path.get_tiling().chunk
    shapes = ((3, torch.float32), (chunk + 5, torch.bfloat16))
    acts = [torch.randn(n, device=DEVICE).to(dtype) for n, dtype in shapes]
    acts[1][:3] = torch.tensor([NAN, INF, 0.0]).to(torch.bfloat16)
    params = [torch.randn(n, device=DEVICE) for n in (10, 2 * chunk + 1)]
    m, v = (torch.randn(chunk + 1) * 1e-3, torch.rand(chunk + 1) * 1e-6)

    def one_step() -> tuple[np.ndarray, int]:
        scans = collections.Counter()
        members = inspect.getmembers
        monkeypatch.setattr(inspect, "getmembers", lambda *a: scans.update(["scan"]) or members(*a))
        out = torch.zeros(8, N_PARTIALS, dtype=torch.float64, device=DEVICE)
        reducer = triton_path.TritonReducer(DEVICE)
        for i, a in enumerate(acts):
            reducer.row(a, out, i, 1e-8)
        reducer.rows(params, out, 2, 1e-8)
        reducer.adam_rows([AdamItem(m, v, 0.1, 0.01, 1e-8, 4, 5)], out, 1e-8)
        reducer.complete(out)
        monkeypatch.setattr(inspect, "getmembers", members)
        return out.cpu().numpy(), scans["scan"]

    patch_lang, run_launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    assert getattr(patch_lang, "_trainmon_skips_repatching", False)  # installed with the kernels
    skipped, skipped_scans = one_step()
    steps_launches = sum(launches.values())
    assert launches == {"stats_one": 2, "stats_table": 1, "adam_table": 1, "finalize": 1}
    monkeypatch.setattr(interpreter, "_patch_lang", patch_lang.__wrapped__)  # Triton's own
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", run_launch.__wrapped__)
    plain, plain_scans = one_step()
    np.testing.assert_array_equal(skipped, plain)  # every statistic, bit for bit (NaN where NaN)
    assert (skipped[:, 0] == [3, chunk + 5, 10, 2 * chunk + 1, chunk + 1, chunk + 1, 0, 0]).all()
    # a patching scans 3-4 modules: per launch, the kernel's own and those of the modules of Triton's library
    # functions it calls (tl.zeros...), once each; Triton alone patches again at every call of a helper, once
    # per block of every program (47 against 1,668 scans here, Triton 3.9)
    assert skipped_scans <= 3 * 4 * steps_launches
    assert plain_scans > 20 * skipped_scans


def test_adam_table_with_per_parameter_bias_corrections(triton_backend):
    torch.manual_seed(3)
    chunk = triton_backend.chunk
    items, tensors = [], []
    for i, (n, dtype) in enumerate([(1, torch.float32), (chunk + 7, torch.bfloat16), (40, torch.float16)]):
        m = (torch.randn(n, device=DEVICE) * 1e-3).to(dtype)
        v = (torch.rand(n, device=DEVICE) * 1e-5).to(dtype)
        if n > 20:
            m[:3], v[:3] = 0.0, torch.tensor([0.0, 1e-6, NAN], device=DEVICE).to(dtype)
        items.append(AdamItem(m, v, 1 - 0.9 ** (i + 1), 1 - 0.999 ** (i + 2), 1e-8, 2 * i, 2 * i + 1))
        tensors.append((m, v))
    out = torch.zeros(6, N_PARTIALS, dtype=torch.float64, device=DEVICE)
    reducer = stats.reducer_for(DEVICE)
    reducer.adam_rows(items, out, 1e-8)
    reducer.complete(out)
    for item in items:
        md, vd = to_numpy(item.exp_avg).astype(np.float64), to_numpy(item.exp_avg_sq).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            den = np.sqrt(vd / item.c2)
            update, ratio = (md / item.c1) / (den + 1e-8), (md / item.c1) / (den + (md == 0))
        for row, values in ((item.row_update, update), (item.row_ratio, ratio)):
            ref, got = reference_partials(values), out[row].cpu().numpy()
            np.testing.assert_array_equal(got[:MIN], ref[:MIN])
            np.testing.assert_allclose(got[MIN : MAX + 1], ref[MIN : MAX + 1], rtol=2e-6)
            assert abs(got[SUM] - ref[SUM]) <= 2e-6 * np.abs(values[np.isfinite(values)]).sum()


def test_tables_of_unmoved_tensors_are_reused(triton_backend, monkeypatch):
    uploads = []
    real = triton_path.upload
    monkeypatch.setattr(triton_path, "upload", lambda t, d: uploads.append(t.numel()) or real(t, d))
    params = [torch.randn(n, device=DEVICE) for n in (4, 9, 100)]
    reducer = stats.reducer_for(DEVICE)
    out = torch.zeros(3, N_PARTIALS, dtype=torch.float64, device=DEVICE)
    for _ in range(3):
        reducer.rows(params, out, 0, 1e-8)
        reducer.complete(out)
    assert len(uploads) == 1 + 3  # the table once; the descriptors of each step
    params[1] = torch.randn(9, device=DEVICE)  # moved: a new table
    reducer.rows(params, out, 0, 1e-8)
    reducer.complete(out)
    assert len(uploads) == 6


def test_a_batch_of_mixed_dtypes_is_one_launch(launches, monkeypatch):
    """Tensors taken in hooks wait in one batch whatever their dtypes (autocast mixes float32 and bfloat16):
    after the learning step, one stats_batch launch reads float32, float16 and bfloat16 tensors of sizes
    across chunks, each by its own dtype, and its table and descriptors are the step's only uploads."""
    uploads = []
    real = triton_path.upload
    monkeypatch.setattr(triton_path, "upload", lambda t, d: uploads.append(t.numel()) or real(t, d))
    chunk = triton_path._tiling.chunk
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    tensors = [(torch.randn(n) * 3).to(dtype).to(DEVICE) for n in (7, chunk + 1) for dtype in dtypes]
    tensors[1][[0, 3]] = torch.tensor([NAN, INF]).half().to(DEVICE)
    tensors[5][:2] = torch.tensor([0.0, 1e-40]).bfloat16().to(DEVICE)  # a bfloat16 subnormal
    reducer = stats.reducer_for(DEVICE)
    out = torch.zeros(len(tensors), N_PARTIALS, dtype=torch.float64, device=DEVICE)

    def step() -> tuple[dict, int]:
        launches.clear()
        before = len(uploads)
        out.zero_()
        for i, t in enumerate(tensors):
            reducer.row(t, out, i, 1e-8, shareable=True, site=i)
        reducer.complete(out)
        reducer.reset()
        for i, t in enumerate(tensors):
            a = t.cpu().float().numpy()
            assert_matches(out[i], reference_partials(a), a)
        return dict(launches), len(uploads) - before

    assert step() == ({"stats_one": 6, "finalize": 1}, 1)  # the learning step: each at its hook
    for _ in range(2):
        assert step() == ({"stats_batch": 1, "finalize": 1}, 2)  # the batch's table, the descriptors


@pytest.mark.parametrize("eps", [1e-8, 2.5, -1.0])
def test_float64_and_integer_tensors_join_the_batch(launches, monkeypatch, eps):
    """A batch also reads float64, int64 and int32 tensors (a model's token ids and positions are its first
    modules' inputs), widened to float64: the same rows as the float64 reference, sums of integers exact,
    the zero count by ``|x| <= eps`` (none with a negative eps), and no torch op after the learning step."""
    by_torch = []
    real_row = triton_path.torch_ops.row
    monkeypatch.setattr(
        triton_path.torch_ops, "row", lambda t, *a: by_torch.append(t.dtype) or real_row(t, *a)
    )
    chunk = triton_path._tiling.chunk
    generator = torch.Generator().manual_seed(3)
    wide = torch.randn(2 * chunk + 3, dtype=torch.float64, generator=generator) * 1e3
    wide[[0, 5, 9]] = torch.tensor([NAN, INF, -INF], dtype=torch.float64)
    wide[[1, 2]] = torch.tensor([1e-300, -2.5], dtype=torch.float64)  # a tiny value, one at -eps
    ids = torch.randint(-(2**40), 2**40, (chunk + 5,), generator=generator)  # sums far beyond int32
    ids[:4] = torch.tensor([0, 2, -2, 3])
    positions = torch.arange(-3, 40, dtype=torch.int32)
    empty = torch.zeros(0, dtype=torch.int64)
    tensors = [t.to(DEVICE) for t in (wide, ids, positions, torch.randn(9), empty)]
    wide_dtypes = (torch.float64, torch.int64, torch.int32)
    reducer = stats.reducer_for(DEVICE)
    out = torch.zeros(len(tensors), N_PARTIALS, dtype=torch.float64, device=DEVICE)

    def step() -> tuple[dict, list]:
        launches.clear()
        by_torch.clear()
        out.zero_()
        for i, t in enumerate(tensors):
            reducer.row(t, out, i, eps, shareable=True, site=i)
        reducer.complete(out)
        reducer.reset()
        for i, t in enumerate(tensors):
            a = t.cpu().numpy()
            want = reference_partials(a, eps)
            # float64 sums of float64 and integer elements; float32's in fp32
            assert_matches(out[i], want, a, rtol=1e-12 if t.dtype in wide_dtypes else 1e-6)
            if t.dtype in wide_dtypes[1:]:
                assert out[i, SUM].item() == float(a.astype(np.int64).sum())  # exact: below 2**53
        return dict(launches), list(by_torch)

    learning = step()  # each at its hook: the wide ones (the empty one too) by torch ops, and watched
    assert learning == ({"stats_one": 1, "finalize": 1}, [*wide_dtypes, torch.int64])
    for _ in range(2):
        assert step() == ({"stats_batch": 1, "finalize": 1}, [])
    # read at its hook by torch ops when not shareable (a collective may rewrite it in place)
    by_torch.clear()
    reducer.row(tensors[1], out, 1, eps, shareable=False, site=1)
    reducer.complete(out)
    reducer.reset()
    assert by_torch == [torch.int64]
    assert_matches(out[1], reference_partials(tensors[1].cpu().numpy(), eps), tensors[1].cpu().numpy())


@pytest.mark.parametrize("backend", ["triton", "native"])
def test_tensors_resized_reshaped_or_replaced_between_steps_get_their_rows(triton_backend, backend):
    """The optimizer side's rows (and, with Triton, tables and their layout) are found again when a step
    hands over the same columns as the last: a tensor resized in place (same address, fewer elements),
    transposed in place (same address and length, another shape, not contiguous) or replaced gets its own
    row description and statistics at once."""
    from trainmon.step.buffer import StepBuffer

    stats.set_backend(backend)
    torch.manual_seed(4)
    chunk = triton_backend.chunk
    tensors = [torch.randn(n, device=DEVICE) for n in (7, chunk + 3)] + [torch.randn(5, 8, device=DEVICE)]
    names = [(0, "a"), (0, "b"), (0, "c")]
    buffer = StepBuffer(1e-8)

    def step():
        buffer.add_many("param_updated", names, tensors, 0, "optimizer")
        record, ready = buffer.finish(0, 0)
        if ready is not None:
            ready()
        return record

    def check(record) -> None:
        for i, t in enumerate(tensors):
            a = t.cpu().numpy()
            assert_matches(record.partials[i], reference_partials(a), a)

    for _ in range(2):
        before = step()
    assert [tuple(r.shape) for r in before.rows] == [(7,), (chunk + 3,), (5, 8)]
    address = tensors[0].data_ptr()
    tensors[0].resize_(3)  # the only change: every other address and length is the last step's
    assert tensors[0].data_ptr() == address
    resized = step()
    assert [tuple(r.shape) for r in resized.rows] == [(3,), (chunk + 3,), (5, 8)]
    assert resized.rows[1:] == before.rows[1:]
    check(resized)
    tensors[1] = torch.randn(chunk + 3, device=DEVICE) * 5 + 2
    tensors[2].t_()
    after = step()
    assert [tuple(r.shape) for r in after.rows] == [(3,), (chunk + 3,), (8, 5)]
    assert after.rows[1] is before.rows[1]  # the same description, found again
    check(after)
    again = step()  # the new columns are found again
    assert again.rows == after.rows
    np.testing.assert_array_equal(again.partials, after.partials)


def test_one_table_cache_serves_the_reducer_and_the_fingerprinter(triton_backend, monkeypatch):
    from trainmon.stats.triton_fingerprints import TritonFingerprinter

    uploads = []
    real = triton_path.upload
    monkeypatch.setattr(triton_path, "upload", lambda t, d: uploads.append(t.tolist()) or real(t, d))
    cache = triton_path.TableCache(DEVICE, capacity=2)
    a = cache.table(("a",), (np.array([1, 2]), np.array([3], dtype=np.int32)))
    assert a.dtype == torch.int64 and a.cpu().tolist() == [1, 2, 3] and uploads == [[1, 2, 3]]
    assert cache.table(("a",), (np.array([9]),)) is a  # the key says what the table holds: no upload
    cache.table(("b",), (np.array([4]),))
    cache.table(("a",), (np.array([9]),))  # used last: it stays
    cache.table(("c",), (np.array([5]),))  # evicts b, the least recently used
    assert cache.table(("a",), (np.array([9]),)) is a
    cache.table(("b",), (np.array([6]),))
    assert uploads == [[1, 2, 3], [4], [5], [6]]
    fingerprinter = TritonFingerprinter(DEVICE)
    assert type(fingerprinter._tables) is type(fingerprinter._reducer._tables) is triton_path.TableCache


# ---------------------------------------------------------------------------------------------------------
# a monitored step


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)).to(
        DEVICE
    )


def run(logdir, steps: int, config: dict, probe=None, after_step=None):
    """Losses and the last step's statistics of a seeded run (``after_step()`` is called after each step)."""
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    losses = []
    cfg = dict(config, grad_probe=probe) if probe else config
    with trainmon.attach(model, optimizer, config=cfg, logdir=logdir) as mon:
        for _ in range(steps):
            x = torch.randn(8, 16, generator=data).to(DEVICE)
            loss = F.mse_loss(model(x), torch.ones(8, 4, device=DEVICE))
            mon.track("loss", loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach().cpu())
            if after_step is not None:
                after_step()
        latest = mon.latest()
        rows = mon._latest[0].rows if mon._latest else ()
    return torch.stack(losses), latest, rows


FULL_UR = {**FULL_COVERAGE, "ur_distribution": True, "format": "csv"}


def test_monitored_steps_equal_the_native_kernel_and_training_is_unchanged(tmp_path, launches):
    previous = stats.get_backend()
    per_step = []
    losses, got, rows = run(
        tmp_path / "triton", 3, FULL_UR, after_step=lambda: per_step.append(dict(launches))
    )
    stats.set_backend("auto")
    try:
        native_losses, want, _ = run(tmp_path / "native", 3, FULL_UR)
    finally:
        stats.set_backend(previous)
    assert torch.equal(losses, native_losses)  # bitwise: the monitor never touches training numerics
    assert set(got) == set(want) and len(want) > 50
    for key in want:
        g, w = got[key], want[key]
        for stat in ("min", "max", "zeros", "nans", "infs"):
            assert g[stat] == pytest.approx(w[stat], rel=1e-6, abs=1e-12), (key, stat)
        assert g["norm"] == pytest.approx(w["norm"], rel=1e-5, abs=1e-12), key
    per_tensor = [r for r in rows if r.kind in ("actv", "actv_grad", "grad_unreduced", "scalar")]
    assert len(per_tensor) == 10 + 9 + 6 + 1
    steps = [
        {k: after.get(k, 0) - before.get(k, 0) for k in after}
        for before, after in zip([{}, *per_step], per_step, strict=False)
    ]
    # the first collected step learns which tensors change in place after their hook: each tensor taken in
    # a hook is launched there (10 activations, 9 of their gradients, 6 weight gradients, the loss); the
    # parameter side is one launch per kind (grad_reduced, param_origin, param_updated, exp_avg, exp_avg_sq)
    assert steps[0] == {"stats_one": 26, "stats_table": 5, "adam_table": 1, "finalize": 1}
    # from then on the tensors taken in hooks wait in one batch read by one launch (stats_batch); a tensor
    # seen again unchanged is read once: each module's output is the next one's input (6 distinct activations
    # for 10 rows), and likewise for their gradients (5 for 9 rows: the first input needs no gradient);
    # grad_reduced is the weight gradients the batch holds (no process group: nothing reduces them in place in
    # between). The tracked loss (a scalar: never batched) is one launch of its own.
    for later in steps[1:]:
        assert later == {"stats_one": 1, "stats_batch": 1, "stats_table": 4, "adam_table": 1, "finalize": 1}


@pytest.mark.skipif(
    DEVICE.type == "cuda", reason="on a GPU, test_cuda.py runs a collected step under set_sync_debug_mode"
)
def test_a_collected_step_writes_no_host_number_into_a_tensor(tmp_path, launches):
    """Between step start and the one copy of the statistics at the step end, the Triton path issues no torch
    op that writes a value into a tensor (fill_, copy_, index_put_, zero_) or reads one on the host (item):
    what the kernels need reaches them as launch arguments or in tables built from host data."""
    step_counters: set[int] = set()

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if not (name == "_local_scalar_dense" and id(args[0]) in step_counters):  # AdamW's CPU counters
                self.counts[name] += 1
            return func(*args, **(kwargs or {}))

    def ops_of(config) -> collections.Counter[str]:
        model = mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / str(len(config))) as mon:
            for _ in range(2):
                x = torch.randn(8, 16, device=DEVICE)
                with Ops() as rec:
                    loss = F.mse_loss(model(x), torch.ones(8, 4, device=DEVICE))
                    mon.track("loss", loss)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                step_counters.update(id(state["step"]) for state in optimizer.state.values())
        return rec.counts  # the second step (its counters known)

    baseline = ops_of({**FULL_UR, "module_ranks": [99]})  # attached, never collecting
    monitored = ops_of(FULL_UR)
    added = {op: monitored[op] - baseline[op] for op in monitored if monitored[op] != baseline[op]}
    writes = ("fill_", "copy_", "index_put_", "_local_scalar_dense", "zero_", "full", "scalar_tensor")
    assert not {op: n for op, n in added.items() if op.startswith(writes)}, added
    assert launches["finalize"] == 2 and added, "the dispatch mode saw nothing of the monitor"
    # the one step-end copy: a clone on the CPU (on a GPU, a non-blocking copy into page-locked memory)
    assert added.get("_to_copy", 0) + added.get("clone", 0) == 1, added


# ---------------------------------------------------------------------------------------------------------
# grad_probe


def test_fingerprints_equal_the_torch_path(tmp_path, launches):
    from trainmon.gradprobe.reader import RankFingerprints

    probe = {"enable": True, "sample_size": 50, "sign_bitmap": True, "bounds": [-0.01, 0.0, 0.013]}
    config = {"format": "csv"}
    previous = stats.get_backend()
    run(tmp_path / "triton", 2, config, probe)  # grad_probe alone: no statistics rows
    fingerprint_launches = {
        k: v for k, v in launches.items() if k in ("bins_table", "gather_table", "signs_table")
    }
    stats.set_backend("torch")
    try:
        run(tmp_path / "torch", 2, config, probe)
    finally:
        stats.set_backend(previous)
    assert fingerprint_launches == {"bins_table": 2, "gather_table": 2, "signs_table": 2}  # one dtype
    got, want = RankFingerprints(tmp_path / "triton", 0), RankFingerprints(tmp_path / "torch", 0)
    assert got.steps == want.steps == [0, 1]
    for step in want.steps:
        a, b = got.step(step), want.step(step)
        assert a.keys() == b.keys() and len(a) == 6
        for key in b:
            assert a[key].layout == b[key].layout
            np.testing.assert_array_equal(a[key].counts, b[key].counts)
            np.testing.assert_array_equal(a[key].sample, b[key].sample)
            np.testing.assert_array_equal(a[key].signs, b[key].signs)
            np.testing.assert_array_equal(a[key].partials[:MIN], b[key].partials[:MIN])
            np.testing.assert_allclose(a[key].partials[MIN:], b[key].partials[MIN:], rtol=1e-5, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# compiled for real GPUs


AOT = Path(__file__).resolve().parents[1] / "bench" / "triton_aot.py"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_kernels_compile_for_hopper_and_ampere():
    """The interpreter accepts code the GPU compiler rejects: compile every kernel to sm_90/sm_80 cubins
    (no GPU needed), in a process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(AOT)], env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    # sm_90: 9 kernels (3 of them the fast variants) x 3 dtypes x 2 integer widths, stats_batch and its fast
    # variant (every dtype) x 2 widths, finalize; sm_80: float32 only
    assert done.stdout.splitlines()[-1] == "compiled 82"


def _with_backend(name: str, fn, *args):
    previous = stats.get_backend()
    stats.set_backend(name)
    try:
        return fn(*args)
    finally:
        stats.set_backend(previous)


def _steps_of(model_fn, logdir, steps: int, config: dict) -> list:
    """``mon.latest()`` after each of ``steps`` seeded steps of ``model_fn()``, trained with SGD."""
    torch.manual_seed(0)
    model = model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    seen = []
    with trainmon.attach(model, optimizer, config=config, logdir=logdir) as mon:
        for _ in range(steps):
            x = torch.randn(8, 16, generator=data).to(DEVICE)
            F.mse_loss(model(x), torch.ones(8, 4, device=DEVICE)).backward()
            optimizer.step()
            optimizer.zero_grad()
            seen.append(mon.latest())
    return seen


def _assert_same_steps(got: list, want: list) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert set(g) == set(w)
        for key in w:
            for stat in ("min", "max", "zeros", "nans", "infs"):
                assert g[key][stat] == w[key][stat], (step, key, stat)
            assert g[key]["norm"] == pytest.approx(w[key]["norm"], rel=1e-6), (step, key)


def test_a_tensor_changed_in_place_after_its_hook_keeps_the_values_the_hook_saw(tmp_path, launches):
    """ReLU(inplace=True) rewrites the Linear's output after the Linear's hook, before a batch is read: the
    first collected step reads every tensor at its hook and finds this one changed at the batch's end, so
    from then on it is read at its hook; each step's statistics equal the native kernel's."""

    def model():
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 4)).to(DEVICE)

    config = {"xy_distribution": True, "format": "csv"}
    got = _steps_of(model, tmp_path / "triton", 4, config)
    want = _with_backend("auto", _steps_of, model, tmp_path / "native", 4, config)
    assert got[-1]["actv/0.output"]["min"] < 0 and got[-1]["actv/1.input"]["min"] == 0  # before/after ReLU
    _assert_same_steps(got, want)
    assert launches["stats_one"] >= 4  # the Linear's output, read at its hook in every step


def test_a_tensor_first_changed_in_place_in_a_later_step_is_said_once_and_read_at_its_hook_after(
    tmp_path, launches, caplog
):
    """A model that rewrites a module's output in place only from its third step on: the batch finds it
    changed, says so once, and reads it at its hook from the next step on (equal to the native kernel)."""

    class Late(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            h = self.fc1(x)
            h = torch.relu_(h) if self.calls >= 3 else torch.relu(h)
            return self.fc2(h)

    config = {"xy_distribution": True, "format": "csv"}
    with caplog.at_level("WARNING", logger="trainmon"):
        got = _steps_of(lambda: Late().to(DEVICE), tmp_path / "triton", 5, config)
    want = _with_backend("auto", _steps_of, lambda: Late().to(DEVICE), tmp_path / "native", 5, config)
    said = [r for r in caplog.records if "changed in place after their hook" in r.getMessage()]
    assert len(said) == 1 and "fc1.output" in said[0].getMessage()
    # step 3 (index 2) read fc1's output after the ReLU: its minimum is 0, not the Linear's negative one
    assert want[2]["actv/fc1.output"]["min"] < 0 and got[2]["actv/fc1.output"]["min"] == 0
    _assert_same_steps(got[:2] + got[3:], want[:2] + want[3:])


def test_batches_stay_within_their_bounds_and_give_the_same_statistics(tmp_path, launches, monkeypatch):
    """At most BATCH_TENSORS tensors, or BATCH_BYTES bytes, wait for one launch."""

    def model():
        return mlp()

    config = {"xy_distribution": True, "format": "csv"}
    want = _with_backend("auto", _steps_of, model, tmp_path / "native", 3, config)
    launches.clear()
    batched = _steps_of(model, tmp_path / "all", 3, config)
    whole = launches["stats_batch"]
    monkeypatch.setattr(triton_path, "BATCH_TENSORS", 2)
    launches.clear()
    by_two = _steps_of(model, tmp_path / "two", 3, config)
    in_twos = launches["stats_batch"]
    monkeypatch.setattr(triton_path, "BATCH_TENSORS", 256)
    monkeypatch.setattr(triton_path, "BATCH_BYTES", 1)  # every tensor fills a batch alone
    launches.clear()
    alone = _steps_of(model, tmp_path / "one", 3, config)
    one_each = launches["stats_batch"]
    for got in (batched, by_two, alone):
        _assert_same_steps(got, want)
    # steps 2 and 3: 11 distinct tensors (6 activations, 5 of their gradients) in one launch; in twos, a
    # tensor seen again is shared only inside its batch: 10 forward and 9 backward rows in 5 + 5 launches;
    # one at a time, one launch per row
    assert whole == 2 and in_twos == 2 * (5 + 5) and one_each == 2 * (10 + 9)


def test_a_batch_holds_a_share_of_its_device_memory(monkeypatch):
    """The bytes a batch may hold are 1/128 of the device's memory, between 64 MiB and 1 GiB, read from the
    device's properties; the CPU (and a backend that cannot say) keeps the fixed BATCH_BYTES."""
    from trainmon import device as device_module

    gib = 1 << 30
    cuda = torch.device("cuda", 1)
    cases = ((141 * 10**9, gib), (80 * gib, 640 << 20), (24 * gib, 192 << 20), (4 * gib, 64 << 20))
    for total, want in cases:
        monkeypatch.setattr(triton_path, "device_memory", lambda device, total=total: total)
        assert triton_path.batch_bytes(cuda) == want
    monkeypatch.setattr(triton_path, "device_memory", device_module.device_memory)
    assert device_module.device_memory(torch.device("cpu")) is None
    assert triton_path.batch_bytes(torch.device("cpu")) == triton_path.BATCH_BYTES == 256 << 20

    asked = []

    class Properties:
        total_memory = 80 * gib

    def properties(index):
        asked.append(index)
        return Properties()

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert device_module.device_memory(cuda) == 80 * gib
    assert device_module.device_memory(torch.device("cuda")) == 80 * gib
    assert asked == [1, 3]  # the tensor's device, or the current one when the device names none

    def no_device(index):
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_device)
    assert device_module.device_memory(cuda) is None
    assert triton_path.batch_bytes(cuda) == triton_path.BATCH_BYTES


def test_a_batch_that_cannot_be_launched_is_read_by_torch_ops(tmp_path, launches, monkeypatch, caplog):
    """A batch whose launch fails for another reason than the kernel (its table cannot be uploaded: out of
    memory) is read by torch ops: the same statistics, said in the log; where even they fail, the rows hold
    no element (never whatever the buffer held before, which could raise a false NaN)."""
    config = {"xy_distribution": True, "format": "csv"}
    want = _with_backend("auto", _steps_of, mlp, tmp_path / "native", 3, config)

    def no_memory(self, *args):
        raise RuntimeError("CUDA out of memory (a test)")

    monkeypatch.setattr(triton_path.TritonReducer, "_launch_batch", no_memory)
    with caplog.at_level("WARNING", logger="trainmon"):
        got = _steps_of(mlp, tmp_path / "fallback", 3, config)
    _assert_same_steps(got, want)
    assert "reading a batch of tensors failed (CUDA out of memory (a test))" in caplog.text

    def broken(*args, **kwargs):
        raise RuntimeError("no torch ops either")

    monkeypatch.setattr(triton_path.torch_ops, "row", broken)
    empty = _steps_of(mlp, tmp_path / "empty", 3, config)[-1]
    batched = [key for key in empty if key.startswith(("actv/", "actv_grad/"))]
    assert len(batched) == 19
    for key in batched:
        assert empty[key]["nans"] == 0 and empty[key]["infs"] == 0 and np.isnan(empty[key]["norm"]), key

"""Shared test helpers."""

from __future__ import annotations

import os

# Two xdist workers share two cores with the ranks and tools they start: torch's intra-op pool (OpenMP,
# whose idle threads spin) only contends there and burns the CPU the other worker needs. One thread per
# process, set before torch is imported and inherited by every subprocess; a test that wants more threads
# sets them itself.
for _threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_threads, "1")

import numpy as np  # noqa: E402 - after the thread settings
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch first

# Without a GPU, Triton's interpreter runs the accelerator kernels on CPU tensors. It is chosen when a
# kernel is defined, so before trainmon imports its Triton module; the setting is explicit (new in 3.9).
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from trainmon.run.records import N_PARTIALS, SUM, SUMSQ  # noqa: E402 - after the Triton setting

INF = float("inf")

# every kind the monitor collects, all statistics, every step (the tests' "full coverage")
FULL_COVERAGE = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
}

# The outputs written by default before issue 33: msprobe CSV and every tensor's TensorBoard scalars. Tests
# that check the contents of those files ask for them (the default is now TensorBoard's summary and the
# statistics store, issue 33).
FULL_OUTPUTS = {"format": ["tensorboard", "csv"], "tensorboard_tensors": "all"}


def reference_partials(a: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """The 8 partials of ``a`` computed in float64: numel, nans, infs, zeros, min, max, sum, sumsq
    (min..sumsq over finite elements; +inf/-inf/0/0 when there is none)."""
    a = np.asarray(a)
    if np.iscomplexobj(a):
        a = np.abs(a)
    with np.errstate(invalid="ignore"):  # NaN payloads
        d = a.astype(np.float64).ravel()
    fin = np.isfinite(d)
    f = d[fin]
    return np.array(
        [
            d.size,
            np.isnan(d).sum(),
            np.isinf(d).sum(),
            (np.abs(d) <= eps).sum(),
            f.min() if f.size else INF,
            f.max() if f.size else -INF,
            f.sum(),
            (f * f).sum(),
        ],
        dtype=np.float64,
    )


def assert_matches(got: torch.Tensor | np.ndarray, ref: np.ndarray, values: np.ndarray, rtol: float = 1e-6):
    """Counts, min and max exact; sum within rtol * sum(|finite x|), sumsq within rtol relative."""
    got = np.asarray(got.cpu() if isinstance(got, torch.Tensor) else got, dtype=np.float64)
    assert got.shape == (N_PARTIALS,)
    np.testing.assert_array_equal(got[:SUM], ref[:SUM])
    with np.errstate(invalid="ignore"):
        v = np.asarray(values, dtype=np.float64).ravel()
    scale = np.abs(v[np.isfinite(v)]).sum()
    assert abs(got[SUM] - ref[SUM]) <= rtol * scale + 1e-300, (got[SUM], ref[SUM])
    assert abs(got[SUMSQ] - ref[SUMSQ]) <= rtol * ref[SUMSQ] + 1e-300, (got[SUMSQ], ref[SUMSQ])


def assert_stats_close(
    got: dict[str, float],
    want: dict[str, float],
    rtol: float = 1e-6,
    where: str = "",
    exact_extremes: bool = True,
) -> None:
    """Two statistics dicts of the same tensor, summed in a different order: counts, min and max exact; norm
    within rtol; mean within rtol * max|x| (a float sum's error is bounded by the sum of |x|, not by the sum
    itself, which cancellation can make arbitrarily small). ``exact_extremes=False`` for tensors the two
    sides derive themselves (Adam's update and update ratio), where min and max are only within rtol too."""
    assert got.keys() == want.keys(), where
    scale = max(abs(want.get("min", 0.0)), abs(want.get("max", 0.0)))
    for stat, value in want.items():
        if stat in ("zeros", "nans", "infs") or (exact_extremes and stat in ("min", "max")):
            assert got[stat] == value, (where, stat, got[stat], value)
        elif stat == "mean":
            assert abs(got[stat] - value) <= rtol * scale + 1e-300, (where, stat, got[stat], value)
        else:
            assert got[stat] == pytest.approx(value, rel=rtol, abs=1e-300), (where, stat)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy()


@pytest.fixture(autouse=True)
def _two_threads():
    torch.set_num_threads(2)
    yield


# Stage-1 programs of 16K elements read 4K at a time, stage 2 reading 4 partial rows at a time: small enough
# that the interpreter (a few ms per program) runs the golden cases quickly, and that tensors of a few
# thousand elements already span several chunks and several stage-2 passes.
TEST_TILING = {"chunk": 1 << 14, "block": 1 << 12, "rows": 4, "sign_bytes": 64}


@pytest.fixture
def triton_tiling():
    """The Triton kernels with :data:`TEST_TILING` (under the interpreter when there is no GPU)."""
    from trainmon import stats
    from trainmon.stats import triton_path

    assert stats.triton_available(), "Triton does not import: run ./scripts/setup.sh"
    previous = triton_path.get_tiling()
    if triton_path.interpreting():
        triton_path.set_tiling(triton_path.Tiling(warps=previous.warps, **TEST_TILING))
    yield triton_path.get_tiling()
    triton_path.set_tiling(previous)
    # a failing kernel hands its rows to the torch ops (test_triton_fallback.py): right for training, but
    # here it would let the torch ops pass the kernels' tests
    assert triton_path.unavailable() is None, f"the Triton kernels failed: {triton_path.unavailable()}"


# The files that take longest (tens of seconds to minutes of 2-core time: the GPU check's dry run, browser
# sessions, multi-rank runs, the MindSpore venv), handed out first so that the run does not end on one of
# them while the other worker waits (pytest --durations on the 2-core VM)
LONGEST_FILES = (
    "test_titan.py",
    "test_gpu_check.py",
    "test_skip_deepspeed.py",
    "test_megatron.py",
    "test_deepspeed.py",
    "test_compile.py",
    "test_mindspore_env.py",
    "test_torchtitan.py",
    "test_skip_megatron.py",
    "test_plugin_routes.py",
    "test_plugin_ui.py",
    "test_dtensor.py",
    "test_loops_huggingface.py",
    "test_safety.py",
    "test_cross_framework.py",
    "test_straggler.py",
    "test_comm.py",
    "test_origin_merged.py",
    "test_hf_families.py",
    "test_reload_ranks.py",
)


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist hands a file's tests to one worker, so that a module's fixtures (demo runs, multi-rank
    # runs, TensorBoard servers) are built once, not once per worker that gets some of its tests; files go
    # out in the order of pytest_collection_modifyitems (xdist would otherwise order them by their number of
    # tests, which sends the long single-test files last)
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: rank for rank, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the rest keep their order

"""Shared test helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

INF = float("inf")

# every kind the monitor collects, all statistics, every step (the tests' "full coverage")
FULL_COVERAGE = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
}


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


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy()


@pytest.fixture(autouse=True)
def _two_threads():
    torch.set_num_threads(2)
    yield

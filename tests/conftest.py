"""Shared test helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainmon.records import N_PARTIALS


def reference_partials(values: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """float64 numpy reference of the stats kernel's partials vector (see trainmon.records.PARTIALS)."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    finite = x[np.isfinite(x)]
    out = np.zeros(N_PARTIALS)
    out[0] = x.size
    out[1] = np.isnan(x).sum()
    out[2] = np.isinf(x).sum()
    out[3] = (np.abs(x) <= eps).sum()
    out[4] = finite.min() if finite.size else np.inf
    out[5] = finite.max() if finite.size else -np.inf
    out[6] = finite.sum()
    out[7] = (finite * finite).sum()
    return out


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy()


@pytest.fixture(autouse=True)
def _two_threads():
    torch.set_num_threads(2)
    yield

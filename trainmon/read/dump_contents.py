"""What a dump file holds, on the host, for ``trainmon dump show`` and the plugin's dump view.

The statistics come from the stats kernel of the framework at hand, so they are computed exactly as the
CSV and TensorBoard values were: torch's (:mod:`trainmon.stats`) when torch is installed, else MindSpore's
(:mod:`trainmon.mindspore.stats`: a MindSpore-only environment reads its own runs' dumps). Files are read
with safetensors only: nothing a file contains is ever executed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from trainmon.run.dumps import DumpError
from trainmon.run.records import derive

if TYPE_CHECKING:  # torch is imported when a dump is read: the plugin loads without it
    import torch


@dataclass(frozen=True)
class DumpContents:
    metadata: dict[str, str]
    dtype: str  # as torch spells it without "torch.": float32, bfloat16
    shape: tuple[int, ...]
    stats: dict[str, float]  # trainmon.run.records.STATS of the whole tensor
    finite_values: np.ndarray  # float64, the finite elements (magnitudes for complex tensors), for histograms

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def read_dump(path: str | os.PathLike[str]) -> DumpContents:
    """Read a dump and compute its statistics; :class:`~trainmon.run.dumps.DumpError` names a bad file."""
    try:
        import torch  # noqa: F401 - the test: is torch installed?
    except ImportError:
        return _read_with_mindspore(path)
    return _read_with_torch(path)


def prepare() -> None:
    """Import what reading a dump needs (torch and its stats kernel: 2 s on two cores) ahead of the first
    dump: the plugin calls it from a thread of its own once it shows a run with dumps. Without torch, the
    MindSpore reader is imported when used."""
    try:
        import torch
    except ImportError:
        return
    from trainmon.stats import partials

    partials(torch.zeros(4))


def load_dump(path: str | os.PathLike[str]) -> tuple[torch.Tensor, dict[str, str]]:
    """The tensor of a dump file and its string metadata. Read with safetensors only (no code runs); a file
    that is not a readable safetensors file holding a tensor raises :class:`DumpError` naming it."""
    try:
        from safetensors import safe_open
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, ...
        raise DumpError(f"{path}: not a readable safetensors dump: {e}") from e
    if not tensors:
        raise DumpError(f"{path}: the file holds no tensor")
    tensor = tensors["tensor"] if "tensor" in tensors else next(iter(tensors.values()))
    return tensor, metadata


def _contents(
    metadata: dict[str, str], dtype: str, shape, partials: np.ndarray, values: np.ndarray
) -> DumpContents:
    derived = derive(np.asarray(partials, dtype=np.float64).reshape(1, -1))
    stats = {k: float(v[0]) for k, v in derived.items()}
    shape = tuple(int(d) for d in shape)
    return DumpContents(dict(metadata), dtype, shape, stats, values[np.isfinite(values)])


def _read_with_torch(path: str | os.PathLike[str]) -> DumpContents:
    import torch

    from trainmon.stats import partials

    tensor, metadata = load_dump(path)
    x = tensor.detach()
    values = (x.abs() if x.is_complex() else x).to(torch.float64).reshape(-1).numpy()
    dtype = str(tensor.dtype).removeprefix("torch.")
    return _contents(metadata, dtype, tensor.shape, partials(tensor).double().cpu().numpy(), values)


def _read_with_mindspore(path: str | os.PathLike[str]) -> DumpContents:
    try:
        import mindspore as ms

        from trainmon.mindspore.stats import partials_row
    except ImportError:
        raise DumpError(f"{path}: reading a dump needs torch or MindSpore installed") from None
    try:
        from safetensors import safe_open
        from safetensors.numpy import load_file

        arrays = load_file(str(path))
        with safe_open(str(path), framework="np") as f:
            metadata = dict(f.metadata() or {})
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, a dtype numpy lacks ...
        raise DumpError(f"{path}: not a readable safetensors dump: {e}") from e
    if not arrays:
        raise DumpError(f"{path}: the file holds no tensor")
    array = arrays["tensor"] if "tensor" in arrays else next(iter(arrays.values()))
    values = np.abs(array) if np.iscomplexobj(array) else array
    row = partials_row(ms.Tensor(np.ascontiguousarray(values))).asnumpy()
    return _contents(metadata, str(array.dtype), array.shape, row, values.astype(np.float64).reshape(-1))

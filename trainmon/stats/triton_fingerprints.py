"""``grad_probe`` fingerprints with the Triton kernels: each part of a step's fingerprints (statistics, bin
counts, samples, sign bitmaps) for all gradients of one dtype in one launch.

The kernels write into typed sections of one device byte buffer, copied to the host once; the writer
thread then cuts it into the per-parameter records of :mod:`trainmon.run.gradprobe` (bin counts arrive
per block of elements and are summed there, exactly: they are integers). Tables of addresses, sample
positions and bounds are staged through page-locked memory or reused, as for the statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainmon.device import upload
from trainmon.run.gradprobe import ParamLayout
from trainmon.run.records import N_PARTIALS
from trainmon.stats import triton_path
from trainmon.stats.native import readable
from trainmon.stats.triton_path import KernelFailed, TableCache, TritonReducer, _tl_dtype, launch

_ALIGN = 8


@dataclass(frozen=True)
class _Sections:
    """Byte offsets of the parts in the step's buffer, and where each parameter's pieces are."""

    stats: int
    bins: int
    samples: int
    signs: int
    total: int
    block_first: np.ndarray  # per parameter: first bin-count row
    block_count: np.ndarray
    sample_first: np.ndarray  # per parameter: first float32 sample
    sign_first: np.ndarray  # per parameter: first bitmap byte


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class TritonFingerprinter:
    """Fingerprints of gradients on one device (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reducer = TritonReducer(device)
        self._k = triton_path.kernels()
        self._tables = TableCache(device)
        self._positions: dict[tuple, tuple[torch.Tensor, np.ndarray, list[np.ndarray]]] = {}
        self._bounds: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def takes(grads: Sequence[torch.Tensor]) -> bool:
        if triton_path.unavailable() is not None:  # a kernel failed: the torch ops take over
            return False
        return all(g.dtype in triton_path.KERNEL_DTYPES and g.layout == torch.strided for g in grads)

    def take(
        self,
        grads: Sequence[torch.Tensor],
        layouts: Sequence[ParamLayout],
        positions: Sequence[np.ndarray],
        eps: float,
    ) -> tuple[torch.Tensor, Callable[[np.ndarray], np.ndarray]] | None:
        """Launch the step's fingerprint kernels; returns the device buffer and the function that turns its
        host copy into the step's records, or None when a kernel failed (the caller uses torch ops)."""
        try:
            return self._take(grads, layouts, positions, eps)
        except KernelFailed:
            return None

    def _take(
        self,
        grads: Sequence[torch.Tensor],
        layouts: Sequence[ParamLayout],
        positions: Sequence[np.ndarray],
        eps: float,
    ) -> tuple[torch.Tensor, Callable[[np.ndarray], np.ndarray]]:
        xs = [readable(g) for g in grads]
        numels = np.fromiter((x.numel() for x in xs), dtype=np.int64, count=len(xs))
        chunks = -(-numels // triton_path.get_tiling().chunk) if layouts[0].bounds else np.zeros_like(numels)
        nbounds = len(layouts[0].bounds)
        ks = np.fromiter((layout.k for layout in layouts), dtype=np.int64, count=len(layouts))
        sign_bytes = np.fromiter(
            (layout.bitmap_bytes for layout in layouts), dtype=np.int64, count=len(layouts)
        )
        groups: dict[torch.dtype, list[int]] = {}
        for i, x in enumerate(xs):
            groups.setdefault(x.dtype, []).append(i)
        # bin-count rows: a dtype's parameters consecutive, so that one launch numbers its programs in order
        block_first = np.zeros(len(xs), dtype=np.int64)
        running = 0
        for members in groups.values():
            for i in members:
                block_first[i] = running
                running += int(chunks[i])
        sections = _layout(len(xs), chunks, block_first, nbounds, ks, sign_bytes)
        buffer = torch.empty(sections.total, dtype=torch.uint8, device=self.device)

        stats = buffer[sections.stats : sections.stats + 8 * N_PARTIALS * len(xs)].view(torch.float64)
        stats = stats.view(len(xs), N_PARTIALS)
        self._reducer.rows(xs, stats, 0, eps)
        self._reducer.complete(stats)
        for dtype, members in groups.items():
            if nbounds:
                self._bins(dtype, xs, members, layouts[0].bounds, buffer, sections)
            if ks[members].sum():
                self._samples(dtype, xs, members, positions, buffer, sections)
            if sign_bytes[members].sum():
                self._signs(dtype, xs, members, buffer, sections)
        return buffer, lambda host: _assemble(host, sections, layouts, nbounds)

    # --------------------------------------------------------------------------------------- launches
    def _bins(self, dtype, xs, members, bounds, buffer, sections: _Sections) -> None:
        tiling = triton_path.get_tiling()
        addresses = np.fromiter((xs[i].data_ptr() for i in members), dtype=np.int64, count=len(members))
        numels = np.fromiter((xs[i].numel() for i in members), dtype=np.int64, count=len(members))
        counts = sections.block_count[members]
        owner = np.repeat(np.arange(len(members), dtype=np.int64), counts)
        key = ("bins", dtype, tiling.chunk, addresses.tobytes(), numels.tobytes())
        starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        table = self._tables.table(key, (addresses, numels, starts, owner))
        blocks = int(counts.sum())
        if not blocks:
            return
        nb = len(bounds)
        width = nb + 1
        rows = buffer[sections.bins :].view(torch.float64)
        row0 = int(sections.block_first[members[0]])  # this dtype's rows are consecutive (see take)
        launch(
            self._k,
            "bins_table",
            (blocks,),
            self.device,
            table,
            len(members),
            self._bounds_on_device(dtype, bounds),
            rows,
            row0,
            NB=nb,
            NBP=_next_pow2(width),
            DTYPE=_tl_dtype(dtype),
            BF16=dtype == torch.bfloat16,
            BLOCK=tiling.block,
            CHUNK=tiling.chunk,
            num_warps=tiling.warps,
            enable_fp_fusion=True,
        )

    def _samples(self, dtype, xs, members, positions, buffer, sections: _Sections) -> None:
        flat_positions, offsets = self._positions_on_device([positions[i] for i in members])
        addresses = np.fromiter((xs[i].data_ptr() for i in members), dtype=np.int64, count=len(members))
        ks = np.fromiter((len(positions[i]) for i in members), dtype=np.int64, count=len(members))
        first_out = sections.sample_first[members]
        key = ("gather", dtype, addresses.tobytes(), ks.tobytes(), offsets.tobytes(), first_out.tobytes())
        table = self._tables.table(key, (addresses, ks, offsets, first_out))
        out = buffer[sections.samples : sections.signs].view(torch.float32)
        launch(
            self._k,
            "gather_table",
            (len(members),),
            self.device,
            table,
            len(members),
            flat_positions,
            out,
            DTYPE=_tl_dtype(dtype),
            BF16=dtype == torch.bfloat16,
            BLOCK=256,
            enable_fp_fusion=True,
        )

    def _signs(self, dtype, xs, members, buffer, sections: _Sections) -> None:
        per_block = triton_path.get_tiling().sign_bytes
        addresses = np.fromiter((xs[i].data_ptr() for i in members), dtype=np.int64, count=len(members))
        numels = np.fromiter((xs[i].numel() for i in members), dtype=np.int64, count=len(members))
        nbytes = (numels + 7) // 8
        blocks = (nbytes + per_block - 1) // per_block
        first_block = np.concatenate(([0], np.cumsum(blocks)[:-1])).astype(np.int64)
        owner = np.repeat(np.arange(len(members), dtype=np.int64), blocks)
        first_byte = sections.sign_first[members]
        key = ("signs", dtype, per_block, addresses.tobytes(), numels.tobytes(), first_byte.tobytes())
        table = self._tables.table(key, (addresses, numels, first_block, first_byte, owner))
        total = int(blocks.sum())
        if not total:
            return
        launch(
            self._k,
            "signs_table",
            (total,),
            self.device,
            table,
            len(members),
            buffer[sections.signs :],
            DTYPE=_tl_dtype(dtype),
            BF16=dtype == torch.bfloat16,
            BYTES=per_block,
            enable_fp_fusion=True,
        )

    def _positions_on_device(self, arrays: list[np.ndarray]) -> tuple[torch.Tensor, np.ndarray]:
        """The sample positions of several parameters in one device tensor (uploaded once: they are fixed),
        and where each parameter's start."""
        key = tuple(id(a) for a in arrays)
        cached = self._positions.get(key)
        if cached is None:
            lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
            offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
            flat = np.concatenate([*arrays, np.zeros(1, dtype=np.int64)]).astype(np.int64)
            # the arrays stay referenced by the entry, so their ids are not reused while it lives
            cached = self._positions[key] = (upload(torch.from_numpy(flat), self.device), offsets, arrays)
        return cached[0], cached[1]

    def _bounds_on_device(self, dtype: torch.dtype, bounds: tuple[float, ...]) -> torch.Tensor:
        """The bounds rounded to the gradient's dtype, as float32: ``x <= b`` then compares as torch does
        for a tensor of that dtype and a Python number."""
        key = (dtype, bounds)
        cached = self._bounds.get(key)
        if cached is None:
            rounded = torch.tensor(bounds, dtype=torch.float64).to(dtype).to(torch.float32)
            cached = self._bounds[key] = upload(rounded, self.device)
        return cached


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _layout(
    count: int,
    chunks: np.ndarray,
    block_first: np.ndarray,
    nbounds: int,
    ks: np.ndarray,
    sign_bytes: np.ndarray,
) -> _Sections:
    stats = 0
    bins = _aligned(stats + 8 * N_PARTIALS * count)
    samples = _aligned(bins + 8 * (nbounds + 1) * int(chunks.sum()) if nbounds else bins)
    sample_first = np.concatenate(([0], np.cumsum(ks)[:-1])).astype(np.int64)
    signs = _aligned(samples + 4 * int(ks.sum()))
    sign_first = np.concatenate(([0], np.cumsum(sign_bytes)[:-1])).astype(np.int64)
    total = _aligned(signs + int(sign_bytes.sum())) or _ALIGN
    return _Sections(stats, bins, samples, signs, total, block_first, chunks, sample_first, sign_first)


def _assemble(host: np.ndarray, s: _Sections, layouts: Sequence[ParamLayout], nbounds: int) -> np.ndarray:
    """The step's records (the file format) from the host copy of the device buffer."""
    raw = np.ascontiguousarray(host).view(np.uint8)
    count = len(layouts)
    stats = raw[s.stats : s.stats + 8 * N_PARTIALS * count].view(np.float64).reshape(count, N_PARTIALS)
    samples = raw[s.samples : s.signs].view(np.float32)
    pieces: list[bytes] = []
    if nbounds:
        width = nbounds + 1
        rows = raw[s.bins : s.samples].view(np.float64)[: width * int(s.block_count.sum())].reshape(-1, width)
        running = np.vstack((np.zeros((1, width)), np.cumsum(rows, axis=0)))  # exact: integer counts
        ends = s.block_first + s.block_count
        counts = running[ends] - running[s.block_first]
    for i, layout in enumerate(layouts):
        pieces.append(stats[i].tobytes())
        if layout.bounds:
            pieces.append(counts[i].tobytes())
        if layout.k:
            pieces.append(samples[s.sample_first[i] : s.sample_first[i] + layout.k].tobytes())
        if layout.sign_bitmap:
            first = s.signs + int(s.sign_first[i])
            pieces.append(raw[first : first + layout.bitmap_bytes].tobytes())
    return np.frombuffer(b"".join(pieces), dtype=np.uint8)

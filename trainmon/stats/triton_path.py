"""The accelerator backend's host side: launches of the Triton kernels (:mod:`trainmon.stats.triton_kernels`)
and the bookkeeping that lets a whole step's statistics finish in one launch.

A :class:`TritonReducer` belongs to one device of a step buffer. During the step, a tensor taken in a hook
(activations, their gradients) waits in a batch that one stage-1 launch reads whatever the dtypes it mixes,
or is launched alone (read at its hook), and the parameter side shares one launch with every tensor of its
dtype (a tensor table: gradients, parameters, Adam moments, update/ratio); the partial rows stay on the
device and the reducer remembers, on the host, which partial rows make which output row (the *descriptors*:
all host-known numbers, numel included). :meth:`TritonReducer.complete` uploads the descriptors through
page-locked memory (no synchronisation) and reduces every output row of the step in one stage-2 launch.

Nothing here reads a device value on the host or copies a Python number into a device tensor: counts,
addresses and offsets reach the device as kernel arguments or in tables staged through page-locked memory.
Tables of tensors whose addresses did not change (parameters, optimizer state) are reused across steps.
Float64, int64 and int32 tensors taken in hooks join the batches too (read widened to float64); elsewhere
they, and every other dtype, go to the torch backend on the same device.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from trainmon.device import device_memory, launch_guard, upload
from trainmon.run.records import MAX, MIN
from trainmon.stats import torch_ops
from trainmon.stats.direct import AdamItem, merge_rows_into
from trainmon.stats.native import readable
from trainmon.stats.thresholds import zero_threshold_f32
from trainmon.stats.triton_interpreter import skip_repatching

log = logging.getLogger(__name__)

_F64 = torch.float64
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_KERNEL_DTYPES = frozenset(KERNEL_DTYPES)  # asked once per monitored tensor: a hash, not three comparisons
# float64 and the common integer types, which only the batch kernel reads (a model's token ids and
# positions are its first modules' inputs): elsewhere the torch ops read them
_WIDE_DTYPES = frozenset((torch.float64, torch.int64, torch.int32))
_DTYPE_CODE = {  # stats_batch's tags
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float64: 3,
    torch.int64: 4,
    torch.int32: 5,
}
_ITEMSIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _DTYPE_CODE}
_JOIN_CODES = {dtype: (code, _ITEMSIZE[dtype]) for dtype, code in _DTYPE_CODE.items()}  # for join_state
_STRIDED = torch.strided


@dataclass(frozen=True)
class Tiling:
    """``chunk`` elements per stage-1 program, read ``block`` at a time by ``warps`` warps; stage 2 reads
    ``rows`` partial rows at a time. Tests shrink chunk and block so Triton's interpreter runs quickly."""

    chunk: int = 1 << 16
    block: int = 2048
    warps: int = 8
    rows: int = 128
    sign_bytes: int = 256
    # "base", or "fast": the stage-1 kernels' variants that read whole blocks unmasked, ``unroll`` blocks'
    # loads in flight, with the same partial rows bit for bit (triton_kernels; bench/gpu_kernel_sweep.py
    # judges them per device); the fast ones run where every address of a launch is 16-byte aligned
    kernel: str = "base"
    unroll: int = 1


def _variant(name: str, tiling: Tiling, aligned: bool) -> tuple[str, dict[str, int]]:
    """The stage-1 kernel ``name`` of ``tiling``'s variant (the base one where an address of the launch is
    not 16-byte aligned), and the constants that variant adds."""
    if tiling.kernel == "fast" and aligned:
        return name + "_fast", {"UNROLL": tiling.unroll}
    return name, {}


def _aligned(addresses: np.ndarray) -> bool:
    """Whether every address is a multiple of 16 bytes (what the fast kernels' vector loads need)."""
    return not (addresses & 15).any()


# The oldest Triton the kernels are checked on, compiled and interpreted (bench/triton_versions.sh): the one
# torch 2.6 brings. An older one is not tried: the torch ops take over, with a warning.
MIN_TRITON = (3, 2)

_tiling = Tiling()
_kernels: ModuleType | None = None
# why the kernels do not run in this process (Triton missing or too old, or a launch failed), once known
_unavailable: str | None = None
_warned = False


def set_tiling(tiling: Tiling) -> None:
    global _tiling
    _tiling = tiling


def get_tiling() -> Tiling:
    return _tiling


def interpreting() -> bool:
    """Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs the kernels on CPU tensors (tests)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def kernels() -> ModuleType | None:
    """The kernel module, or None when Triton does not import, is older than :data:`MIN_TRITON`, or one of
    the kernels failed in this process (see :func:`unavailable`)."""
    global _kernels
    if _kernels is None and _unavailable is None:
        try:
            import triton

            if version_tuple(triton.__version__) < MIN_TRITON:
                oldest = ".".join(map(str, MIN_TRITON))
                _set_unavailable(f"Triton {triton.__version__} is older than {oldest}, the oldest supported")
            else:
                from trainmon.stats import triton_kernels

                if interpreting():  # CI and the CPU dry runs: a launch's helpers set nothing up again
                    skip_repatching()
                _kernels = triton_kernels
        except Exception as exc:  # ImportError, or a Triton build that fails to initialise
            _set_unavailable(f"Triton does not import: {describe(exc)}")
    return _kernels if _unavailable is None else None


def unavailable() -> str | None:
    """Why the kernels do not run in this process, or None (they do, or were not needed yet)."""
    return _unavailable


def version_tuple(version: str) -> tuple[int, ...]:
    """``"3.2.0"`` -> ``(3, 2, 0)``, without a local or pre-release tail (``3.3.0+git1234``, ``3.4.0rc1``)."""
    parts = []
    for part in version.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def describe(error: BaseException) -> str:
    """An exception in one line: its type, and for a compile error its position and its last line (the
    cause; Triton puts the kernel's source in between)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}" if lines else ""
    if len(text) > 400:
        text = text[:400] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _set_unavailable(reason: str) -> None:
    global _unavailable
    if _unavailable is None:
        _unavailable = reason


def _warn_unavailable() -> None:
    """The one warning of a process whose accelerators use the torch ops instead of the kernels."""
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "trainmon: the Triton statistics kernels are off (%s); statistics on accelerators use torch ops "
            "(the same statistics, more kernel launches)",
            _unavailable,
        )


def supports(device: torch.device) -> bool:
    """Whether the kernels can run on ``device``: CUDA (ROCm too, which torch calls cuda), or the CPU under
    Triton's interpreter. Where they would but cannot, warns once (naming the reason)."""
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return False
    if kernels() is None:
        _warn_unavailable()
        return False
    return True


class KernelFailed(RuntimeError):
    """A kernel launch raised (a compile error, an unsupported GPU, a driver error): the kernels are off for
    the rest of the process and the caller redoes its work with torch ops."""


def launch(k: Any, name: str, grid: tuple[int, ...], device: torch.device, *args: Any, **kwargs: Any) -> None:
    """``k.<name>[grid](*args, **kwargs)`` on ``device``. Triton compiles a kernel at its first launch with
    new constants, so a Triton or GPU the kernels do not suit fails here, in the step where it is first
    seen: the kernels are turned off (one warning) and :class:`KernelFailed` tells the caller to fall back.
    """
    try:
        with launch_guard(device):
            getattr(k, name)[grid](*args, **kwargs)
    except Exception as error:
        log.debug("trainmon: Triton kernel %s failed", name, exc_info=True)
        _set_unavailable(f"kernel {name} failed on {device}: {describe(error)}")
        _warn_unavailable()
        raise KernelFailed(name) from error


_TL_DTYPES: dict[torch.dtype, Any] = {}  # filled at the first launch, once Triton is imported


def _tl_dtype(dtype: torch.dtype) -> Any:
    """The element type the kernels read a tensor of ``dtype`` as (bfloat16 as its int16 bits)."""
    if not _TL_DTYPES:
        tl = _kernels.triton.language  # type: ignore[union-attr]
        _TL_DTYPES.update({torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.int16})
    return _TL_DTYPES[dtype]


def as_loaded(x: torch.Tensor) -> torch.Tensor:
    """What a single-tensor kernel receives: bfloat16 as its int16 bits (see the kernels' docstring)."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


@functools.lru_cache(maxsize=16)
def _zero_thresholds(eps: float) -> tuple[float, float, float, int]:
    """stats_batch's zero thresholds for ``eps``: of float32, float16 and bfloat16 (kernel arguments), and
    float64's as the bits of an int64 (its table's entry: a float argument would be a float32), which the
    integer tensors widened to float64 share (``|x| <= eps``; -1 where nothing is a zero)."""
    f32, f16, bf16 = (zero_threshold_f32(dtype, eps) for dtype in KERNEL_DTYPES)
    wide = eps if eps >= 0 else -1.0  # a NaN eps: nothing is a zero, as zero_bounds says
    return f32, f16, bf16, int(np.float64(wide).view(np.int64))


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)


class TableCache:
    """Device copies of tensor tables (int64 columns, concatenated), keyed by what they hold (addresses and
    sizes): a parameter set whose memory did not move reuses its table, with no upload. The one cache of
    the statistics reducer and of the gradient fingerprinter (``triton_fingerprints``)."""

    def __init__(self, device: torch.device, capacity: int = 32) -> None:
        self.device = device
        self._entries: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._capacity = capacity

    def table(self, key: tuple, columns: Sequence[np.ndarray]) -> torch.Tensor:
        """The table of ``columns`` on the device, uploaded only when ``key`` is new (least recently used
        tables make room)."""
        entry = self.get(key)
        if entry is None:
            entry = self.put(key, self.upload(columns))
        return entry

    def upload(self, columns: Sequence[np.ndarray]) -> torch.Tensor:
        """``columns`` concatenated as int64 on the device (no synchronisation: :func:`upload`)."""
        return upload(
            torch.from_numpy(np.ascontiguousarray(np.concatenate(columns).astype(np.int64))), self.device
        )

    def get(self, key: tuple) -> Any:
        """What :meth:`put` kept under ``key`` (a table, or a table with what was computed with it), or
        None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: tuple, entry: Any) -> Any:
        self._entries[key] = entry
        if len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
        return entry


@dataclass(frozen=True)
class _Blocks:
    """How the tensors of one table launch split into stage-1 programs."""

    table: torch.Tensor  # on the device
    first_block: np.ndarray  # per tensor
    chunks: np.ndarray  # per tensor (0 for an empty tensor)
    numels: np.ndarray
    count: int  # programs in all
    total: int  # elements in all
    aligned: bool  # every address a multiple of 16 bytes


def _block_layout(numels: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per tensor of int64 ``numels``: its programs and its first one; per program: its tensor. (Each numpy
    call on a small array costs about a microsecond, a batch of any size the same: as few as can be.)"""
    chunks = (numels + (chunk - 1)) // chunk
    first_block = np.cumsum(chunks) - chunks
    owner = np.repeat(np.arange(len(numels), dtype=np.int64), chunks)
    return chunks, first_block, owner


# Single tensors (activations, their gradients, per-parameter gradient hooks) wait in a batch that one launch
# reads: at most this many tensors, or a device's batch bytes (batch_bytes), are held at once. Holding them
# may keep memory alive past its last use (most are saved for backward anyway): the bytes bound is that extra
# memory's bound. It is a share of the device's memory, not a fixed size: every launch costs the host about
# 0.1 ms on a GPU (the table's upload, Triton's launcher), so a device that can spare more takes fewer, larger
# batches (bench/batch_memory.py); BATCH_BYTES where the device does not say (the CPU under the interpreter).
BATCH_TENSORS = 256
BATCH_BYTES = 256 << 20
BATCH_MEMORY_SHARE = 128  # a batch holds at most 1/128 of its device's memory (0.8%) ...
BATCH_BYTES_RANGE = (64 << 20, 1 << 30)  # ... within these bounds


def batch_bytes(device: torch.device) -> int:
    """The bytes a batch of ``device`` may hold before its launch (:data:`BATCH_MEMORY_SHARE`)."""
    total = device_memory(device)
    if total is None:
        return BATCH_BYTES
    low, high = BATCH_BYTES_RANGE
    return min(max(total // BATCH_MEMORY_SHARE, low), high)


class _Batch:
    """Tensors whose statistics wait for one shared launch, with their version counter, address and length
    when their hook saw them (the launch reads them later: see :meth:`TritonReducer.row`). Lists of numbers
    and references, cleared and reused: a batch allocates no object that outlives it. The hot path
    (:meth:`TritonReducer._defer`) appends to the columns itself: a call per tensor is most of its cost."""

    __slots__ = (
        "tensors",
        "rows",
        "versions",
        "addresses",
        "numels",
        "sites",
        "by_address",
        "shared_from",
        "shared_rows",
        "codes",
        "nbytes",
    )

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.rows: list[int] = []  # the output row of each tensor
        self.versions: list[int] = []
        self.addresses: list[int] = []
        self.numels: list[int] = []
        self.sites: list[Any] = []  # what the caller knows the tensor's hook by (its row description)
        self.by_address: dict[int, int] = {}  # data_ptr -> the first entry there, for a tensor seen again
        self.shared_from: list[int] = []  # rows that reuse an entry's statistics: the entry ...
        self.shared_rows: list[int] = []  # ... and the row
        self.codes: list[int] = []  # each entry's dtype, as the kernel tags it
        self.nbytes = 0

    def clear(self) -> None:
        for column in (self.tensors, self.rows, self.versions, self.addresses, self.numels, self.sites):
            column.clear()
        self.codes.clear()
        self.by_address.clear()
        self.shared_from.clear()
        self.shared_rows.clear()
        self.nbytes = 0

    def find(self, x: torch.Tensor, address: int) -> int | None:
        """The entry holding ``x``'s elements (``address``: its data_ptr), unchanged since its hook: the same
        memory (another view of it, or a detached alias) of the same length and dtype. Held entries keep
        their memory from being reused, so the same address means the same elements."""
        j = self.by_address.get(address)
        if j is None or self.rows[j] < 0:
            return None
        held = self.tensors[j]
        if held.dtype != x.dtype or self.numels[j] != x.numel() or not self.unchanged(j):
            return None
        return j if x._version == held._version else None

    def hold(self, x: torch.Tensor, address: int, numel: int, row: int, site: Any) -> None:
        """Entry of ``x`` (readable in place at ``address``, ``numel`` elements) for output row ``row``."""
        self.by_address.setdefault(address, len(self.tensors))
        self.tensors.append(x)
        self.rows.append(row)
        self.versions.append(x._version)
        self.addresses.append(address)
        self.numels.append(numel)
        self.sites.append(site)
        dtype = x.dtype
        self.codes.append(_DTYPE_CODE[dtype])
        self.nbytes += numel * _ITEMSIZE[dtype]

    def unchanged(self, j: int) -> bool:
        """Entry ``j`` holds what its hook saw: nothing wrote it in place, nothing swapped its memory."""
        t = self.tensors[j]
        return t._version == self.versions[j] and t.data_ptr() == self.addresses[j]

    def changed(self) -> list[int]:
        """The entries not :meth:`unchanged`. Whole columns are compared first (the usual answer is none,
        and two list comparisons cost less than a test per entry)."""
        tensors = self.tensors
        versions = [t._version for t in tensors]
        if versions == self.versions and [t.data_ptr() for t in tensors] == self.addresses:
            return []
        held = enumerate(zip(tensors, self.versions, self.addresses, strict=True))
        return [j for j, (t, version, address) in held if t._version != version or t.data_ptr() != address]


class TritonReducer:
    """Rows of one device's step buffer computed by the Triton kernels; see the module docstring.

    Single tensors of the kinds nothing rewrites behind their version counter (``shareable``: activations,
    their gradients, and gradients where no collective reduces them in place) are not launched one by one:
    they join a batch (:data:`BATCH_TENSORS`, :func:`batch_bytes`) that one launch reads, when it is full or
    when the step's rows are completed. The launch must see what the hook saw, so a tensor changed in place
    between its hook and the launch (a ReLU with ``inplace=True`` after the module, a clipped gradient) is
    read at its hook instead. Which ones are is learnt in the first collected step, in which every tensor is
    launched at its hook and only checked at the batch's end; a tensor found changed later (a model that
    changes in place only now and then) is read as the launch finds it, said once, and read at its hook from
    then on.

    Once a kernel has failed (:func:`launch`), every row is computed with torch ops, the one that failed
    included; rows of kernels that ran before it are finished as usual at :meth:`complete` (by torch ops
    too if the failing kernel is stage 2's). Training never sees the failure."""

    deferred = True

    def __init__(self, device: torch.device) -> None:
        if kernels() is None:
            raise RuntimeError("Triton is not available")
        self.device = device
        self._k = _kernels
        self._part: torch.Tensor | None = None  # partial rows, kept across steps
        self._used = 0
        # the step's descriptors (see triton_kernels): a launch of many tensors adds an (n, DESC_WIDTH) array,
        # one of a single tensor DESC_WIDTH ints (a Python int costs less to add than an array)
        self._desc_blocks: list[np.ndarray] = []
        self._descs: list[int] = []
        self._tables = TableCache(device)
        self._batch = _Batch()
        self._batch_bytes = batch_bytes(device)
        self._eps = 0.0  # of the batch's rows (the step buffer's eps, the same for a whole step)
        self._learnt = False  # a collected step has shown which tensors change in place after their hook
        self._seen_batchable = False  # this step had rows that may join a batch
        self._at_hook: set[Any] = set()  # sites read at their hook: changed in place after it
        self._said_late = False

    def join_state(self) -> dict[str, Any]:
        """What joins a tensor to the batch as :meth:`_defer` does, for the step buffer's native hot path
        (``trainmon.step._fastrows``): this reducer and its batch, whose attributes it reads and writes at
        every row, this module's globals (``_unavailable``, ``BATCH_TENSORS``), each dtype's tag and size."""
        return {"reducer": self, "batch": self._batch, "module": sys.modules[__name__], "codes": _JOIN_CODES}

    # ----------------------------------------------------------------------------------------- bookkeeping
    def _reserve(self, rows: int) -> int:
        first = self._used
        need = first + rows
        part = self._part
        if part is None or need > part.shape[0]:
            grown = torch.empty(
                (max(need, 4096, 2 * (0 if part is None else part.shape[0])), self._k.PARTIAL_WIDTH),
                dtype=_F64,
                device=self.device,
            )
            if part is not None and first:
                grown[:first].copy_(part[:first])  # queued after the kernels that wrote them
            self._part = grown
        self._used = need
        return first

    def _takes(self, t: torch.Tensor) -> bool:
        return t.dtype in _KERNEL_DTYPES and t.device == self.device and t.layout is _STRIDED

    # ----------------------------------------------------------------------------------------- rows
    def row(
        self,
        t: torch.Tensor,
        out: torch.Tensor,
        index: int,
        eps: float,
        shareable: bool = False,
        site: Any = None,
    ) -> None:
        """The row ``index`` of ``out`` gets the partials of ``t`` (final after :meth:`complete`).
        ``shareable``: nothing rewrites ``t``'s memory behind its version counter (no collective works on
        it in place), so ``t`` may wait in a batch, and a tensor seen again in it is read once. ``site``:
        what identifies the hook step after step (the row's description), for learning which tensors
        change in place after it."""
        dtype = t.dtype
        if _unavailable is not None or t.layout is not _STRIDED:
            torch_ops.row(t, out, index, eps)
            return
        if dtype not in _KERNEL_DTYPES:
            if shareable and dtype in _WIDE_DTYPES:
                self._wide_row(t, dtype, out, index, eps, site)
            else:
                torch_ops.row(t, out, index, eps)
            return
        try:
            if not shareable:
                self._row(t, index, eps)
            elif self._learnt and not (self._at_hook and site in self._at_hook):
                self._defer(t, dtype, out, index, eps, site)
            else:
                self._row(t, index, eps)
                if not self._learnt:
                    self._watch(t, out, eps, site)
        except KernelFailed:
            torch_ops.row(t, out, index, eps)

    def _wide_row(
        self, t: torch.Tensor, dtype: torch.dtype, out: torch.Tensor, index: int, eps: float, site: Any
    ) -> None:
        """A float64 or integer tensor, which only the batch kernel reads: it joins a batch, or where it must
        be read at its hook (the learning step, a tensor changed in place after its hook) the torch ops read
        it, and in the learning step it is watched as the others are."""
        if self._learnt and not (self._at_hook and site in self._at_hook):
            self._defer(t, dtype, out, index, eps, site)
            return
        torch_ops.row(t, out, index, eps)
        if not self._learnt:
            self._watch(t, out, eps, site)

    def _row(self, t: torch.Tensor, index: int, eps: float) -> None:
        """One launch for ``t`` now."""
        x = readable(t)
        n = x.numel()
        if n == 0:
            self._descs += (0, 0, index, 0)
            return
        tiling = _tiling
        chunks = _cdiv(n, tiling.chunk)
        first = self._reserve(chunks)
        # Triton specialises a pointer argument on its 16-byte alignment: any address suits the fast variant
        name, extra = _variant("stats_one", tiling, True)
        launch(
            self._k,
            name,
            (chunks,),
            self.device,
            as_loaded(x),
            n,
            self._part,
            first,
            zero_threshold_f32(t.dtype, eps),
            BF16=t.dtype == torch.bfloat16,
            BLOCK=tiling.block,
            CHUNK=tiling.chunk,
            num_warps=tiling.warps,
            enable_fp_fusion=True,
            **extra,
        )
        self._descs += (first, chunks, index, n)

    def _defer(
        self, t: torch.Tensor, dtype: torch.dtype, out: torch.Tensor, index: int, eps: float, site: Any
    ) -> None:
        """``t`` joins the batch (:meth:`_Batch.hold`, written out: this runs for every activation)."""
        # a tensor the kernel cannot read in place is copied now, while it holds what the hook saw
        x = t if t.is_contiguous() else readable(t)
        n = x.numel()
        if n == 0:
            self._descs += (0, 0, index, 0)
            return
        batch = self._batch
        address = x.data_ptr()
        by_address = batch.by_address
        tensors = batch.tensors
        if address not in by_address:
            by_address[address] = len(tensors)
        else:
            j = batch.find(x, address)
            if j is not None:  # the same tensor again (a module's input: the previous module's output)
                batch.shared_from.append(j)
                batch.shared_rows.append(index)
                return
        tensors.append(x)
        batch.rows.append(index)
        batch.versions.append(x._version)
        batch.addresses.append(address)
        batch.numels.append(n)
        batch.sites.append(site)
        batch.codes.append(_DTYPE_CODE[dtype])
        batch.nbytes += n * _ITEMSIZE[dtype]
        self._eps = eps
        if len(tensors) >= BATCH_TENSORS or batch.nbytes >= self._batch_bytes:
            self._flush(out)

    def _watch(self, t: torch.Tensor, out: torch.Tensor, eps: float, site: Any) -> None:
        """The learning step: ``t`` was launched at its hook; it is held as a batch would hold it, and
        checked when that batch would be launched."""
        self._seen_batchable = True
        n = t.numel()
        if n:
            batch = self._batch
            batch.hold(t, t.data_ptr(), n, -1, site)
            self._eps = eps
            if len(batch.tensors) >= BATCH_TENSORS or batch.nbytes >= self._batch_bytes:
                self._flush(out)

    def _flush(self, out: torch.Tensor) -> None:
        """Launch the batch (one launch, whatever its dtypes), or, in the learning step, check it."""
        batch = self._batch
        if not batch.tensors:
            return
        try:
            changed = batch.changed()
            if not self._learnt:
                self._at_hook.update(batch.sites[j] for j in changed)
                return
            if changed:
                self._say_late([batch.sites[j] for j in changed])
            try:
                self._launch_batch(changed)
            except Exception as error:  # a kernel that failed, or the table's upload (out of memory)
                if not isinstance(error, KernelFailed):
                    log.warning("trainmon: reading a batch of tensors failed (%s); torch ops read it", error)
                self._batch_with_torch(out)
        finally:
            batch.clear()

    def _batch_with_torch(self, out: torch.Tensor) -> None:
        """Every row of the batch (shared ones included) by torch ops. The rows are in the step's record
        already, so one that even they cannot read holds no element rather than whatever was there."""
        batch = self._batch
        pairs = [*enumerate(batch.rows), *zip(batch.shared_from, batch.shared_rows, strict=True)]
        for j, row in pairs:
            try:
                torch_ops.row(batch.tensors[j], out, row, self._eps)
            except Exception:
                log.debug("trainmon: torch ops could not read a batched tensor either", exc_info=True)
                empty = out[row]  # fill_ takes its number as a kernel argument: no copy, no sync
                empty.fill_(0.0)
                empty[MIN].fill_(float("inf"))
                empty[MAX].fill_(float("-inf"))

    def _launch_batch(self, changed: list[int]) -> None:
        """One launch over the batch's table of addresses, lengths and dtypes, as the hooks saw them (the
        table is uploaded each time: a training loop's tensors do not come back at the same addresses step
        after step, as measured on the GPU yardstick); an entry ``changed`` since (said once) is read as it is
        now. The descriptors of the batch's rows, shared ones included, are added as arrays."""
        batch = self._batch
        n, chunk = len(batch.numels), _tiling.chunk
        # every number goes straight into the two arrays the step keeps: the table (addresses, numels, first
        # blocks, dtype tags, the float64 zero threshold, then the tensor of each block) and the descriptors
        # (first partial row, partial rows, output row, numel) of each entry, then of each shared row
        desc = np.empty((n + len(batch.shared_rows), 4), dtype=np.int64)
        numels, chunks = desc[:n, 3], desc[:n, 1]
        numels[:] = batch.numels
        addresses = np.array(batch.addresses, dtype=np.int64)
        for j in changed:
            t = batch.tensors[j]
            addresses[j], numels[j] = t.data_ptr(), t.numel()
        np.floor_divide(numels + (chunk - 1), chunk, out=chunks)
        owner = np.repeat(np.arange(n, dtype=np.int64), chunks)
        count = len(owner)
        f32, f16, bf16, wide = _zero_thresholds(self._eps)
        table = np.empty(4 * n + 1 + count, dtype=np.int64)
        table[:n] = addresses
        table[n : 2 * n] = numels
        first_block = table[2 * n : 3 * n]
        np.cumsum(chunks, out=first_block)
        first_block -= chunks
        table[3 * n : 4 * n] = batch.codes
        table[4 * n] = wide
        table[4 * n + 1 :] = owner
        p0 = self._reserve(count)
        if count:
            tiling = _tiling
            name, extra = _variant("stats_batch", tiling, _aligned(addresses))
            launch(
                self._k,
                name,
                (count,),
                self.device,
                upload(torch.from_numpy(table), self.device),
                n,
                self._part,
                p0,
                f32,
                f16,
                bf16,
                BLOCK=tiling.block,
                CHUNK=tiling.chunk,
                num_warps=tiling.warps,
                enable_fp_fusion=True,
                **extra,
            )
        np.add(first_block, p0, out=desc[:n, 0])
        desc[:n, 2] = batch.rows
        if batch.shared_rows:
            desc[n:] = desc[batch.shared_from]
            desc[n:, 2] = batch.shared_rows
        self._desc_blocks.append(desc)

    def _say_late(self, sites: list[Any]) -> None:
        self._at_hook.update(sites)
        if not self._said_late:
            self._said_late = True
            name = getattr(sites[0], "name", sites[0])
            log.warning(
                "trainmon: %d tensor(s) changed in place after their hook, before their statistics were read "
                "(first: %s); this step's statistics of them are of the changed values, and from now on they "
                "are read at their hook",
                len(sites),
                name,
            )

    def rows(
        self,
        tensors: Sequence[torch.Tensor],
        out: torch.Tensor,
        first: int,
        eps: float,
        shareable: bool = False,
    ) -> None:
        """Rows ``first + i`` for ``tensors[i]``, tensors of this reducer's device (the step buffer's store
        of that device): one launch per dtype (``shareable``: a tensor still waiting in the batch is read
        once)."""
        if _unavailable is None:
            try:
                self._rows(tensors, out, first, eps, shareable)
                return
            except KernelFailed:
                pass
        # all of them (rows a launch already took are written twice, the same statistics)
        torch_ops.rows(tensors, out, first, eps)

    def _rows(
        self, tensors: Sequence[torch.Tensor], out: torch.Tensor, first: int, eps: float, shareable: bool
    ) -> None:
        batch = self._batch
        for dtype, members in self._by_dtype(tensors, out, first, eps).items():
            if shareable and self._learnt and batch.by_address:
                left = []
                for i in members if members is not None else range(len(tensors)):
                    # a tensor still waiting in the batch (a gradient hooked in backward)
                    j = batch.find(tensors[i], tensors[i].data_ptr())
                    if j is not None:
                        batch.shared_from.append(j)
                        batch.shared_rows.append(first + i)
                    else:
                        left.append(i)
                members = left
                if not members:
                    continue
            if members is None:  # every tensor, in order (the usual call: one dtype)
                xs = tensors if all([t.is_contiguous() for t in tensors]) else [readable(t) for t in tensors]
                rows = np.arange(first, first + len(tensors), dtype=np.int64)
            else:
                xs = [t if (t := tensors[i]).is_contiguous() else readable(t) for i in members]
                rows = first + np.array(members, dtype=np.int64)
            blocks = self._blocks(dtype, xs)
            p0 = self._launch_stats(dtype, blocks, eps)
            self._desc_blocks.append(
                np.stack((p0 + blocks.first_block, blocks.chunks, rows, blocks.numels), axis=1)
            )

    def merged_row(self, tensors: Sequence[torch.Tensor], out: torch.Tensor, index: int, eps: float) -> None:
        """One row with the statistics of the concatenation of ``tensors`` (a coalesced collective)."""
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) == 1 and all(self._takes(t) for t in tensors) and _unavailable is None:
            xs = [readable(t) for t in tensors]
            try:
                blocks = self._blocks(xs[0].dtype, xs)
                p0 = self._launch_stats(xs[0].dtype, blocks, eps)
                self._descs += (p0, blocks.count, index, blocks.total)
                return
            except KernelFailed:
                pass
        merge_rows_into(torch_ops.rows, tensors, out, index, eps)  # mixed dtypes (rare), or no kernels

    def adam_rows(self, items: Sequence[AdamItem], out: torch.Tensor, eps: float) -> None:
        """Rows of Adam's update and ratio for each item; one launch per dtype of the moments."""
        groups: dict[torch.dtype, list[AdamItem]] = {}
        for item in items:
            m, v = item.exp_avg, item.exp_avg_sq
            if (
                _unavailable is None
                and self._takes(m)
                and self._takes(v)
                and v.dtype == m.dtype
                and m.numel() == v.numel()
                and not isinstance(item.c1, torch.Tensor)
                and not isinstance(item.c2, torch.Tensor)
            ):
                groups.setdefault(m.dtype, []).append(item)
            else:
                torch_ops.adam_rows(*item.op_args(out, eps))
        for dtype, members in groups.items():
            try:
                self._launch_adam(dtype, members, eps)
            except KernelFailed:
                for item in members:
                    torch_ops.adam_rows(*item.op_args(out, eps))

    def complete(self, out: torch.Tensor) -> None:
        """Launch what waits in the batch and reduce every pending row into ``out`` (one launch); the rows
        are final in stream order."""
        self._flush(out)
        descs = self.pending_descriptors()
        count = len(descs)
        if not count:
            return
        part = self._part if self._part is not None else self._reserve_empty()
        try:
            if _unavailable is not None:
                raise KernelFailed("finalize")  # an earlier kernel failed: no stage-2 launch either
            launch(
                self._k,
                "finalize",
                (count,),
                self.device,
                upload(torch.from_numpy(descs.reshape(-1)), self.device),
                part,
                out,
                ROWS=_tiling.rows,
                num_warps=4,
                enable_fp_fusion=True,
            )
        except KernelFailed:
            finalize_with_torch(descs, part, out)
        self._descs = []
        self._desc_blocks = []
        self._used = 0

    def pending_descriptors(self) -> np.ndarray:
        """The descriptors of the rows launched and not completed yet, (n, DESC_WIDTH) int64 (any order: each
        names its output row)."""
        blocks = self._desc_blocks
        if self._descs:
            blocks = [*blocks, np.array(self._descs, dtype=np.int64).reshape(-1, self._k.DESC_WIDTH)]
        if not blocks:
            return np.empty((0, self._k.DESC_WIDTH), dtype=np.int64)
        return blocks[0] if len(blocks) == 1 else np.concatenate(blocks)

    def reset(self) -> None:
        """The step is over (its rows completed, or dropped): the next one starts empty. After the first step
        with rows that may wait in a batch, the tensors changed in place after their hook are known."""
        self._batch.clear()
        self._descs = []
        self._desc_blocks = []
        self._used = 0
        if self._seen_batchable:
            self._learnt = True

    # ----------------------------------------------------------------------------------------- launches
    def _reserve_empty(self) -> torch.Tensor:
        self._reserve(0)
        assert self._part is not None
        return self._part

    def _by_dtype(
        self, tensors: Sequence[torch.Tensor], out: torch.Tensor, first: int, eps: float
    ) -> dict[torch.dtype, list[int] | None]:
        """The tensors the kernels read, by dtype (on this device: :meth:`rows`); torch ops read the rest.
        ``{dtype: None}`` when the kernels read every tensor and all have one dtype (the usual call: whole
        columns are asked, not each tensor in turn)."""
        dtypes = [t.dtype for t in tensors]
        dtype = dtypes[0] if dtypes else None
        if (
            dtype in _KERNEL_DTYPES
            and dtypes.count(dtype) == len(dtypes)
            and all([t.layout is _STRIDED for t in tensors])
        ):
            return {dtype: None}
        groups: dict[torch.dtype, list[int] | None] = {}
        for i, t in enumerate(tensors):
            dtype = t.dtype
            if dtype in _KERNEL_DTYPES and t.layout is _STRIDED:
                group = groups.get(dtype)
                if group is None:
                    group = groups[dtype] = []
                group.append(i)
            else:
                torch_ops.row(t, out, first + i, eps)
        return groups

    def _blocks(self, dtype: torch.dtype, xs: Sequence[torch.Tensor]) -> _Blocks:
        """The tensor table of ``xs`` on the device and its layout, kept for the next step with the same
        addresses and lengths (a parameter set, optimizer state)."""
        chunk = _tiling.chunk
        addresses = np.array([x.data_ptr() for x in xs], dtype=np.int64)
        numels = np.array([x.numel() for x in xs], dtype=np.int64)
        key = ("stats", dtype, chunk, addresses.tobytes(), numels.tobytes())
        blocks = self._tables.get(key)
        if blocks is None:
            chunks, first_block, owner = _block_layout(numels, chunk)
            table = self._tables.upload((addresses, numels, first_block, owner))
            blocks = _Blocks(
                table, first_block, chunks, numels, int(chunks.sum()), int(numels.sum()), _aligned(addresses)
            )
            self._tables.put(key, blocks)
        return blocks

    def _launch_stats(self, dtype: torch.dtype, blocks: _Blocks, eps: float) -> int:
        p0 = self._reserve(blocks.count)
        if blocks.count:
            tiling = _tiling
            name, extra = _variant("stats_table", tiling, blocks.aligned)
            launch(
                self._k,
                name,
                (blocks.count,),
                self.device,
                blocks.table,
                len(blocks.numels),
                self._part,
                p0,
                zero_threshold_f32(dtype, eps),
                DTYPE=_tl_dtype(dtype),
                BF16=dtype == torch.bfloat16,
                BLOCK=tiling.block,
                CHUNK=tiling.chunk,
                num_warps=tiling.warps,
                enable_fp_fusion=True,
                **extra,
            )
        return p0

    def _launch_adam(self, dtype: torch.dtype, items: Sequence[AdamItem], eps: float) -> None:
        tiling = _tiling
        ms = [readable(item.exp_avg) for item in items]
        vs = [readable(item.exp_avg_sq) for item in items]
        numels = np.fromiter((m.numel() for m in ms), dtype=np.int64, count=len(ms))
        chunks, first_block, owner = _block_layout(numels, tiling.chunk)
        m_addr = np.fromiter((m.data_ptr() for m in ms), dtype=np.int64, count=len(ms))
        v_addr = np.fromiter((v.data_ptr() for v in vs), dtype=np.int64, count=len(vs))
        key = ("adam", dtype, tiling.chunk, m_addr.tobytes(), v_addr.tobytes(), numels.tobytes())
        table = self._tables.table(key, (m_addr, v_addr, numels, first_block, owner))
        # the bias corrections change every step: a small float table, uploaded each time
        hyper = np.empty(3 * len(items), dtype=np.float32)
        hyper[: len(items)] = [1.0 / float(item.c1) for item in items]
        hyper[len(items) : 2 * len(items)] = [1.0 / float(item.c2) for item in items]
        hyper[2 * len(items) :] = [float(item.adam_eps) for item in items]
        nblocks = int(chunks.sum())
        p0 = self._reserve(2 * nblocks)
        if nblocks:
            name, extra = _variant("adam_table", tiling, _aligned(m_addr) and _aligned(v_addr))
            launch(
                self._k,
                name,
                (nblocks,),
                self.device,
                table,
                upload(torch.from_numpy(hyper), self.device),
                len(items),
                nblocks,
                self._part,
                p0,
                zero_threshold_f32(torch.float32, eps),
                DTYPE=_tl_dtype(dtype),
                BF16=dtype == torch.bfloat16,
                BLOCK=tiling.block,
                CHUNK=tiling.chunk,
                num_warps=tiling.warps,
                enable_fp_fusion=True,
                **extra,
            )
        updates = np.fromiter((item.row_update for item in items), dtype=np.int64, count=len(items))
        ratios = np.fromiter((item.row_ratio for item in items), dtype=np.int64, count=len(items))
        self._desc_blocks.append(np.stack((p0 + first_block, chunks, updates, numels), axis=1))
        self._desc_blocks.append(np.stack((p0 + nblocks + first_block, chunks, ratios, numels), axis=1))


def finalize_with_torch(descs: np.ndarray, part: torch.Tensor, out: torch.Tensor) -> None:
    """Stage 2 with torch ops, for the step in which a kernel failed: reduce the partial rows of each
    descriptor (first, count, output row, numel) into its output row. Device ops on tables staged like the
    kernels' (no synchronisation); index_add_ sums in no fixed order, which only this one step sees."""
    device = part.device
    n = len(descs)
    first, counts, out_rows, numels = (descs[:, j] for j in range(4))
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    owner = np.repeat(np.arange(n, dtype=np.int64), counts)
    rows = np.repeat(first - starts, counts) + np.arange(int(counts.sum()), dtype=np.int64)
    host = torch.from_numpy(np.concatenate((owner, rows, out_rows)).astype(np.int64))
    tables = upload(host, device)
    k = len(owner)
    owner_t, rows_t, out_t = tables[:k], tables[k : 2 * k], tables[2 * k :]
    taken = part.index_select(0, rows_t)  # (rows, PARTIAL_WIDTH): nans, infs, zeros, min, max, sum, sumsq
    sums = torch.zeros((n, taken.shape[1]), dtype=_F64, device=device).index_add_(0, owner_t, taken)
    result = torch.empty((n, out.shape[1]), dtype=_F64, device=device)
    result[:, 0] = upload(torch.from_numpy(numels.astype(np.float64)), device)
    result[:, 1:4] = sums[:, 0:3]
    result[:, 4] = torch.full((n,), float("inf"), dtype=_F64, device=device).scatter_reduce_(
        0, owner_t, taken[:, 3], "amin"
    )
    result[:, 5] = torch.full((n,), float("-inf"), dtype=_F64, device=device).scatter_reduce_(
        0, owner_t, taken[:, 4], "amax"
    )
    result[:, 6:8] = sums[:, 5:7]
    out.index_copy_(0, out_t, result)

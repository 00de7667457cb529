"""``grad_probe`` for MindSpore: the PyTorch collector's gradient fingerprints, from MindSpore gradients.

At each collected step the monitor hands over the gradient tuple the optimizer is about to apply; per
selected parameter this computes, with MindSpore ops on the gradient's device, the same record as
:mod:`trainmon.collect.gradprobe` (format: :mod:`trainmon.run.gradprobe`): the 8 partials of
:func:`trainmon.mindspore.stats.partials_row`, at L2 the cumulative bin counts and exact zeros, at L1/L2 the
gradient at the sample positions of :mod:`trainmon.gradprobe.sampling` (the same positions as in a PyTorch
run for the same name and shape, or the same shape with ``sample_seed: shape``) and, with ``sign_bitmap``,
every element's sign packed as ``numpy.packbits`` packs it (all but the partials in one compiled graph per
shape and layout). Every piece is reinterpreted as bytes on the
device, the step's pieces are concatenated and read on the host once; the writer thread writes them with
the PyTorch monitor's :class:`~trainmon.gradprobe.writer.GradProbeSink`, so ``trainmon compare`` reads
both frameworks' runs alike.

Gradients that are missing, not a tensor or not of their parameter's shape (a sharded optimizer) are
skipped, the last with one warning.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import ops

from trainmon.config import GradProbe
from trainmon.gradprobe.sampling import sample_positions, sample_seed
from trainmon.gradprobe.writer import GradProbeSink, layout_for
from trainmon.mindspore.stats import partials_row
from trainmon.run.gradprobe import ParamLayout

logger = logging.getLogger("trainmon")

# numpy.packbits order: the first element of a byte is its most significant bit
_BIT_WEIGHTS = np.array([128, 64, 32, 16, 8, 4, 2, 1], dtype=np.uint8)
# dtypes MindSpore's comparison and gather kernels take on every backend; others (bfloat16: not on CPU) are
# compared and sampled in float32, which holds them exactly
_COMPARABLE = (ms.float32, ms.float16, ms.float64)
_no_grad = getattr(ms, "_no_grad", contextlib.nullcontext)  # private in MindSpore 2.x: see stats.py


def dtype_name(dtype: Any) -> str:
    """A MindSpore dtype spelled as torch spells it without ``torch.``: ``float32``, ``bfloat16``."""
    return str(dtype).lower()


def _comparable(flat: ms.Tensor) -> ms.Tensor:
    return flat if flat.dtype in _COMPARABLE else flat.astype(ms.float32)


def bin_counts(flat: ms.Tensor, bounds: Sequence[float]) -> ms.Tensor:
    """Elements ``<= b`` for each bound, then elements ``== 0``: a (B+1,) float64 device tensor."""
    x = _comparable(flat)
    counts = [(x <= float(b)).astype(ms.int32).sum() for b in bounds]
    counts.append((x == 0).astype(ms.int32).sum())
    return ops.stack(counts).astype(ms.float64)


def pack_signs(flat: ms.Tensor) -> ms.Tensor:
    """``flat > 0`` packed 8 elements a byte (numpy.packbits layout): a uint8 device tensor."""
    bits = (_comparable(flat) > 0).astype(ms.uint8)
    if int(bits.size) == 0:
        return ops.zeros(0, ms.uint8)
    pad = (-int(bits.size)) % 8
    if pad:
        bits = ops.concat((bits, ops.zeros(pad, ms.uint8)))
    return (bits.reshape(-1, 8) * ms.Tensor(_BIT_WEIGHTS)).sum(axis=1, dtype=ms.uint8)


def _as_bytes(x: ms.Tensor) -> ms.Tensor:
    """The bytes of a 1-D tensor, as a uint8 device tensor (a reinterpretation, no host copy)."""
    return x.view(ms.uint8)


def _device_pieces(
    flat: ms.Tensor, positions: ms.Tensor, bounds: tuple[float, ...], sample: bool, signs: bool
) -> tuple[ms.Tensor, ...]:
    """After the partials: the bin counts (when ``bounds``), the sample (float32) and the packed signs of a
    flat, comparable gradient, as device tensors."""
    out = []
    if bounds:
        out.append(bin_counts(flat, bounds))
    if sample:
        out.append(ops.gather(flat, positions, 0).astype(ms.float32))
    if signs:
        out.append(pack_signs(flat))
    return tuple(out)


_compiled_pieces = ms.jit(_device_pieces)


class _Kernel:
    """The compiled pieces (a graph per shape, dtype and layout: one launch instead of a dozen PyNative op
    dispatches of about 1 ms each on a CPU), or the same ops run eagerly once compiling failed (logged
    once)."""

    def __init__(self) -> None:
        self.compiled = True

    def __call__(self, flat: ms.Tensor, positions: ms.Tensor, layout: ParamLayout) -> tuple[ms.Tensor, ...]:
        args = (flat, positions, tuple(layout.bounds), layout.k > 0, layout.sign_bitmap)
        if self.compiled:
            try:
                return tuple(_compiled_pieces(*args))
            except Exception:
                self.compiled = False
                logger.warning(
                    "trainmon: the compiled grad_probe kernel failed for a %s %s gradient; fingerprints use "
                    "eager ops from now on (slower)",
                    tuple(flat.shape),
                    flat.dtype,
                    exc_info=True,
                )
        return _device_pieces(*args)


_kernel = _Kernel()


@dataclass
class _Plan:
    """One probed parameter: its name, shape, what its record holds, and its sample positions."""

    name: str
    shape: tuple[int, ...]
    config: GradProbe
    seed: int
    positions: np.ndarray
    _device_positions: ms.Tensor | None = None
    _layouts: dict[str, ParamLayout] = field(default_factory=dict)

    def positions_tensor(self) -> ms.Tensor:
        if self._device_positions is None:  # a placeholder when nothing is sampled (k = 0, no element)
            positions = self.positions if len(self.positions) else np.zeros(1, np.int64)
            self._device_positions = ms.Tensor(positions, ms.int64)
        return self._device_positions

    def layout(self, dtype: str) -> ParamLayout:
        layout = self._layouts.get(dtype)
        if layout is None:
            layout = self._layouts[dtype] = layout_for(
                self.config, self.name, 0, self.shape, dtype, self.seed, len(self.positions)
            )
        return layout


class MindSporeGradProbe:
    """Fingerprints of the gradients a MindSpore optimizer is about to apply.

    :meth:`configure` selects the parameters, :meth:`collect` takes a collected step's named gradients;
    :attr:`sink` goes to the writer thread."""

    def __init__(self, run_dir: str | Path, rank: int) -> None:
        self.sink = GradProbeSink(run_dir, rank)
        self._plans: dict[str, _Plan] = {}
        self._eps = 1e-8
        self._warned_shapes = False

    @property
    def names(self) -> list[str]:
        """The probed parameters, in the optimizer's order."""
        return list(self._plans)

    def configure(self, config: GradProbe, named_params: Sequence[tuple[str, Any]], eps: float) -> None:
        """Select the parameters (``param_list``: names or globs, matched against the monitored name and
        ``Parameter.name``; empty: all of ``named_params``, the optimizer's) and draw their positions."""
        self._eps = float(eps)
        self._plans = {}
        k = config.sample_size if config.grad_level != "L0" else 0
        for name, param in named_params:
            raw = getattr(param, "name", name)
            if config.param_list and not any(
                fnmatchcase(n, pattern) for pattern in config.param_list for n in (raw, name)
            ):
                continue
            shape = tuple(int(d) for d in param.shape)
            numel = int(np.prod(shape, dtype=np.int64))
            seed = sample_seed(name, shape, config.sample_seed)
            self._plans[name] = _Plan(name, shape, config, seed, sample_positions(numel, k, seed))
        if config.param_list and not self._plans:
            logger.warning("trainmon: grad_probe.param_list %s matches no parameter", list(config.param_list))

    def collect(self, step: int, named_grads: Sequence[tuple[str | None, Any]]) -> None:
        """Fingerprint the step's gradients (``(name, gradient)`` pairs; unknown names are ignored) and
        queue them for the writer. Never raises: a failure is logged and training goes on."""
        if not self._plans:
            return
        try:
            with _no_grad():
                self._collect(step, named_grads)
        except Exception:
            logger.exception("trainmon: grad_probe fingerprints of step %d failed; training continues", step)

    def _collect(self, step: int, named_grads: Sequence[tuple[str | None, Any]]) -> None:
        pieces: list[ms.Tensor] = []
        layouts: list[ParamLayout] = []
        for name, grad in named_grads:
            plan = self._plans.get(name) if name is not None else None
            if plan is None or not isinstance(grad, ms.Tensor):
                continue
            if tuple(grad.shape) != plan.shape:
                if not self._warned_shapes:
                    self._warned_shapes = True
                    logger.warning(
                        "trainmon: grad_probe: the gradient of %s has shape %s, the parameter %s (a sharded "
                        "optimizer?): such gradients are skipped",
                        name,
                        tuple(grad.shape),
                        plan.shape,
                    )
                continue
            layout = plan.layout(dtype_name(grad.dtype))
            flat = ops.stop_gradient(grad).reshape(-1)
            pieces.append(_as_bytes(partials_row(flat, self._eps)))
            if layout.bounds or layout.k or layout.sign_bitmap:
                extra = _kernel(_comparable(flat), plan.positions_tensor(), layout)
                pieces.extend(_as_bytes(t) for t in extra)
            layouts.append(layout)
        if not layouts:
            return
        host = np.array(ops.concat(pieces).asnumpy(), copy=True)  # the step's only device-to-host read
        self.sink.submit(step, tuple(layouts), host, None)

"""``grad_probe``: a fingerprint of each selected gradient at the optimizer pre-step (``trainmon compare``).

Per parameter and collected step, computed on the gradient's device with no host sync: the stats kernel's
partials, at L2 cumulative counts over the configured bounds plus exact zeros, at L1/L2 the gradient at a
fixed sample of positions (seeded by name and shape, so two runs sample the same elements) and, with
``sign_bitmap``, every element's sign packed at 1 bit. The step's fingerprints are concatenated into one byte
tensor and copied to the host once (non-blocking on accelerators); the writer thread writes them.

Sharded optimizers (a :class:`~trainmon.adapters.Shard` gradient: ZeRO, Megatron's distributed optimizer)
are not supported yet: such parameters are skipped with one warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from trainmon import stats
from trainmon.adapters import OptimizerAdapter, Shard
from trainmon.collect.base import guarded
from trainmon.config import GradProbe
from trainmon.device import copy_to_host, upload
from trainmon.gradprobe.sampling import sample_positions, sample_seed
from trainmon.gradprobe.writer import GradProbeSink, layout_for
from trainmon.joblog import job_wide
from trainmon.run.gradprobe import ParamLayout
from trainmon.run.records import N_PARTIALS
from trainmon.step.gate import GATE, is_plain
from trainmon.step.position import LoopPosition

if TYPE_CHECKING:
    from trainmon.stats.triton_fingerprints import TritonFingerprinter

logger = logging.getLogger("trainmon")

# numpy.packbits order: the first element of a byte is its most significant bit
_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
_bit_weights_on: dict[torch.device, torch.Tensor] = {}


def pack_signs(flat: torch.Tensor) -> torch.Tensor:
    """``flat > 0`` packed 8 elements a byte (numpy.packbits layout), with device ops."""
    bits = (flat > 0).to(torch.uint8)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat((bits, bits.new_zeros(pad)))
    weights = _bit_weights_on.get(bits.device)
    if weights is None:  # staged once per device, without synchronising it
        weights = _bit_weights_on[bits.device] = upload(_BIT_WEIGHTS, bits.device)
    return (bits.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def bin_counts(flat: torch.Tensor, bounds: Sequence[float]) -> torch.Tensor:
    """Elements ``<= b`` for each bound, then elements ``== 0``, as float64 on the device.

    Cumulative counts by comparison take a 1-byte temporary per pass, where bucketize would take 8 (or 4)
    bytes per element; NaN is in no count, so the reader derives each interval and the last one exactly."""
    counts = [(flat <= b).sum() for b in bounds]
    counts.append((flat == 0).sum())
    return torch.stack(counts).to(torch.float64)


@dataclass
class _Plan:
    """One probed parameter: its name, what its record holds, and its sample positions per device."""

    vpp_stage: int
    name: str
    param: torch.Tensor
    config: GradProbe
    seed: int
    positions: np.ndarray
    _on_device: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    _layouts: dict[torch.dtype, ParamLayout] = field(default_factory=dict)

    def positions_on(self, device: torch.device) -> torch.Tensor:
        t = self._on_device.get(device)
        if t is None:
            t = self._on_device[device] = upload(torch.from_numpy(self.positions), device)
        return t

    def layout(self, dtype: torch.dtype) -> ParamLayout:
        layout = self._layouts.get(dtype)
        if layout is None:
            layout = self._layouts[dtype] = layout_for(
                self.config,
                self.name,
                self.vpp_stage,
                tuple(self.param.shape),
                str(dtype).removeprefix("torch."),
                self.seed,
                len(self.positions),
            )
        return layout


class GradProbeCollector:
    """Fingerprints of the gradients the optimizer is about to apply, at each collected step.

    The monitor arms it for collected steps; armed, it holds a pre-step hook on the optimizer. Its
    :attr:`sink` goes to the writer thread."""

    def __init__(self, adapter: OptimizerAdapter, state: LoopPosition, run_dir: Path, rank: int) -> None:
        self._adapter = adapter
        self._state = state
        self.sink = GradProbeSink(run_dir, rank)
        self._plans: list[_Plan] = []
        self._eps = 1e-8
        self._handles: list = []
        self._positions: dict[tuple[int, int, int], np.ndarray] = {}  # kept across reloads
        self._warned_shards = False
        self._fingerprinters: dict[torch.device, TritonFingerprinter | None] = {}

    def configure(
        self, config: GradProbe, chunks: Sequence[nn.Module], rename: Callable[[str], str], eps: float
    ) -> None:
        """Select the parameters (``param_list``: names or globs; empty: every parameter the optimizer
        updates) and prepare their sample positions."""
        optimized = {id(p) for p in self._adapter.params()}
        self._eps = eps
        self._plans = []
        k = config.sample_size if config.grad_level != "L0" else 0
        for vpp, chunk in enumerate(chunks):
            for raw_name, param in chunk.named_parameters():
                name = rename(raw_name)
                if id(param) not in optimized:
                    continue
                if config.param_list and not any(
                    fnmatchcase(n, pattern) for pattern in config.param_list for n in (raw_name, name)
                ):
                    continue
                seed = sample_seed(name, param.shape, config.sample_seed)
                key = (param.numel(), k, seed)
                positions = self._positions.get(key)
                if positions is None:
                    positions = self._positions[key] = sample_positions(param.numel(), k, seed)
                self._plans.append(_Plan(vpp, name, param, config, seed, positions))
        if config.param_list and not self._plans:
            job_wide(logger).warning(
                "trainmon: grad_probe.param_list %s matches no parameter", list(config.param_list)
            )

    def arm(self) -> None:
        if not self._handles and self._plans:
            self._handles = self._adapter.register_step_hooks(self._pre_step, _nothing)

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre_step(self) -> None:
        if self._state.collecting:
            self._collect()

    def _fingerprinter(self, device: torch.device) -> TritonFingerprinter | None:
        """The Triton fingerprint kernels where the stats backend of ``device`` is Triton (one launch per
        part and dtype); None: the torch ops below."""
        if device not in self._fingerprinters:
            uses_triton = stats.backend_of(device, torch.float32) == "triton"
            if uses_triton:
                from trainmon.stats.triton_fingerprints import TritonFingerprinter

                self._fingerprinters[device] = TritonFingerprinter(device)
            else:
                self._fingerprinters[device] = None
        return self._fingerprinters[device]

    @guarded("grad_probe fingerprints")
    def _collect(self) -> None:
        taken: list[tuple[_Plan, torch.Tensor]] = []
        for plan in self._plans:
            grad = self._adapter.grad(plan.param)
            if grad is not None and not isinstance(grad, Shard) and not is_plain(grad):
                grad = GATE.piece(grad, f"grad_probe {plan.name!r}")  # a DTensor: its Shard
            if grad is None:
                continue
            if isinstance(grad, Shard):
                if not self._warned_shards:
                    self._warned_shards = True
                    job_wide(logger).warning(
                        "trainmon: grad_probe does not support sharded optimizers yet; %s is skipped",
                        plan.name,
                    )
                continue
            taken.append((plan, grad.detach()))
        if not taken:
            return
        device = taken[0][1].device
        grads = [g if g.device == device else g.to(device) for _, g in taken]
        layouts = [plan.layout(grad.dtype) for (plan, _), grad in zip(taken, grads, strict=True)]
        fingerprinter = self._fingerprinter(device)
        if fingerprinter is not None and fingerprinter.takes(grads):
            launched = fingerprinter.take(grads, layouts, [plan.positions for plan, _ in taken], self._eps)
            if launched is not None:  # else a kernel failed: the torch ops below
                buffer, assemble = launched
                host, ready = copy_to_host(buffer)
                self.sink.submit(self._state.step, tuple(layouts), host, ready, assemble)
                return
        partials = torch.empty((len(grads), N_PARTIALS), dtype=torch.float64, device=device)
        stats.partials_many_into(grads, partials, 0, self._eps)
        pieces: list[torch.Tensor] = []
        for i, ((plan, _), grad, layout) in enumerate(zip(taken, grads, layouts, strict=True)):
            flat = grad.reshape(-1)
            pieces.append(partials[i].view(torch.uint8))
            if layout.bounds:
                pieces.append(bin_counts(flat, layout.bounds).view(torch.uint8))
            if layout.k:
                sample = flat.index_select(0, plan.positions_on(device)).to(torch.float32)
                pieces.append(sample.view(torch.uint8))
            if layout.sign_bitmap:
                pieces.append(pack_signs(flat))
        host, ready = copy_to_host(torch.cat(pieces))
        self.sink.submit(self._state.step, tuple(layouts), host, ready)


def _nothing() -> None:
    pass

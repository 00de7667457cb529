"""Weight gradients, parameters and optimizer state, taken around the optimizer step."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from trainmon.adapters import OptimizerAdapter, Piece, Shard
from trainmon.collect.base import Guard, HookSlot, guarded
from trainmon.collect.fsdp2 import ShardedParams
from trainmon.device import is_dtensor
from trainmon.joblog import job_wide
from trainmon.run.records import Kind, Phase, Row
from trainmon.step.buffer import AdamMoments, StepBuffer
from trainmon.step.gate import GATE, is_dense
from trainmon.step.position import LoopPosition
from trainmon.step.timing import StepTimer

logger = logging.getLogger("trainmon")

_BACKWARD, _OPTIMIZER = Phase.BACKWARD.value, Phase.OPTIMIZER.value


@dataclass(frozen=True)
class ParamSite:
    vpp_stage: int
    name: str
    param: torch.Tensor


def _admitted(piece: Piece | None, what: str) -> Piece | None:
    """``piece`` as the gate admits it (trainmon.step.gate): a DTensor becomes this rank's Shard."""
    if piece is None or isinstance(piece, Shard) or is_dense(piece):
        return piece
    return GATE.piece(piece, what)


def _local(piece: Piece) -> torch.Tensor:
    return (piece.local if isinstance(piece, Shard) else piece).detach()


class UnreducedGradCollector:
    """``grad_unreduced``: the gradient as backward produced it (before any data-parallel reduction).

    Taken once per step on the last micro-batch (the gradient accumulated over the step's micro-batches),
    or on every micro-batch with ``monitor_mbs_grad``. FSDP2's parameters are the exception: FSDP2 holds no
    gradient of the whole step before its reduce-scatter (it reduces each micro-batch, or keeps the running
    sum apart in ``reduce_dtype`` under a ``MixedPrecisionPolicy``), so each micro-batch's own gradient is
    taken, as autograd hands it to the unsharded parameter: the same tensor in every dtype and
    accumulation mode, and a NaN of any micro-batch is seen.
    """

    def __init__(
        self,
        sites: Sequence[ParamSite],
        state: LoopPosition,
        buffer: StepBuffer,
        *,
        every_micro_step: bool,
        chunks: Sequence[nn.Module] = (),
    ) -> None:
        self._sites = [s for s in sites if s.param.requires_grad]
        self._state = state
        self._buffer = buffer
        self._every_micro_step = every_micro_step
        # FSDP2's parameters: their unreduced gradient goes to the unsharded parameter (collect.fsdp2), whose
        # hook is installed once FSDP2 has made it; ``_pending``: those not hooked yet
        self._fsdp = ShardedParams(chunks)
        if not self._fsdp.readable:
            job_wide(logger).warning(
                "trainmon: this torch's FSDP2 keeps its unsharded parameters where trainmon cannot find "
                "them; grad_unreduced of FSDP2 parameters is not recorded (grad_reduced is)"
            )
        self._pending = [s for s in self._sites if s.param in self._fsdp]
        self._checks: list[Callable[[], bool]] = []
        direct = [s for s in self._sites if s.param not in self._fsdp]
        if not self._fsdp.readable:  # FSDP2's parameters cannot be told from tensor parallelism's
            direct = [s for s in direct if not is_dtensor(s.param)]
        # one hook per parameter for the run, put back at each arm (HookSlot)
        self._slots = [
            HookSlot(functools.partial(s.param.register_post_accumulate_grad_hook, self._hook(s)))
            for s in direct
        ]
        self._armed = False

    def arm(self) -> None:
        if not self._armed:
            for slot in self._slots:
                slot.arm()
            self._armed = True
        # FSDP2's unsharded parameters: hooked when they exist (from the first all-gather on)
        self._checks = [check for check in self._checks if not check()]
        pending, self._pending = self._pending, []
        for site in pending:
            check = self._fsdp.when_unsharded(site.param, functools.partial(self._hook_unsharded, site))
            self._checks.append(check)

    def _hook_unsharded(self, site: ParamSite, unsharded: torch.Tensor) -> None:
        # a hook on the tensor itself: autograd calls it with the micro-batch's gradient before adding it
        slot = HookSlot(functools.partial(unsharded.register_hook, self._micro_batch_hook(site)))
        self._slots.append(slot)
        if self._armed:
            slot.arm()

    def disarm(self) -> None:
        for slot in self._slots:
            slot.disarm()
        self._armed = False

    def _hook(self, site: ParamSite) -> Callable[[torch.Tensor], None]:
        state, buffer, every = self._state, self._buffer, self._every_micro_step
        kind, name, vpp = Kind.GRAD_UNREDUCED.value, site.name, site.vpp_stage
        guard = Guard(f"grad hook of {site.name!r}")

        def hook(param: torch.Tensor) -> None:
            try:
                micro = state.backward_micro
                if not every and micro != state.expected_micro_steps - 1:
                    return
                grad = param.grad
                if grad is not None:
                    buffer.add(kind, name, vpp, micro if micro > 0 else 0, _BACKWARD, grad)
            except Exception as error:
                guard.failed(error)

        return hook


    def _micro_batch_hook(self, site: ParamSite) -> Callable[[torch.Tensor], None]:
        """The hook of an FSDP2 parameter: each micro-batch's own gradient (see the class docstring)."""
        state, buffer = self._state, self._buffer
        kind, name, vpp = Kind.GRAD_UNREDUCED.value, site.name, site.vpp_stage
        guard = Guard(f"grad hook of {site.name!r}")

        def hook(grad: torch.Tensor) -> None:
            try:
                micro = state.backward_micro
                buffer.add(kind, name, vpp, micro if micro > 0 else 0, _BACKWARD, grad)
            except Exception as error:
                guard.failed(error)

        return hook


class OptimizerCollector:
    """Hooks on the optimizer step: ``grad_reduced`` and ``param_origin`` before it; ``param_updated``,
    ``exp_avg``/``exp_avg_sq`` and ``update``/``ratio`` after it. The post hook also closes the step."""

    def __init__(
        self,
        adapter: OptimizerAdapter,
        state: LoopPosition,
        buffer: StepBuffer,
        on_step_end: Callable[[bool, str], None],
        on_boundary: Callable[[], str] | None = None,
    ) -> None:
        self._adapter = adapter
        # called before the update of a collected step; a non-empty reason keeps the update from landing
        self._on_boundary = on_boundary
        self._skip_reason = ""
        self._state = state
        self._buffer = buffer
        self._on_step_end = on_step_end
        self.timer: StepTimer | None = None  # marks the optimizer's start on timed steps
        self._optimized = {id(p) for p in adapter.params()}
        # DTensor parameters (FSDP2, TP) have DTensor moments, which the gate turns into shards
        self._dtensors = any(is_dtensor(p) for p in adapter.params())
        self.configure([], grads=False, params=False, moments=False, update_ratio=False, stats_eps=1e-8)
        self._warned_no_moments = False
        # registered once for the monitor's lifetime: the post hook is what ends a step
        self._handles = adapter.register_step_hooks(self._pre_step, self._post_step)

    def configure(
        self,
        sites: Sequence[ParamSite],
        *,
        grads: bool,
        params: bool,
        moments: bool,
        update_ratio: bool,
        stats_eps: float,
    ) -> None:
        """What to collect from now on (at attach, and when the config is reloaded between steps)."""
        self._sites = [s for s in sites if id(s.param) in self._optimized]
        self._names = [(s.vpp_stage, s.name) for s in self._sites]  # of every site, in order
        self._grads, self._params, self._moments, self._update_ratio = grads, params, moments, update_ratio
        self._stats_eps = stats_eps

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def state_of(self, site: ParamSite) -> list[tuple[str, torch.Tensor]]:
        """The parameter's tensors as they are now, between steps: value, gradient, Adam moments (this
        rank's pieces of sharded ones)."""
        moments = self._adapter.moments(site.param) or (None, None)
        pieces = [
            (Kind.PARAM_UPDATED.value, self._adapter.value(site.param)),
            (Kind.GRAD_REDUCED.value, self._adapter.grad(site.param)),
            (Kind.EXP_AVG.value, moments[0]),
            (Kind.EXP_AVG_SQ.value, moments[1]),
        ]
        admitted = [(kind, _admitted(piece, f"{kind} {site.name!r}")) for kind, piece in pieces]
        return [(kind, _local(piece)) for kind, piece in admitted if piece is not None]

    @property
    def sites(self) -> list[ParamSite]:
        return self._sites

    def _pre_step(self) -> bool:
        """True when the adapter must not apply this step's update (``alert.on_nan: skip``)."""
        timer = self.timer
        if timer is not None and timer.active:
            timer.optimizer_start()
        self._state.phase = _OPTIMIZER
        self._skip_reason = ""
        if self._state.collecting:
            self._collect_before()
            if self._on_boundary is not None:
                self._skip_reason = self._on_boundary()
        return bool(self._skip_reason)

    def _post_step(self) -> None:
        if self._state.collecting:
            self._collect_after()
        self._end_step()

    @guarded("step-boundary handling")
    def _end_step(self) -> None:
        reason, self._skip_reason = self._skip_reason, ""
        by_adapter = self._adapter.step_skipped()
        if by_adapter:  # the loss scaler found the overflow and skipped the step, as without the monitor:
            reason = ""  # an expected loss-scale skip, reported as one (see BoundaryCheck.settle)
        self._on_step_end(by_adapter or bool(reason), reason)

    @guarded("optimizer pre-step collection")
    def _collect_before(self) -> None:
        if self._grads:
            self._add(Kind.GRAD_REDUCED, self._adapter.grad)
        if self._params:
            self._add(Kind.PARAM_ORIGIN, self._adapter.value)

    @guarded("optimizer post-step collection")
    def _collect_after(self) -> None:
        if self._params:
            self._add(Kind.PARAM_UPDATED, self._adapter.value)
        if not (self._moments or self._update_ratio):
            return
        with_moments = [(s, m) for s in self._sites if (m := self._moments_of(s)) is not None]
        if not with_moments and not self._warned_no_moments:
            self._warned_no_moments = True
            if not self._sites:  # the optimizer may well keep them: no target chose a parameter it updates
                job_wide(logger).warning(
                    "trainmon: no target matches a parameter that %s updates; mv/ur statistics record "
                    "nothing (targets choose the parameters, as for wg_distribution)",
                    self._adapter.name,
                )
            else:
                job_wide(logger).warning(
                    "trainmon: %s keeps no exp_avg/exp_avg_sq state; mv/ur statistics are skipped",
                    self._adapter.name,
                )
        if self._moments:
            every = len(with_moments) == len(self._sites)
            for k, kind in enumerate((Kind.EXP_AVG, Kind.EXP_AVG_SQ)):
                if every:
                    self._hand_over(kind, self._names, [m[k] for _, m in with_moments])
                else:
                    held = {id(s): m for s, m in with_moments}
                    self._hand_over_some(
                        kind, [held[id(s)][k] if id(s) in held else None for s in self._sites]
                    )
        if self._update_ratio:
            self._add_update_ratio(with_moments)

    def _moments_of(self, site: ParamSite) -> tuple[Piece, Piece] | None:
        moments = self._adapter.moments(site.param)
        if moments is None or not self._dtensors:
            return moments
        avg = _admitted(moments[0], f"exp_avg {site.name!r}")
        avg_sq = _admitted(moments[1], f"exp_avg_sq {site.name!r}")
        return None if avg is None or avg_sq is None else (avg, avg_sq)

    def _add(self, kind: Kind, piece_of: Callable[[torch.Tensor], Piece | None]) -> None:
        """Rows of ``piece_of(param)`` for every site's parameter that has one."""
        pieces = [piece_of(s.param) for s in self._sites]
        if any(p is None for p in pieces):
            self._hand_over_some(kind, pieces)
        else:
            self._hand_over(kind, self._names, pieces)

    def _hand_over_some(self, kind: Kind, pieces: list[Piece | None]) -> None:
        """Rows of the sites' pieces where there is one (``pieces`` in the sites' order). A sharded
        parameter without one on this rank (its gradient is None here) keeps its place in the merge of its
        shards: other ranks may hold it, and every rank's merge must have the same layout."""
        kept: list[tuple[ParamSite, Piece]] = []
        for site, piece in zip(self._sites, pieces, strict=True):
            if piece is None:
                piece = self._absent(site)
            if piece is not None:
                kept.append((site, piece))
        self._hand_over(kind, [(s.vpp_stage, s.name) for s, _ in kept], [p for _, p in kept])

    def _absent(self, site: ParamSite) -> Shard | None:
        """The place in the merge of a tensor of ``site`` that this rank does not hold: shaped like the
        parameter's shard (its group), or None for a parameter that is not sharded (nothing to merge)."""
        value = _admitted(self._adapter.value(site.param), f"parameter {site.name!r}")
        if not isinstance(value, Shard):
            return None
        return Shard(value.local.new_empty(0), value.group, value.shape, absent=True)

    def _hand_over(self, kind: Kind, names: list[tuple[int, str]], pieces: list[Piece]) -> None:
        """To the step buffer: whole tensors in one call; shards of tensors split over ranks by their runs.
        The statistics read the tensors' memory, not their autograd graph: nothing is detached."""
        if not pieces:
            return
        if any([isinstance(p, Shard) for p in pieces]):  # a list: faster than a generator here
            self._buffer.add_pieces(kind.value, names, pieces, 0, _OPTIMIZER)
        else:
            self._buffer.add_many(kind.value, names, pieces, 0, _OPTIMIZER)

    def _add_update_ratio(self, with_moments: list[tuple[ParamSite, tuple[Piece, Piece]]]) -> None:
        """Update and ratio rows of every parameter: one batched call per (device, shard group), so that a
        fused kernel covers them all (one launch per dtype with Triton, one pass each on the CPU). A sharded
        parameter without moments on this rank keeps its two places in its group's merge."""
        moments_of = {id(s): m for s, m in with_moments}
        batches: dict[tuple[torch.device, int], tuple[object, bool, list]] = {}
        for site in self._sites:
            if id(site) not in moments_of:
                absent = self._absent(site) if len(moments_of) < len(self._sites) else None
                if absent is not None:
                    key = (absent.local.device, id(absent.group))
                    batches.setdefault(key, (absent.group, True, []))[2].append(None)
                continue
            avg_piece, avg_sq_piece = moments_of[id(site)]
            hparams = self._adapter.adam_bias_corrections(site.param)
            if hparams is None:
                continue
            c1, c2, adam_eps = hparams
            exp_avg, exp_avg_sq = _local(avg_piece), _local(avg_sq_piece)
            shape = avg_piece.shape if isinstance(avg_piece, Shard) and avg_piece.shape else exp_avg.shape
            rows = tuple(
                Row(kind, site.name, site.vpp_stage, 0, _OPTIMIZER, tuple(shape), exp_avg.dtype)
                for kind in (Kind.UPDATE.value, Kind.RATIO.value)
            )
            sharded = isinstance(avg_piece, Shard)
            group = avg_piece.group if sharded else None
            key = (exp_avg.device, id(group) if sharded else -1)
            batch = batches.setdefault(key, (group, sharded, []))
            batch[2].append((AdamMoments(exp_avg, exp_avg_sq, c1, c2, adam_eps), rows))
        for (device, _), (group, sharded, moments) in batches.items():
            start = 0
            while start < len(moments):  # runs of moments held here, and of places kept for the others
                held = moments[start] is not None
                end = start + 1
                while end < len(moments) and (moments[end] is not None) == held:
                    end += 1
                if held:
                    self._buffer.add_update_ratio(
                        device, moments[start:end], shard_group=group, sharded=sharded
                    )
                else:
                    self._buffer.mark_gap(group, device, 2 * (end - start))
                start = end

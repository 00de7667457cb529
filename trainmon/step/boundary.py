"""The step-boundary check: NaN/Inf known before the optimizer applies the update.

With ``alert.capture: exact`` or ``alert.on_nan: skip``, ``raise`` or ``exit`` the monitor reads the NaN/Inf
counters of the rows a collected step has produced so far (activations, their gradients, weight gradients,
parameters before the update, tracked scalars) in the optimizer's pre-step hook, with one small
device-to-host copy: the one synchronisation these options cost. On a non-finite value it

* ``capture: exact``: copies out, for this very step, the inputs and outputs of the module where the bad
  value appeared (held by reference since their hook fired, see :class:`HeldTensors`), the tracked scalars,
  and the gradients, parameters (as before the update) and Adam moments of the affected parameters;
* ``on_nan: skip``: tells the optimizer adapter not to apply the update (as loss scaling does on an fp16
  overflow), up to ``max_skips`` times in a run, then raises :class:`TrainingNaNError`;
* ``on_nan: raise`` / ``exit``: tells the adapter not to apply the update either (no limit); the monitor
  raises or exits when the step has ended, so the error reaches the caller with parameters and optimizer
  state as they were before the NaN step.

In a process group the decision is agreed over all ranks (one all-reduce of one number on the host, over
the monitor's own gloo group: :class:`trainmon.step.agree.RankAgreement`), so that every rank skips the same
steps: the ranks of a sharded optimizer must all take the same path through its step. When the other ranks
do not answer within ``sync_timeout_s`` (one has stopped stepping), skipping is switched off for the rest of
the run, said once: a rank that skipped alone would leave the model replicas apart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from trainmon.anomaly.alerts import TrainingNaNError
from trainmon.anomaly.rules import RuleEngine
from trainmon.config.rules import MaxRatioRule, Rule, ThresholdRule
from trainmon.device import copy_to_host
from trainmon.joblog import rank_note
from trainmon.run.records import INFS, NANS, NUMEL, Kind, Phase, Row, StepRecord
from trainmon.step.capture import Captured

logger = logging.getLogger("trainmon")

# rules decided from one step's values on this rank (max_ratio also from the maxima of earlier steps): the
# boundary read has everything they need, so an exact capture can be taken for them too
VALUE_RULES = (ThresholdRule, MaxRatioRule)
_HELD_KINDS = frozenset({Kind.ACTV.value, Kind.SCALAR.value})
_IO_PARTS = ("input", "output")


@dataclass
class _Held:
    row: Row
    tensor: torch.Tensor
    version: int


class HeldTensors:
    """References (not copies) to a collected step's forward activations and tracked scalars, kept from
    their hook to the boundary check and dropped right after it. Activation gradients are not held: they
    live only while backward needs them, and holding them all to the step end would cost as much memory as
    the activations themselves."""

    def __init__(self) -> None:
        self.items: dict[int, _Held] = {}

    def keep(self, index: int, row: Row, tensor: torch.Tensor) -> None:
        if row.kind in _HELD_KINDS:
            self.items[index] = _Held(row, tensor, tensor._version)

    def nbytes(self) -> int:
        """Bytes the held tensors keep alive (each storage counted once)."""
        seen: dict[int, int] = {}
        for held in self.items.values():
            storage = held.tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())


@dataclass(frozen=True)
class Verdict:
    """What the boundary check found in a step."""

    bad: bool = False
    skip: bool = False
    reason: str = ""  # e.g. "nan in actv layers.1.output"
    captured: list[Captured] = field(default_factory=list)


NO_ANOMALY = Verdict()


def module_of(row: Row) -> str | None:
    """The module an activation row belongs to (``layers.1`` for ``layers.1.input_1``), else None."""
    if row.kind not in (Kind.ACTV.value, Kind.ACTV_GRAD.value):
        return None
    module, _, part = row.name.rpartition(".")
    return module if module and part.startswith(_IO_PARTS) else None


class BoundaryCheck:
    """Runs in the optimizer's pre-step hook of collected steps (see the module docstring)."""

    def __init__(
        self,
        *,
        exact: bool,
        skip: bool,
        max_skips: int | None,
        agree: Callable[[int, str], int | None] | None = None,
        value_rules: Sequence[Rule] = (),
        admit: Callable[[Row, torch.Tensor], bool] | None = None,
    ) -> None:
        self.exact = exact
        # the dump caps (Capture.admit), checked before a tensor is copied
        self._admit = admit or (lambda row, tensor: True)
        self.skip = skip  # keep a NaN step's update from landing (on_nan: skip, raise, exit)
        self.max_skips = max_skips  # None: no limit (raise/exit end training at the first one anyway)
        self.skips = 0
        self._skipping = False  # the step now ending was skipped by this check
        self._previous_bad = False  # captures are taken at the onset of an anomaly, not while it lasts
        self._agree = agree  # (this rank's worst count, what) -> the worst over the ranks, None: no answer
        chosen = [r for r in value_rules if isinstance(r, VALUE_RULES)]
        # its own history, fed the same collected steps as the writer's engine: it only decides captures
        self._values = RuleEngine(chosen) if (exact and chosen) else None
        self.held: HeldTensors | None = None

    def start_step(self, collecting: bool) -> HeldTensors | None:
        """A fresh holder for a collected step (the step buffer feeds it), None otherwise."""
        self.held = HeldTensors() if (self.exact and collecting) else None
        return self.held

    def check(
        self,
        rows: Sequence[Row],
        read: Callable[[object], tuple[int, np.ndarray]],
        params_at_hand: Callable[[str, np.ndarray], list[tuple[Row, torch.Tensor]]],
        unmerged: Callable[[], np.ndarray] | None = None,
    ) -> Verdict:
        """``read()``: the step buffer's partials so far (:meth:`StepBuffer.partials_so_far`);
        ``params_at_hand(module, bad)``: the parameter-side tensors (kind-labelled rows and tensors) to dump
        for the origin ``module`` and the rows flagged in ``bad``; ``unmerged()``: the rows holding only this
        rank's shard of a tensor, which value rules must not judge. Raises TrainingNaNError when a skip would
        exceed ``max_skips``."""
        held, self.held = self.held, None
        onset = not self._previous_bad
        worst, partials = read()
        if self._agree is not None:
            agreed = self._agree(worst, "the NaN/Inf check of a step (alert.on_nan: skip)")
            if agreed is not None:
                worst = agreed
            else:  # no answer: decide alone from now on, and never skip alone
                self._agree = None
                if self.skip:
                    self.skip = False
                    logger.warning(
                        "trainmon: %salert.on_nan: skip is off from now on: the ranks cannot agree on which "
                        "steps to skip, so NaN/Inf steps are reported, not skipped",
                        rank_note(),
                    )
        if worst == 0:
            verdict = self._check_values(rows, partials, held if onset else None, params_at_hand, unmerged)
            self._previous_bad = verdict.bad
            return verdict
        self._previous_bad = True
        per_row = partials[:, [NANS, INFS]]
        bad = per_row.sum(axis=1) > 0
        reason = _reason(rows, per_row, bad)
        # a NaN that stays (weights gone NaN under on_nan: continue) would otherwise dump every step
        captured = self._capture(rows, bad, reason, held, params_at_hand) if self.exact and onset else []
        skip = False
        if self.skip:
            if self.max_skips is not None and self.skips >= self.max_skips:
                raise TrainingNaNError(
                    f"{reason or 'a NaN/Inf on another rank'}: the update would be skipped, but "
                    f"alert.max_skips={self.max_skips} steps were skipped already"
                )
            self.skips += 1
            self._skipping = skip = True
        return Verdict(True, skip, reason, captured)

    def _check_values(
        self,
        rows: Sequence[Row],
        partials: np.ndarray,
        held: HeldTensors | None,
        params_at_hand: Callable[[str, np.ndarray], list[tuple[Row, torch.Tensor]]],
        unmerged: Callable[[], np.ndarray] | None,
    ) -> Verdict:
        """A finite step: the threshold / max_ratio rules on the values so far. What they flag is captured
        like a NaN (never skipped: a large value is not a poisoned update)."""
        if self._values is None or not len(rows):
            return NO_ANOMALY
        if unmerged is not None and (shards := unmerged()).any():
            partials = partials.copy()
            partials[shards, NUMEL] = 0  # an empty row: no rule judges a part of a tensor
        found = self._values.evaluate(StepRecord(-1, -1, tuple(rows), partials, 0.0))
        if not found:
            return NO_ANOMALY
        bad = np.zeros(len(rows), dtype=bool)
        bad[[a.seq for a in found]] = True
        reason = f"{found[0].rule}: {found[0].message}"
        if held is None:  # the value was flagged at the step before too: captured then
            return Verdict(True, False, reason)
        return Verdict(True, False, reason, self._capture(rows, bad, reason, held, params_at_hand))

    def settle(self, skipped_for_nan: bool) -> None:
        """At the end of every step: whether the skip this check asked for stands as a NaN skip. It does not
        when the framework's loss scaler found the overflow and skipped the step itself (fp16 DeepSpeed or
        Megatron): that expected skip does not count against ``max_skips``."""
        if self._skipping and not skipped_for_nan:
            self.skips -= 1
        self._skipping = False

    def _capture(
        self,
        rows: Sequence[Row],
        bad: np.ndarray,
        reason: str,
        held: HeldTensors | None,
        params_at_hand: Callable[[str, np.ndarray], list[tuple[Row, torch.Tensor]]],
    ) -> list[Captured]:
        """Copies of what explains the step's first bad value, most telling first (the dump caps keep the
        first ones): the origin module's inputs and outputs (and its parent's when the first bad value is
        an input, which then came from the parent's own code), tracked scalars, then parameters."""
        first = int(np.argmax(bad)) if bad.any() else None
        modules: list[str] = []
        if first is not None and (module := module_of(rows[first])) is not None:
            modules.append(module)
            if rows[first].name.rpartition(".")[2].startswith("input") and "." in module:
                modules.append(module.rpartition(".")[0])
        label = f"exact: {reason}" if reason else "exact: NaN/Inf on another rank"
        taken: list[Captured] = []
        if held is not None:
            ordered = sorted(
                held.items.values(),
                key=lambda h: (_rank_of(h.row, modules), h.row.kind != Kind.ACTV.value),
            )
            for item in ordered:
                if _rank_of(item.row, modules) == len(modules) and item.row.kind != Kind.SCALAR.value:
                    continue  # an activation of another module
                note = ""
                if item.tensor._version != item.version:
                    note = (
                        f"modified in place after its hook (version {item.version} -> "
                        f"{item.tensor._version}): values as at the step boundary, not as the hook saw them"
                    )
                if self._admit(item.row, item.tensor):
                    host, ready = copy_to_host(item.tensor.detach())
                    taken.append(Captured(item.row, host, ready, label, note))
        origin = modules[-1] if modules else ""
        for row, tensor in params_at_hand(origin, bad):
            if self._admit(row, tensor):
                host, ready = copy_to_host(tensor.detach())
                taken.append(Captured(row, host, ready, label))
        return taken


def _rank_of(row: Row, modules: list[str]) -> int:
    """0 for the origin module's own rows, 1 for its parent's, len(modules) for anything else."""
    module = module_of(row)
    return modules.index(module) if module in modules else len(modules)


def _reason(rows: Sequence[Row], per_row: np.ndarray, bad: np.ndarray) -> str:
    if not bad.any():
        return ""
    first = int(np.argmax(bad))
    row = rows[first]
    what = "nan" if per_row[first, 0] > 0 else "inf"
    phase = "" if row.phase == Phase.FORWARD.value else f" ({row.phase})"
    return f"{what} in {row.kind} {row.name}{phase}"

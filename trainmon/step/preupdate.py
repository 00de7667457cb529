"""The check before the optimizer's update, across config edits: ``alert.capture: exact`` and ``alert.on_nan:
skip, raise, exit`` (the check itself: :mod:`trainmon.step.boundary`). It decides whether a NaN step's update
lands, and what an exact capture takes; ``raise`` and ``exit`` keep the update from landing as ``skip``
does, and training stops once the step has ended."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from trainmon.adapters import OptimizerAdapter
from trainmon.anomaly.alerts import TrainingNaNError
from trainmon.config import MonitorConfig
from trainmon.joblog import job_wide, rank_note
from trainmon.run.records import Row
from trainmon.step.agree import RankAgreement
from trainmon.step.boundary import BoundaryCheck
from trainmon.step.buffer import StepBuffer
from trainmon.step.capture import Capture, Captured

logger = logging.getLogger("trainmon")

__all__ = ["PreUpdateCheck"]


class Dumps(Protocol):
    """Where an exact capture's tensors come from and go (``trainmon.collect.dumping.StepDumps``)."""

    capture: Capture

    def params_at_hand(
        self, rows: Sequence[Row], module: str, bad: np.ndarray
    ) -> list[tuple[Row, torch.Tensor]]: ...

    def exact(self, step: int, captured: list[Captured]) -> None: ...


class PreUpdateCheck:
    """The check of the config in force (:attr:`check`, None when the config asks for none). ``dumps``: None
    when nothing is written (then nothing is captured); ``before_stopping()`` runs before ``max_skips``
    stops training (the writer's pending steps written)."""

    def __init__(
        self,
        run_dir: Path,
        adapter: OptimizerAdapter | None,
        agreement: RankAgreement,
        dumps: Dumps | None,
        before_stopping: Callable[[], None],
    ) -> None:
        self._run_dir, self._adapter, self._agreement, self._dumps = run_dir, adapter, agreement, dumps
        self._before_stopping = before_stopping
        self.check: BoundaryCheck | None = None

    def configure(self, config: MonitorConfig, every_rank: bool) -> None:
        """``every_rank``: every rank checks the same steps, so the ranks can agree on a skip."""
        alert = config.alert
        exact = alert.capture == "exact"
        action = alert.on_nan
        hold = action in ("skip", "raise", "exit")
        adapter = self._adapter
        if hold and adapter is not None and not adapter.skips_steps:
            why = adapter.skip_unsupported or f"not supported for {adapter.name}"
            if action == "skip":
                job_wide(logger).warning("trainmon: alert.on_nan: skip is off: %s", why)
            else:
                job_wide(logger).warning(
                    "trainmon: alert.on_nan: %s acts after the update of a NaN step, not before it: %s",
                    action,
                    why,
                )
            hold = False
        previous, self.check = self.check, None
        if not (exact or hold):
            return
        capture = self._dumps.capture if self._dumps is not None else None
        self.check = BoundaryCheck(
            exact=exact and capture is not None,
            skip=hold,
            max_skips=alert.max_skips if action == "skip" else None,
            agree=self._agreement.max if every_rank else None,
            value_rules=alert.evaluated_rules if exact else (),
            admit=capture.admit if capture is not None else None,
        )
        if previous is not None:
            self.check.skips = previous.skips  # a config reload does not reset the count

    def start_step(self, buffer: StepBuffer, collecting: bool) -> None:
        if self.check is not None:
            buffer.hold = self.check.start_step(collecting)

    def run(self, buffer: StepBuffer, step: int, closed: bool) -> str:
        """In the optimizer's pre-step of a collected step. Returns the reason the update must not land
        (``alert.on_nan`` skip, raise or exit), or "". Only TrainingNaNError (max_skips) leaves here."""
        check = self.check
        if check is None or closed:
            buffer.hold = None
            return ""
        dumps = self._dumps
        try:
            verdict = check.check(
                buffer.rows,
                buffer.partials_so_far,
                lambda module, bad: dumps.params_at_hand(buffer.rows, module, bad) if dumps else [],
                buffer.unmerged_rows,
            )
        except TrainingNaNError as e:
            self._before_stopping()
            raise TrainingNaNError(f"{e}; anomalies in {self._run_dir}") from None
        except Exception:  # the monitor's own fault: report it, let the step go on
            logger.exception(
                "trainmon: %sthe step-boundary NaN check failed; training continues", rank_note()
            )
            return ""
        finally:
            buffer.hold = None  # activations are not kept past the check
        if verdict.captured and dumps is not None:
            dumps.exact(step, verdict.captured)
        if not verdict.skip:
            return ""
        # the warning waits for the step's end: under fp16 loss scaling the framework may find the overflow
        # and skip the step itself, and then it is no NaN skip (BoundaryCheck.settle)
        return verdict.reason or "NaN/Inf on another rank"

    def settle(self, step: int, skip_reason: str, on_nan: str) -> None:
        """At the end of every step: the skip asked for stands as a NaN skip (``skip_reason``), or not."""
        check = self.check
        if check is None:
            return
        check.settle(bool(skip_reason))
        if skip_reason and on_nan == "skip":
            logger.warning(
                "trainmon: %sstep %d: %s; the update is skipped (alert.on_nan: skip, %d of max_skips %d)",
                rank_note(),
                step,
                skip_reason,
                check.skips,
                check.max_skips,
            )

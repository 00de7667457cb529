"""Dumps of a monitor's steps: the tensors the hooks copied (``trainmon.step.capture``), the parameter side's
tensors at hand for a request or an anomaly, and what the pre-update check captured (``alert.capture:
exact``), all handed to the dump sink, which saves them on the writer thread."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase
from pathlib import Path

import numpy as np
import torch

from trainmon.collect.params import OptimizerCollector
from trainmon.device import copy_to_host
from trainmon.run.layout import step_dumps_dir
from trainmon.run.records import Kind, Phase, Row
from trainmon.step.capture import Capture, Captured, DumpSink

logger = logging.getLogger("trainmon")

__all__ = ["StepDumps"]


class StepDumps:
    """The tensors taken for dumps (:attr:`capture`, on the training thread) and their sink (:attr:`sink`,
    on the writer thread). :attr:`note_exact` ``(step, folder)`` tells the anomaly records where an exact
    capture went (set once the anomaly sink exists)."""

    def __init__(self, run_dir: Path, rank: int, optimizer: OptimizerCollector | None) -> None:
        self._run_dir, self._rank, self._optimizer = run_dir, rank, optimizer
        self.capture, self.sink = Capture(run_dir, rank), DumpSink(run_dir, rank)
        self.note_exact: Callable[[int, str], None] | None = None

    def step_end(self, step: int) -> None:
        """A collected step ends: the tensors at hand for fresh requests, then what the hooks copied."""
        try:
            self._tensors_at_hand(step)
        except Exception:  # a dump must never keep the step from ending
            logger.exception("trainmon: dumping the tensors at hand failed; training continues")
        self.sink.add(step, self.capture.finish_step())

    def _tensors_at_hand(self, step: int) -> None:
        """For anomalies flagged since the last boundary: the matching parameters, gradients and Adam state
        as they are now, saved with this step (their activations follow at their next occurrence)."""
        requests = self.capture.pop_fresh_triggers()
        collector = self._optimizer
        if not requests or collector is None:
            return
        taken = []
        for site in collector.sites:
            request = next((r for r in requests if fnmatchcase(site.name, r.name)), None)
            if request is None:
                continue
            for kind, tensor in collector.state_of(site):
                row = Row(
                    kind, site.name, site.vpp_stage, 0, Phase.OPTIMIZER.value, tensor.shape, tensor.dtype
                )
                if not self.capture.admit(row, tensor):  # the dump caps, before any copy
                    continue
                host, ready = copy_to_host(tensor)
                taken.append(Captured(row, host, ready, f"request {request.id} (at hand)"))
        self.sink.add(step, taken)

    def params_at_hand(
        self, rows: Sequence[Row], module: str, bad: np.ndarray
    ) -> list[tuple[Row, torch.Tensor]]:
        """Parameter-side tensors for an exact dump: those of the origin ``module``'s own parameters and of
        parameters with a flagged row, as they are before the update (value as ``param_origin``)."""
        optimizer = self._optimizer
        if optimizer is None:
            return []
        flagged = {row.name for row, is_bad in zip(rows, bad, strict=True) if is_bad}
        prefix = f"{module}." if module else None
        taken = []
        for site in optimizer.sites:
            if not (site.name in flagged or (prefix and site.name.startswith(prefix))):
                continue
            for kind, tensor in optimizer.state_of(site):
                if kind == Kind.PARAM_UPDATED.value:
                    kind = Kind.PARAM_ORIGIN.value  # the update has not been applied yet
                row = Row(
                    kind, site.name, site.vpp_stage, 0, Phase.OPTIMIZER.value, tensor.shape, tensor.dtype
                )
                taken.append((row, tensor))
        return taken

    def exact(self, step: int, captured: list[Captured]) -> None:
        """What the pre-update check captured at ``step``."""
        self.sink.add(step, captured)
        folder = step_dumps_dir(self._run_dir, step, self._rank).relative_to(self._run_dir)
        if self.note_exact is not None:
            self.note_exact(step, folder.as_posix())

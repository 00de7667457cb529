"""The gradient norm a loop logs before it clips (Hugging Face's ``train/grad_norm``), beside trainmon's
``step/grad_norm`` of the gradients the update uses (after clipping)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from trainmon.joblog import rank_note

logger = logging.getLogger("trainmon")

NAME = "grad_norm_before_clip"
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class NormBeforeClipping:
    """Tracks ``grad_norm_before_clip`` once a step: when the backward pass of the step's last micro-batch
    ends, before the loop clips, with the function torch's ``clip_grad_norm_`` computes its total norm with
    (so the value is the one the loop logs). Device operations only: no host sync. The loop's callback says
    which micro-batch runs (``micro``)."""

    def __init__(self, model: nn.Module, monitor: Any, micro_batches: int) -> None:
        self._monitor, self._last = monitor, max(1, micro_batches) - 1
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self._params]
        self.micro = 0
        self._queued = False
        self._failed = False

    def _accumulated(self, param: torch.Tensor) -> None:
        if self.micro == self._last and not self._queued:
            self._queued = True
            _queue_callback(self._backward_done)  # runs when this backward pass is done

    def _backward_done(self) -> None:
        self._queued = False
        try:
            grads = [p.grad for p in self._params if p.grad is not None]
            if grads:
                self._monitor.track(NAME, torch.nn.utils.get_total_norm(grads))
        except Exception:  # the monitor's own fault: said once, training goes on
            if not self._failed:
                self._failed = True
                logger.exception("trainmon: %sthe gradient norm before clipping failed", rank_note())

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

"""Lightning's ``Trainer``, in one line::

    trainer = L.Trainer(..., callbacks=[TrainmonCallback(config="monitor.yaml")])

At ``on_train_start`` the callback attaches to the module that runs and to the Trainer's torch optimizer,
with ``accumulate_grad_batches`` and Lightning's step numbers (``trainer.global_step`` when the step
starts, the step its logged metrics carry). The module that runs: a LightningModule's ``training_step``
usually calls the network it holds (``self.model(...)``), not the LightningModule's own ``forward``, so
where one child module holds every trainable parameter that child is watched (its rows are named as in a
plain run of it); else the LightningModule itself. The loss: the watched module's output ``loss`` where it
has one (a Hugging Face model), else the loss Lightning hands ``on_before_backward`` times the accumulation
steps (Lightning divides it by them). Automatic optimization runs the last micro-batch inside
``optimizer.step(closure)``: trainmon reads the gradients and decides on NaN after that closure's backward.
The run directory is ``<logger's log_dir or default_root_dir>/trainmon``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from torch import nn

import trainmon
from trainmon.loops.loss import output_loss, track_output_loss

logger = logging.getLogger("trainmon")


def module_that_runs(pl_module: nn.Module) -> nn.Module:
    """The one child holding every trainable parameter of ``pl_module``, else ``pl_module`` itself."""
    trainable = {id(p) for p in pl_module.parameters() if p.requires_grad}
    for child in pl_module.children():
        if trainable and {id(p) for p in child.parameters() if p.requires_grad} == trainable:
            return child
    return pl_module


class TrainmonCallback(Callback):
    """trainmon in a Lightning Trainer: ``config`` and ``overrides`` as for :func:`trainmon.attach`;
    ``logdir`` replaces the run directory. ``monitor`` is the running ``Monitor``."""

    def __init__(self, config: Any = None, logdir: str | os.PathLike | None = None, **overrides: Any) -> None:
        self._config, self._logdir, self._overrides = config, logdir, overrides
        self.monitor: trainmon.Monitor | None = None
        self._loss_hook: Any = None
        self._output_loss = False
        self._accumulate = 1

    def run_dir(self, trainer: Any) -> Path:
        if self._logdir is not None:
            return Path(self._logdir)
        log_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
        return Path(log_dir or trainer.default_root_dir) / "trainmon"

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None:
            self._close()
        if len(trainer.optimizers) > 1:
            logger.warning(
                "trainmon: the Trainer has %d optimizers; the first one is watched", len(trainer.optimizers)
            )
        model = module_that_runs(pl_module)
        self._accumulate = trainer.accumulate_grad_batches
        self.monitor = trainmon.attach(
            model,
            trainer.optimizers[0] if trainer.optimizers else None,
            config=self._config,
            logdir=self.run_dir(trainer),
            grad_acc_steps=self._accumulate,
            start_iteration=trainer.global_step,
            **self._overrides,
        )
        self._output_loss = False

        def seen(module: nn.Module, args: Any, output: Any) -> None:
            self._output_loss = self._output_loss or output_loss(output) is not None

        self._loss_hook = [track_output_loss(model, self.monitor), model.register_forward_hook(seen)]

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.monitor is not None and not self._output_loss:
            self.monitor.track("loss", loss.detach() * self._accumulate)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        for handle in self._loss_hook or ():
            handle.remove()
        self._loss_hook = None
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None

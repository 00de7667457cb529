"""Hugging Face's ``Trainer`` (and anything built on it, such as TRL's trainers), in one line::

    trainer = Trainer(model, args, ..., callbacks=[TrainmonCallback(config="monitor.yaml")])

At ``on_train_begin`` the callback attaches to the model the Trainer trains and to the torch optimizer
inside Accelerate's ``AcceleratedOptimizer``, with the Trainer's gradient accumulation steps and its step
numbers (trainmon's step N is the update after which ``state.global_step`` is N, as in the Trainer's own
logs). Beside trainmon's ``step/grad_norm`` (the gradients the update uses, after clipping) the Trainer's
own ``grad_norm`` (before clipping) is tracked as ``grad_norm_before_clip``. The run directory is beside
the Trainer's TensorBoard run: ``<output_dir>/trainmon``, or under ``$TENSORBOARD_LOGGING_DIR`` or
``logging_dir`` where they are set. The loss is the model output's ``loss`` of each micro-batch, unscaled.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

import trainmon
from trainmon.loops.gradnorm import NormBeforeClipping
from trainmon.loops.loss import track_output_loss


class TrainmonCallback(TrainerCallback):
    """trainmon in a Trainer: ``config`` and ``overrides`` as for :func:`trainmon.attach`; ``logdir`` replaces
    the run directory chosen from the Trainer's arguments. ``monitor`` is the running ``Monitor``."""

    def __init__(self, config: Any = None, logdir: str | os.PathLike | None = None, **overrides: Any) -> None:
        self._config, self._logdir, self._overrides = config, logdir, overrides
        self.monitor: trainmon.Monitor | None = None
        self._loss_hook: Any = None
        self._norm: NormBeforeClipping | None = None

    def run_dir(self, args: Any) -> Path:
        """Beside the Trainer's TensorBoard run, so that one ``tensorboard --logdir`` shows both."""
        if self._logdir is not None:
            return Path(self._logdir)
        base = (
            os.environ.get("TENSORBOARD_LOGGING_DIR") or getattr(args, "logging_dir", None) or args.output_dir
        )
        return Path(base) / "trainmon"

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        if self.monitor is not None:  # a second train() call with the same callback: a new monitor
            self._close()
        self.monitor = trainmon.attach(
            model,
            optimizer,
            config=self._config,
            logdir=self.run_dir(args),
            grad_acc_steps=args.gradient_accumulation_steps,
            start_iteration=state.global_step + 1,
            **self._overrides,
        )
        self._loss_hook = track_output_loss(model, self.monitor)
        self._norm = NormBeforeClipping(model, self.monitor, args.gradient_accumulation_steps)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._norm is not None:
            self._norm.micro = 0

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._norm is not None:
            self._norm.micro += 1

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def _close(self) -> None:
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = None
        if self._norm is not None:
            self._norm.remove()
            self._norm = None
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None

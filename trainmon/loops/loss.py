"""The loss of each micro-batch, taken from the model's own output (Hugging Face's ``ModelOutput.loss``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def output_loss(output: Any) -> torch.Tensor | None:
    """``output.loss`` of a ``ModelOutput`` (or a dict's ``"loss"``) when it is a tensor, else None."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def track_output_loss(model: nn.Module, monitor: Any, name: str = "loss") -> Any:
    """A forward hook on ``model`` that tracks the loss its output carries, per micro-batch and unscaled
    (the step's row is their mean, what the loop logs). Returns the hook's handle."""

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if module.training:
            loss = output_loss(output)
            if loss is not None:
                monitor.track(name, loss)

    return model.register_forward_hook(hook)

"""torchtitan's Trainer: ``trainmon.attach(trainer, config=...)`` after the Trainer is built, before
``trainer.train()``.

The Trainer is recognised by class name, so importing trainmon never imports torchtitan. Everything comes
from it: the model parts (one, or a pipeline stage's several), its ``OptimizersContainer`` (each parameter's
Adam state is read from the inner optimizer that updates it, see :mod:`trainmon.adapters.torch_optim`),
the micro-batches of a step (gradient accumulation times pipeline micro-batches) and the steps it has
trained. Parameters, gradients and Adam moments are FSDP2/TP DTensors, read as whole tensors.
"""

from __future__ import annotations

from typing import Any

from trainmon.adapters import Resolved, register_framework


def is_torchtitan_trainer(model: Any, optimizer: Any = None) -> bool:
    """A ``torchtitan.trainer.Trainer`` (or a subclass, e.g. a model's own trainer), without importing it."""
    return any(
        cls.__name__ == "Trainer" and cls.__module__.startswith("torchtitan.") for cls in type(model).__mro__
    )


@register_framework("torchtitan", is_torchtitan_trainer)
def resolve_trainer(trainer: Any, optimizer: Any = None) -> Resolved:
    """The model parts and ``trainer.optimizers`` (an ``optimizer`` argument is ignored: it is that one
    anyway). Steps count from ``trainer.step``: torchtitan loads a checkpoint inside ``train()``, so a
    resumed run passes ``start_iteration`` (the checkpoint's step) to ``attach``."""
    from trainmon.adapters.torch_optim import TorchOptimizerAdapter

    micro_batches = int(trainer.gradient_accumulation_steps)
    if trainer.parallel_dims.pp_enabled:
        # a pipeline schedule runs every stage's micro-batches inside each accumulation step
        micro_batches *= int(trainer.num_pipeline_parallel_microbatches)
    return Resolved(
        chunks=tuple(trainer.model_parts),
        optimizer=TorchOptimizerAdapter(trainer.optimizers),
        grad_acc_steps=micro_batches,
        start_iteration=int(trainer.step),
    )

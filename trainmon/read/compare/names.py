"""Tensor names as two runs of one model may spell them: the same tensor behind other wrappers, in another
framework.

Two canonical forms, tried in this order after the exact name:

- :func:`unwrapped`: without what wraps a model and not the model itself: a model chunk's ``<n>:`` (several
  virtual pipeline stages), leading ``module.`` (DistributedDataParallel, DeepSpeed, Megatron's
  ``Float16Module`` and DDP: ``module.module.``), and anywhere in the path the wrappers of ``torch.compile``
  (``_orig_mod``), FSDP (``_fsdp_wrapped_module``), activation checkpointing
  (``_checkpoint_wrapped_module``) and Lightning/DeepSpeed (``_forward_module``); empty segments
  (``layers.0..fc``, a trailing ``.``) are dropped;
- :func:`spelled`: also a parameter's last segment as PyTorch spells it where MindSpore spells it otherwise:
  ``gamma``/``beta`` (LayerNorm, BatchNorm) are ``weight``/``bias``, ``moving_mean``/``moving_variance`` are
  ``running_mean``/``running_var``, ``embedding_table`` (Embedding) is ``weight``.
"""

from __future__ import annotations

import re

from trainmon.read.compare.tensors import PARAM_KINDS

__all__ = ["spelled", "unwrapped"]

_CHUNK = re.compile(r"^\d+:")
_WRAPPERS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module"})
_LEADING = "module"
_MINDSPORE = {
    "gamma": "weight",
    "beta": "bias",
    "moving_mean": "running_mean",
    "moving_variance": "running_var",
    "embedding_table": "weight",
}


def _segments(name: str) -> list[str]:
    parts = [p for p in _CHUNK.sub("", name, count=1).split(".") if p]
    parts = [p for p in parts if p not in _WRAPPERS]
    while len(parts) > 1 and parts[0] == _LEADING:
        parts.pop(0)
    return parts


def unwrapped(name: str) -> str:
    """``name`` without model wrappers and chunk prefix."""
    return ".".join(_segments(name))


def spelled(kind: str, name: str) -> str:
    """:func:`unwrapped`, and a parameter's MindSpore spelling as PyTorch's."""
    parts = _segments(name)
    if kind in PARAM_KINDS and parts:
        parts[-1] = _MINDSPORE.get(parts[-1], parts[-1])
    return ".".join(parts)

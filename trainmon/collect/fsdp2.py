"""Where FSDP2 (``fully_shard``) keeps a parameter's gradient before its reduce-scatter.

FSDP2 replaces each parameter by a sharded DTensor that autograd never sees: forward and backward run on an
unsharded ``nn.Parameter`` of the full shape that FSDP2 all-gathers, and the gradient of this rank's batch
lands there before FSDP2 reduce-scatters it into the sharded parameter's ``.grad``. A gradient hook on the
sharded parameter therefore sees the *reduced* shard; ``grad_unreduced`` is read from the unsharded one.
That parameter is made at FSDP2's first all-gather (in the module's first forward) and kept afterwards
(FSDP2 frees and re-allocates its storage, not the object), so its hook is installed once it exists.

torch has no public name for it: this module reads FSDP2's private state (``_get_fsdp_state``,
``fsdp_params``, ``_unsharded_param``, torch 2.6-2.13) and says once when a torch lacks it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("trainmon")


class ShardedParams:
    """The FSDP2 parameters of some model chunks: which module all-gathers each one, and its unsharded
    parameter once it exists."""

    def __init__(self, chunks: Sequence[nn.Module]) -> None:
        self._owner: dict[int, tuple[nn.Module, Any]] = {}  # id(sharded param) -> (FSDP module, FSDPParam)
        self.readable = True
        for chunk in chunks:
            for module in chunk.modules():
                state_of = getattr(module, "_get_fsdp_state", None)
                if state_of is None:
                    continue
                try:
                    group = state_of()._fsdp_param_group
                    params = group.fsdp_params if group is not None else []
                    for fsdp_param in params:
                        self._owner[id(fsdp_param.sharded_param)] = (module, fsdp_param)
                except Exception:  # another torch's FSDP2 internals
                    self.readable = False

    def __contains__(self, param: torch.Tensor) -> bool:
        return id(param) in self._owner

    def unsharded(self, param: torch.Tensor) -> torch.Tensor | None:
        """The parameter autograd accumulates ``param``'s gradient into, or None before its first
        all-gather."""
        _, fsdp_param = self._owner[id(param)]
        return getattr(fsdp_param, "_unsharded_param", None)

    def when_unsharded(self, param: torch.Tensor, then: Callable[[torch.Tensor], None]) -> Callable[[], bool]:
        """``then(unsharded)`` now if it exists, else right after FSDP2 first all-gathers ``param`` (a
        forward pre-hook behind FSDP2's own, which it puts first). Returns a check to call again later (at
        each arm): it runs ``then`` if that has not happened yet and the parameter exists by now, and says
        whether ``then`` ran. A module compiled in place traces its hooks: the pre-hook then does nothing
        (dynamo cannot trace its side effects), and the check finds the parameter at the next step."""
        done = False
        handle: Any = None

        def check() -> bool:
            nonlocal done
            if not done:
                unsharded = self.unsharded(param)
                if unsharded is not None:
                    done = True
                    if handle is not None:
                        handle.remove()
                    then(unsharded)
            return done

        def once(mod: nn.Module, args: Any) -> None:
            if not torch.compiler.is_compiling():
                check()

        if not check():
            module, _ = self._owner[id(param)]
            handle = module.register_forward_pre_hook(once)
        return check

"""What the ranks of a process group agree on between steps: config edits and the NaN check of
``alert.on_nan: skip``.

Both must come out the same on every rank, at the same step: ranks that collect different steps, or skip
different updates, issue different collectives (a sharded optimizer's merge, the skip agreement itself,
DDP's gradient all-reduce on a skipped step) and the job dies of a collective mismatch. So they are decided
by small collectives on a gloo group of the monitor's own, created with every rank the first time it is
needed (at attach when a config file is watched or a skip may have to be agreed):

* CPU tensors only: no accelerator is synchronised for an agreement, whatever the job's backend is;
* the monitor's calls never share a sequence number with the job's groups (the anomaly ordering counts the
  default group's collectives) and never go through the ``cc_distribution`` wrappers;
* a bounded wait (``sync_timeout_s``): a rank that stopped stepping (hung, killed, far behind) costs the
  others that long once, not the process group's timeout at every step. Past it this rank stops agreeing
  for good and says so once; the group is not used again, so a peer that comes back times out on the same
  call and stops too: every rank gives up at the same agreement.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("trainmon")
_DISTRIBUTED = dist.is_available()

__all__ = ["RankAgreement"]


class RankAgreement:
    """The monitor's agreements with the other ranks of the default process group (see the module
    docstring). With no process group, or one rank, every call answers at once from this rank alone."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self._group: Any = None
        self.broken: str | None = None  # why this rank stopped agreeing (said once)

    @staticmethod
    def _world() -> tuple[int, int]:
        if _DISTRIBUTED and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    @property
    def shared(self) -> bool:
        """A process group of several ranks is up and the ranks still agree (not :attr:`broken`)."""
        return self.broken is None and self._world()[1] > 1

    @property
    def leader(self) -> bool:
        """Rank 0 (or a single process): the rank whose reading of the config file counts."""
        return self._world()[0] == 0

    def ready(self, what: str) -> bool:
        """Create the group when a process group of several ranks is up; every rank calls this at the same
        point (attach, a step boundary). False when there is nothing to agree with or agreeing failed."""
        if not self.shared:
            return False
        if self._group is None:
            try:
                self._group = dist.new_group(
                    backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s)
                )
            except Exception as e:  # no gloo in this build, a peer that never attaches, ...
                self._fail(what, e)
                return False
        return True

    def max(self, value: int, what: str) -> int | None:
        """The largest ``value`` over the ranks; None when the ranks did not answer within the timeout."""
        if not self.ready(what):
            return None if self.broken is not None else value
        tensor = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        return int(tensor[0]) if self._run(lambda: self._group.allreduce([tensor], options), what) else None

    def broadcast(self, tensor: torch.Tensor, what: str) -> bool:
        """Rank 0's ``tensor`` (CPU, same shape on every rank) into every rank's; False when it failed."""
        if not self.ready(what):
            return self.broken is None
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        return self._run(lambda: self._group.broadcast([tensor], options), what)

    def _run(self, start: Any, what: str) -> bool:
        try:
            start().wait()
        except Exception as e:  # a timeout, a peer gone: gloo raises RuntimeError
            self._fail(what, e)
            return False
        return True

    def _fail(self, what: str, error: BaseException) -> None:
        if self.broken is not None:
            return
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        self.broken = f"{what}: {first}"
        self._group = None  # never used again: a late peer's call must find no partner, not a later call
        logger.warning(
            "trainmon: rank %d: the other ranks did not answer within sync_timeout_s=%gs while agreeing on "
            "%s (a rank has stopped or is far behind: %s). This rank no longer agrees with the others; what "
            "depends on it is switched off, each said once below.",
            self._world()[0],
            self.timeout_s,
            what,
            first[:300],
        )

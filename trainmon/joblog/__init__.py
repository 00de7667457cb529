"""Which rank says what in a job of several ranks, and the run's first line, seen without a logging setup.

A *job-wide* message states a fact that every rank finds alike: a config note, a module kind trainmon cannot
read, the activation rows compiled code leaves out, a setting of the environment. Said by every rank it is one
fact told once per rank (4 identical lines on 4 ranks, 1024 on 1024), so it is said once for the job, by the
rank that speaks for it. A call site declares such a message with ``job_wide(logger).warning(...)``.

A message about one rank (a hook that failed there, a NaN it found, its disk, a peer it lost) is still said by
that rank, and names it: ``rank_note()`` starts it with ``rank R: `` when the job has several ranks.

The rank that speaks for the job is rank 0, or the first rank of ``module_ranks`` when rank 0 is not one of
them (only the ranks listed hook the modules, so only they meet what the modules hold). A rank of a later
pipeline stage holds modules the speaker does not, so it says the job-wide messages too: a fact that only
some ranks meet is said more than once rather than never. A monitor tells this module where its process
stands (:func:`settle`); before that, and in a process without a monitor, the rank is torch.distributed's,
else the launcher's ``RANK``.

Imports nothing of trainmon and no torch: the config loader, the writer process and the MindSpore monitor use
it too.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

__all__ = ["Place", "announce", "job_wide", "leave", "place", "rank_note", "settle"]


@dataclass(frozen=True)
class Place:
    """This process in its job: its rank, the number of ranks, and whether it says the job-wide messages."""

    rank: int
    world: int
    speaks: bool


# the place a monitor settled, from its attach to its close; None: read from the process (place())
_settled: Place | None = None

# what job_wide() hands the ranks that do not speak: a logger outside the hierarchy, disabled, so that each
# of its calls returns at once and no handler (caplog's included) sees a record
_UNSAID = logging.Logger("trainmon (said by the rank that speaks for the job)")
_UNSAID.disabled = True


def place() -> Place:
    """Where this process stands: the place a monitor settled, else its rank as torch.distributed (or the
    launcher's ``RANK`` and ``WORLD_SIZE``) says, rank 0 speaking for the job."""
    if _settled is not None:
        return _settled
    rank, world = _process_rank()
    return Place(rank, world, rank == 0 or world < 2)


def settle(where: Place) -> None:
    """A monitor's place, in force until :func:`leave` (the last monitor attached in a process wins)."""
    global _settled
    _settled = where


def leave(where: Place) -> None:
    """A monitor closes: its place is no longer in force (unless a later monitor settled another)."""
    global _settled
    if _settled is where:
        _settled = None


def job_wide(logger: logging.Logger) -> logging.Logger:
    """``logger`` where this process speaks for the job, else a logger that says nothing: for a message that
    every rank would say alike (``job_wide(logger).warning(...)``)."""
    return logger if place().speaks else _UNSAID


def rank_note() -> str:
    """``"rank R: "`` in a job of several ranks, else ``""``: the start of a message about this rank only."""
    where = place()
    return f"rank {where.rank}: " if where.world > 1 else ""


def announce(logger: logging.Logger, message: str) -> None:
    """Say ``message`` where it is seen without any logging setup: logged at INFO where the logging setup
    shows the logger's INFO records (its handlers print it, formatted as they are configured), else printed
    on stderr as it is, as ``tensorboard`` prints where it serves. A level above INFO set on purpose (on the
    logger or a parent below the root, or ``logging.disable``) keeps it quiet; the root's default WARNING is
    no such choice."""
    if logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
        logger.info("%s", message)
    elif not _quieted(logger):
        print(message, file=sys.stderr, flush=True)


def _quieted(logger: logging.Logger) -> bool:
    if logger.manager.disable >= logging.INFO:
        return True
    node: logging.Logger | None = logger
    while node is not None and node.parent is not None:  # the root is the one without a parent
        if node.level != logging.NOTSET:
            return node.level > logging.INFO
        node = node.parent
    return False


def _process_rank() -> tuple[int, int]:
    """This process's rank and world size, without importing torch: the default process group's when one is
    up, else the launcher's environment (``RANK`` and ``WORLD_SIZE``, as torchrun sets them)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # a torch.distributed that cannot answer: the launcher's variables still can
        pass
    return _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default

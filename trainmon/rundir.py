"""The default run directory of a job (``runs/<date>-<time>``, or a name from the launcher's job id), shared
by the PyTorch and the MindSpore monitors (no framework import at module level). What lies inside a run
directory is spelled in ``trainmon.run.layout``.

The default run directory of a job is named once for the whole job: every rank of a torchrun job (or of any
job whose process group is up when it attaches) gets the same ``runs/<date>-<time>``, however far apart the
ranks attach. See docs/distributed.md ("Which folder a job writes to").
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from trainmon.joblog import job_wide

logger = logging.getLogger("trainmon")

# The n-th default run directory this process asks for is agreed under key n: ranks attach in the same
# order, so a job that attaches twice (say, two training phases) agrees on each folder separately.
_requests = itertools.count()
_KEY = "trainmon/run_dir/{}"
# Reaching torchrun's store is a loopback or LAN round trip; give up long before training would notice.
_STORE_TIMEOUT = datetime.timedelta(seconds=30)


def _output_root() -> Path:
    return Path(os.environ.get("MONITOR_OUTPUT_DIR", "runs"))


def _clock_name() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def default_run_dir() -> Path:
    """``runs/<date>-<time>`` from this process's clock, under ``$MONITOR_OUTPUT_DIR`` when set (as msprobe
    users expect). One process only: :func:`job_run_dir` is the directory a whole job agrees on."""
    return _output_root() / _clock_name()


def job_run_dir() -> Path:
    """The default run directory, the same on every rank of a job.

    In order: the name the first rank to ask proposed (from its clock), kept in torchrun's store when the
    process runs under torchrun, else in the default process group's store; else a name from the launcher's
    job id (``TORCHELASTIC_RUN_ID``, Slurm's job and step ids); else this process's clock.
    """
    proposal = _clock_name()
    key = _KEY.format(next(_requests))
    store = _job_store()
    if store is not None:
        try:
            # the first rank to get here sets the name; every later one reads it (no collective, no wait)
            return _output_root() / store.compare_set(key, "", proposal).decode()
        except Exception as e:  # a store problem must not stop training: fall back to the launcher's id
            logger.warning("trainmon: could not agree on the run directory through the job's store: %s", e)
    job = launcher_job_name(os.environ)
    if job is not None:
        return _output_root() / job
    if _int(os.environ.get("WORLD_SIZE")) > 1:
        job_wide(logger).warning(
            "trainmon: WORLD_SIZE=%s but neither a process group nor a launcher id to agree on a run "
            "directory; each rank names it from its own clock. Pass logdir= to trainmon.attach to keep the "
            "job's ranks together.",
            os.environ.get("WORLD_SIZE"),
        )
    return _output_root() / proposal


def _job_store() -> Any:
    """A key-value store every rank of the job shares, or None."""
    env = os.environ
    if (
        env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and env.get("MASTER_ADDR")
        and env.get("MASTER_PORT")
    ):
        # torchrun's agent serves the rendezvous store at MASTER_ADDR:MASTER_PORT to all workers from their
        # start, before and without a process group (it is the store init_process_group itself joins)
        try:
            from torch.distributed import TCPStore

            return TCPStore(
                env["MASTER_ADDR"],
                int(env["MASTER_PORT"]),
                is_master=False,
                timeout=_STORE_TIMEOUT,
                wait_for_workers=False,
            )
        except Exception as e:
            logger.warning(
                "trainmon: torchrun's store at %s:%s is unreachable: %s",
                env["MASTER_ADDR"],
                env["MASTER_PORT"],
                e,
            )
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # the store the process group was set up with: a small message, unlike a broadcast it is no
            # collective, so it needs neither all ranks at this point nor a device for NCCL
            return dist.distributed_c10d._get_default_store()
    except Exception:  # private API moved: fall back to the launcher's id
        logger.debug("trainmon: no store of the default process group", exc_info=True)
    return None


def launcher_job_name(env: Any) -> str | None:
    """A run-directory name from a launcher's job id that every rank of the job sees, or None.

    torchrun's ``TORCHELASTIC_RUN_ID`` is the rendezvous id: a fresh UUID with ``--standalone``, the user's
    ``--rdzv-id`` otherwise, and the literal ``none`` with the static rendezvous (``--master-addr/port``),
    which names no job (every such job would share one folder), so it is not used.
    """
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun-{_safe(run_id)}"
    slurm_job = env.get("SLURM_JOB_ID")
    if slurm_job:
        step = env.get("SLURM_STEP_ID")
        return f"slurm-{_safe(slurm_job)}" + (f"-{_safe(step)}" if step else "")
    return None


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:64]


def _int(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0

"""Writing tensor dumps on the writer thread (safetensors files and the rank's index), and polling the
run's request file for dump requests (the formats: :mod:`trainmon.run.dumps`)."""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainmon.joblog import job_wide
from trainmon.run.append import AppendFile
from trainmon.run.dumps import DumpEntry, DumpRequest, dump_file_name, json_line
from trainmon.run.layout import dump_index_file, requests_file, step_dumps_dir
from trainmon.run.records import kind_name

if TYPE_CHECKING:  # torch is imported where tensors are written
    import torch

__all__ = [
    "DEFAULT_MAX_BYTES_PER_RUN",
    "DEFAULT_MAX_BYTES_PER_STEP",
    "DumpBudget",
    "DumpWriter",
    "RequestPoller",
]

logger = logging.getLogger("trainmon")

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_MAX_BYTES_PER_STEP = 256 * MiB
DEFAULT_MAX_BYTES_PER_RUN = 4 * GiB


# A request line is ~150 bytes: a longer line without its newline is no request being written, and is
# skipped instead of being read again at every step; a poll reads at most MAX_POLL_BYTES.
MAX_REQUEST_LINE = 64 << 10
MAX_POLL_BYTES = 1 << 20
_MAX_SEEN_IDS = 1 << 16


class RequestPoller:
    """Reads the requests appended to a run's request file since the last :meth:`poll`.

    The first poll returns every request already in the file. A poll with nothing new costs one ``stat``.
    A partial last line (a writer mid-append) is left for the next poll, unless it is longer than
    ``MAX_REQUEST_LINE``: then it is skipped up to its newline (with a warning). If the file is replaced or
    truncated, reading starts again from its beginning, and requests already returned (same id) are not
    returned again.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = requests_file(run_dir)
        self._offset = 0
        self._ino: int | None = None
        self._skipping = False  # inside an over-long line: skip to its newline
        self._seen: OrderedDict[str, None] = OrderedDict()  # ids returned already (the latest ones)

    def poll(self) -> list[DumpRequest]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._offset, self._ino, self._skipping = 0, None, False
            return []
        except OSError as e:
            logger.warning("trainmon: cannot stat %s: %s", self.path, e)
            return []
        if self._ino is not None and (st.st_ino != self._ino or st.st_size < self._offset):
            self._offset, self._skipping = 0, False  # replaced or truncated
        self._ino = st.st_ino
        if st.st_size <= self._offset:
            return []
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(min(st.st_size - self._offset, MAX_POLL_BYTES))
        except OSError as e:
            logger.warning("trainmon: cannot read %s: %s", self.path, e)
            return []
        start = 0
        if self._skipping:
            start = data.find(b"\n") + 1
            if not start:
                self._offset += len(data)
                return []
            self._skipping = False
        end = data.rfind(b"\n", start) + 1  # complete lines only
        if not end:
            end = start
        if len(data) - end > MAX_REQUEST_LINE:
            job_wide(logger).warning(
                "trainmon: %s: a line of more than %d bytes without a newline at byte %d is no request; "
                "skipped",
                self.path,
                MAX_REQUEST_LINE,
                self._offset + end,
            )
            self._skipping, end = True, len(data)
        out = [r for r in map(self._parse, data[start:end].splitlines()) if r is not None]
        self._offset += end
        return out

    def _parse(self, raw: bytes) -> DumpRequest | None:
        if not raw.strip() or len(raw) > MAX_REQUEST_LINE:
            return None
        try:
            request = DumpRequest.from_dict(json.loads(raw))
        except (ValueError, TypeError) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
            job_wide(logger).warning("trainmon: %s: malformed dump request skipped: %s", self.path, e)
            return None
        if request.id in self._seen:  # the file was replaced by one holding it again
            return None
        self._seen[request.id] = None
        if len(self._seen) > _MAX_SEEN_IDS:
            self._seen.popitem(last=False)
        return request


@functools.cache
def _file_mode() -> int:
    """The mode every other output gets (0644 less the umask); safetensors creates its files 0600."""
    try:
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = 0o022
    return 0o644 & ~umask


class DumpBudget:
    """The dump caps as the training thread applies them before it copies a tensor: a copy that would take
    the bytes taken at its step above ``max_bytes_per_step``, or all bytes taken above ``max_bytes_per_run``,
    is never made (a warning once per step). :class:`DumpWriter` checks the same caps again when writing."""

    def __init__(self) -> None:
        self.max_bytes_per_step = DEFAULT_MAX_BYTES_PER_STEP  # read now: tests lower the module's defaults
        self.max_bytes_per_run = DEFAULT_MAX_BYTES_PER_RUN
        self._step: int | None = None
        self._step_bytes = self._run_bytes = 0
        self._warned: int | None = None

    def admit(self, step: int, kind: str, name: str, nbytes: int) -> bool:
        """Whether a copy of ``nbytes`` (from the tensor's shape and dtype) fits; counted when it does."""
        if self._step != step:
            self._step, self._step_bytes = step, 0
        if self._step_bytes + nbytes > self.max_bytes_per_step:
            cap = f"the step cap of {self.max_bytes_per_step} bytes"
        elif self._run_bytes + nbytes > self.max_bytes_per_run:
            cap = f"the run cap of {self.max_bytes_per_run} bytes"
        else:
            self._step_bytes += nbytes
            self._run_bytes += nbytes
            return True
        if self._warned != step:
            self._warned = step
            logger.warning(
                "trainmon: dump of %s %r (%d bytes) at step %d skipped before copying it: %s would be "
                "exceeded (further skips at this step are not logged)",
                kind,
                name,
                nbytes,
                step,
                cap,
            )
        return False


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class DumpWriter:
    """Writes the dumps of one rank of a run. Not for the training thread: call it from a writer thread.

    Caps count tensor data bytes (``numel * element_size``; the safetensors header, a few hundred bytes, is
    not counted): a tensor that would take the bytes dumped at its step above ``max_bytes_per_step``, or the
    bytes dumped by this writer above ``max_bytes_per_run``, is skipped (a warning once per step).
    I/O and serialisation errors are logged on the ``trainmon`` logger and give ``None``; they never raise.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        rank: int,
        *,
        max_bytes_per_step: int | None = None,
        max_bytes_per_run: int | None = None,
    ) -> None:
        # None: the module's defaults as they are now (the capture checks the same ones before copying)
        max_bytes_per_step = DEFAULT_MAX_BYTES_PER_STEP if max_bytes_per_step is None else max_bytes_per_step
        max_bytes_per_run = DEFAULT_MAX_BYTES_PER_RUN if max_bytes_per_run is None else max_bytes_per_run
        if max_bytes_per_step < 0 or max_bytes_per_run < 0:
            raise ValueError("dump byte caps must be >= 0")
        self.run_dir = Path(run_dir)
        self.rank = int(rank)
        self.max_bytes_per_step = int(max_bytes_per_step)
        self.max_bytes_per_run = int(max_bytes_per_run)
        self.index_path = dump_index_file(run_dir, self.rank)
        self.run_bytes = 0
        self._step_bytes: dict[int, int] = {}
        self._warned_steps: set[int] = set()
        self._lock = threading.Lock()
        self._index: AppendFile | None = None  # opened on first write

    def _warn_once(self, step: int, msg: str, *args: Any) -> None:
        if step not in self._warned_steps:
            self._warned_steps.add(step)
            logger.warning(msg + " (further skips at this step are not logged)", *args)

    def _forget_old_steps(self, step: int) -> None:
        # Steps arrive in order; keep a few recent ones so late micro-batches are still counted.
        for s in [s for s in self._step_bytes if s < step - 8]:
            del self._step_bytes[s]
        self._warned_steps = {s for s in self._warned_steps if s >= step - 8}

    def write(
        self,
        step: int,
        micro_step: int,
        kind: str,
        name: str,
        tensor: torch.Tensor | np.ndarray,
        reason: str,
        note: str = "",
    ) -> DumpEntry | None:
        """Save one tensor and index it; the entry, or None when skipped by a cap or on an error."""
        step, micro_step, kind = int(step), int(micro_step), kind_name(kind)
        with self._lock:
            self._forget_old_steps(step)
            try:
                # numpy arrays come from the MindSpore monitor (host copies), torch tensors from the torch one
                if isinstance(tensor, np.ndarray):
                    nbytes = tensor.nbytes
                else:
                    nbytes = tensor.numel() * tensor.element_size()
            except Exception as e:  # noqa: BLE001 - never raise into the monitor
                logger.warning("trainmon: dump of %s %r at step %d skipped: %s", kind, name, step, e)
                return None
            used = self._step_bytes.get(step, 0)
            if used + nbytes > self.max_bytes_per_step:
                self._warn_once(
                    step,
                    "trainmon: dump of %s %r (%d bytes) at step %d skipped: the step cap "
                    "of %d bytes would be exceeded",
                    kind,
                    name,
                    nbytes,
                    step,
                    self.max_bytes_per_step,
                )
                return None
            if self.run_bytes + nbytes > self.max_bytes_per_run:
                self._warn_once(
                    step,
                    "trainmon: dump of %s %r (%d bytes) at step %d skipped: the run cap "
                    "of %d bytes would be exceeded",
                    kind,
                    name,
                    nbytes,
                    step,
                    self.max_bytes_per_run,
                )
                return None
            try:
                entry = self._save(step, micro_step, kind, name, tensor, reason, note)
            except Exception as e:  # noqa: BLE001 - I/O, unsupported dtype, ...: log, never raise
                logger.warning(
                    "trainmon: dump of %s %r at step %d on rank %d failed: %s", kind, name, step, self.rank, e
                )
                return None
            self._step_bytes[step] = used + nbytes
            self.run_bytes += nbytes
            return entry

    def _save(
        self,
        step: int,
        micro_step: int,
        kind: str,
        name: str,
        tensor: torch.Tensor | np.ndarray,
        reason: str,
        note: str = "",
    ) -> DumpEntry:
        if isinstance(tensor, np.ndarray):
            t = np.ascontiguousarray(tensor)
            dtype = str(t.dtype)
        else:
            t = tensor.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            dtype = _dtype_name(t.dtype)
        shape = tuple(int(s) for s in t.shape)
        metadata = {
            "step": str(step),
            "rank": str(self.rank),
            "name": name,
            "kind": kind,
            "micro_step": str(micro_step),
            "reason": str(reason),
            "dtype": dtype,
            "shape": json.dumps(list(shape)),
        }
        if note:
            metadata["note"] = str(note)
        directory = step_dumps_dir(self.run_dir, step, self.rank)
        directory.mkdir(parents=True, exist_ok=True)
        file_name = dump_file_name(kind, name, micro_step)
        target = directory / file_name
        n = 1
        while target.exists():  # the same tensor dumped twice at one step, or two names sanitised alike
            target = directory / file_name.replace(".safetensors", f"__{n}.safetensors")
            n += 1
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            if isinstance(t, np.ndarray):
                from safetensors.numpy import save_file
            else:
                from safetensors.torch import save_file

            save_file({"tensor": t}, str(tmp), metadata=metadata)
            os.chmod(tmp, _file_mode())
            os.replace(tmp, target)  # readers never see a half-written dump
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        entry = DumpEntry(
            path=target.relative_to(self.run_dir).as_posix(),
            bytes=target.stat().st_size,
            shape=shape,
            dtype=dtype,
            step=step,
            rank=self.rank,
            kind=kind,
            name=name,
            micro_step=micro_step,
            reason=str(reason),
            wall_time=time.time(),
            note=str(note),
        )
        try:
            if self._index is None:
                self._index = AppendFile(self.index_path)
            self._index.append(json_line(entry.to_dict()))
        except BaseException:
            target.unlink(missing_ok=True)  # an unindexed dump would never be found
            raise
        return entry

    def close(self) -> None:
        with self._lock:
            if self._index is not None:
                index, self._index = self._index, None
                index.close()

    def __enter__(self) -> DumpWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The MindSpore monitor: step boundaries, one host read per step, and the torch monitor's writer sinks.

A step is collected (or not) as the config's schedule decides; on a collected step the Cell hooks and the
optimizer hooks add rows whose partials stay on the device, and the optimizer call ends the step: the rows
are read on the host at once and the :class:`~trainmon.run.records.StepRecord` goes to the same writer thread
and sinks as the PyTorch monitor's, so TensorBoard, CSV, the stat store, anomalies and the manifest are
written in the same formats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mindspore as ms
from mindspore import nn

from trainmon.anomaly.alerts import apply_nan_action, nan_message
from trainmon.anomaly.sink import AnomalySink
from trainmon.config import MonitorConfig
from trainmon.config.targets import TargetMatcher, squash_name
from trainmon.joblog import announce
from trainmon.mindspore.dumps import MindSporeDumps
from trainmon.mindspore.gradprobe import MindSporeGradProbe
from trainmon.mindspore.hooks import CellHooks, CellSite
from trainmon.mindspore.optimizer import OptimizerHooks, OptimizerParts
from trainmon.mindspore.stats import DeviceRows
from trainmon.run.layout import rank_dir
from trainmon.run.names import encode_name
from trainmon.run.records import Phase, Row, StepRecord
from trainmon.step.schedule import Schedule
from trainmon.step.stepstats import StepStats
from trainmon.writer.manifest import ManifestSink
from trainmon.writer.outputs import format_sinks, unwritable_run_dir, where_it_goes, writes_to_disk
from trainmon.writer.thread import WriterThread

logger = logging.getLogger("trainmon")

# On a CPU a compiled reduction waits for every op queued before it: holding up to this many bytes of a
# step's tensors and reducing them together costs one wait instead of one per hook call. Elsewhere the
# reductions are queued like any op, so nothing is held (activation memory is freed as usual).
CPU_HOLD_BYTES = 256 << 20


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (``mindspore.communication``; 0 and 1 before ``init()``)."""
    try:
        from mindspore.communication import get_group_size, get_rank

        return int(get_rank()), int(get_group_size())
    except Exception:  # no communication backend at all: one process
        return 0, 1


def _hold_bytes() -> int:
    return CPU_HOLD_BYTES if ms.get_context("device_target") == "CPU" else 0


class MindSporeMonitor:
    """A running monitor of a MindSpore PyNative network; create it with :func:`trainmon.mindspore.attach`."""

    def __init__(
        self,
        net: nn.Cell,
        optimizer: nn.Cell | None,
        config: MonitorConfig,
        run_dir: Path,
        *,
        start_iteration: int = 0,
        on_alert: Callable[[Any], Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.rank, self.world_size = _rank_and_world()
        self.rank_dir = rank_dir(self.run_dir, self.rank)
        self.config = config
        note = where_it_goes(config, self.run_dir) if self.rank == 0 else None
        if note is not None:  # the run's first line, seen without a logging setup
            announce(logger, note)
        self._on_alert = on_alert
        self._closed = False
        self._step = int(start_iteration)
        self._micro = -1  # forward passes of the network in this step, minus one
        self._collecting = False
        self._rows: list[Row] = []
        self._device = DeviceRows(config.eps, hold_bytes=_hold_bytes())
        self._latest: StepRecord | None = None
        self.schedule = Schedule(
            config.start_step, config.step_interval, config.collect_times, config.module_ranks, self.rank
        )
        on_disk = writes_to_disk(config)
        self._dumps = MindSporeDumps(self.run_dir, self.rank) if on_disk else None
        # grad_probe fingerprints of the gradients the optimizer receives (trainmon compare)
        probing = optimizer is not None and config.grad_probe.enable and on_disk
        self._gradprobe = MindSporeGradProbe(self.run_dir, self.rank) if probing else None
        try:
            self.writer = self._start_writer()
        except OSError as e:  # a full or read-only disk: say which folder, and what to do
            raise unwritable_run_dir(self.run_dir, e) from e

        # every output writes the names as trainmon.run.names encodes them (lossless, valid UTF-8)
        rename = (lambda name: encode_name(squash_name(name))) if config.squash_name else encode_name
        matcher = TargetMatcher(config.targets)
        self._root_hook = net.register_forward_pre_hook(self._count_micro_step)
        sites = [
            CellSite(rename(name), cell)
            for name, cell in net.cells_and_names()
            if name and (config.monitor_all_modules or matcher.match_module(name))
        ]
        self._cells = CellHooks(
            sites if config.xy_enabled else (),
            self._add_cell_row,
            lambda: self._collecting,
            lambda: max(self._micro, 0),
            self._device.settle,
            forward=config.xy_forward,
            backward=config.xy_backward,
        )
        self._optimizer: OptimizerHooks | None = None
        if optimizer is None:
            logger.warning("trainmon: no optimizer given; steps never end, so nothing is written.")
        else:
            names = [rename(p.name) if matcher.match_param(p.name) else None for p in optimizer.parameters]
            parts = OptimizerParts(
                grads=config.wg_distribution,
                params=config.param_distribution,
                moments=config.mv_distribution,
                update_ratio=config.ur_distribution,
            )
            on_grads = None
            if self._gradprobe is not None:  # every parameter the optimizer updates, not only the targets
                probe, probe_names = self._gradprobe, [rename(p.name) for p in optimizer.parameters]
                probe.configure(
                    config.grad_probe, list(zip(probe_names, optimizer.parameters, strict=True)), config.eps
                )

                def on_grads(grads: Any) -> None:
                    probe.collect(self._step, list(zip(probe_names, grads, strict=False)))

            self._optimizer = OptimizerHooks(
                optimizer,
                names,
                self._add_param_row,
                lambda: self._collecting,
                lambda: parts,
                self._end_step,
                on_grads=on_grads,
                before_update=self._device.reduce,
                settle=self._device.settle,
            )
        self._arm()

    # ------------------------------------------------------------------ public API
    @property
    def step(self) -> int:
        """The step being trained now (the next one to finish)."""
        return self._step

    def track(self, name: str, value: ms.Tensor | float) -> None:
        """Record an extra scalar (e.g. the loss) of the current step; call it before the optimizer."""
        if not self._collecting or self._closed:
            return
        tensor = value if isinstance(value, ms.Tensor) else ms.Tensor(float(value), ms.float32)
        self._add("scalar", encode_name(name), max(self._micro, 0), Phase.FORWARD.value, tensor)

    def latest(self) -> StepStats | None:
        """Statistics of the last finished collected step (None before the first one), keyed by
        ``"{kind}/{name}"`` then stat, as :meth:`trainmon.Monitor.latest` returns them."""
        record = self._latest
        return StepStats(record, multi_chunk=False) if record is not None else None

    def latest_record(self) -> StepRecord | None:
        """The raw record (rows and partials) of the last finished collected step; None before the first."""
        return self._latest

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every finished step is written to disk."""
        return self.writer.flush(timeout)

    def close(self) -> None:
        """Remove every hook, write what is pending, close files. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._collecting = False
        self._cells.remove()
        if self._optimizer is not None:
            self._optimizer.remove()
        self._root_hook.remove()
        self.writer.close()

    def __enter__(self) -> MindSporeMonitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MindSporeMonitor(run_dir={str(self.run_dir)!r}, step={self.step})"

    # ------------------------------------------------------------------ internals
    def _start_writer(self) -> WriterThread:
        config = self.config
        sinks: list[Any] = format_sinks(
            config, self.run_dir, self.rank, multi_chunk=False, world=self.world_size
        )
        on_disk = writes_to_disk(config)
        self._anomalies = AnomalySink(
            config.alert,
            self.rank,
            self.run_dir.name,
            self.run_dir if on_disk else None,
            request_dump=self._dumps.trigger if self._dumps is not None else None,
            on_alert=self._on_alert,
        )
        sinks.append(self._anomalies)
        if self._gradprobe is not None:
            sinks.append(self._gradprobe.sink)
        if self._dumps is not None:  # after the anomaly sink: a step's dumps follow its anomalies
            sinks.append(self._dumps)
        if on_disk:
            meta = {
                "world_size": self.world_size,
                "config": config.to_dict(),
                "chunks": 1,
                "framework": "mindspore",
            }
            sinks.append(ManifestSink(self.run_dir, meta))
        return WriterThread(sinks, check_dropped=self._anomalies.check_non_finite)

    def _count_micro_step(self, cell: nn.Cell, inputs: tuple) -> None:
        self._micro += 1

    def _add(self, kind: str, name: str, micro: int, phase: str, tensor: ms.Tensor) -> None:
        self._device.add(tensor)
        row = Row(kind, name, 0, micro, phase, tuple(tensor.shape), str(tensor.dtype))
        self._rows.append(row)
        if self._dumps is not None:
            self._dumps.offer(row, tensor)

    def _add_cell_row(self, kind: str, name: str, micro: int, phase: str, tensor: ms.Tensor) -> None:
        self._add(kind, name, micro, phase, tensor)

    def _add_param_row(self, kind: str, name: str, tensor: ms.Tensor) -> None:
        self._add(kind, name, 0, Phase.OPTIMIZER.value, tensor)

    def _end_step(self) -> None:
        """Called after every optimizer call: read the step's partials on the host (once) and ship them."""
        if self._collecting:
            try:
                partials = self._device.to_host()
                record = StepRecord(self._step, self.rank, tuple(self._rows), partials, time.time())
                self._latest = record
                self.writer.submit(record)
            except Exception:
                logger.exception("trainmon: step %d could not be recorded; training continues", self._step)
        self._rows = []
        self._step += 1
        self._micro = -1
        self._arm()
        self._act_on_nan()

    def _act_on_nan(self) -> None:
        """``alert.on_nan: raise | exit``: once the step's anomalies are known (the writer has run its rules),
        raise :class:`~trainmon.anomaly.alerts.TrainingNaNError` or exit, from the optimizer call."""
        action = self.config.alert.on_nan
        if action == "continue":
            return
        self.writer.flush()
        found = self._anomalies.take_non_finite()
        if found is not None:
            apply_nan_action(
                action,
                self.config.alert.exit_code,
                nan_message(found, self.run_dir),
                before=lambda: self._anomalies.flush_alerts(timeout=5.0),
            )

    def _arm(self) -> None:
        self._collecting = not self._closed and self.schedule.start(self._step)
        try:
            if self._collecting:
                self._cells.install()
            else:
                self._cells.remove()
        except Exception:
            logger.exception("trainmon: Cell hooks not changed at step %d; training continues", self._step)
        if self._dumps is not None:
            self._dumps.start_step(self._step, self._collecting)

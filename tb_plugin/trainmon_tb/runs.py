"""Finding trainmon runs under the logdir and keeping one index per run current.

A run is a directory holding ``plugins/trainmon/``. Discovery walks the logdir (never into a run, whose rank
folders may be thousands; through symlinks only where they stay inside the logdir); it and the indexes are
refreshed by a daemon thread every ``poll_secs`` and, throttled, when a request arrives, so new records
appear while a job runs.

Requests never wait for the poller: a refresh the poller is running is not waited for (the request answers
from the indexes as they are; each index publishes its state at once when a refresh ends), except the very
first one of a run, without which there is nothing to answer from. Discovery runs outside the registry's
lock."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from trainmon.run.damage import damaged
from trainmon.run.layout import PLUGIN_DIR, is_run
from trainmon.run.manifest import read_manifest
from trainmon_tb.anomaly_index import AnomalyIndex
from trainmon_tb.dump_index import DumpIndex
from trainmon_tb.paths import run_id
from trainmon_tb.shape_index import ShapeIndex
from trainmon_tb.stat_index import StatIndex
from trainmon_tb.time_index import TimeIndex

logger = logging.getLogger("trainmon")

MAX_DEPTH = 8  # below the logdir; deeper directories are not searched for runs
MIN_REFRESH_SECS = 1.0  # requests refresh a run at most this often


class Run:
    """One trainmon run directory and its indexes."""

    def __init__(self, run_id_: str, run_dir: Path) -> None:
        self.id = run_id_
        self.dir = run_dir
        self.anomalies = AnomalyIndex(run_dir)
        self.stats = StatIndex(run_dir)
        self.shapes = ShapeIndex(run_dir)  # read when a view names a tensor: never by a refresh
        self.dumps = DumpIndex(run_dir)
        self.times = TimeIndex(run_dir)  # read when the time heat map asks: never by a refresh
        self._refreshed = 0.0
        self._lock = threading.Lock()
        self.loaded = threading.Event()  # set once the first refresh ended
        self._summary: dict | None = None
        self._said: set[tuple[str, str]] = set()  # damaged files said in the log
        self.interval = 1  # steps between collected steps (the config's step_interval)

    def refresh(self, min_age: float = 0.0, wait: bool = True) -> None:
        """Bring the indexes up to date (unless done less than ``min_age`` seconds ago). With ``wait`` False,
        return at once when another thread is refreshing the run."""
        if not self._lock.acquire(blocking=wait):
            return
        try:
            now = time.monotonic()
            if now - self._refreshed < min_age:
                return
            self._refreshed = now
            for index in (self.anomalies, self.stats, self.dumps):
                try:
                    index.refresh()
                except Exception:  # one unreadable file must not hide the rest of the run
                    logger.exception(
                        "trainmon: refreshing %s of run %s failed", type(index).__name__, self.id
                    )
            self.interval = _step_interval(read_manifest(self.dir))
            try:  # the unfiltered timeline's onsets, ready before the tab asks for it
                self.anomalies.prepare(self.interval)
            except Exception:
                logger.exception("trainmon: preparing the timeline of run %s failed", self.id)
            try:
                self._summary = self._summarise()
            except Exception:
                logger.exception("trainmon: summarising run %s failed", self.id)
        finally:
            self._lock.release()
            self.loaded.set()

    def summary(self) -> dict:
        """What the run list shows, as of the last refresh."""
        if self._summary is None:
            self.refresh()
        return self._summary or self._summarise()

    def _summarise(self) -> dict:
        a, s = self.anomalies.summary(), self.stats.summary()
        ranges = [r for r in (a["steps"], s["steps"]) if r]
        return {
            "run": self.id,
            "ranks": sorted(set(a["ranks"]) | set(s["ranks"]) | set(self.dumps.ranks())),
            "stat_ranks": list(s["ranks"]),  # what the compare view's rank list offers
            "world_size": self.dumps.world_size(),
            "steps": [min(r[0] for r in ranges), max(r[1] for r in ranges)] if ranges else None,
            "anomalies": a["anomalies"],
            "suppressed": a["suppressed"],
            "stragglers": a["stragglers"],  # episodes, said apart from the anomalies (as analyze does)
            "kinds": a["kinds"],
            "rules": a["rules"],
            "stat_kinds": s["stat_kinds"],
            "dumps": len(self.dumps),
            "timed": self.times.available(),  # whether the run has timing tables (nothing read)
        }

    def damaged(self) -> list[dict[str, str]]:
        """The run's damaged files (:mod:`trainmon.run.damage`) its readers met, as ``{"path", "why"}`` with
        the path relative to the run; each is said once in TensorBoard's log."""
        found = damaged(self.dir)
        for d in found:
            if (str(d.path), d.why) not in self._said:
                self._said.add((str(d.path), d.why))
                logger.warning("trainmon: run %s: damaged file %s: %s; the tab shows the rest of the run",
                               self.id, d.path, d.why)  # fmt: skip
        return [{"path": d.relative_to(self.dir), "why": d.why} for d in found]

    def timeline_key(self) -> str:
        """Changes whenever a timeline answer of the run may change (records, ranks, steps)."""
        summary = self.summary()
        ranks, steps = summary["ranks"], summary["steps"] or [0, 0]
        return f"{self.anomalies.version}.{len(ranks)}.{ranks[-1] if ranks else -1}.{steps[0]}.{steps[1]}"


def _step_interval(manifest: dict | None) -> int:
    """The run's ``step_interval`` (its manifest's config; 1 when unknown)."""
    config = (manifest or {}).get("config")
    value = config.get("step_interval") if isinstance(config, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def discover(logdir: Path, max_depth: int = MAX_DEPTH) -> list[Path]:
    """Run directories under ``logdir`` (itself included), sorted.

    Symbolic links to directories are followed when they resolve inside the logdir (a ``latest`` link to a
    run, a folder of links to runs), under the link's own name; links that resolve outside the logdir are not
    (nothing outside it is read), nor are links back to a directory the walk is in (a loop)."""
    found: list[Path] = []
    base_depth = len(logdir.parts)
    real_root = os.path.realpath(logdir)
    for dirpath, dirnames, _ in os.walk(logdir, followlinks=True):
        here = Path(dirpath)
        if is_run(here):
            found.append(here)
            dirnames.clear()  # a run holds rank folders (thousands in a big job), not other runs
            continue
        if len(here.parts) - base_depth >= max_depth:
            dirnames.clear()
        # a run's plugin data holds no runs; hidden directories are not runs
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d != PLUGIN_DIR.parts[0] and not d.startswith(".") and _may_enter(here / d, real_root)
        )
    return sorted(found)


def _may_enter(directory: Path, real_root: str) -> bool:
    """A directory, or a link to one inside the logdir that does not lead back to where the walk is."""
    if not directory.is_symlink():
        return True
    target = os.path.realpath(directory)
    if os.path.commonpath([target, real_root]) != real_root:
        return False  # outside the logdir
    here = os.path.realpath(directory.parent)
    return os.path.commonpath([target, here]) != target  # not an ancestor of the link (a loop)


class RunRegistry:
    """The runs of a logdir. ``runs()`` never walks the logdir itself more often than ``poll_secs``."""

    def __init__(self, logdir: Path | None, poll_secs: float) -> None:
        self.logdir = Path(os.path.realpath(os.path.expanduser(str(logdir)))) if logdir else None
        self.poll_secs = poll_secs
        self._runs: dict[str, Run] = {}
        self._scanned = 0.0
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def scan(self, force: bool = False) -> dict[str, Run]:
        """The runs; the logdir is walked again when ``force`` or when the last walk is ``poll_secs`` old."""
        if self.logdir is None or (not force and self._fresh()):
            return dict(self._runs)
        with self._scan_lock:  # one walk at a time, outside the lock that guards the runs
            if not force and self._fresh():  # another thread just walked it
                return dict(self._runs)
            found = {run_id(self.logdir, d): d for d in discover(self.logdir)} if self.logdir.is_dir() else {}
            with self._lock:
                runs = {key: self._runs.get(key) or Run(key, directory) for key, directory in found.items()}
                self._runs = runs
            self._scanned = time.monotonic()
            return dict(runs)

    def _fresh(self) -> bool:
        return bool(self._scanned) and time.monotonic() - self._scanned < self.poll_secs

    def get(self, key: str) -> Run | None:
        run = self._runs.get(key) or self.scan().get(key)
        if run is None:  # created since the last scan?
            run = self.scan(force=True).get(key)
        if run is not None:
            # the first refresh of a run is waited for; later ones never wait for the poller's
            run.refresh(MIN_REFRESH_SECS, wait=not run.loaded.is_set())
        return run

    def has_runs(self) -> bool:
        return bool(self.scan())

    def start(self) -> None:
        """Keep discovery and every index warm in a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll, name="trainmon-plugin-poll", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                for run in self.scan(force=True).values():
                    run.refresh()
            except Exception:
                logger.exception("trainmon: polling the logdir failed")
            self._stop.wait(self.poll_secs)

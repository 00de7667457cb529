"""A small progress bar on a text stream (stderr): fraction done, amount, rate, time left."""

from __future__ import annotations

import time
from typing import TextIO

__all__ = ["Progress"]

_WIDTH = 30
_MIN_INTERVAL = 0.1  # seconds between redraws


class Progress:
    """``total`` units (bytes here); :meth:`advance` adds done units; :meth:`close` ends the line.
    Draws nothing when ``stream`` is None."""

    def __init__(self, total: float, stream: TextIO | None, label: str = "") -> None:
        self.total = max(float(total), 1.0)
        self.done = 0.0
        self.stream = stream
        self.label = label
        self.start = time.monotonic()
        self._last_draw = 0.0

    def advance(self, units: float) -> None:
        self.done = min(self.total, self.done + units)
        now = time.monotonic()
        if now - self._last_draw >= _MIN_INTERVAL or self.done >= self.total:
            self._last_draw = now
            self.draw()

    def line(self) -> str:
        frac = self.done / self.total
        filled = int(round(frac * _WIDTH))
        elapsed = time.monotonic() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        return (
            f"{self.label}[{'#' * filled}{'.' * (_WIDTH - filled)}] {100 * frac:5.1f}% "
            f"{self.done / 2**20:.1f}/{self.total / 2**20:.1f} MiB {rate / 2**20:.1f} MiB/s "
            f"{elapsed:.1f}s elapsed, {left:.0f}s left"
        )

    def draw(self) -> None:
        if self.stream is not None:
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.draw()
            self.stream.write("\n")
            self.stream.flush()

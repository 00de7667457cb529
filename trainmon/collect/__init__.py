"""Collectors: hooks that feed tensors to the stats kernel and rows to the step buffer.

Each collector is armed (hooks installed) only for collected steps, so an off step costs nothing.
"""

from trainmon.collect.base import Collector, guarded

__all__ = ["Collector", "guarded"]

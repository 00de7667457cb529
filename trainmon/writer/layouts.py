"""Work a sink does once per row layout (the kinds, names and order of a step's rows) instead of once per
step: consecutive steps almost always share their layout, often as the very same tuple object."""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["LayoutCache"]

# How many distinct layouts to keep precomputed work for.
_LAYOUT_CACHE = 8


class LayoutCache:
    """Work precomputed per layout (a tuple of rows or tags), with a fast path for "same as last time":
    consecutive steps almost always share their layout, often as the very same tuple object."""

    def __init__(self, build, size: int = _LAYOUT_CACHE) -> None:
        self._build = build
        self._size = size
        self._cache: OrderedDict = OrderedDict()
        self._last_key: object = None
        self._last = None

    def get(self, key):
        if key is self._last_key and self._last is not None:
            return self._last
        if self._last is not None and key == self._last_key:
            value = self._last
        else:
            try:
                value = self._cache.get(key)
            except TypeError:  # unhashable field (e.g. a list shape): build, do not cache
                return self._build(key)
            if value is None:
                value = self._cache[key] = self._build(key)
                if len(self._cache) > self._size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        self._last_key, self._last = key, value
        return value

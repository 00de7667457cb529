"""Counted nouns in the commands' messages: ``1 rank``, ``2 ranks``."""

from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``1 rank file``, ``2 rank files``; ``nouns`` for an irregular plural (``anomalies``)."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"

"""Argument types shared by the subcommands: integers with a lower bound, and steps."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(lowest: int) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers >= ``lowest``."""
    expected = "a positive integer" if lowest == 1 else f"an integer >= {lowest}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def step_or_next(text: str) -> int | None:
    """A step number, or ``next`` (None): the next collected step."""
    if text == "next":
        return None
    try:
        return non_negative_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or 'next', got {text!r}") from None


def name_glob(text: str) -> str:
    """A tensor-name glob (``fnmatch``): not empty, which would match no tensor."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"an empty glob matches no tensor, got {text!r}; give a name or a glob, e.g. 'layers.3.*' ('*': "
            "every tensor)"
        )
    return text

"""The exit statuses of ``trainmon compare`` (whatever the source) and how it reports an error."""

from __future__ import annotations

import sys

EXIT_SAME = 0  # no divergence
EXIT_DIVERGED = 1
EXIT_ERROR = 2  # bad input: the message says what and where


def error(msg: str) -> int:
    print(f"trainmon compare: error: {msg}", file=sys.stderr)
    return EXIT_ERROR

"""Resolving paths that come from HTTP requests. Every path is relative, free of ``..`` and, once symlinks
are resolved, inside its root: nothing outside the logdir is ever read."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath


class PathRefused(ValueError):
    """A path that is absolute, climbs out of its root or otherwise cannot be served."""


def _relative_parts(text: str, what: str) -> tuple[str, ...]:
    if "\x00" in text:
        raise PathRefused(f"{what}: NUL character in path")
    if "\\" in text:
        raise PathRefused(f"{what}: backslash in path {text!r}")
    p = PurePosixPath(text)
    if p.is_absolute() or (text[1:2] == ":"):
        raise PathRefused(f"{what}: absolute path {text!r} refused (give it relative to the logdir)")
    parts = tuple(x for x in p.parts if x not in ("", "."))
    if ".." in parts:
        raise PathRefused(f"{what}: '..' in path {text!r} refused")
    return parts


def confined(root: Path, text: str, what: str) -> Path:
    """``root / text`` with symlinks resolved, refusing anything that ends up outside ``root``."""
    parts = _relative_parts(text, what)
    real_root = Path(os.path.realpath(root))
    target = Path(os.path.realpath(real_root.joinpath(*parts)))
    if target != real_root and real_root not in target.parents:
        raise PathRefused(f"{what}: {text!r} resolves outside the logdir")
    return target


def run_id(logdir: Path, run_dir: Path) -> str:
    """The id of a run directory: its path relative to the logdir with ``/`` separators, ``.`` for the
    logdir itself."""
    rel = os.path.relpath(run_dir, logdir)
    return "." if rel == "." else PurePosixPath(*Path(rel).parts).as_posix()

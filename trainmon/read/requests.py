"""Checking a dump request against the run it is for, before it is written: is the folder a run at all, is
there a rank to serve it, does any tensor of the run carry a matching name (``trainmon dump request``)."""

from __future__ import annotations

import difflib
import os
import re
from fnmatch import fnmatchcase
from pathlib import Path

from trainmon.run.layout import is_run
from trainmon.run.manifest import read_manifest
from trainmon.run.statstore import stat_ranks, stored_tensors

__all__ = ["not_a_run", "unserved"]

_RANK_DIR = re.compile(r"^rank_(\d+)$")
_CHUNK = re.compile(r"^\d+:")  # the "{vpp_stage}:" of a name in a model of several chunks
_SHOWN = 5


def not_a_run(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is no run folder, and which folder is meant (None when it is a run)."""
    path = Path(path)
    if not path.exists():
        return f"run directory not found: {path}"
    if not path.is_dir():
        return f"{path} is not a directory"
    if is_run(path):
        return None
    m = _RANK_DIR.match(path.name)
    if m and is_run(path.parent):
        return (
            f"{path} is the folder of rank {m.group(1)} in the run {path.parent}: pass {path.parent} "
            f"(with --rank {m.group(1)} for this rank only)"
        )
    for above in path.resolve().parents:
        if is_run(above):
            return f"{path} is inside the run {above}: pass {above}"
    try:
        runs = sorted(str(p) for p in path.iterdir() if is_run(p))
    except OSError:
        runs = []
    if runs:
        more = f" (and {len(runs) - _SHOWN} more)" if len(runs) > _SHOWN else ""
        return f"{path} holds runs but is none itself: pass one of {', '.join(runs[:_SHOWN])}{more}"
    return (
        f"{path} is not a trainmon run: it has no plugins/trainmon/ folder (a run is the logdir given to "
        "trainmon.attach, and gets that folder when the job attaches)"
    )


def _names(run: Path, manifest: dict, kind: str | None) -> tuple[set[str], bool]:
    """The tensor names the run lists (of ``kind``, or all), without chunk prefixes, and whether they cover
    every rank: the manifest has rank 0's, each rank's statistics store its own."""
    listed = manifest.get("names")
    names: set[str] = set()
    if isinstance(listed, dict):
        for k, seq in listed.items():
            if (kind is None or k == kind) and isinstance(seq, list):
                names.update(str(n) for n in seq)
    stores = stat_ranks(run)
    for rank in stores:
        names.update(n for k, n in stored_tensors(run, rank) if kind is None or k == kind)
    if int(manifest.get("chunks", 1) or 1) > 1:
        names = {_CHUNK.sub("", n, count=1) for n in names}
    world = manifest.get("world_size")
    every_rank = not isinstance(world, int) or world <= 1 or len(stores) >= world
    return names, every_rank


def unserved(run: str | os.PathLike[str], name: str, rank: int | None, kind: str | None) -> list[str]:
    """Why a request for tensors named like the glob ``name`` (on ``rank``, of ``kind``) would never be
    served, from what the run's files list; empty when nothing speaks against it (or nothing is listed yet:
    the first collected step writes the names)."""
    run = Path(run)
    manifest = read_manifest(run) or {}
    found: list[str] = []
    world = manifest.get("world_size")
    if rank is not None and isinstance(world, int) and not isinstance(world, bool) and rank >= world:
        found.append(
            f"--rank {rank}: the run has {world} rank{'s' if world != 1 else ''} (0..{world - 1}), so no "
            "rank will serve this request"
        )
    names, every_rank = _names(run, manifest, kind)
    if not names:
        if kind is not None and _names(run, manifest, None)[0]:
            kinds = ", ".join(manifest.get("kinds") or []) or "none listed"
            found.append(f"--kind {kind}: the run records no {kind} tensors (its kinds: {kinds})")
        return found
    if any(fnmatchcase(n, name) for n in names):
        return found
    of = f" {kind}" if kind else ""
    where = "" if every_rank else " (the names of the ranks that list theirs)"
    guess = next((g for g in (f"{name}.*", f"*{name}*") if any(fnmatchcase(n, g) for n in names)), None)
    if guess is not None:
        hint = f"did you mean {guess!r}?"
    else:
        close = difflib.get_close_matches(name, sorted(names), n=_SHOWN, cutoff=0.4)
        hint = f"closest names: {', '.join(map(repr, close))}." if close else "no name is close."
    found.append(
        f"no{of} tensor of {run} is named like {name!r}{where} (--name is a glob matched against whole "
        f"names); {hint} The request is kept, and served only if such a tensor appears."
    )
    return found

"""The kernels on the oldest supported Triton (3.2, the one torch 2.6 brings): AOT compile for sm_90/sm_80,
the interpreter golden tests, and results bit-identical to the venv's Triton (the newest, which the rest of
the suite runs).

A Triton wheel is ~250 MB and the check takes a minute or two, so it runs only when the kernels' source
(trainmon/stats/triton_kernels.py) changed since it last passed: bench/triton_checked.json records the
source hash that ``bench/triton_versions.sh --record`` checked, and a pass on this machine leaves a marker
in the cache folder (``$TRAINMON_TRITON_CACHE``, default ``~/.cache/trainmon-triton``, which also keeps the
wheel; CI keeps it only while a run gets the same machine back). ``TRAINMON_TRITON_OLDEST=always`` runs it
regardless, ``never`` skips it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "triton_versions.py"


def versions_module():
    spec = importlib.util.spec_from_file_location("triton_versions", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("triton_versions", module)  # dataclasses look their module up
    spec.loader.exec_module(sys.modules["triton_versions"])
    return sys.modules["triton_versions"]


def already_checked(tv, sha: str) -> str | None:
    """Where a pass of the oldest version for this kernel source is recorded, or None."""
    if tv.RECORD.exists():
        record = json.loads(tv.RECORD.read_text())
        entry = record.get("versions", {}).get(tv.OLDEST, {})
        if record.get("kernels_sha256") == sha and entry.get("ok"):
            return f"{tv.RECORD.name} ({record.get('when')})"
    marker = tv.cache_dir() / "results" / f"{tv.OLDEST}-{sha}.ok"
    return str(marker) if marker.exists() else None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kernels_compile_and_agree_on_the_oldest_supported_triton():
    mode = os.environ.get("TRAINMON_TRITON_OLDEST", "auto").strip().lower()
    if mode == "never":
        pytest.skip("TRAINMON_TRITON_OLDEST=never")
    tv = versions_module()
    sha = tv.kernels_sha256()
    where = already_checked(tv, sha)
    if mode != "always" and where:
        pytest.skip(f"triton {tv.OLDEST} passed for this kernel source: {where}")
    site = tv.install(tv.OLDEST, tv.cache_dir())  # downloads the wheel once
    result = tv.check(tv.OLDEST, site, timeout=400)
    assert result.compile == "pass", result.compile
    assert result.interpreter_ok, result.interpreter
    assert result.digest == tv.digest(None), "the oldest Triton computes other bits than the venv's"
    marker = tv.cache_dir() / "results" / f"{tv.OLDEST}-{sha}.ok"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"version": tv.OLDEST, "interpreter": result.interpreter}) + "\n")

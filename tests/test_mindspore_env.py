"""The MindSpore tests (tests_ms/) in their own virtual environment (.venv-ms: MindSpore 2.10 needs
numpy<2 and must not share the torch venv). ``scripts/setup_mindspore.sh`` creates or refreshes it (about a
minute the first time, a few seconds after), then tests_ms runs there; its result is this test's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mindspore_suite_passes_in_its_own_venv():
    setup = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup_mindspore.sh")], cwd=ROOT, capture_output=True, text=True
    )
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    assert "with mindspore 2.10.0 numpy 1." in setup.stdout
    python = ROOT / ".venv-ms" / "bin" / "python"
    tests = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests_ms"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert tests.returncode == 0, tests.stdout[-6000:] + tests.stderr[-3000:]
    assert " passed" in tests.stdout and "failed" not in tests.stdout and "skipped" not in tests.stdout
    # the torch venv is untouched: MindSpore is not importable from it
    assert subprocess.run([sys.executable, "-c", "import mindspore"], capture_output=True).returncode != 0

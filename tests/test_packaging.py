"""The wheel carries every module of the library and the TensorBoard plugin: its entry point, and every
asset its frontend loads (the plugin's iframe may load nothing from outside TensorBoard)."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "tb_plugin" / "trainmon_tb" / "static"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
        ],
        check=True,
        timeout=300,
    )
    (path,) = out.glob("trainmon-*.whl")
    return zipfile.ZipFile(path)


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_wheel_has_the_plugin_entry_point_and_every_static_asset(wheel):
    names = set(wheel.namelist())
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = wheel.read(entry_points).decode()
    assert "[tensorboard_plugins]\ntrainmon = trainmon_tb.loader:TrainmonLoader" in text
    shipped = {n.removeprefix("trainmon_tb/static/") for n in names if n.startswith("trainmon_tb/static/")}
    sources = {p.name for p in STATIC.iterdir() if p.suffix in (".js", ".css")}
    assert sources and sources <= shipped
    for module in ("loader", "plugin", "runs", "anomaly_index", "stat_index", "dump_view", "paths", "params"):
        assert f"trainmon_tb/{module}.py" in names
    assert not [n for n in names if "tfevents" in n]


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_wheel_has_every_module_of_the_library(wheel):
    names = set(wheel.namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "trainmon").rglob("*.py")}
    assert len(modules) > 80
    shipped = {n for n in names if n.startswith("trainmon/") and n.endswith(".py")}
    assert sorted(modules - shipped) == []  # a folder without __init__.py would be left out
    assert sorted(shipped - modules) == []  # nor a module that no longer exists


def test_frontend_loads_only_its_own_files():
    for path in STATIC.iterdir():
        text = path.read_text()
        # no CDN, no absolute URL: the CSP would block it, and --path_prefix needs relative URLs
        assert not re.search(r"""(?:src|href|from|import|url|fetch)\s*\(?\s*['"`](?:https?:)?//""", text), (
            path.name
        )
        for target in re.findall(r"""(?:from|import)\s*\(?\s*['"](\.[^'"]+)['"]""", text):
            assert (STATIC / target).resolve().is_file(), f"{path.name} imports missing {target}"
    assert (
        "export async function render" in (STATIC / "index.js").read_text()
        or "export function render" in (STATIC / "index.js").read_text()
    )

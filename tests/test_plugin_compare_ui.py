"""The trainmon tab's comparison of two runs in a real TensorBoard, driven by headless Chromium through
Playwright: choose two real training runs (tests/compare_runs.py: the base network and one with GELU's tanh
approximation), see the step x tensor heatmap with the first divergence outlined and named, hover a cell,
and press the button that requests dumps of that tensor and its module in both runs. The screenshot is the
user guide's ``plugin-compare.png`` (``TRAINMON_SCREENSHOT_DIR=docs/img``). Needs chromium and playwright
(scripts/setup.sh installs both); it does not skip without them."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import time
from pathlib import Path

import compare_runs
import numpy as np
import pytest
from playwright.sync_api import expect, sync_playwright
from tbserver import get_json, tensorboard_server
from test_plugin_ui import CHROMIUM_ARGS, TIMEOUT_MS, loopback_only, open_tab

from trainmon.run.layout import requests_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _wait_for_runs(base: str, names: set[str]) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            enabled = get_json(f"{base}/data/plugins_listing").get("trainmon", {}).get("enabled")
            runs = get_json(f"{base}/data/plugin/trainmon/runs") if enabled else {}
        except OSError:
            runs = {}
        if names <= {r["run"] for r in runs.get("runs", [])}:
            return
        assert time.monotonic() < deadline, f"the plugin never listed {names}: {runs}"
        time.sleep(0.25)


def test_two_runs_are_compared_in_the_tab_and_the_divergence_dumped(tmp_path):
    logdir = tmp_path / "logs"
    for variant in ("base", "forward"):
        compare_runs.train(logdir / variant, variant)
    shots = Path(os.environ.get("TRAINMON_SCREENSHOT_DIR") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not on the PATH: run scripts/setup.sh (apt-get install chromium)"
    with tensorboard_server(logdir, tmp_path, "true", ["--trainmon_allow_dump_requests"]) as base:
        _wait_for_runs(base, {"base", "forward"})
        problems: list[str] = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1400})
                page.set_default_timeout(TIMEOUT_MS)
                page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
                page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
                page.route("**/*", loopback_only(base, problems))
                frame = open_tab(page, f"{base}/#trainmon")
                panel = frame.locator("#compare-panel")
                panel.scroll_into_view_if_needed()
                frame.locator("#compare-a").select_option("base")
                frame.locator("#compare-b").select_option("forward")
                frame.locator("#compare-run").click()
                canvas = frame.locator("#compare-canvas")
                expect(canvas).to_be_visible()
                expect(canvas).to_have_attribute("data-pairs", "51")
                info = frame.locator("#compare-info")
                expect(info).to_contain_text("first divergence: step 0, forward, actv act.output")
                expect(info).to_contain_text("act's forward: its output differs while its input agrees")
                evidence = frame.locator("#compare-evidence")
                expect(evidence.locator(".ev-differs")).to_have_attribute("data-name", "act.output")
                expect(evidence.locator(".ev-agrees")).to_have_attribute("data-name", "act.input")
                first = frame.locator(".hm-label.compare-first")
                expect(first).to_have_count(1)
                expect(first).to_have_text("actv act.output")
                # hovering the outlined cell tells its steps, its relative difference and that it diverges
                labels = "[...document.querySelectorAll('#compare-heatmap .hm-label')]"
                row = int(frame.evaluate(f"{labels}.findIndex(l => l.classList.contains('compare-first'))"))
                box = canvas.bounding_box()
                bins = int(canvas.get_attribute("data-bins"))
                row_h = box["height"] / 51
                page.mouse.move(box["x"] + box["width"] / bins / 2, box["y"] + (row + 0.5) * row_h)
                tooltip = frame.locator(".tm-tooltip")
                expect(tooltip).to_contain_text("actv act.output")
                expect(tooltip).to_contain_text("DIVERGES")
                panel.screenshot(path=shots / "plugin-compare.png")
                # the button: dump requests of the divergent tensor and its module, in both runs
                button = frame.locator("#compare-dumps")
                expect(button).to_be_enabled()
                button.click()
                result = frame.locator("#compare-dumps-result")
                expect(result).to_contain_text("4 dump requests written to both runs for step 0, rank 0")
                expect(result).to_have_attribute("data-requests", "4")
            finally:
                browser.close()
        assert not problems, problems
    for run in ("base", "forward"):
        lines = [json.loads(x) for x in requests_file(logdir / run).read_text().splitlines()]
        assert {(r["name"], r["kind"], r["step"], r["rank"]) for r in lines} == {
            ("act.output", "actv", 0, 0), ("act.*", "actv", 0, 0)}  # fmt: skip


def test_the_tooltip_gives_the_decision_with_its_parts_and_the_map_has_steps_and_ranks_at_once(tmp_path):
    """Issue 45, "Comparisons" 3 and 5: initial weights 30% apart (tests/compare_runs.py ``weights30``). A
    cell whose difference is far above the pair's tolerance and within it only with the state allowance says
    so, with the command line's score; the heat map labels its steps; the rank list is filled as soon as two
    runs are chosen, before any comparison answers."""
    logdir = tmp_path / "logs"
    for variant in ("base", "weights30"):
        compare_runs.train(logdir / variant, variant)
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not on the PATH: run scripts/setup.sh (apt-get install chromium)"
    with tensorboard_server(logdir, tmp_path, "true") as base:
        _wait_for_runs(base, {"base", "weights30"})
        problems: list[str] = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1400})
                page.set_default_timeout(TIMEOUT_MS)
                page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
                page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
                page.route("**/*", loopback_only(base, problems))
                frame = open_tab(page, f"{base}/#trainmon")
                frame.locator("#compare-panel").scroll_into_view_if_needed()
                frame.locator("#compare-a").select_option("base")
                frame.locator("#compare-b").select_option("weights30")
                # no comparison asked for yet: the ranks come from the run list
                ranks = frame.locator("#compare-rank option")
                expect(ranks).to_have_count(1)
                expect(ranks).to_have_attribute("value", "0")
                assert frame.locator("#compare-canvas").count() == 0
                frame.locator("#compare-run").click()
                canvas = frame.locator("#compare-canvas")
                expect(canvas).to_have_attribute("data-pairs", "51")
                info = frame.locator("#compare-info")
                expect(info).to_contain_text("first divergence: step 0, start, param_origin fc1.weight")
                expect(info).to_contain_text("the initial weights")
                ticks = frame.locator("#compare-axis .tl-tick-label")
                assert [int(t) for t in ticks.all_text_contents()] == list(range(compare_runs.STEPS))
                expect(frame.locator("#compare-axis .tl-axis-title")).to_have_text("step")
                # the cell to hover, from the same comparison as the tab drew (its bins)
                bins = int(canvas.get_attribute("data-bins"))
                answer = get_json(
                    f"{base}/data/plugin/trainmon/compare?run_a=base&run_b=weights30&bins={bins}"
                )
                n = len(answer["pairs"])

                def cells(name: str) -> np.ndarray:
                    return np.frombuffer(base64.b64decode(answer[name]), dtype="<f4").reshape(n, bins)

                scores, rel, slack = cells("scores"), cells("rel_at"), cells("slack_at")
                rtol = np.asarray([p["rtol"] for p in answer["pairs"]], dtype=np.float32)[:, None]
                explained = np.isfinite(scores) & (rel > 10 * rtol) & (scores <= 1) & (slack > 0)
                row, column = (int(x[0]) for x in np.nonzero(explained))
                box = canvas.bounding_box()
                row_h, bin_w = box["height"] / n, box["width"] / bins
                labels = frame.locator("#compare-heatmap .hm-label")

                def hover(row: int, column: int) -> None:  # the row's label scrolled into view first
                    labels.nth(row).scroll_into_view_if_needed()
                    canvas.hover(position={"x": (column + 0.5) * bin_w, "y": (row + 0.5) * row_h})

                hover(row, column)
                tooltip = frame.locator(".tm-tooltip")
                pair = answer["pairs"][row]
                expect(tooltip).to_contain_text(f"{pair['kind']} {pair['name']}")
                expect(tooltip).to_contain_text("+ state allowance")
                expect(tooltip).to_contain_text("within tolerance (score \u2264 1)")
                text = tooltip.inner_text()
                assert "DIVERGES" not in text, text
                score = float(re.search(r"^score ([0-9.e+-]+): within", text, re.M).group(1))
                assert score == pytest.approx(float(scores[row, column]), rel=1e-4) and score <= 1
                # a divergent cell: its score above 1, and the decision says so
                first = answer["marked"]
                hover(first["row"], first["bin"])
                expect(tooltip).to_contain_text("param_origin fc1.weight")
                expect(tooltip).to_contain_text("DIVERGES in this bin")
                expect(tooltip).to_contain_text("tolerance of float32: the parameters the step starts from")
            finally:
                browser.close()
        assert not problems, problems

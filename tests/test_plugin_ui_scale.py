"""The grouped timeline in a real TensorBoard, driven by headless Chromium through Playwright: a run of 300
ranks shows 150 rows of 2 ranks; clicking a group's label shows its two ranks below it, a rank's cell lists
that rank's anomalies, a live refresh with nothing new is answered "unchanged" (nothing redrawn), and clicking
the label again folds the group. Needs chromium on the PATH and
playwright (scripts/setup.sh installs both)."""

from __future__ import annotations

import shutil
import time

import pytest
from playwright.sync_api import expect, sync_playwright
from tbserver import tensorboard_server
from test_plugin_scale import NAN_RANK, WORLD, write_world
from test_plugin_ui import CHROMIUM_ARGS, TIMEOUT_MS, api, loopback_only, open_tab


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_group_of_ranks_expands_to_its_ranks(tmp_path):
    logdir = tmp_path / "logs"
    write_world(logdir / "big")
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not on the PATH: run scripts/setup.sh (apt-get install chromium)"
    with tensorboard_server(logdir, tmp_path, "true") as base:
        deadline = time.monotonic() + 60
        while not any(r["anomalies"] == WORLD + 1 for r in api(base, "runs")["runs"]):
            assert time.monotonic() < deadline, "the plugin never indexed the run"
            time.sleep(0.25)
        problems: list[str] = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1300})
                page.set_default_timeout(TIMEOUT_MS)
                page.on("console", lambda m: m.type == "error" and problems.append(m.text))
                page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
                page.route("**/*", loopback_only(base, problems))
                frame = open_tab(page, f"{base}/#trainmon")
                svg = frame.locator("#timeline-svg")
                expect(svg).to_have_attribute("data-group-size", "2")
                expect(svg).to_have_attribute("data-rows", str(WORLD // 2))
                expect(frame.locator("#timeline-info")).to_contain_text(f"{WORLD} ranks in groups of 2")
                group = frame.locator('text.tl-group[data-row="136-137"]')
                expect(group).to_contain_text("\u25b8 ranks 136\u2013137")  # and its <title>
                expect(frame.locator('rect.tl-cell.tl-origin[data-row="136-137"]')).to_have_count(1)

                group.click()  # show the group's ranks
                expect(svg).to_have_attribute("data-rows", str(WORLD // 2 + 2))
                expect(group).to_have_attribute("data-row-kind", "open")
                expect(frame.locator('text.tl-member[data-row="137"]')).to_contain_text("rank 137")
                origin = frame.locator('rect.tl-cell.tl-origin[data-row="137"]')
                expect(origin).to_have_count(1)
                origin.click()
                expect(frame.locator("#detail-title")).to_contain_text(f"rank {NAN_RANK}")
                expect(frame.locator("#detail-title")).to_contain_text("step 3 \u00b7 1 anomaly")
                frame.locator("#timeline-panel").screenshot(path=tmp_path / "grouped-timeline.png")

                # a live refresh with nothing new: the server answers "unchanged" and nothing is redrawn
                frame.evaluate("window.trainmon.refresh()")
                expect(frame.locator("#trainmon")).to_have_attribute("data-timeline-unchanged", "1")
                expect(frame.locator('text.tl-member[data-row="137"]')).to_have_count(1)

                group.click()  # fold it again
                expect(svg).to_have_attribute("data-rows", str(WORLD // 2))
                expect(frame.locator('text.tl-member[data-row="137"]')).to_have_count(0)
            finally:
                browser.close()
        assert not problems, problems

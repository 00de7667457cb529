"""The grouped timeline in a real TensorBoard, driven by headless Chromium through Playwright: a run of 300
ranks shows 150 rows of 2 ranks; clicking a group's label shows its two ranks below it, a rank's cell lists
that rank's anomalies, a live refresh with nothing new is answered "unchanged" (nothing redrawn), and clicking
the label again folds the group. At 256 ranks with a NaN that persists, where it started stands out (issue
32). Needs chromium on the PATH and playwright (scripts/setup.sh installs both)."""

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


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_first_nan_stands_out_at_256_ranks(tmp_path):
    """Issue 32's walk: 256 ranks, rank 150's NaN one step before every other rank's, and it persists. The
    timeline marks where a NaN started on each row (129 cells, none where it persists) and the first one
    apart (a ring and a red marker); it opens scrolled to that row, the first-NaN button scrolls back to it,
    the ranks filter `150` shows rank 150 alone; a damaged file is named in a notice and the rest shown."""
    from test_plugin_scale import NAN_RANK_256, NAN_STEP_256, RANKS_256, STEPS_256, write_persisting_nan

    from trainmon.run.columnar import segments
    from trainmon.run.layout import anomalies_rank_dir

    logdir = tmp_path / "logs"
    write_persisting_nan(logdir / "r256")
    broken = segments(anomalies_rank_dir(logdir / "r256", 7))[0].path  # a rank of group 6-7, cut short
    broken.write_bytes(broken.read_bytes()[:-100])
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not on the PATH: run scripts/setup.sh (apt-get install chromium)"
    group = f"{NAN_RANK_256}-{NAN_RANK_256 + 1}"
    with tensorboard_server(logdir, tmp_path, "true") as base:
        deadline = time.monotonic() + 60
        while not any(r["anomalies"] > 0 for r in api(base, "runs")["runs"]):
            assert time.monotonic() < deadline, "the plugin never indexed the run"
            time.sleep(0.25)
        problems: list[str] = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1100})
                page.set_default_timeout(TIMEOUT_MS)
                page.on("console", lambda m: m.type == "error" and problems.append(m.text))
                page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
                page.route("**/*", loopback_only(base, problems))
                frame = open_tab(page, f"{base}/#trainmon")
                svg = frame.locator("#timeline-svg")
                expect(svg).to_have_attribute("data-rows", str(RANKS_256 // 2))
                expect(svg).to_have_attribute("data-bins", str(STEPS_256))

                # -- marks: where a NaN started on each row (rank 150 at its step, every row at the next),
                # not where it persists; the first NaN of the run apart, with one red column marker
                origins = frame.locator("rect.tl-cell.tl-origin")
                expect(origins).to_have_count(RANKS_256 // 2 + 1)
                starts = {int(s) for s in origins.evaluate_all("rs => rs.map(r => r.dataset.stepLo)")}
                assert starts == {NAN_STEP_256, NAN_STEP_256 + 1}
                first = frame.locator("rect.tl-cell.tl-first")
                expect(first).to_have_count(1)
                expect(first).to_have_attribute("data-row", group)
                expect(first).to_have_attribute("data-step-lo", str(NAN_STEP_256))
                expect(frame.locator("circle.tl-first-ring")).to_have_count(1)
                expect(frame.locator("path.tl-first-mark")).to_have_count(1)
                expect(frame.locator("path.tl-origin-mark")).to_have_count(2)
                # where it persists: one wide cell a row, unmarked
                after = NAN_STEP_256 + 2
                persisting = frame.locator(f'rect.tl-cell[data-row="{group}"][data-step-lo="{after}"]')
                expect(persisting).to_have_attribute("data-origin", "0")
                expect(persisting).to_have_attribute("data-step-hi", str(STEPS_256 - 1))

                # -- scroll: the tab opens at the first NaN's row; the button scrolls back to it
                scroller = frame.locator("#timeline .tl-scroll")

                def first_in_view() -> bool:
                    return frame.evaluate(
                        """() => {
                          const s = document.querySelector('#timeline .tl-scroll').getBoundingClientRect();
                          const c = document.querySelector('rect.tl-first').getBoundingClientRect();
                          return c.top >= s.top && c.bottom <= s.bottom; }"""
                    )

                assert scroller.evaluate("s => s.scrollTop") > 0 and first_in_view()
                scroller.evaluate("s => { s.scrollTop = 0; }")
                assert not first_in_view()
                frame.locator("#jump-first").click()
                expect(frame.locator("#detail-title")).to_contain_text(
                    f"rank {NAN_RANK_256} \u00b7 step {NAN_STEP_256}"
                )
                assert scroller.evaluate("s => s.scrollTop") > 0 and first_in_view()
                frame.locator("#timeline-panel").screenshot(path=tmp_path / "first-nan-256.png")

                # -- a damaged file: named, and the rest of the run shown
                notice = frame.locator("#damaged")
                expect(notice).to_be_visible()
                expect(notice.locator("li")).to_have_count(1)
                expect(notice).to_contain_text(broken.relative_to(logdir / "r256").as_posix())

                # -- the ranks filter 150: rank 150 alone
                frame.locator("#filter-ranks").fill(str(NAN_RANK_256))
                frame.locator("#filter-ranks").dispatch_event("change")
                expect(svg).to_have_attribute("data-rows", "1")
                expect(frame.locator("text.tl-label")).to_have_count(1)
                expect(frame.locator("text.tl-label")).to_have_attribute("data-row", str(NAN_RANK_256))
                expect(frame.locator("text.tl-label")).to_contain_text(f"rank {NAN_RANK_256}")
                expect(frame.locator("rect.tl-cell.tl-first")).to_have_count(1)
                expect(frame.locator("rect.tl-cell.tl-origin")).to_have_count(1)
                expect(frame.locator("#timeline-info")).to_contain_text("anomalies")
            finally:
                browser.close()
        assert not problems, problems

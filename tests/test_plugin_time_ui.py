"""The tab's time views in a real TensorBoard, driven by headless Chromium through Playwright, on a run with
known per-rank times (tests/time_runs.py: 12 ranks, 300 steps, rank 9 sleeping 40 ms in its forward from
step 150, its straggler record written by the rule itself).

The time heat map is asked for only after the first view; it draws one cell per rank and step, the straggler's
forward cells the brightest from step 150 on; a cell's tooltip gives its rank, steps, max and median in ms
(the route's numbers); the straggler episode is on the anomaly timeline with its part and factor, and
clicking it opens the time heat map around its steps on its part with its rank's row marked; a rank's row
opens its time per step beside its gradient norm. Screenshots go to ``$TRAINMON_SCREENSHOT_DIR`` (the user
guide's ``plugin-time.png`` and ``plugin-rank-time.png``: ``TRAINMON_SCREENSHOT_DIR=docs/img``), else to
tmp_path. Needs chromium on the PATH and playwright (scripts/setup.sh installs both)."""

from __future__ import annotations

import base64
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from playwright.sync_api import expect, sync_playwright
from tbserver import tensorboard_server
from test_plugin_ui import CHROMIUM_ARGS, TIMEOUT_MS, api, loopback_only, open_tab
from time_runs import write_timed_run

WORLD, STEPS, STRAGGLER, FROM = 12, 300, 9, 150
RUN = "timed"


def pixel(frame, canvas: str, row: int, bin_: int) -> list[int]:
    """The RGB drawn at the centre of a heat map cell."""
    return frame.evaluate(
        """([sel, row, bin]) => {
          const c = document.querySelector(sel);
          const sx = c.width / Number(c.dataset.bins), sy = c.height / Number(c.dataset.names);
          const x = Math.floor((bin + 0.5) * sx), y = Math.floor((row + 0.5) * sy);
          const d = c.getContext('2d').getImageData(x, y, 1, 1);
          return [d.data[0], d.data[1], d.data[2]];
        }""",
        [canvas, row, bin_],
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_time_heat_map_the_straggler_episode_and_a_rank_s_time(tmp_path):
    logdir = tmp_path / "logs"
    write_timed_run(logdir / RUN, WORLD, STEPS, STRAGGLER, FROM)
    shots = Path(os.environ.get("TRAINMON_SCREENSHOT_DIR") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not on the PATH: run scripts/setup.sh (apt-get install chromium)"
    with tensorboard_server(logdir, tmp_path, "true") as base:
        deadline = time.monotonic() + 60
        while not any(r["run"] == RUN and r["stragglers"] for r in api(base, "runs")["runs"]):
            assert time.monotonic() < deadline, "the plugin never indexed the run"
            time.sleep(0.25)
        (episode,) = api(base, "timeline", run=RUN, bins=300)["episodes"]
        assert (episode["rank"], episode["phase"]) == (STRAGGLER, "forward")
        # its span: from its first slow step to the last step (it never ends), though named a few steps later
        assert (episode["from_step"], episode["to_step"]) == (FROM, STEPS - 1) and episode["step"] > FROM
        problems: list[str] = []
        asked: list[str] = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1900})
                page.set_default_timeout(TIMEOUT_MS)
                page.on("console", lambda m: m.type == "error" and problems.append(m.text))
                page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
                page.on("request", lambda r: "/data/plugin/trainmon/" in r.url and asked.append(r.url))
                page.route("**/*", loopback_only(base, problems))
                frame = open_tab(page, f"{base}/#trainmon")

                # -- the heat map, asked for after the first view (the timeline) only
                canvas = frame.locator("#time-canvas")
                expect(canvas).to_have_attribute("data-names", str(WORLD))
                expect(canvas).to_have_attribute("data-bins", str(STEPS))
                routes = [u.split("/data/plugin/trainmon/")[1].split("?")[0] for u in asked]
                assert routes.index("time_heatmap") > routes.index("timeline"), routes
                heat = frame.locator("#time-heatmap")
                # the part of the step the straggler rule flagged, not the whole step every rank waits in
                expect(heat).to_have_attribute("data-time", "forward")
                info = f"{WORLD} ranks \u00b7 steps 0\u2013{STEPS - 1}"
                expect(frame.locator("#time-info")).to_contain_text(info)
                expect(frame.locator("#time-legend")).to_contain_text("forward time, ms (max")
                frame.locator("#time-name").select_option("step")
                expect(heat).to_have_attribute("data-time", "step")

                frame.locator("#time-name").select_option("forward")
                expect(heat).to_have_attribute("data-time", "forward")
                late, early, other = (pixel(frame, "#time-canvas", STRAGGLER, b) for b in (STEPS - 20, 20, 0))
                calm = pixel(frame, "#time-canvas", 0, STEPS - 20)
                assert late[0] > 200 and late[1] > 200, late  # the top of the colour scale: yellow
                assert max(early) < 120 and max(calm) < 120 and max(other) < 120, (early, calm, other)

                # a cell's tooltip: its rank, step, max and median, the route's numbers
                d = api(base, "time_heatmap", run=RUN, time="forward", bins=STEPS)
                top = np.frombuffer(base64.b64decode(d["max"]), "<f4").reshape(WORLD, STEPS)
                box = canvas.bounding_box()
                bin_ = STEPS - 20
                canvas.hover(position={
                    "x": (bin_ + 0.5) * box["width"] / STEPS,
                    "y": (STRAGGLER + 0.5) * box["height"] / WORLD,
                })  # fmt: skip
                tip = frame.locator(".tm-tooltip")
                expect(tip).to_contain_text(f"rank {STRAGGLER}")
                expect(tip).to_contain_text(f"step {bin_}")
                expect(tip).to_contain_text(f"forward: max {top[STRAGGLER, bin_]:.2f} ms")
                expect(tip).to_contain_text(f"forward: median {top[STRAGGLER, bin_]:.2f} ms")  # one value
                frame.locator("#time-agg").select_option("median")
                expect(heat).to_have_attribute("data-agg", "median")
                expect(frame.locator("#time-legend")).to_contain_text("median of each cell")
                frame.locator("#time-agg").select_option("max")
                # a live refresh with nothing new: the server answers "unchanged", nothing is redrawn
                frame.evaluate("window.trainmon.refresh()")
                expect(heat).to_have_attribute("data-unchanged", "1")
                expect(heat).to_have_attribute("data-agg", "max")

                # -- the straggler episode on the timeline, with its part and factor; its click
                mark = frame.locator(f'g.tl-episode[data-rank="{STRAGGLER}"]')
                expect(mark).to_have_count(1)
                expect(mark).to_have_attribute("data-phase", "forward")
                expect(mark.locator("text")).to_have_text(f"forward {episode['factor']:.1f}x")
                expect(frame.locator("#timeline-legend")).to_contain_text("straggler episode")
                frame.locator("#time-name").select_option("step")
                expect(heat).to_have_attribute("data-time", "step")
                mark.locator("path").click()
                lo = episode["from_step"] - 25  # 100 steps from a quarter before its first slow step
                expect(heat).to_have_attribute("data-time", "forward")
                expect(heat).to_have_attribute("data-step-lo", str(lo))
                expect(heat).to_have_attribute("data-step-hi", str(lo + 99))
                expect(frame.locator("#time-name")).to_have_value("forward")
                expect(frame.locator("#timeline-svg")).to_have_attribute("data-step-lo", str(lo))
                selected = frame.locator("#time-heatmap .hm-label.selected")
                expect(selected).to_have_attribute("data-name", str(STRAGGLER))
                expect(frame.locator("#time-heatmap .hm-selrow")).to_be_visible()
                frame.locator("#time-panel").screenshot(path=shots / "plugin-time.png")

                # -- a rank's row: its time per step beside its gradient norm, over the zoomed steps
                frame.locator(f'#time-heatmap .hm-label[data-name="{STRAGGLER}"]').click()
                panel = frame.locator("#rank-panel")
                expect(panel).to_be_visible()
                expect(panel).to_have_attribute("data-rank", str(STRAGGLER))
                title = f"rank {STRAGGLER} \u00b7 100 timed steps"
                expect(frame.locator("#rank-title")).to_contain_text(title)
                stacked = frame.locator("#rank-time svg.stacked-svg")
                expect(stacked).to_have_attribute("data-points", "100")
                parts = "data,forward,backward,optimizer,comm,gc,monitor,other"
                expect(stacked).to_have_attribute("data-parts", parts)
                expect(frame.locator("#rank-time path.stacked-area")).to_have_count(8)
                expect(frame.locator("#rank-time path.stacked-wait")).to_have_count(1)
                series = frame.locator("#rank-numerics svg.series-svg")
                expect(series).to_have_attribute("data-points", "100")
                expect(series).to_have_attribute("data-anomalies", "1")  # the episode's record
                expect(frame.locator("#rank-numerics circle.anomaly-marker")).to_have_attribute(
                    "data-step", str(episode["step"])
                )
                panel.screenshot(path=shots / "plugin-rank-time.png")
                frame.locator("#rank-close").click()
                expect(panel).to_be_hidden()
            finally:
                browser.close()
        assert not problems, problems

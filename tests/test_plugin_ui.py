"""The trainmon tab in a real TensorBoard, driven by headless Chromium through Playwright.

``trainmon demo`` writes a run whose forward output of ``layers.2.mlp.fc2`` turns NaN at step 140; the test
checks that the tab finds it, lists it, opens its dump with the values of the safetensors file, charts
statistics, files a dump request, and that the axis toggle, the filters, the error bar, TensorBoard's reload
button and deep links work. Screenshots go to ``$TRAINMON_SCREENSHOT_DIR`` (the user guide's images:
``TRAINMON_SCREENSHOT_DIR=docs/img .venv/bin/python -m pytest tests/test_plugin_ui.py``), else to tmp_path.
Needs chromium on the PATH and playwright (scripts/setup.sh installs both); it does not skip without them.

The exact-capture test: from the origin's anomaly row, the tab opens the dump taken at the NaN's own step
(``alert.capture: exact``) and shows the module call, its two finite inputs next to its bad output, with
where the bad values are; the run is a real tiny torch run (test_plugin_exact_run.py). A second run, whose
only dump of the origin is a request-based one taken a step later, says so in its row. Its screenshot is the
user guide's ``plugin-exact-dump.png``.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import acc_runs
import numpy as np
import origin_cases
import pytest
import test_plugin_exact_run as exact
import torch
from playwright.sync_api import Frame, Page, Route, expect, sync_playwright
from safetensors.torch import load_file
from tbserver import get_json, tensorboard_server
from trainmon_tb.anomaly_index import bin_edges

import trainmon
from trainmon.anomaly.log import AnomalyLog
from trainmon.cli.demo import NAN_MODULE
from trainmon.read.dump_contents import load_dump
from trainmon.run.records import Anomaly
from trainmon.writer.dumps import DumpWriter

NAN_STEP = 140  # the demo's default: 10 steps before the end of its 150
ORIGIN = f"{NAN_MODULE}.output"
RUN = "demo"
# the demo model's (trainmon.demo: batch 16, sequence 32, width 64); test_plugin_routes.py checks every
# tensor's against the model itself
ORIGIN_SHAPE = "[16, 32, 64]"  # the output of layers.2.mlp.fc2, nn.Linear(256, 64): batch x sequence x 64
FC1_SHAPE = "[256, 64]"  # the weight (and its gradient) of layers.0.mlp.fc1, nn.Linear(64, 256): [out, in]
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TIMEOUT_MS = 20_000
expect.set_options(timeout=TIMEOUT_MS)  # a loaded CI machine: the default 5 s is short


def api(base: str, route: str, **params) -> dict:
    return get_json(f"{base}/data/plugin/trainmon/{route}?" + urllib.parse.urlencode(params))


def wait_for_run(base: str) -> dict:
    """Polls until TensorBoard lists the plugin as enabled and the plugin has indexed the demo run."""
    deadline = time.monotonic() + 60
    while True:
        try:
            listing = get_json(f"{base}/data/plugins_listing")
            runs = api(base, "runs") if listing.get("trainmon", {}).get("enabled") else {"runs": []}
        except OSError:
            runs = {"runs": []}
        run = next((r for r in runs["runs"] if r["run"] == RUN), None)
        if run and run["anomalies"] > 0 and run["stat_kinds"] and run["dumps"] > 0:
            assert runs["allow_dump_requests"] is True
            return run
        assert time.monotonic() < deadline, f"the plugin never listed the demo run: {runs}"
        time.sleep(0.25)


def loopback_only(base: str, problems: list[str]) -> Callable[[Route], None]:
    """A route handler that lets the page reach the TensorBoard server at ``base`` and nothing else."""

    def guard(route: Route) -> None:
        url = route.request.url
        if url.startswith((base + "/", "data:", "blob:")) or url == base:
            route.continue_()
        else:
            problems.append(f"blocked request to {url}")
            route.abort()

    return guard


def open_tab(page: Page, url: str) -> Frame:
    page.goto(url)
    iframe = page.wait_for_selector('iframe[src*="plugin_entry.html?name=trainmon"]', timeout=TIMEOUT_MS)
    frame = iframe.content_frame()
    assert frame is not None
    frame.wait_for_selector('#trainmon[data-ready="1"]', timeout=TIMEOUT_MS)
    return frame


class StepCell:
    """A timeline cell (a run of ``data-span`` bins) at one of its steps: clicks and boxes are that step's
    bin, as a user points at it."""

    def __init__(self, frame: Frame, rect, step: int) -> None:
        self.rect, self.step = rect, step
        svg = frame.locator("#timeline-svg")
        lo, hi = int(svg.get_attribute("data-step-lo")), int(svg.get_attribute("data-step-hi"))
        _, edges = bin_edges(lo, hi, int(svg.get_attribute("data-bins")))
        at = max(i for i, e in enumerate(edges[:-1]) if e <= step)
        self.offset = at - int(rect.get_attribute("data-bin"))
        self.span = int(rect.get_attribute("data-span"))

    def get_attribute(self, name: str) -> str | None:
        return self.rect.get_attribute(name)

    def _x(self, box: dict) -> float:
        return (self.offset + 0.5) * box["width"] / self.span

    def bounding_box(self) -> dict:
        box = self.rect.bounding_box()
        return {"x": box["x"] + self._x(box) - 0.5, "y": box["y"], "width": 1.0, "height": box["height"]}

    def click(self) -> None:
        box = self.rect.bounding_box()
        self.rect.click(position={"x": self._x(box), "y": box["height"] / 2})


def cell_with_step(frame: Frame, selector: str, step: int) -> StepCell:
    """The timeline cell matching `selector` whose step range holds `step`, at that step."""
    cells = frame.locator(selector)
    for i in range(cells.count()):
        c = cells.nth(i)
        if int(c.get_attribute("data-step-lo")) <= step <= int(c.get_attribute("data-step-hi")):
            return StepCell(frame, c, step)
    raise AssertionError(f"no cell {selector} holds step {step}")


def distinct_cells(answer: dict) -> int:
    """The cells the tab draws: one a run of bins (the server's cells, each kind of a run an entry)."""
    cells = {(r, b) for r, b in zip(answer["cells"]["row"], answer["cells"]["bin"], strict=True)}
    cells |= {(r, b) for r, b in zip(answer["origins"]["row"], answer["origins"]["bin"], strict=True)}
    return len(cells)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_trainmon_tab_shows_the_demo_nan(tmp_path):
    t_start = time.monotonic()
    logdir = tmp_path / "logs"
    run_dir = logdir / RUN
    subprocess.run(
        [sys.executable, "-m", "trainmon", "demo", "--logdir", str(run_dir)],
        check=True,
        stdout=subprocess.DEVNULL,
        # one intra-op thread: spinning OpenMP threads slow the tiny model down a lot on a busy machine
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    shots = Path(os.environ.get("TRAINMON_SCREENSHOT_DIR") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not on the PATH: run scripts/setup.sh (apt-get install chromium)"

    with tensorboard_server(logdir, tmp_path, "true", ["--trainmon_allow_dump_requests"]) as base:
        run = wait_for_run(base)
        problems: list[str] = []
        guard = loopback_only(base, problems)
        expected_console = []  # substrings of console errors a step provokes on purpose

        def on_console(msg):
            if msg.type != "error":
                return
            text = f"console.error: {msg.text} ({msg.location.get('url')})"
            if not any(s in text for s in expected_console):
                problems.append(text)

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1300})
                page.set_default_timeout(TIMEOUT_MS)
                page.on("console", on_console)
                page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
                page.route("**/*", guard)
                frame = open_tab(page, f"{base}/#trainmon")
                expect(frame.locator("#error")).to_be_hidden()
                expect(frame.locator("#run-select")).to_have_value(RUN)

                # -- timeline: the cells are the server's sparse cells; the first NaN is named
                jump = frame.locator("#jump-first")
                expect(jump).to_have_text(f"first nan: step {NAN_STEP}, rank 0, actv {ORIGIN} (origin)")
                svg = frame.locator("#timeline-svg")
                expect(svg).to_have_attribute("data-axis", "rank")
                bins = int(svg.get_attribute("data-bins"))
                timeline = api(base, "timeline", run=RUN, bins=bins)
                assert timeline["bins"] == bins
                expect(frame.locator("rect.tl-cell")).to_have_count(distinct_cells(timeline))
                assert run["steps"] == [0, 149]
                # the legend of a run without straggler episodes: its items, nothing for the missing one
                legend = frame.locator("#timeline-legend")
                expect(legend).to_contain_text("the first NaN/Inf of the run")
                expect(legend).not_to_contain_text("straggler episode")
                expect(legend).not_to_contain_text("null")
                frame.locator("#timeline-panel").screenshot(path=shots / "plugin-timeline.png")

                # -- brush: dragging from step 101 to step 120 zooms the timeline and the heatmap there
                a = cell_with_step(frame, 'rect.tl-cell[data-row="0"]', 101).bounding_box()
                b = cell_with_step(frame, 'rect.tl-cell[data-row="0"]', 120).bounding_box()
                y = a["y"] + a["height"] / 2
                page.mouse.move(a["x"] + a["width"] / 2, y)
                page.mouse.down()
                page.mouse.move(b["x"] + b["width"] / 2, y, steps=8)
                page.mouse.up()
                expect(svg).to_have_attribute("data-step-lo", "101")
                expect(svg).to_have_attribute("data-step-hi", "120")
                expect(frame.locator("#timeline-info")).to_contain_text("zoomed")
                expect(frame.locator("#hm-info")).to_contain_text("steps 101\u2013120")
                zoomed = api(
                    base, "timeline", run=RUN, bins=svg.get_attribute("data-bins"), step_lo=101, step_hi=120
                )
                expect(frame.locator("rect.tl-cell")).to_have_count(distinct_cells(zoomed))
                # a refresh (what the 10 s poll and TensorBoard's reload run) keeps the zoom and the selection
                cell_with_step(frame, 'rect.tl-cell[data-row="0"]', 110).click()
                expect(frame.locator("#detail-title")).to_contain_text("step 110")
                frame.evaluate("window.trainmon.refresh()")
                expect(svg).to_have_attribute("data-step-lo", "101")
                expect(frame.locator("#detail-title")).to_contain_text("step 110")
                expect(frame.locator("rect.tl-sel")).to_have_attribute("visibility", "visible")
                frame.locator("#reset-zoom").click()
                expect(svg).to_have_attribute("data-step-lo", "0")
                expect(svg).to_have_attribute("data-step-hi", "149")
                expect(frame.locator("#reset-zoom")).to_be_disabled()

                # -- detail: the origin cell lists the origin first
                origin_cell = cell_with_step(frame, 'rect.tl-cell[data-origin="1"][data-row="0"]', NAN_STEP)
                lo, hi = (
                    int(origin_cell.get_attribute("data-step-lo")),
                    int(origin_cell.get_attribute("data-step-hi")),
                )
                origin_cell.click()
                events = api(base, "events", run=RUN, step_lo=lo, step_hi=hi, ranks=0, limit=200)
                rows = frame.locator("tr.event")
                expect(rows).to_have_count(len(events["events"]))
                first = rows.first
                expect(first).to_have_attribute("data-origin", "1")
                expect(first).to_have_attribute("data-name", ORIGIN)
                expect(first).to_have_attribute("data-kind", "actv")
                expect(first).to_have_attribute("data-step", str(NAN_STEP))
                expect(first.locator(".badge-origin")).to_have_text("origin")
                expect(frame.locator("#detail-title")).to_contain_text(f"{events['total']} anomalies")
                # each row names its tensor's shape and dtype: the origin's output is batch x sequence x width
                expect(first.locator("td.col-shape")).to_have_text(f"{ORIGIN_SHAPE} float32")
                expect(first).to_have_attribute("data-shape", ORIGIN_SHAPE)
                shown = rows.locator("td.col-shape").all_text_contents()
                assert shown == [f"{e['shape']} {e['dtype']}" if e["shape"] else "" for e in events["events"]]
                assert sum(map(bool, shown)) == sum(1 for e in events["events"] if e["name"] != "*")

                # -- dump of the origin tensor: the statistics are those of the safetensors file
                own = [d for d in events["events"][0]["dumps"] if d["name"] == ORIGIN and d["kind"] == "actv"]
                assert own, events["events"][0]["dumps"]
                dump = own[0]
                first.locator(f'a.dump-open[data-path="{dump["path"]}"]').click()
                expect(frame.locator("#dump-view")).to_be_visible()
                tensor = load_file(run_dir / dump["path"])["tensor"]
                stats = frame.locator("#dump-stats")
                expect(stats.locator("td[data-stat=numel]")).to_have_text(str(tensor.numel()))
                expect(stats.locator("td[data-stat=nans]")).to_have_text(str(int(torch.isnan(tensor).sum())))
                expect(stats.locator("td[data-stat=infs]")).to_have_text(str(int(torch.isinf(tensor).sum())))
                assert int(torch.isnan(tensor).sum()) > 0  # the demo's NaN is in the dump
                expect(frame.locator("#dump-hist")).to_be_visible()
                download = frame.locator("a.dump-download")
                assert download.get_attribute("download") == Path(dump["path"]).name
                with urllib.request.urlopen(download.evaluate("a => a.href"), timeout=10) as r:
                    assert r.read() == (run_dir / dump["path"]).read_bytes()
                frame.locator("#detail-panel").screenshot(path=shots / "plugin-detail.png")
                frame.locator("#dump-panel").screenshot(path=shots / "plugin-dump.png")

                # -- "dump next step": one request line, with the id the page shows
                requests_file = run_dir / "plugins" / "trainmon" / "requests.jsonl"
                before = requests_file.read_text().splitlines() if requests_file.exists() else []
                button = first.locator("button.request-dump")
                expect(button).to_be_enabled()
                with page.expect_request(lambda r: r.url.endswith("/request_dump")) as posted:
                    button.click()
                assert posted.value.method == "POST"
                assert posted.value.headers["content-type"] == "application/json"
                assert json.loads(posted.value.post_data) == {
                    "run": RUN,
                    "name": ORIGIN,
                    "kind": "actv",
                    "rank": 0,
                }
                status = first.locator(".request-status.ok")
                expect(status).to_contain_text("requested")
                lines = requests_file.read_text().splitlines()
                assert len(lines) == len(before) + 1
                request = json.loads(lines[-1])
                assert (request["name"], request["kind"], request["rank"]) == (ORIGIN, "actv", 0)
                assert status.get_attribute("data-request-id") == request["id"]

                # -- a finite dump (the loss the spike flagged): histogram and min/max as the file says
                loss_events = api(
                    base, "events", run=RUN, step_lo=0, step_hi=149, name="loss", rules="turbulence"
                )
                with_dump = next(e for e in loss_events["events"] if e["dumps"])
                cell_with_step(frame, 'rect.tl-cell[data-row="0"]', with_dump["step"]).click()
                expect(rows.first).to_have_attribute("data-step", str(with_dump["step"]))
                loss_dump = with_dump["dumps"][0]
                frame.locator(f'a.dump-open[data-path="{loss_dump["path"]}"]').first.click()
                expect(frame.locator("#dump-view")).to_have_attribute("data-path", loss_dump["path"])
                value = load_file(run_dir / loss_dump["path"])["tensor"].double()
                for stat, v in (("min", value.min().item()), ("max", value.max().item())):
                    text = frame.evaluate("v => Number(v).toPrecision(6)", v)
                    expect(stats.locator(f"td[data-stat={stat}]")).to_have_text(text)
                bars = frame.locator("#dump-hist rect.hist-bar")
                assert (
                    sum(int(c) for c in bars.evaluate_all("bs => bs.map(b => b.dataset.count)"))
                    == value.numel()
                )

                # -- heatmap of grad_reduced norms; a click on a canvas row charts that tensor
                frame.select_option("#hm-kind", "grad_reduced")
                frame.select_option("#hm-stat", "norm")
                heat = api(base, "heatmap", run=RUN, rank=0, kind="grad_reduced", stat="norm")
                canvas = frame.locator("#heatmap-canvas")
                expect(canvas).to_have_attribute("data-names", str(len(heat["names"])))
                expect(frame.locator("#heatmap .hm-label")).to_have_count(len(heat["names"]))
                painted = canvas.evaluate(
                    "c => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
                    " let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; }"
                )
                assert painted > 0
                name = "layers.0.mlp.fc1.weight"
                # its row: the name and the shape of nn.Linear(64, 256)'s weight, [out, in]; dtype on hover
                fc1 = frame.locator(f'#heatmap .hm-label[data-name="{name}"]')
                expect(fc1.locator(".hm-shape")).to_have_text(FC1_SHAPE)
                expect(fc1).to_have_attribute("title", f"{name} {FC1_SHAPE} float32")
                expect(fc1).to_have_attribute("data-dtype", "float32")
                row_h = int(canvas.get_attribute("data-row-height"))
                at = {"x": 40, "y": heat["names"].index(name) * row_h + row_h / 2}
                canvas.hover(position=at)
                expect(frame.locator(".tm-tooltip div").first).to_have_text(f"{name} {FC1_SHAPE} float32")
                canvas.click(position=at)
                series = api(base, "series", run=RUN, rank=0, kind="grad_reduced", name=name, stat="norm")
                expect(frame.locator("#series-title")).to_contain_text(
                    f"grad_reduced {name} {FC1_SHAPE} float32 \u00b7 norm \u00b7 rank 0"
                )
                expect(frame.locator("#series-chart svg")).to_have_attribute(
                    "data-points", str(len(series["steps"]))
                )

                # ... and the origin's activation norm carries the anomaly markers, the origin's the biggest
                frame.select_option("#hm-kind", "actv")
                label = frame.locator(f'.hm-label[data-name="{ORIGIN}"]')
                label.click()
                series = api(base, "series", run=RUN, rank=0, kind="actv", name=ORIGIN, stat="norm")
                chart = frame.locator("#series-chart svg")
                expect(frame.locator("#series-title")).to_contain_text(
                    f"actv {ORIGIN} {ORIGIN_SHAPE} float32 \u00b7 norm"
                )
                # (over 100 rows, the labels are thin bars: the name and shape are in their tooltips)
                expect(label).to_have_attribute("title", f"{ORIGIN} {ORIGIN_SHAPE} float32")
                expect(chart).to_have_attribute("data-points", str(len(series["steps"])))
                assert len(series["anomalies"]) >= 1
                expect(chart.locator("circle.anomaly-marker")).to_have_count(len(series["anomalies"]))
                expect(
                    chart.locator(f'circle.anomaly-marker[data-origin="1"][data-step="{NAN_STEP}"]')
                ).to_have_count(1)
                expect(label).to_have_class("hm-label selected")
                frame.locator("#heatmap-panel").screenshot(path=shots / "plugin-heatmap.png")

                # -- module axis: the origin's row holds the origin cell; with the loss spike's rule
                # unchecked it is the top row
                frame.select_option("#axis-select", "module")
                expect(svg).to_have_attribute("data-axis", "module")
                origin_cell = cell_with_step(frame, 'rect.tl-cell[data-origin="1"]', NAN_STEP)
                assert origin_cell.get_attribute("data-row") == ORIGIN
                frame.locator("#timeline-panel").screenshot(path=shots / "plugin-timeline-module.png")
                frame.locator('#filter-rules input[value="turbulence"]').uncheck()
                top_origin = frame.locator('rect.tl-cell[data-row-index="0"][data-origin="1"]')
                expect(top_origin).to_have_count(1)
                expect(top_origin).to_have_attribute("data-row", ORIGIN)
                expect(frame.locator("text.tl-label").first).to_have_attribute("data-row", ORIGIN)
                frame.locator('#filter-rules input[value="turbulence"]').check()

                # -- rule filter: without "nan" no origin cell is left, and it comes back
                frame.select_option("#axis-select", "rank")
                expect(svg).to_have_attribute("data-axis", "rank")
                expect(frame.locator('rect.tl-cell[data-origin="1"]')).not_to_have_count(0)
                frame.locator('#filter-rules input[value="nan"]').uncheck()
                expect(frame.locator('rect.tl-cell[data-origin="1"]')).to_have_count(0)
                expect(jump).not_to_contain_text("first nan")
                frame.locator('#filter-rules input[value="nan"]').check()
                expect(frame.locator('rect.tl-cell[data-origin="1"]')).not_to_have_count(0)
                expect(jump).to_contain_text(f"first nan: step {NAN_STEP}")

                # -- errors are shown: a bad rank list (checked here) and a failing route (the server's
                # {"error": ...} body)
                frame.fill("#filter-ranks", "0,x")
                frame.press("#filter-ranks", "Enter")
                expect(frame.locator("#error")).to_be_visible()
                expect(frame.locator("#error")).to_contain_text("ranks")
                frame.fill("#filter-ranks", "")
                frame.press("#filter-ranks", "Enter")
                expect(frame.locator("#error")).to_be_hidden()
                expected_console.append("status of 400")

                def fail(route: Route) -> None:
                    route.fulfill(
                        status=400, content_type="application/json", body='{"error": "simulated failure"}'
                    )

                page.route("**/data/plugin/trainmon/heatmap?*", fail)
                frame.select_option("#hm-stat", "max")
                expect(frame.locator("#error")).to_contain_text("heatmap: HTTP 400: simulated failure")
                page.unroute("**/data/plugin/trainmon/heatmap?*", fail)
                frame.select_option("#hm-stat", "norm")
                expect(frame.locator("#error")).to_be_hidden()
                expected_console.clear()

                # -- TensorBoard's reload button reaches the tab (experimental.DataReloaded)
                frame.locator("#live").uncheck()
                refreshes = int(frame.locator("#trainmon").get_attribute("data-refreshes") or 0)
                page.click("button.reload-button")
                frame.wait_for_function(
                    f"Number(document.getElementById('trainmon').dataset.refreshes || 0) > {refreshes}"
                )

                # -- overview screenshot: the whole tab at once
                frame.locator("#live").check()
                cell_with_step(frame, 'rect.tl-cell[data-origin="1"]', NAN_STEP).click()
                expect(rows.first).to_have_attribute("data-origin", "1")
                frame.locator(f'a.dump-open[data-path="{dump["path"]}"]').first.click()
                expect(frame.locator("#dump-view")).to_have_attribute("data-path", dump["path"])
                height = frame.evaluate("document.documentElement.scrollHeight")
                page.set_viewport_size({"width": 1400, "height": height + 80})
                page.wait_for_timeout(300)  # the tab re-lays out on resize
                page.screenshot(path=shots / "plugin-overview.png")

                # -- deep link: run and step from TensorBoard's URL open that step's anomalies
                link = browser.new_page(viewport={"width": 1400, "height": 1000})
                link.set_default_timeout(TIMEOUT_MS)
                link.on("console", on_console)
                link.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
                link.route("**/*", guard)

                def without_dump_requests(route: Route) -> None:  # as if the flag were off
                    answer = route.fetch()
                    route.fulfill(response=answer, json={**answer.json(), "allow_dump_requests": False})

                link.route("**/data/plugin/trainmon/runs", without_dump_requests)
                deep = open_tab(link, f"{base}/#trainmon&p.trainmon.run={RUN}&p.trainmon.step={NAN_STEP}")
                expect(deep.locator("#detail-title")).to_contain_text(f"step {NAN_STEP}")
                expect(deep.locator("tr.event").first).to_have_attribute("data-name", ORIGIN)
                expect(deep.locator("tr.event").first).to_have_attribute("data-origin", "1")
                disabled = deep.locator("tr.event").first.locator("button.request-dump")
                expect(disabled).to_be_disabled()
                expect(disabled).to_have_attribute("title", re.compile("--trainmon_allow_dump_requests"))
            finally:
                browser.close()
        assert not problems, "\n".join(problems)
    print(f"UI test took {time.monotonic() - t_start:.1f} s")


# ---------------------------------------------------------------------------------------------- exact capture
EXACT_RUN = "exact"
LATER_RUN = "later"  # a run whose origin has only a dump of the next step


def write_later_run(run_dir: Path) -> None:
    with AnomalyLog(run_dir, 0) as log:
        log.write_step(
            9,
            [
                Anomaly(step=9, kind="actv", name="m.output", value=1.0, rule="nan", seq=3, stat="nans",
                        rank=0, micro_step=0, phase="forward", origin=True, dump="request:anomaly-step9-0"),
            ],
        )  # fmt: skip
    with DumpWriter(run_dir, 0) as w:
        w.write(10, 0, "actv", "m.output", torch.tensor([1.0, float("nan")]), "request anomaly-step9-0")


def wait_for_runs(base: str, names: set[str]) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            listing = get_json(f"{base}/data/plugins_listing")
            runs = api(base, "runs")["runs"] if listing.get("trainmon", {}).get("enabled") else []
        except OSError:
            runs = []
        if {r["run"] for r in runs if r["anomalies"] > 0 and r["dumps"] > 0} >= names:
            return
        assert time.monotonic() < deadline, f"the plugin never listed {names}: {runs}"
        time.sleep(0.25)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_origin_row_opens_the_exact_step_dump_with_its_inputs(tmp_path):
    logdir = tmp_path / "logs"
    exact.write_exact_torch_run(logdir / EXACT_RUN)
    write_later_run(logdir / LATER_RUN)
    shots = Path(os.environ.get("TRAINMON_SCREENSHOT_DIR") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not on the PATH: run scripts/setup.sh (apt-get install chromium)"

    with tensorboard_server(logdir, tmp_path, "true") as base:
        wait_for_runs(base, {EXACT_RUN, LATER_RUN})
        problems: list[str] = []

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1200})
                page.set_default_timeout(TIMEOUT_MS)
                page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
                page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
                page.route("**/*", loopback_only(base, problems))
                frame = open_tab(
                    page, f"{base}/#trainmon&p.trainmon.run={EXACT_RUN}&p.trainmon.step={exact.NAN_STEP}"
                )
                expect(frame.locator("#error")).to_be_hidden()
                row = frame.locator("tr.event").first
                expect(row).to_have_attribute("data-name", exact.ORIGIN)
                expect(row).to_have_attribute("data-origin", "1")

                # -- the row's own dump is the one of step 4, marked as such; nothing says "later"
                events = api(
                    base, "events", run=EXACT_RUN, step_lo=exact.NAN_STEP, step_hi=exact.NAN_STEP, limit=200
                )
                own = events["events"][0]["dumps"][0]
                link = row.locator("a.dump-open.dump-same-step").first
                expect(link).to_have_text(f"step {exact.NAN_STEP}")
                expect(link).to_have_attribute("data-path", own["path"])
                expect(row.locator(".dump-later-note")).to_have_count(0)
                link.click()

                view = frame.locator("#dump-view")
                expect(view).to_have_attribute("data-path", own["path"])
                output, _ = load_dump(logdir / EXACT_RUN / own["path"])
                expect(frame.locator("#dump-stats td[data-stat=nans]")).to_have_text("1")
                expect(frame.locator("#dump-stats td[data-stat=infs]")).to_have_text("1")
                assert int((~torch.isfinite(output)).sum()) == 2
                # where the bad values are: first indices and rows
                nf = frame.locator("#dump-nonfinite")
                expect(nf).to_have_attribute("data-count", "2")
                expect(nf.locator(".nf-index")).to_have_count(2)
                assert nf.locator(".nf-index").evaluate_all(
                    "ns => ns.map(n => [n.dataset.index, n.dataset.value])"
                ) == [[f"{i},{j}", v] for (i, j), v in sorted(exact.BAD.items())]
                assert nf.locator(".nf-row").evaluate_all("ns => ns.map(n => n.dataset.row)") == ["1", "3"]

                # -- the module call: both inputs (finite, with a histogram) on the left of the bad output
                call = frame.locator("#dump-module")
                expect(call).to_have_attribute("data-module", exact.ORIGIN_MODULE)
                expect(call).to_have_attribute("data-step", str(exact.NAN_STEP))
                inputs = call.locator('.module-side[data-side="input"] .module-tensor')
                outputs = call.locator('.module-side[data-side="output"] .module-tensor')
                expect(inputs).to_have_count(2)
                expect(outputs).to_have_count(1)
                assert inputs.evaluate_all("ns => ns.map(n => n.dataset.name)") == list(exact.INPUTS)
                expect(outputs.first).to_have_class("module-tensor current nonfinite-tensor")
                for i in range(2):
                    card = inputs.nth(i)
                    expect(card).to_have_attribute("data-nans", "0")
                    expect(card).to_have_attribute("data-infs", "0")
                    expect(card.locator(".module-counts")).to_contain_text("all 30 finite")
                    bars = card.locator("svg.dump-hist rect.hist-bar")
                    assert sum(int(c) for c in bars.evaluate_all("bs => bs.map(b => b.dataset.count)")) == 30
                expect(outputs.first.locator(".module-counts")).to_contain_text("1 NaN, 1 Inf of 30")
                frame.locator("#dump-panel").screenshot(path=shots / "plugin-exact-dump.png")

                # -- a card's name opens that input as the main dump
                inputs.nth(0).locator("a.module-tensor-name").click()
                first_input = next(d for d in events["events"][0]["dumps"] if d["name"] == exact.INPUTS[0])
                expect(view).to_have_attribute("data-path", first_input["path"])
                expect(frame.locator("#dump-nonfinite")).to_have_count(0)
                expect(frame.locator("#dump-module .module-tensor.current")).to_have_attribute(
                    "data-name", exact.INPUTS[0]
                )

                # -- a run whose origin has only a later dump says so in the row
                later = open_tab(
                    browser.new_page(), f"{base}/#trainmon&p.trainmon.run={LATER_RUN}&p.trainmon.step=9"
                )
                later_row = later.locator("tr.event").first
                expect(later_row.locator("a.dump-open.dump-later")).to_have_text("step 10")
                expect(later_row.locator(".dump-later-note")).to_have_text(
                    "later step only: step 10, 1 after (a dump request is served at the next collected step "
                    "once the job has read it); alert.capture: exact dumps at step 9 itself"
                )
                expect(later_row.locator(".dump-later-note")).to_have_attribute(
                    "title",
                    "No dump of this tensor at step 9: a dump request is served at the tensor's next "
                    "collected step. With alert.capture: exact the monitor dumps at the anomaly's own step.",
                )
                later_row.locator("a.dump-open").click()
                expect(later.locator("#dump-module .module-alone")).to_contain_text("alert.capture: exact")
            finally:
                browser.close()
        assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------ diagnosis views (issue 22)


class _HalfNanGrad(torch.autograd.Function):
    """Identity forward; in backward, 4064 of the 4096 gradient elements NaN when ``on``."""

    on = False

    @staticmethod
    def forward(ctx, w: torch.Tensor) -> torch.Tensor:
        return w.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if _HalfNanGrad.on:
            grad = grad.clone()
            grad.view(-1)[:PARTIAL_NANS] = float("nan")
        return grad


PARTIAL_NANS, PARTIAL_STEP = 4064, 2


class _Partial(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ _HalfNanGrad.apply(self.w)


def write_partial_nan_run(run_dir: Path) -> None:
    """A weight gradient with 4064 of its 4096 elements NaN at the last step (its norm is finite)."""
    torch.manual_seed(0)
    model = _Partial()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with trainmon.attach(model, optimizer, config={"wg_distribution": True}, logdir=run_dir):
        for step in range(PARTIAL_STEP + 1):
            _HalfNanGrad.on = step == PARTIAL_STEP
            model(torch.randn(2, 64)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    _HalfNanGrad.on = False


def deep_link(base: str, run: str, step: int | None = None) -> str:
    return f"{base}/#trainmon&p.trainmon.run={run}" + (f"&p.trainmon.step={step}" if step is not None else "")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_origin_badge_first_button_dump_link_and_partly_nan_cells(tmp_path):
    """For each place a NaN can be born (tests/origin_cases.py) the "first nan" button and the origin badge
    name the origin of the documented rule; with gradient accumulation the origin's bold dump link opens its
    own micro-step; a heatmap cell whose gradient is mostly NaN (finite norm) is magenta, with the count."""
    logdir = tmp_path / "logs"
    for case in origin_cases.CASES:
        origin_cases.write_case_run(logdir / case.run, case)
    acc_runs.write_acc_run(logdir / "acc", micro_steps=4, nan_micro=2, where="leaf")
    write_partial_nan_run(logdir / "partial")
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not on the PATH: run scripts/setup.sh (apt-get install chromium)"

    with tensorboard_server(logdir, tmp_path, "true") as base:
        wait_for_runs(base, {"acc"})
        problems: list[str] = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:

                def tab(run: str, step: int | None = None) -> tuple[Page, Frame]:
                    """A fresh page on the run (a changed hash alone does not reload TensorBoard)."""
                    page = browser.new_page(viewport={"width": 1400, "height": 1200})
                    page.set_default_timeout(TIMEOUT_MS)
                    page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
                    page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
                    page.route("**/*", loopback_only(base, problems))
                    return page, open_tab(page, deep_link(base, run, step))

                # -- the button and the badge agree with the rule, leaf or parent, forward or backward
                for case in origin_cases.CASES:
                    step = origin_cases.NAN_STEP
                    page, frame = tab(case.run, step)
                    expect(frame.locator("#jump-first")).to_have_text(
                        f"first nan: step {step}, rank 0, {case.kind} {case.origin} (origin)"
                    )
                    badged = frame.locator("tr.event:has(.badge-origin)")
                    expect(badged).to_have_count(1)
                    expect(badged).to_have_attribute("data-name", case.origin)
                    expect(frame.locator("tr.event").first).to_have_attribute("data-name", case.origin)
                    page.close()

                # -- the origin at micro-step 2 of 4: its first (bold) link opens micro-step 2's dump
                page, frame = tab("acc", acc_runs.NAN_STEP)
                row = frame.locator("tr.event").first
                expect(row).to_have_attribute("data-name", "1.v.output")
                link = row.locator("a.dump-open.dump-same-step").first
                expect(link).to_have_text(f"step {acc_runs.NAN_STEP} m2")
                link.click()
                expect(frame.locator("#dump-view")).to_have_attribute(
                    "data-path", re.compile(r"actv__1\.v\.output__m2\.safetensors$")
                )
                expect(frame.locator("#dump-nonfinite")).to_have_attribute("data-count", "2")

                # -- a gradient mostly NaN, its norm finite: the cell is magenta, its tooltip has the count
                page, frame = tab("partial")
                frame.select_option("#hm-kind", "grad_reduced")
                frame.select_option("#hm-stat", "norm")
                heat = api(base, "heatmap", run="partial", rank=0, kind="grad_reduced", stat="norm")
                values = np.frombuffer(base64.b64decode(heat["values"]), "<f4")
                assert heat["names"] == ["w"] and np.isfinite(values).all()  # the norm is finite
                canvas = frame.locator("#heatmap-canvas")
                expect(canvas).to_have_attribute("data-names", "1")
                bins = int(canvas.get_attribute("data-bins"))
                box = canvas.bounding_box()
                while box is None:  # a redraw (a refresh's answer) replaces the canvas: the next one
                    box = canvas.bounding_box()
                colours = canvas.evaluate(
                    "(c, nb) => { const ctx = c.getContext('2d'); const out = [];"
                    " for (let b = 0; b < nb; b++) { const x = Math.floor((b + 0.5) * c.width / nb);"
                    " out.push(Array.from(ctx.getImageData(x, 1, 1, 1).data.slice(0, 3))); } return out; }",
                    bins,
                )
                nan_bin = next(i for i, e in enumerate(heat["edges"]) if e > PARTIAL_STEP) - 1
                assert colours[nan_bin] == [255, 0, 255]
                assert all(c != [255, 0, 255] for i, c in enumerate(colours) if i != nan_bin)
                canvas.hover(position={"x": (nan_bin + 0.5) * box["width"] / bins, "y": 3})
                expect(frame.locator(".tm-tooltip")).to_contain_text(f"NaN: {PARTIAL_NANS} elements")
            finally:
                browser.close()
        assert not problems, "\n".join(problems)

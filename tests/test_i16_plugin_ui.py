"""Issue 16 in a real browser: from the origin's anomaly row, the trainmon tab opens the dump taken at the
NaN's own step (``alert.capture: exact``) and shows the module call, its two finite inputs next to its bad
output, with where the bad values are. The run is a real tiny torch run (test_i16_plugin_exact_run.py).

A second run, whose only dump of the origin is a request-based one taken a step later, says so in its row.
Screenshots go to ``$TRAINMON_SCREENSHOT_DIR`` (``TRAINMON_SCREENSHOT_DIR=docs/img``: the user guide's
``plugin-exact-dump.png``), else to tmp_path. Needs chromium and playwright, as test_plugin_ui.py."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from playwright.sync_api import expect, sync_playwright
from tbserver import get_json, tensorboard_server
from test_i16_plugin_exact_run import BAD, INPUTS, NAN_STEP, ORIGIN, ORIGIN_MODULE, write_exact_torch_run
from test_plugin_ui import CHROMIUM_ARGS, TIMEOUT_MS, api, loopback_only, open_tab

from trainmon.anomaly.log import AnomalyLog
from trainmon.read.dump_contents import load_dump
from trainmon.run.records import Anomaly
from trainmon.writer.dumps import DumpWriter

RUN = "exact"
LATER = "later"  # a run whose origin has only a dump of the next step


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
    write_exact_torch_run(logdir / RUN)
    write_later_run(logdir / LATER)
    shots = Path(os.environ.get("TRAINMON_SCREENSHOT_DIR") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not on the PATH: run scripts/setup.sh (apt-get install chromium)"

    with tensorboard_server(logdir, tmp_path, "true") as base:
        wait_for_runs(base, {RUN, LATER})
        problems: list[str] = []

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1200})
                page.set_default_timeout(TIMEOUT_MS)
                page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
                page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
                page.route("**/*", loopback_only(base, problems))
                frame = open_tab(page, f"{base}/#trainmon&p.trainmon.run={RUN}&p.trainmon.step={NAN_STEP}")
                expect(frame.locator("#error")).to_be_hidden()
                row = frame.locator("tr.event").first
                expect(row).to_have_attribute("data-name", ORIGIN)
                expect(row).to_have_attribute("data-origin", "1")

                # -- the row's own dump is the one of step 4, marked as such; nothing says "later"
                events = api(base, "events", run=RUN, step_lo=NAN_STEP, step_hi=NAN_STEP, limit=200)
                own = events["events"][0]["dumps"][0]
                link = row.locator("a.dump-open.dump-same-step").first
                expect(link).to_have_text(f"step {NAN_STEP}")
                expect(link).to_have_attribute("data-path", own["path"])
                expect(row.locator(".dump-later-note")).to_have_count(0)
                link.click()

                view = frame.locator("#dump-view")
                expect(view).to_have_attribute("data-path", own["path"])
                output, _ = load_dump(logdir / RUN / own["path"])
                expect(frame.locator("#dump-stats td[data-stat=nans]")).to_have_text("1")
                expect(frame.locator("#dump-stats td[data-stat=infs]")).to_have_text("1")
                assert int((~torch.isfinite(output)).sum()) == 2
                # where the bad values are: first indices and rows
                nf = frame.locator("#dump-nonfinite")
                expect(nf).to_have_attribute("data-count", "2")
                expect(nf.locator(".nf-index")).to_have_count(2)
                assert nf.locator(".nf-index").evaluate_all(
                    "ns => ns.map(n => [n.dataset.index, n.dataset.value])"
                ) == [[f"{i},{j}", v] for (i, j), v in sorted(BAD.items())]
                assert nf.locator(".nf-row").evaluate_all("ns => ns.map(n => n.dataset.row)") == ["1", "3"]

                # -- the module call: both inputs (finite, with a histogram) on the left of the bad output
                call = frame.locator("#dump-module")
                expect(call).to_have_attribute("data-module", ORIGIN_MODULE)
                expect(call).to_have_attribute("data-step", str(NAN_STEP))
                inputs = call.locator('.module-side[data-side="input"] .module-tensor')
                outputs = call.locator('.module-side[data-side="output"] .module-tensor')
                expect(inputs).to_have_count(2)
                expect(outputs).to_have_count(1)
                assert inputs.evaluate_all("ns => ns.map(n => n.dataset.name)") == list(INPUTS)
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
                first_input = next(d for d in events["events"][0]["dumps"] if d["name"] == INPUTS[0])
                expect(view).to_have_attribute("data-path", first_input["path"])
                expect(frame.locator("#dump-nonfinite")).to_have_count(0)
                expect(frame.locator("#dump-module .module-tensor.current")).to_have_attribute(
                    "data-name", INPUTS[0]
                )

                # -- a run whose origin has only a later dump says so in the row
                later = open_tab(
                    browser.new_page(), f"{base}/#trainmon&p.trainmon.run={LATER}&p.trainmon.step=9"
                )
                later_row = later.locator("tr.event").first
                expect(later_row.locator("a.dump-open.dump-later")).to_have_text("step 10")
                expect(later_row.locator(".dump-later-note")).to_have_text("later step only")
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

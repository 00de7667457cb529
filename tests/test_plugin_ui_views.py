"""The tab at 64 ranks in a real TensorBoard and headless Chromium (issue 45): a run written by
``bench/scale.py`` (the monitor's own write path: statistics, anomaly records, timing tables, the straggler
rule's record), rank 37's NaN first, rank 21 a straggler in its forward for a stretch of steps.

- every timeline row is labelled with its rank, as the time heat map's are (at 256 ranks too);
- the tab counts the anomalies ``trainmon analyze`` counts, the straggler episode said apart, as it does;
- the straggler episode is drawn and said over its true span (from its first slow step to its last), and the
  time heat map opens on the part it was slow in;
- views follow a click: "first nan" moves the header's rank, the statistics heat map (the origin's kind) and
  its series, and an open rank panel to rank 37; a straggler's diamond lists its record and moves them to its
  rank;
- the series marks the NaN steps (no dip to the finite elements' value) on a log axis; a live refresh of a
  finished run's heat map is answered "unchanged".
Needs chromium on the PATH and playwright (scripts/setup.sh installs both)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright
from tbserver import tensorboard_server
from test_plugin_scale import NAN_STEP_256, RANKS_256, write_persisting_nan
from test_plugin_ui import CHROMIUM_ARGS, TIMEOUT_MS, api, loopback_only, open_tab

ROOT = Path(__file__).resolve().parents[1]
RANKS, STEPS, NAN_RANK, NAN_STEP = 64, 60, 37, 40
TENSORS = 8  # a step's tensors (bench/scale.py's layout thinned to 8 activations)
SLOW_RANK, SLOW_FROM, SLOW_STEPS = 21, 12, 20  # its forward slowed in steps 12-31


def own_text(labels) -> list[str]:
    """Each label's own text (not its <title>'s)."""
    return labels.evaluate_all("ts => ts.map(t => t.firstChild.textContent)")


def layout_shape(kind: str, name: str) -> str:
    """A tensor's shape and dtype as the tab shows them (``[8, 128, 256] bfloat16``), from the layout
    ``bench/scale.py`` writes, not from the run."""
    spec = importlib.util.spec_from_file_location("bench_scale", ROOT / "bench" / "scale.py")
    module = sys.modules["bench_scale"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(module)
    (row,) = [r for r in module.layout(TENSORS) if (r.kind, r.name) == (kind, name)]
    return "[" + ", ".join(str(d) for d in row.shape) + "] " + str(row.dtype).removeprefix("torch.")


def analyze(run: Path, *extra: str) -> dict:
    command = [sys.executable, "-m", "trainmon", "analyze", str(run), "--json", *extra]
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=120).stdout
    return json.loads(out)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("views")
    command = [
        sys.executable, str(ROOT / "bench" / "scale.py"), "build", str(root / "r64"), "--ranks", str(RANKS),
        "--steps", str(STEPS), "--tensors", str(TENSORS), "--nan-rank", str(NAN_RANK), "--nan-step",
        str(NAN_STEP), "--straggler-rank", str(SLOW_RANK), "--straggler-step", str(SLOW_FROM),
        "--straggler-steps", str(SLOW_STEPS), "--jobs", "2",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=240)
    return root


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_tab_at_64_ranks_agrees_with_analyze_and_follows_clicks(logdir, tmp_path):
    run = logdir / "r64"
    said = analyze(run)
    assert said["first"]["rank"] == NAN_RANK and said["left_out"] == {"straggler": 1}
    (episode,) = analyze(run, "--rule", "straggler")["stragglers"]
    last = SLOW_FROM + SLOW_STEPS - 1
    assert (episode["rank"], episode["from_step"], episode["to_step"]) == (SLOW_RANK, SLOW_FROM, last)
    assert episode["length"] == SLOW_STEPS and episode["step"] > SLOW_FROM  # named once the rule held
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not on the PATH: run scripts/setup.sh (apt-get install chromium)"
    with tensorboard_server(logdir, tmp_path, "true") as base:
        deadline = time.monotonic() + 60
        while not any(r["anomalies"] for r in api(base, "runs")["runs"]):
            assert time.monotonic() < deadline, "the plugin never indexed the run"
            time.sleep(0.25)
        (listed,) = api(base, "runs")["runs"]
        assert (listed["anomalies"], listed["stragglers"]) == (said["anomalies"], 1)  # analyze's numbers
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

                # -- every row labelled with its rank
                labels = frame.locator("#timeline-svg text.tl-label")
                expect(labels).to_have_count(RANKS)
                assert own_text(labels) == [f"rank {r}" for r in range(RANKS)]
                box = frame.locator(f'text.tl-label[data-row="{NAN_RANK}"]').bounding_box()
                assert box is not None and box["height"] >= 8, box  # readable, not a 6 px row

                # -- the counts: analyze's, the straggler episode apart
                info = frame.locator("#run-info")
                expect(info).to_contain_text(f"{RANKS} ranks")
                expect(info).to_contain_text(f"{said['anomalies']} anomalies \u00b7 1 straggler episode")
                expect(frame.locator("#timeline-info")).to_contain_text(
                    f"{said['anomalies']} anomalies \u00b7 1 straggler episode"
                )

                # -- the episode over its span; the time heat map on the part it was slow in
                mark = frame.locator(f'g.tl-episode[data-rank="{SLOW_RANK}"]')
                expect(mark).to_have_attribute("data-from-step", str(SLOW_FROM))
                expect(mark).to_have_attribute("data-to-step", str(last))
                expect(mark.locator("rect.tl-episode-span")).to_have_count(1)
                mark.locator("path").hover()
                expect(frame.locator(".tm-tooltip")).to_contain_text(
                    f"straggler in steps {SLOW_FROM}\u2013{last} ({SLOW_STEPS} steps)"
                )
                frame.locator("#time-panel").scroll_into_view_if_needed()
                expect(frame.locator("#time-heatmap")).to_have_attribute("data-time", "forward")
                expect(frame.locator("#time-name")).to_have_value("forward")

                # -- an open rank panel, then "first nan": the views of one rank follow it
                frame.locator('#time-heatmap .hm-label[data-name="3"]').click()
                expect(frame.locator("#rank-panel")).to_have_attribute("data-rank", "3")
                frame.locator("#jump-first").click()
                expect(frame.locator("#detail-title")).to_contain_text(
                    f"rank {NAN_RANK} \u00b7 step {NAN_STEP}"
                )
                kind, name = said["first"]["kind"], said["first"]["name"]
                origin = frame.locator(f'tr.event[data-name="{name}"][data-kind="{kind}"]').first
                expect(origin.locator("td.col-shape")).to_have_text(layout_shape(kind, name))
                expect(frame.locator("#rank-select")).to_have_value(str(NAN_RANK))
                heat = frame.locator("#heatmap")
                expect(heat).to_have_attribute("data-rank", str(NAN_RANK))
                expect(heat).to_have_attribute("data-kind", said["first"]["kind"])
                expect(frame.locator("#hm-kind")).to_have_value(said["first"]["kind"])
                expect(frame.locator("#rank-panel")).to_have_attribute("data-rank", str(NAN_RANK))
                # the origin's series: its shape and dtype as bench/scale.py's layout wrote them; its NaN
                # steps marked (no dip to its finite elements' 0), on a log axis
                tensor = f"{kind} {name} {layout_shape(kind, name)}"
                title = f"{tensor} \u00b7 norm \u00b7 rank {NAN_RANK}"
                expect(frame.locator("#series-title")).to_contain_text(title)
                chart = frame.locator("#series-chart svg.series-svg")
                expect(chart).to_have_attribute("data-nan-steps", str(STEPS - NAN_STEP))
                expect(chart).to_have_attribute("data-scale", "log")
                expect(frame.locator("#series-chart path.chart-nan")).to_have_count(STEPS - NAN_STEP)
                expect(frame.locator("#series-title")).to_contain_text(f"NaN at {STEPS - NAN_STEP} steps")

                # -- a live refresh of a finished run: the heat map is answered "unchanged"
                frame.evaluate("window.trainmon.refresh()")
                expect(heat).to_have_attribute("data-unchanged", "1")

                # -- the straggler's diamond: its record listed, the views on its rank
                mark.locator("path").click()
                expect(frame.locator("#detail-title")).to_contain_text(
                    f"rank {SLOW_RANK} \u00b7 step {episode['step']} \u00b7 1 anomaly"
                )
                expect(frame.locator("#detail")).to_contain_text("straggler")
                expect(frame.locator("#rank-select")).to_have_value(str(SLOW_RANK))
                expect(frame.locator("#rank-panel")).to_have_attribute("data-rank", str(SLOW_RANK))
                expect(heat).to_have_attribute("data-rank", str(SLOW_RANK))
            finally:
                browser.close()
        assert not problems, problems


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_row_is_labelled_at_256_ranks(tmp_path):
    logdir = tmp_path / "logs"
    write_persisting_nan(logdir / "r256")
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not on the PATH: run scripts/setup.sh (apt-get install chromium)"
    with tensorboard_server(logdir, tmp_path, "true") as base:
        deadline = time.monotonic() + 60
        while not any(r["anomalies"] for r in api(base, "runs")["runs"]):
            assert time.monotonic() < deadline, "the plugin never indexed the run"
            time.sleep(0.25)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1100})
                page.set_default_timeout(TIMEOUT_MS)
                frame = open_tab(page, f"{base}/#trainmon")
                labels = frame.locator("#timeline-svg text.tl-label")
                expect(labels).to_have_count(RANKS_256 // 2)
                expected = [f"\u25b8 ranks {r}\u2013{r + 1}" for r in range(0, RANKS_256, 2)]
                assert own_text(labels) == expected
                # "first nan": rank 150's group, and the header's rank follows it
                frame.locator("#jump-first").click()
                expect(frame.locator("#detail-title")).to_contain_text(f"step {NAN_STEP_256}")
            finally:
                browser.close()

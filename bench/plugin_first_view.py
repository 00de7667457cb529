"""The trainmon tab's first useful view, as a user gets it: ``tensorboard --logdir RUN`` started, a browser
opening the tab as soon as TensorBoard answers HTTP, until the anomaly timeline is drawn; and the first dump
opened in a fresh TensorBoard against the next ones.

    python bench/plugin_first_view.py RUN [--repeat 3] [--pause 2]

Each repeat starts a fresh TensorBoard (as a user does) and a fresh headless Chromium (Playwright, the
chromium on the PATH), and prints:

- ``HTTP up``: seconds from the start of ``tensorboard`` until it answers ``/data/plugins_listing``;
- ``first view``: seconds from then until the tab's timeline is drawn (``#timeline-svg`` in the plugin's
  frame: TensorBoard's own page, the tab's scripts, ``/runs``, ``/timeline`` and the drawing);
- the ``/timeline`` answer's size (JSON, and sent gzip-compressed), and the timeline's cells drawn;
- when the run has dumps: the first ``/dump_meta`` (``--pause`` seconds after the view, a user finding a dump
  to open) and the median of the next five.

Not a test: figures depend on the machine (say which when you report them).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _get(url: str, gzip_ok: bool = False) -> tuple[bytes, int]:
    headers = {"Accept-Encoding": "gzip"} if gzip_ok else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=600) as r:
        raw = r.read()
        body = gzip.decompress(raw) if r.headers.get("Content-Encoding") == "gzip" else raw
    return body, len(raw)


def _start(logdir: Path, tmp: Path) -> tuple[subprocess.Popen, str, float, float]:
    """(process, base URL, its start time, seconds until it answered HTTP)."""
    err = tmp / "tb.err"
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
         "--port", "0"],
        stdout=subprocess.DEVNULL, stderr=open(err, "wb"),  # noqa: SIM115 - the process keeps it
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tb_plugin'}"},
    )  # fmt: skip
    base = None
    while True:
        if base is None:
            m = re.search(r"http://127\.0\.0\.1:(\d+)/", err.read_text(errors="replace"))
            base = f"http://127.0.0.1:{m.group(1)}" if m else None
        if base is not None:
            try:
                _get(f"{base}/data/plugins_listing")
                return proc, base, start, time.perf_counter() - start
            except OSError:
                pass
        if proc.poll() is not None or time.perf_counter() - start > 300:
            raise RuntimeError("TensorBoard did not start:\n" + err.read_text(errors="replace")[-2000:])
        time.sleep(0.01)


# Seconds from the tab's frame starting to load (TensorBoard's own page has booted) to its first view.
_TAB_PART = """() => new Promise((done) => {
  const t0 = performance.getEntriesByType('navigation')[0].startTime;
  const app = () => window.trainmon;
  const until = performance.now() + 5000;  // a tab that does not say when it drew: null
  const wait = () => (app() && app().drawnAt ? done((app().drawnAt - t0) / 1000)
                      : performance.now() > until ? done(null) : setTimeout(wait, 10));
  wait(); })"""


def once(run: Path, pause: float) -> dict:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if not chromium:
        raise SystemExit("chromium is not on the PATH (scripts/setup.sh installs it)")
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        proc, base, _, out["http_up"] = _start(run, Path(tmp))
        try:
            up = time.perf_counter()
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.set_default_timeout(300_000)
            page.goto(f"{base}/#trainmon")
            iframe = page.wait_for_selector('iframe[src*="plugin_entry.html?name=trainmon"]')
            frame = iframe.content_frame()
            frame.wait_for_selector("#timeline-svg")
            out["first_view"] = time.perf_counter() - up
            out["cells"] = frame.locator("rect.tl-cell").count()
            # the tab's own part: from its frame's start (TensorBoard's page booted) to the timeline drawn
            out["tab_part"] = frame.evaluate(_TAB_PART)
            # the same page again: TensorBoard's scripts cached by the browser, the plugin's indexes warm
            t0 = time.perf_counter()
            page.reload()
            frame = page.wait_for_selector('iframe[src*="plugin_entry.html?name=trainmon"]').content_frame()
            frame.wait_for_selector("#timeline-svg")
            out["reload"] = time.perf_counter() - t0
            bins = frame.locator("#timeline-svg").get_attribute("data-bins")
            q = urllib.parse.quote
            body, sent = _get(f"{base}/data/plugin/trainmon/timeline?run={q('.')}&bins={bins}", gzip_ok=True)
            out["timeline_bytes"], out["timeline_sent"] = len(body), sent
            runs = json.loads(_get(f"{base}/data/plugin/trainmon/runs")[0])["runs"]
            if runs and runs[0]["dumps"]:
                from trainmon.run.dumps import list_dumps

                paths = [e.path for e in list_dumps(run)[:6]]
                time.sleep(pause)
                times = []
                for path in paths:
                    t0 = time.perf_counter()
                    _get(f"{base}/data/plugin/trainmon/dump_meta?run=.&path={q(path)}")
                    times.append(time.perf_counter() - t0)
                out["first_dump_meta"], out["next_dump_meta"] = times[0], statistics.median(times[1:])
        finally:
            browser.close()
            proc.terminate()
            proc.wait(20)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pause", type=float, default=2.0, help="seconds before the first dump is opened")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    print(f"{args.run}: {os.cpu_count()} CPUs")
    for i in range(args.repeat):
        r = once(args.run, args.pause)
        tab = "?" if r["tab_part"] is None else format(r["tab_part"], ".2f")  # a tab that does not say
        line = (f"  #{i + 1}: HTTP up {r['http_up']:.2f} s; first view {r['first_view']:.2f} s after it "
                f"({r['cells']} cells drawn), of which the tab's own part (its frame to the timeline drawn) "
                f"{tab} s; reload {r['reload']:.2f} s; /timeline "
                f"{r['timeline_bytes'] / 1e3:.1f} KB ({r['timeline_sent'] / 1e3:.1f} KB gzip)")  # fmt: skip
        if "first_dump_meta" in r:
            line += (f"; first /dump_meta {r['first_dump_meta'] * 1e3:.0f} ms ({args.pause:g} s after the "
                     f"view), next ones {r['next_dump_meta'] * 1e3:.0f} ms")  # fmt: skip
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

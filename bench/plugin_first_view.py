"""The trainmon tab's first view and its clicks, as a user gets them, split into their parts.

    python bench/plugin_first_view.py RUN [--repeat 5] [--pause 2]

Each repeat starts a fresh ``tensorboard --logdir RUN`` (as a user does) and a fresh headless Chromium
(Playwright, the chromium on the PATH), opens the tab as soon as TensorBoard answers HTTP, waits for the
timeline to be drawn, then clicks. Every time comes from the browser's own clocks (Navigation and Resource
Timing, the marks the tab sets: ``trainmon:modules``, ``trainmon:drawn``, ``trainmon:parse <route>``,
``trainmon:draw <view>``) and the plugin's ``Server-Timing`` header (its time in process), so the parts add
up whatever else the machine runs. The parts of the first view, each from the one before:

- ``HTTP up``: from the start of ``tensorboard`` until it answers ``/data/plugins_listing``;
- ``TB index``: from then until TensorBoard's index page answers the browser ("TensorBoard answers");
- ``TB page``: TensorBoard's own page (its scripts fetched and booted) until the plugin's frame starts;
- ``frame -> modules``: the frame's page and the tab's modules loaded;
- ``modules -> drawn``: the tab's requests (each listed with its time in the plugin's process, its time in
  the browser and its bytes, sent and JSON), its JSON parsing and drawing.

``first view`` is **from the plugin's frame starting to the timeline drawn** (the issue's "after TensorBoard
answers": TensorBoard's page is TensorBoard's, whatever the plugin); ``from TB index`` adds that page.

Then each click (a fresh TensorBoard each repeat, so the first click of its kind): choosing a rank in the
header, the first-anomaly button, a straggler episode's diamond, switching the statistics' kind; each from the
click to the frame painted after the last of the loads it started, with its requests.

Not a test: figures depend on the machine (say which, and the load average printed, when you report them).
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
PLUGIN_DATA = "/data/plugin/trainmon/"


def _get(url: str, gzip_ok: bool = False) -> tuple[bytes, int]:
    headers = {"Accept-Encoding": "gzip"} if gzip_ok else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=600) as r:
        raw = r.read()
        body = gzip.decompress(raw) if r.headers.get("Content-Encoding") == "gzip" else raw
    return body, len(raw)


def _start(logdir: Path, tmp: Path) -> tuple[subprocess.Popen, str, float]:
    """(process, base URL, seconds until it answered HTTP)."""
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
                return proc, base, time.perf_counter() - start
            except OSError:
                pass
        if proc.poll() is not None or time.perf_counter() - start > 300:
            raise RuntimeError("TensorBoard did not start:\n" + err.read_text(errors="replace")[-2000:])
        time.sleep(0.01)


# The plugin's requests and the tab's marks and measures, on the frame's clock (ms from the frame's start),
# entries after `since` only
_ENTRIES = """(since) => {
  const out = {origin: performance.timeOrigin, requests: [], marks: {}, measures: []};
  for (const r of performance.getEntriesByType('resource')) {
    if (r.startTime < since || !r.name.includes('/data/plugin/trainmon/')) continue;
    const server = (r.serverTiming || []).find((s) => s.name === 'app');
    out.requests.push({url: r.name, start: r.startTime, end: r.responseEnd,
                       server: server ? server.duration : null, sent: r.encodedBodySize,
                       json: r.decodedBodySize});
  }
  for (const m of performance.getEntriesByType('mark')) {
    if (m.startTime >= since) out.marks[m.name] = m.startTime;
  }
  for (const m of performance.getEntriesByType('measure')) {
    if (m.startTime < since || !m.name.startsWith('trainmon:')) continue;
    out.measures.push([m.name.slice(9), m.duration]);
  }
  return out; }"""

# Waits until the tab's loads are over and a frame is painted; resolves to that time (frame clock), or null
_SETTLED = """(since) => new Promise((done) => {
  const app = window.trainmon;
  const until = performance.now() + 60000;
  const wait = () => {
    if (app.busy === 0 && (app.settledAt || 0) >= since) requestAnimationFrame(() => done(performance.now()));
    else if (performance.now() > until) done(null);
    else setTimeout(wait, 5);
  };
  wait(); })"""

# One click, done in the page; resolves to its start on the frame's clock, or null when there is nothing to
# click (no straggler episode drawn, a single rank, a single kind)
_CLICK = """(what) => {
  const app = window.trainmon;
  const change = (select, value) => { select.value = value; select.dispatchEvent(new Event('change')); };
  const other = (select) => [...select.options].map((o) => o.value).find((v) => v !== select.value);
  const t0 = performance.now();
  if (what === 'rank') {
    const v = other(app.rankSelect);
    if (v === undefined) return null;
    change(app.rankSelect, v);
  } else if (what === 'first anomaly') {
    const b = document.querySelector('#jump-first');
    if (!b || b.disabled) return null;
    b.click();
  } else if (what === 'straggler diamond') {
    const d = document.querySelector('g.tl-episode path');
    if (!d) return null;
    d.dispatchEvent(new MouseEvent('click', {bubbles: true}));
  } else if (what === 'kind') {
    const v = other(app.hmKindSelect);
    if (v === undefined) return null;
    change(app.hmKindSelect, v);
  }
  if (app.busy === 0) app.settledAt = performance.now();  // nothing to load: done when painted
  return t0; }"""

CLICKS = ("rank", "first anomaly", "straggler diamond", "kind")


def _route(url: str) -> str:
    path, _, query = url.partition(PLUGIN_DATA)[2].partition("?")
    return path if not query else f"{path}?{urllib.parse.unquote(query)[:60]}"


def _requests(entries: dict, t0: float) -> list[dict]:
    return [{**r, "route": _route(r["url"]), "at": r["start"] - t0, "took": r["end"] - r["start"]}
            for r in sorted(entries["requests"], key=lambda r: r["start"])]  # fmt: skip


def once(run: Path, pause: float) -> dict:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if not chromium:
        raise SystemExit("chromium is not on the PATH (scripts/setup.sh installs it)")
    out: dict = {"load": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.set_default_timeout(300_000)
        proc, base, out["http_up"] = _start(run, Path(tmp))
        try:
            up = time.time() * 1e3  # epoch ms, the browser's timeOrigin's clock
            page.goto(f"{base}/#trainmon")
            frame = page.wait_for_selector('iframe[src*="plugin_entry.html?name=trainmon"]').content_frame()
            frame.wait_for_selector("#timeline-svg")
            frame.wait_for_function("() => window.trainmon && window.trainmon.drawnAt")
            top = page.evaluate(
                "() => ({origin: performance.timeOrigin, "
                "index: performance.getEntriesByType('navigation')[0].responseStart})"
            )
            entries = frame.evaluate(_ENTRIES, 0)
            index = top["origin"] + top["index"] - entries["origin"]  # TB's index answered, frame clock
            marks = entries["marks"]
            out["tb_index"] = (top["origin"] + top["index"] - up) / 1e3
            out["tb_page"] = -index / 1e3
            out["modules"] = marks["trainmon:modules"] / 1e3
            out["drawn"] = (marks["trainmon:drawn"] - marks["trainmon:modules"]) / 1e3
            out["first_view"] = marks["trainmon:drawn"] / 1e3
            out["from_index"] = (marks["trainmon:drawn"] - index) / 1e3
            out["requests"] = [r for r in _requests(entries, 0) if r["start"] <= marks["trainmon:drawn"]]
            out["measures"] = [m for m in entries["measures"]]
            out["cells"] = frame.locator("rect.tl-cell").count()
            # the views the first view starts after it (the statistics, the time heat map) drawn too
            out["settled"] = frame.evaluate(_SETTLED, 0) / 1e3
            out["clicks"] = {}
            for what in CLICKS:
                t0 = frame.evaluate(_CLICK, what)
                if t0 is None:
                    continue
                end = frame.evaluate(_SETTLED, t0)
                got = frame.evaluate(_ENTRIES, t0)
                took = None if end is None else (end - t0) / 1e3
                requests = _requests(got, t0)
                out["clicks"][what] = {"took": took, "requests": requests, "measures": got["measures"]}
            # the same page again: TensorBoard's scripts cached by the browser, the plugin's indexes warm
            t0 = time.perf_counter()
            page.reload()
            frame = page.wait_for_selector('iframe[src*="plugin_entry.html?name=trainmon"]').content_frame()
            frame.wait_for_selector("#timeline-svg")
            out["reload"] = time.perf_counter() - t0
            runs = json.loads(_get(f"{base}/data/plugin/trainmon/runs")[0])["runs"]
            if runs and runs[0]["dumps"]:
                from trainmon.run.dumps import list_dumps

                q = urllib.parse.quote
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
    out["load_after"] = os.getloadavg()[0]
    return out


def _kb(n: float | None) -> str:
    return "?" if n is None else f"{n / 1e3:.1f} KB"


def _ms(n: float | None) -> str:
    return "?" if n is None else f"{n:.0f} ms"


def _request_lines(requests: list[dict], indent: str) -> list[str]:
    return [f"{indent}{r['route']}: at {r['at']:.0f} ms, {r['took']:.0f} ms in the browser, "
            f"{_ms(r['server'])} in the plugin; {_kb(r['sent'])} sent, {_kb(r['json'])} JSON"
            for r in requests]  # fmt: skip


def _spread(values: list[float], unit: str = "s") -> str:
    if not values:
        return "-"
    scale, digits = (1, 2) if unit == "s" else (1e3, 0)
    med = statistics.median(values) * scale
    lo, hi = min(values) * scale, max(values) * scale
    return f"{med:.{digits}f} {unit} [{lo:.{digits}f}-{hi:.{digits}f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--pause", type=float, default=2.0, help="seconds before the first dump is opened")
    ap.add_argument("--json", type=Path, default=None, help="also write every repeat's figures there")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    print(f"{args.run}: {os.cpu_count()} CPUs; times from the browser's clock and the plugin's Server-Timing")
    results = []
    for i in range(args.repeat):
        r = once(args.run, args.pause)
        results.append(r)
        print(f"#{i + 1} (load {r['load']:.1f} -> {r['load_after']:.1f}): HTTP up {r['http_up']:.2f} s, "
              f"TB index +{r['tb_index']:.2f} s, TB page +{r['tb_page']:.2f} s, frame -> modules "
              f"+{r['modules']:.2f} s, modules -> drawn +{r['drawn']:.2f} s ({r['cells']} cells): first view "
              f"{r['first_view']:.2f} s after the frame starts ({r['from_index']:.2f} s after TB's index); "
              f"every view settled {r['settled']:.2f} s; reload {r['reload']:.2f} s", flush=True)  # fmt: skip
        for line in _request_lines(r["requests"], "    "):
            print(line)
        print("    " + ", ".join(f"{name} {ms:.0f} ms" for name, ms in r["measures"]))
        for what, c in r["clicks"].items():
            print(
                f"  click {what}: {'?' if c['took'] is None else format(c['took'] * 1e3, '.0f')} ms; "
                + ", ".join(f"{name} {ms:.0f} ms" for name, ms in c["measures"])
            )
            for line in _request_lines(c["requests"], "      "):
                print(line)
        if "first_dump_meta" in r:
            print(
                f"  first /dump_meta {r['first_dump_meta'] * 1e3:.0f} ms ({args.pause:g} s after the "
                f"view), next ones {r['next_dump_meta'] * 1e3:.0f} ms"
            )
    loads = [r["load"] for r in results] + [r["load_after"] for r in results]
    print(f"\nmedian [range] of {len(results)} starts, load average {min(loads):.1f}-{max(loads):.1f}:")
    for key, label in (("http_up", "HTTP up (tensorboard started -> answers)"),
                       ("tb_index", "TB index (HTTP up -> TensorBoard's index answered)"),
                       ("tb_page", "TB page (index -> the plugin's frame starts)"),
                       ("modules", "frame -> the tab's modules loaded"),
                       ("drawn", "modules -> timeline drawn"),
                       ("first_view", "FIRST VIEW: the frame starts -> timeline drawn"),
                       ("from_index", "TB's index answered -> timeline drawn"),
                       ("settled", "the frame starts -> every first view's load drawn"),
                       ("reload", "reload (browser cache warm)")):  # fmt: skip
        print(f"  {label}: {_spread([r[key] for r in results])}")
    routes: dict[str, list[dict]] = {}
    for r in results:
        for q in r["requests"]:
            routes.setdefault(q["route"].partition("?")[0], []).append(q)
    for route, qs in routes.items():
        print(f"  first view's /{route}: in the plugin {_spread([q['server'] / 1e3 for q in qs], 'ms')}, "
              f"in the browser {_spread([q['took'] / 1e3 for q in qs], 'ms')}, {len(qs) / len(results):g} "
              f"a view, {_kb(statistics.median(q['json'] for q in qs))} JSON")  # fmt: skip
    for what in CLICKS:
        took = [r["clicks"][what]["took"] for r in results if what in r["clicks"]]
        if took:
            print(f"  click {what}: {_spread([t for t in took if t is not None], 'ms')}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

// Line chart of one tensor's statistic over steps (SVG), with anomaly markers: red dots at the anomaly
// steps, bigger and outlined for an origin. Non-finite values break the line and are marked on the top edge.

import {
  ANOMALY_COLOR,
  clear,
  el,
  fmt,
  fmtTick,
  hideTooltip,
  logTicks,
  niceTicks,
  showTooltip,
  svg,
  toNumber,
} from './util.js';

const M = { left: 70, right: 18, top: 16, bottom: 30 };
const HEIGHT = 260;

export function drawSeries(container, data, { logY = false } = {}) {
  clear(container);
  hideTooltip();
  const steps = data.steps || [];
  const vals = (data.values || []).map(toNumber);
  const anomalies = data.anomalies || [];
  const width = Math.max(360, container.clientWidth || 900);
  const root = svg('svg', {
    class: 'series-svg',
    width,
    height: HEIGHT,
    dataset: { points: steps.length, anomalies: anomalies.length },
  });
  container.append(root);
  if (steps.length === 0) {
    root.append(svg('text', { class: 'chart-empty', x: width / 2, y: HEIGHT / 2, 'text-anchor': 'middle' }, 'no data'));
    return;
  }
  const plotW = width - M.left - M.right;
  const plotH = HEIGHT - M.top - M.bottom;
  let xlo = steps[0];
  let xhi = steps[steps.length - 1];
  for (const a of anomalies) {
    xlo = Math.min(xlo, a.step);
    xhi = Math.max(xhi, a.step);
  }
  if (xhi === xlo) {
    xlo -= 1;
    xhi += 1;
  }
  let ylo = Infinity;
  let yhi = -Infinity;
  let positive = true;
  for (const v of vals) {
    if (!Number.isFinite(v)) continue;
    if (v < ylo) ylo = v;
    if (v > yhi) yhi = v;
    if (v <= 0) positive = false;
  }
  const useLog = logY && positive && Number.isFinite(ylo);
  if (!Number.isFinite(ylo)) {
    ylo = 0;
    yhi = 1;
  } else if (useLog) {
    if (yhi / ylo < 10) {
      ylo /= 2;
      yhi *= 2;
    }
  } else if (yhi === ylo) {
    const d = Math.abs(ylo) * 0.1 || 1;
    ylo -= d;
    yhi += d;
  } else {
    const pad = (yhi - ylo) * 0.06;
    ylo -= pad;
    yhi += pad;
  }
  const sx = (s) => M.left + ((s - xlo) / (xhi - xlo)) * plotW;
  const sy = useLog
    ? (v) => M.top + (1 - (Math.log(v) - Math.log(ylo)) / (Math.log(yhi) - Math.log(ylo))) * plotH
    : (v) => M.top + (1 - (v - ylo) / (yhi - ylo)) * plotH;

  // grid and axes
  const g = svg('g', { class: 'chart-axes' });
  const yt = useLog ? logTicks(ylo, yhi) : niceTicks(ylo, yhi, 5);
  for (const t of yt) {
    const y = sy(t);
    g.append(svg('line', { class: 'chart-grid', x1: M.left, x2: M.left + plotW, y1: y, y2: y }));
    g.append(svg('text', { class: 'tl-tick-label', x: M.left - 6, y, 'text-anchor': 'end', 'dominant-baseline': 'central' }, fmtTick(t)));
  }
  for (const t of niceTicks(xlo, xhi, Math.max(2, Math.floor(plotW / 90)), true)) {
    const x = sx(t);
    g.append(svg('line', { class: 'tl-tick', x1: x, x2: x, y1: M.top + plotH, y2: M.top + plotH + 5 }));
    g.append(svg('text', { class: 'tl-tick-label', x, y: M.top + plotH + 18, 'text-anchor': 'middle' }, String(t)));
  }
  g.append(svg('rect', { class: 'chart-frame', x: M.left, y: M.top, width: plotW, height: plotH }));
  root.append(g);

  // line, broken at non-finite values; non-finite points marked at the top
  let d = '';
  let pen = false;
  const bad = svg('g', { class: 'chart-nonfinite' });
  const dots = svg('g', { class: 'chart-dots' });
  const valueAt = new Map();
  for (let i = 0; i < steps.length; i += 1) {
    const v = vals[i];
    valueAt.set(steps[i], v);
    if (!Number.isFinite(v) || (useLog && v <= 0)) {
      pen = false;
      const x = sx(steps[i]);
      bad.append(
        svg('path', {
          class: Number.isNaN(v) ? 'chart-nan' : 'chart-inf',
          d: `M${x - 4},${M.top - 8} L${x + 4},${M.top - 8} L${x},${M.top - 1} Z`,
        }),
      );
      continue;
    }
    const x = sx(steps[i]).toFixed(1);
    const y = sy(v).toFixed(1);
    d += `${pen ? 'L' : 'M'}${x},${y}`;
    pen = true;
    if (steps.length <= 200) dots.append(svg('circle', { class: 'chart-dot', cx: x, cy: y, r: 2 }));
  }
  root.append(svg('path', { class: 'chart-line', d }), dots, bad);

  // anomaly markers (origin last, so it is drawn on top)
  const marks = svg('g', { class: 'chart-anomalies' });
  const sorted = [...anomalies].sort((a, b) => Number(!!a.origin) - Number(!!b.origin));
  for (const a of sorted) {
    const v = valueAt.get(a.step);
    const y = Number.isFinite(v) && !(useLog && v <= 0) ? sy(v) : M.top + 2;
    const c = svg('circle', {
      class: a.origin ? 'anomaly-marker origin' : 'anomaly-marker',
      cx: sx(a.step),
      cy: y,
      r: a.origin ? 7 : 4,
      fill: ANOMALY_COLOR,
      dataset: { step: a.step, rule: a.rule, origin: a.origin ? '1' : '0' },
    });
    c.append(svg('title', null, `step ${a.step}: ${a.rule} (${a.stat} = ${fmt(a.value)})${a.origin ? ', origin' : ''}`));
    marks.append(c);
  }
  root.append(marks);

  // hover: nearest step
  const cross = svg('line', { class: 'chart-cross', y1: M.top, y2: M.top + plotH, visibility: 'hidden' });
  root.append(cross);
  root.addEventListener('pointermove', (ev) => {
    const b = root.getBoundingClientRect();
    const x = ev.clientX - b.left;
    if (x < M.left || x > M.left + plotW) {
      cross.setAttribute('visibility', 'hidden');
      hideTooltip();
      return;
    }
    const s = xlo + ((x - M.left) / plotW) * (xhi - xlo);
    let lo = 0;
    let hi = steps.length - 1;
    while (hi - lo > 1) {
      const mid = (lo + hi) >> 1;
      if (steps[mid] < s) lo = mid;
      else hi = mid;
    }
    const i = Math.abs(steps[lo] - s) <= Math.abs(steps[hi] - s) ? lo : hi;
    const cx = sx(steps[i]);
    cross.setAttribute('x1', cx);
    cross.setAttribute('x2', cx);
    cross.setAttribute('visibility', 'visible');
    const lines = [`step ${steps[i]}: ${fmt(data.values[i])}`];
    for (const a of anomalies) if (a.step === steps[i]) lines.push(`${a.rule}: ${a.stat} = ${fmt(a.value)}${a.origin ? ' (origin)' : ''}`);
    showTooltip(ev.clientX, ev.clientY, lines);
  });
  root.addEventListener('pointerleave', () => {
    cross.setAttribute('visibility', 'hidden');
    hideTooltip();
  });
}

export function seriesLegend() {
  return el(
    'div',
    { class: 'chart-legend' },
    el('span', { class: 'legend-item' }, el('span', { class: 'legend-line' }), 'value'),
    el('span', { class: 'legend-item' }, el('span', { class: 'legend-dot' }), 'anomaly'),
    el('span', { class: 'legend-item' }, el('span', { class: 'legend-dot big' }), 'origin'),
    el('span', { class: 'legend-item' }, el('span', { class: 'legend-tri' }), 'NaN / Inf'),
  );
}

// Line chart of one tensor's statistic over steps (SVG), with anomaly markers: red dots at the anomaly
// steps, bigger and outlined for an origin. Non-finite values, and the steps where the tensor held NaN/Inf
// elements (`nan_steps`, `inf_steps`: its statistic there is of its finite elements only, NaN when none is),
// break the line and are marked on the top edge. On a log axis, values <= 0 break the line and are marked on
// the bottom edge.

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
  // the width read before the old drawing is removed: read after, it laid the whole page out again
  const width = Math.max(360, container.clientWidth || 900);
  clear(container);
  hideTooltip();
  const steps = data.steps || [];
  const nanAt = new Set(data.nan_steps || []);
  const infAt = new Set(data.inf_steps || []);
  // a step where the tensor held NaN/Inf elements reads as that, whatever the finite ones' statistic
  const vals = (data.values || []).map((v, i) => (nanAt.has(steps[i]) ? NaN : infAt.has(steps[i]) ? Infinity : toNumber(v)));
  const anomalies = data.anomalies || [];
  const root = svg('svg', {
    class: 'series-svg',
    width,
    height: HEIGHT,
    dataset: { points: steps.length, anomalies: anomalies.length, nanSteps: nanAt.size, infSteps: infAt.size },
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
  // log y: over the positive values (values <= 0 are marked on the bottom edge); linear when none is
  let plo = Infinity;
  let phi = -Infinity;
  let ylo = Infinity;
  let yhi = -Infinity;
  for (const v of vals) {
    if (!Number.isFinite(v)) continue;
    if (v < ylo) ylo = v;
    if (v > yhi) yhi = v;
    if (v > 0 && v < plo) plo = v;
    if (v > 0 && v > phi) phi = v;
  }
  const useLog = logY && Number.isFinite(plo);
  if (useLog) {
    ylo = plo;
    yhi = phi;
  }
  root.dataset.scale = useLog ? 'log' : 'linear';
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
    if (useLog && v <= 0) {
      pen = false;
      const x = sx(steps[i]);
      const yb = M.top + plotH;
      bad.append(svg('path', { class: 'chart-nonpositive', d: `M${x - 3},${yb + 7} L${x + 3},${yb + 7} L${x},${yb + 1} Z` }));
      continue;
    }
    if (!Number.isFinite(v)) {
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
    const held = nanAt.has(steps[i]) ? ' (NaN elements: the finite ones\' value)' : infAt.has(steps[i]) ? ' (Inf elements: the finite ones\' value)' : '';
    const lines = [`step ${steps[i]}: ${fmt(data.values[i])}${held}`];
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

// The colours of a step's parts (the stacked time chart), in the order they are stacked from the bottom.
export const PART_COLORS = {
  data: '#8c564b',
  forward: '#1f77b4',
  backward: '#ff7f0e',
  optimizer: '#2ca02c',
  comm: '#9467bd',
  gc: '#d62728',
  monitor: '#7f7f7f',
  other: '#bcbd22',
};
const WAIT_COLOR = '#111';

/**
 * One rank's time per step (SVG): the parts of each step stacked (they add up to the step), the wait at
 * collectives (inside comm) as a dashed line.
 * @param {HTMLElement} container
 * @param {object} data the /rank_steps answer: steps (each point's first step), edges (when points are bins
 *   of steps), times {name: [ms]}
 */
export function drawStacked(container, data) {
  // the width read before the old drawing is removed: read after, it laid the whole page out again
  const width = Math.max(300, container.clientWidth || 600);
  clear(container);
  hideTooltip();
  const steps = data.steps || [];
  const times = data.times || {};
  const parts = Object.keys(PART_COLORS).filter((p) => times[p]);
  const root = svg('svg', { class: 'stacked-svg', width, height: HEIGHT, dataset: { points: steps.length, parts: parts.join(',') } });
  container.append(root);
  if (steps.length === 0) {
    root.append(svg('text', { class: 'chart-empty', x: width / 2, y: HEIGHT / 2, 'text-anchor': 'middle' }, 'no timed step'));
    return;
  }
  const plotW = width - M.left - M.right;
  const plotH = HEIGHT - M.top - M.bottom;
  const edges = data.edges;
  // x runs from the first point's step to the end of the last point (a point spans its steps)
  const xlo = steps[0];
  const xhi = edges ? edges[edges.length - 1] : steps[steps.length - 1] + 1;
  const n = steps.length;
  // the stack: cumulative sums per point, NaN parts counted as 0
  const value = (name, i) => {
    const v = toNumber((times[name] || [])[i]);
    return Number.isFinite(v) ? v : 0;
  };
  const tops = parts.map(() => new Float64Array(n));
  let yhi = 0;
  for (let i = 0; i < n; i += 1) {
    let acc = 0;
    parts.forEach((p, k) => {
      acc += value(p, i);
      tops[k][i] = acc;
    });
    const step = toNumber((times.step || [])[i]);
    yhi = Math.max(yhi, acc, Number.isFinite(step) ? step : 0);
  }
  yhi = yhi > 0 ? yhi * 1.06 : 1;
  // a point spans its steps (a bin: up to the next point's first step)
  const x0 = (i) => M.left + ((steps[i] - xlo) / (xhi - xlo)) * plotW;
  const x1 = (i) => M.left + (((edges ? edges[i + 1] : steps[i] + 1) - xlo) / (xhi - xlo)) * plotW;
  const sy = (v) => M.top + (1 - v / yhi) * plotH;

  const g = svg('g', { class: 'chart-axes' });
  for (const t of niceTicks(0, yhi, 5)) {
    const y = sy(t);
    g.append(svg('line', { class: 'chart-grid', x1: M.left, x2: M.left + plotW, y1: y, y2: y }));
    g.append(svg('text', { class: 'tl-tick-label', x: M.left - 6, y, 'text-anchor': 'end', 'dominant-baseline': 'central' }, fmtTick(t)));
  }
  for (const t of niceTicks(xlo, xhi, Math.max(2, Math.floor(plotW / 90)), true)) {
    const x = M.left + ((t - xlo) / (xhi - xlo)) * plotW;
    g.append(svg('line', { class: 'tl-tick', x1: x, x2: x, y1: M.top + plotH, y2: M.top + plotH + 5 }));
    g.append(svg('text', { class: 'tl-tick-label', x, y: M.top + plotH + 18, 'text-anchor': 'middle' }, String(t)));
  }
  g.append(svg('text', { class: 'tl-axis-title', x: 8, y: M.top + 4, 'dominant-baseline': 'hanging' }, 'ms'));
  g.append(svg('rect', { class: 'chart-frame', x: M.left, y: M.top, width: plotW, height: plotH }));
  root.append(g);

  // each part an area between its bottom and its top (steps as flat runs)
  const area = (k) => {
    let up = '';
    let down = '';
    for (let i = 0; i < n; i += 1) {
      const a = x0(i).toFixed(1);
      const b = x1(i).toFixed(1);
      const top = sy(tops[k][i]).toFixed(1);
      up += `${i ? 'L' : 'M'}${a},${top}L${b},${top}`;
      const bottom = sy(k ? tops[k - 1][i] : 0).toFixed(1);
      down = `L${b},${bottom}L${a},${bottom}` + down;
    }
    return `${up}${down}Z`;
  };
  parts.forEach((p, k) => {
    root.append(svg('path', { class: 'stacked-area', d: area(k), fill: PART_COLORS[p], dataset: { part: p } }));
  });
  if (times.wait) {
    let d = '';
    let pen = false;
    for (let i = 0; i < n; i += 1) {
      const v = toNumber(times.wait[i]);
      if (!Number.isFinite(v)) {
        pen = false;
        continue;
      }
      d += `${pen ? 'L' : 'M'}${x0(i).toFixed(1)},${sy(v).toFixed(1)}L${x1(i).toFixed(1)},${sy(v).toFixed(1)}`;
      pen = true;
    }
    if (d) root.append(svg('path', { class: 'stacked-wait', d, stroke: WAIT_COLOR, dataset: { part: 'wait' } }));
  }

  const cross = svg('line', { class: 'chart-cross', y1: M.top, y2: M.top + plotH, visibility: 'hidden' });
  root.append(cross);
  root.addEventListener('pointermove', (ev) => {
    const b = root.getBoundingClientRect();
    const x = ev.clientX - b.left;
    const s = xlo + ((x - M.left) / plotW) * (xhi - xlo);
    let i = -1;
    for (let lo = 0, hi = n - 1; lo <= hi; ) {
      const mid = (lo + hi) >> 1;
      if (steps[mid] <= s) {
        i = mid;
        lo = mid + 1;
      } else hi = mid - 1;
    }
    if (x < M.left || x > M.left + plotW || i < 0) {
      cross.setAttribute('visibility', 'hidden');
      hideTooltip();
      return;
    }
    const cx = (x0(i) + x1(i)) / 2;
    cross.setAttribute('x1', cx);
    cross.setAttribute('x2', cx);
    cross.setAttribute('visibility', 'visible');
    const span = edges ? edges[i + 1] - 1 : steps[i];
    const lines = [span === steps[i] ? `step ${steps[i]}` : `steps ${steps[i]}\u2013${span} (mean a step)`];
    const ms = (name) => {
      const v = toNumber((times[name] || [])[i]);
      return Number.isFinite(v) ? `${v.toFixed(1)} ms` : '\u2013';
    };
    lines.push(`step ${ms('step')}`);
    for (const p of [...parts].reverse()) lines.push(`${p} ${ms(p)}${p === 'comm' && times.wait ? ` (wait ${ms('wait')})` : ''}`);
    showTooltip(ev.clientX, ev.clientY, lines);
  });
  root.addEventListener('pointerleave', () => {
    cross.setAttribute('visibility', 'hidden');
    hideTooltip();
  });
}

export function stackedLegend() {
  const items = Object.entries(PART_COLORS).map(([p, c]) => el('span', { class: 'legend-item' }, el('span', { class: 'hm-swatch', style: { background: c } }), p));
  items.push(el('span', { class: 'legend-item' }, el('span', { class: 'legend-dash' }), 'wait (inside comm)'));
  return el('div', { class: 'chart-legend' }, ...items);
}

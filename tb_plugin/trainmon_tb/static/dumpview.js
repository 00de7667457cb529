// Dump panel: one dumped tensor from /dump_meta: shape/dtype, statistics, safetensors metadata, a histogram
// of the finite values and a download link (./dump, served as an attachment).

import { routeUrl } from './api.js';
import { clear, el, fmt, fmtBytes, fmtTick, hideTooltip, showTooltip, svg, toNumber } from './util.js';

const STATS = ['numel', 'min', 'max', 'mean', 'norm', 'zeros', 'nans', 'infs'];
const COUNTS = new Set(['numel', 'nans', 'infs']);

/** A statistic as shown in #dump-stats: counts exactly, other values with 6 significant digits. */
export function formatStat(stat, v) {
  if (v === null || v === undefined) return '';
  if (typeof v === 'string') return v; // "nan", "inf", "-inf"
  if (COUNTS.has(stat) && Number.isInteger(v)) return String(v);
  return Number(v).toPrecision(6);
}

export function renderDump(container, meta, { run, onClose }) {
  clear(container);
  const path = meta.path;
  const entry = meta.entry || {};
  const tensor = meta.tensor || {};
  const shape = tensor.shape || entry.shape || [];
  const base = path.split('/').pop();
  const download = el(
    'a',
    { class: 'dump-download button-link', href: routeUrl('dump', { run, path }), download: base, title: 'the safetensors file' },
    '\u2b07 download .safetensors',
  );
  const header = el(
    'div',
    { class: 'dump-head' },
    el('div', null, el('div', { class: 'dump-title' }, entry.name || meta.metadata?.name || base), el('div', { class: 'mono muted small' }, path)),
    el('div', { class: 'dump-actions' }, download, el('button', { type: 'button', class: 'dump-close', onclick: onClose, title: 'close' }, '\u00d7')),
  );

  const info = el('table', { class: 'kv', id: 'dump-info' });
  const addKv = (t, k, v) => t.append(el('tr', null, el('th', null, k), el('td', null, v)));
  addKv(info, 'dtype', `${tensor.dtype ?? entry.dtype ?? ''}`);
  addKv(info, 'shape', `[${shape.join(', ')}]`);
  for (const k of ['step', 'rank', 'kind', 'micro_step', 'reason']) if (entry[k] !== undefined && entry[k] !== null) addKv(info, k.replace('_', ' '), String(entry[k]));
  if (entry.bytes !== undefined) addKv(info, 'file size', fmtBytes(entry.bytes));

  const stats = el('table', { class: 'kv', id: 'dump-stats' });
  const s = meta.stats || {};
  for (const k of STATS) {
    if (!(k in s)) continue;
    const v = s[k];
    const td = el('td', { class: 'num', dataset: { stat: k, value: JSON.stringify(v) }, title: String(v) }, formatStat(k, v));
    if ((k === 'nans' || k === 'infs') && toNumber(v) > 0) td.classList.add('bad');
    stats.append(el('tr', null, el('th', null, k === 'zeros' ? 'zeros (fraction)' : k), td));
  }

  const md = el('table', { class: 'kv', id: 'dump-metadata' });
  for (const [k, v] of Object.entries(meta.metadata || {}).sort()) addKv(md, k, String(v));

  const cols = el(
    'div',
    { class: 'dump-cols' },
    el('div', null, el('h4', null, 'tensor'), info),
    el('div', null, el('h4', null, 'statistics'), stats),
    el('div', null, el('h4', null, 'metadata'), md),
  );
  const hist = el('div', { class: 'dump-hist-wrap' });
  container.append(header, cols, el('h4', null, 'histogram of the finite values'), hist);
  drawHistogram(hist, meta.histogram, s);
}

function drawHistogram(container, h, stats) {
  const edges = (h && h.edges) || [];
  const counts = (h && h.counts) || [];
  const width = Math.max(320, Math.min(900, container.clientWidth || 700));
  const height = 170;
  const m = { left: 56, right: 12, top: 8, bottom: 26 };
  const root = svg('svg', { id: 'dump-hist', width, height, dataset: { bins: counts.length } });
  container.append(root);
  const total = counts.reduce((a, b) => a + b, 0);
  if (!counts.length || total === 0) {
    const bad = [];
    if (toNumber(stats.nans) > 0) bad.push(`${stats.nans} NaN`);
    if (toNumber(stats.infs) > 0) bad.push(`${stats.infs} Inf`);
    const of = stats.numel !== undefined ? ` of ${stats.numel} elements` : '';
    const text = `no finite value${bad.length ? `: ${bad.join(', ')}${of}` : ''}`;
    root.setAttribute('height', 60);
    root.append(svg('text', { class: 'chart-empty', x: width / 2, y: 30, 'text-anchor': 'middle' }, text));
    return;
  }
  const plotW = width - m.left - m.right;
  const plotH = height - m.top - m.bottom;
  const maxC = Math.max(...counts);
  const bw = plotW / counts.length;
  counts.forEach((c, i) => {
    const bh = (c / maxC) * plotH;
    const bar = svg('rect', {
      class: 'hist-bar',
      x: m.left + i * bw + (bw > 3 ? 0.5 : 0),
      y: m.top + plotH - bh,
      width: Math.max(0.5, bw - (bw > 3 ? 1 : 0)),
      height: Math.max(c > 0 ? 1 : 0, bh),
      dataset: { count: c },
    });
    const hover = svg('rect', { class: 'hist-hover', x: m.left + i * bw, y: m.top, width: bw, height: plotH });
    const label = `[${fmt(edges[i])}, ${fmt(edges[i + 1])}${i === counts.length - 1 ? ']' : ')'}: ${c}`;
    hover.addEventListener('pointermove', (ev) => showTooltip(ev.clientX, ev.clientY, [label]));
    hover.addEventListener('pointerleave', () => hideTooltip());
    root.append(bar, hover);
  });
  root.append(svg('line', { class: 'tl-frame', x1: m.left, x2: m.left + plotW, y1: m.top + plotH, y2: m.top + plotH }));
  const lo = toNumber(edges[0]);
  const hi = toNumber(edges[edges.length - 1]);
  root.append(svg('text', { class: 'tl-tick-label', x: m.left, y: height - 8, 'text-anchor': 'start' }, fmtTick(lo)));
  root.append(svg('text', { class: 'tl-tick-label', x: m.left + plotW, y: height - 8, 'text-anchor': 'end' }, fmtTick(hi)));
  if (lo < 0 && hi > 0) {
    const x0 = m.left + ((0 - lo) / (hi - lo)) * plotW;
    root.append(svg('line', { class: 'hist-zero', x1: x0, x2: x0, y1: m.top, y2: m.top + plotH }));
    root.append(svg('text', { class: 'tl-tick-label', x: x0, y: height - 8, 'text-anchor': 'middle' }, '0'));
  }
  root.append(svg('text', { class: 'tl-tick-label', x: m.left - 6, y: m.top + 8, 'text-anchor': 'end' }, String(maxC)));
  root.append(svg('text', { class: 'tl-tick-label', x: m.left - 6, y: m.top + plotH, 'text-anchor': 'end' }, '0'));
}

// Dump panel: one dumped tensor from /dump_meta: shape/dtype, statistics, safetensors metadata, a histogram
// of the finite values, where its non-finite values are, a download link (./dump, served as an attachment),
// and for a module input or output the other dumped tensors of that module call, inputs next to outputs, so
// the input that went bad (or the module that made a clean input bad) is seen at a glance.

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

/**
 * @param {object} opts {run, onClose, onOpenDump(path): open another dump, loadMeta(path) -> Promise<meta>}
 */
export function renderDump(container, meta, { run, onClose, onOpenDump, loadMeta }) {
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
  if (entry.note) addKv(info, 'note', entry.note); // e.g. the tensor was modified in place after its hook
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
  container.append(header, cols);
  if (meta.nonfinite && meta.nonfinite.count > 0) {
    container.append(el('h4', null, 'non-finite values'), nonFinite(meta.nonfinite, 'dump-nonfinite', { numel: meta.stats?.numel }));
  }
  container.append(el('h4', null, 'histogram of the finite values'), hist);
  drawHistogram(hist, meta.histogram, s, { id: 'dump-hist' });
  if (meta.module) container.append(moduleCall(meta, { onOpenDump, loadMeta }));
}

/** Where the non-finite values are: their count, the first indices (row-major) and, for a tensor of 2 or
 * more dimensions seen as rows x last dimension, the rows holding any with their count. `numel` (when
 * known) turns "every element" into one line; `shown` caps the indices and rows listed (a card has less
 * room than the panel). */
function nonFinite(nf, id, { numel, shown = 24 } = {}) {
  const box = el('div', { class: 'nonfinite', id, dataset: { count: nf.count } });
  if (numel !== undefined && nf.count === toNumber(numel)) {
    box.append(el('div', { class: 'nf-all' }, `every element is non-finite (${nf.count})`));
    return box;
  }
  const first = (nf.first || []).slice(0, shown).map((f) =>
    el('span', { class: 'nf-index', dataset: { index: f.index.join(','), value: f.value } }, `[${f.index.join(', ')}] ${f.value}`),
  );
  const more = nf.count > first.length ? ` \u2026 (${nf.count} in all)` : '';
  box.append(el('div', { class: 'nf-first' }, el('span', { class: 'muted' }, `${nf.count} non-finite; first at `), joined(first, ', '), more));
  const r = nf.rows;
  if (r && r.with_non_finite > 0) {
    const view = r.flattened ? ` (leading dimensions flattened: [${r.shape.join(', ')}])` : '';
    const head = `${r.with_non_finite} of ${r.shape[0]} rows of ${r.shape[1]} hold one${view}`;
    const counts = r.counts || [];
    // every row with the same count: one number says it
    if (r.with_non_finite === r.shape[0] && counts.length === r.shape[0] && counts.every(([, n]) => n === counts[0][1])) {
      box.append(el('div', { class: 'nf-rows' }, el('span', { class: 'muted' }, `${head}: `), `${counts[0][1]} in each`));
      return box;
    }
    const rows = counts.slice(0, shown).map(([row, n]) => el('span', { class: 'nf-row', dataset: { row, count: n } }, `row ${row}: ${n}`));
    const rest = r.with_non_finite > rows.length ? ` \u2026 ${r.with_non_finite - rows.length} more rows` : '';
    box.append(el('div', { class: 'nf-rows' }, el('span', { class: 'muted' }, `${head}: `), joined(rows, ', '), rest));
  }
  return box;
}

function joined(nodes, sep) {
  return nodes.flatMap((n, i) => (i ? [sep, n] : [n]));
}

const PHASES = [
  ['forward', ['input', 'output']],
  ['backward', ['output_grad', 'input_grad']],
];

/** The dumped tensors of the module call a dump belongs to: per phase, what flows in, an arrow, what flows
 * out; each a card with its counts, a small histogram and its first non-finite index, filled from its own
 * /dump_meta. The open dump is outlined; a card's name opens that dump. */
function moduleCall(meta, { onOpenDump, loadMeta }) {
  const mod = meta.module;
  const tensors = mod.tensors || [];
  const micro = mod.micro_step ? `, micro-step ${mod.micro_step}` : '';
  const box = el('div', { class: 'module-call', id: 'dump-module', dataset: { module: mod.module, step: mod.step } });
  box.append(
    el('h4', null, 'module call'),
    el('div', { class: 'module-title' }, el('span', { class: 'mono' }, mod.module), el('span', { class: 'muted' }, ` at step ${mod.step}, rank ${mod.rank}${micro}: its dumped inputs \u2192 outputs`)),
  );
  if (tensors.length < 2) {
    box.append(
      el(
        'div',
        { class: 'muted small module-alone' },
        'No other tensor of this module call was dumped. With alert.capture: exact the monitor dumps the ' +
          "origin module's inputs and outputs at the anomaly's step.",
      ),
    );
  }
  for (const [phase, roles] of PHASES) {
    const ins = tensors.filter((t) => t.role === roles[0]);
    const outs = tensors.filter((t) => t.role === roles[1]);
    if (!ins.length && !outs.length) continue;
    const side = (list, label) =>
      el('div', { class: 'module-side', dataset: { side: label } }, list.length ? list.map((t) => card(t, meta, { onOpenDump, loadMeta })) : el('div', { class: 'muted small' }, `no ${label} dumped`));
    box.append(el('div', { class: 'module-phase', dataset: { phase } }, side(ins, roles[0].replace('_', ' ')), el('div', { class: 'module-arrow' }, '\u2192'), side(outs, roles[1].replace('_', ' '))));
  }
  return box;
}

function card(t, meta, { onOpenDump, loadMeta }) {
  const current = t.path === meta.path;
  const title = el(
    'a',
    {
      href: '#',
      class: 'module-tensor-name mono',
      title: `${t.path}${t.reason ? `\nreason: ${t.reason}` : ''}${t.note ? `\n${t.note}` : ''}`,
      onclick: (e) => {
        e.preventDefault();
        if (!current && onOpenDump) onOpenDump(t.path);
      },
    },
    t.name,
  );
  const body = el('div', { class: 'module-tensor-body muted small' }, 'loading\u2026');
  const node = el(
    'div',
    { class: current ? 'module-tensor current' : 'module-tensor', dataset: { path: t.path, role: t.role, name: t.name } },
    title,
    el('div', { class: 'muted small' }, `${t.dtype} [${(t.shape || []).join(', ')}]`),
    t.note ? el('div', { class: 'small module-note' }, t.note) : null,
    body,
  );
  const fill = (m) => {
    const s = m.stats || {};
    const nans = toNumber(s.nans);
    const infs = toNumber(s.infs);
    node.dataset.nans = String(s.nans);
    node.dataset.infs = String(s.infs);
    node.classList.add(nans + infs > 0 ? 'nonfinite-tensor' : 'finite-tensor');
    const maxAbs = Math.max(Math.abs(toNumber(s.min)), Math.abs(toNumber(s.max))); // NaN: no finite value
    const counts = el(
      'div',
      { class: 'module-counts small' },
      nans + infs > 0
        ? el('span', { class: 'bad' }, `${s.nans} NaN, ${s.infs} Inf of ${s.numel}`)
        : el('span', { class: 'ok' }, `all ${s.numel} finite`),
      Number.isNaN(maxAbs) ? '' : ` \u00b7 max |x| ${fmt(maxAbs)}`,
    );
    const hist = el('div', { class: 'module-hist' });
    body.replaceWith(el('div', { class: 'module-tensor-body' }, counts, hist, m.nonfinite && m.nonfinite.count > 0 ? nonFinite(m.nonfinite, null, { numel: s.numel, shown: 6 }) : null));
    drawHistogram(hist, m.histogram, s, { width: 300, height: 90 });
  };
  if (current) fill(meta);
  else if (loadMeta) {
    loadMeta(t.path).then(fill, (e) => {
      body.textContent = String(e.message || e);
      body.classList.add('bad');
    });
  }
  return node;
}

const CHAR_W = 6.2; // px of a digit of .tl-tick-label (11 px sans-serif), for the labels' room

function drawHistogram(container, h, stats, { id, width: fixedWidth, height = 170 } = {}) {
  const edges = (h && h.edges) || [];
  const counts = (h && h.counts) || [];
  const width = fixedWidth || Math.max(320, Math.min(900, container.clientWidth || 700));
  const small = height < 120;
  const m = small ? { left: 36, right: 8, top: 6, bottom: 20 } : { left: 56, right: 12, top: 8, bottom: 26 };
  const maxC = Math.max(0, ...counts);
  // the largest count labels the y axis in full: the left margin is as wide as it needs
  const yLabel = String(maxC);
  m.left = Math.max(m.left, Math.ceil(yLabel.length * CHAR_W) + 10);
  const root = svg('svg', { id, class: 'dump-hist', width, height, dataset: { bins: counts.length } });
  container.append(root);
  const total = counts.reduce((a, b) => a + b, 0);
  if (!counts.length || total === 0) {
    const bad = [];
    if (toNumber(stats.nans) > 0) bad.push(`${stats.nans} NaN`);
    if (toNumber(stats.infs) > 0) bad.push(`${stats.infs} Inf`);
    const of = stats.numel !== undefined ? ` of ${stats.numel} element${stats.numel === 1 ? '' : 's'}` : '';
    const text = `no finite value${bad.length ? `: ${bad.join(', ')}${of}` : ''}`;
    root.setAttribute('height', small ? 40 : 60);
    root.append(svg('text', { class: 'chart-empty', x: width / 2, y: small ? 22 : 30, 'text-anchor': 'middle' }, small ? 'no finite value' : text));
    return;
  }
  const plotW = width - m.left - m.right;
  const plotH = height - m.top - m.bottom;
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
  const ty = height - (small ? 6 : 8);
  const loText = fmtTick(lo);
  const hiText = fmtTick(hi);
  root.append(svg('text', { class: 'tl-tick-label hist-lo', x: m.left, y: ty, 'text-anchor': 'start' }, loText));
  root.append(svg('text', { class: 'tl-tick-label hist-hi', x: m.left + plotW, y: ty, 'text-anchor': 'end' }, hiText));
  if (lo < 0 && hi > 0) {
    const x0 = m.left + ((0 - lo) / (hi - lo)) * plotW;
    root.append(svg('line', { class: 'hist-zero', x1: x0, x2: x0, y1: m.top, y2: m.top + plotH }));
    // "0" only where it clears the end labels (it stood on "-0.17" when zero was near an end)
    const clear0 = x0 - CHAR_W / 2 > m.left + loText.length * CHAR_W + 4 && x0 + CHAR_W / 2 < m.left + plotW - hiText.length * CHAR_W - 4;
    if (clear0) root.append(svg('text', { class: 'tl-tick-label hist-zero-label', x: x0, y: ty, 'text-anchor': 'middle' }, '0'));
  }
  // the largest count at the top of the plot, its text below the top edge (it was cut at the top)
  root.append(svg('text', { class: 'tl-tick-label hist-max', x: m.left - 6, y: m.top, 'text-anchor': 'end', 'dominant-baseline': 'hanging' }, yLabel));
  root.append(svg('text', { class: 'tl-tick-label', x: m.left - 6, y: m.top + plotH, 'text-anchor': 'end' }, '0'));
}

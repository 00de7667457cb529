// Anomaly timeline (SVG): x = step bins (binned by the server), y = rank or tensor name, colour = count per
// record kind (one hue per kind, intensity ~ log(count)). The server sends runs of bins that hold the same
// anomalies (a NaN that persists is one wide cell). Where a NaN/Inf started on a row the cell is outlined and
// dotted (steps where it persists are not); the first NaN/Inf of the run gets a ring and a red marker.
// Dragging over the plot selects a step range (zoom); clicking a cell opens the anomalies of its bin.
// A straggler episode (one record of the straggler rule) is a diamond at its first slow step on its rank's
// row and a bar over its slow steps, labelled with the part of the step and the factor; clicking it opens the
// time heat map around it.

import {
  clear,
  el,
  ellipsizeLeft,
  hideTooltip,
  kindColor,
  kindLabel,
  niceTicks,
  showTooltip,
  stepToX,
  svg,
} from './util.js';

const TOP = 12; // room for the origin column markers
const AXIS_H = 24;
const RIGHT = 14;
const MAX_PLOT_H = 440;

/** How a rank-axis row reads: a rank, a group of ranks (collapsed or expanded), or a rank of an expanded group. */
export function rankLabel(label, kind) {
  if (kind === 'group') return `\u25b8 ranks ${label.replace('-', '\u2013')}`;
  if (kind === 'open') return `\u25be ranks ${label.replace('-', '\u2013')}`;
  if (kind === 'member') return `rank ${label}`;
  return `rank ${label}`;
}

/** The row of `rank` (a string or number): its own row, else the row of the group holding it; -1: none. */
function rowOfRank(data, rank) {
  const rows = data.rows || [];
  const own = rows.indexOf(String(rank));
  if (own >= 0 || !data.row_kinds) return own;
  const r = Number(rank);
  return rows.findIndex((label, i) => {
    if (data.row_kinds[i] !== 'group' && data.row_kinds[i] !== 'open') return false;
    const [lo, hi] = label.split('-').map(Number);
    return r >= lo && r <= (Number.isNaN(hi) ? lo : hi);
  });
}

/** What a straggler episode says: "forward 2.2x" (the factor over the ranks' median). */
export function episodeLabel(e) {
  return e.factor ? `${e.phase} ${e.factor.toFixed(1)}x` : `${e.phase} slow`;
}

/** "steps 600–799 (200 steps)": an episode's span, from its first slow step to its last. */
export function episodeSpan(e) {
  if (e.from_step === null || e.from_step === undefined) return `from step ${e.step}`;
  const n = e.to_step - e.from_step + 1;
  return `steps ${e.from_step}\u2013${e.to_step} (${n} step${n === 1 ? '' : 's'})`;
}

/** The lines of an episode's tooltip. */
export function episodeLines(e) {
  const ms = (v) => (typeof v === 'number' ? `${v.toFixed(1)} ms` : '–');
  return [
    `rank ${e.rank}: straggler in ${episodeSpan(e)}, named by the rule at step ${e.step}`,
    `${e.phase} ${ms(e.time_ms)} a step, ${e.factor ? `${e.factor.toFixed(2)}x` : 'above'} the ranks' median ${ms(e.median_ms)}`,
    'click: the time heat map around it',
  ];
}

export class Timeline {
  constructor(container, { onCellClick, onZoom, onToggleGroup, onEpisodeClick }) {
    this.container = container;
    this.onCellClick = onCellClick;
    this.onEpisodeClick = onEpisodeClick || (() => {});
    this.onZoom = onZoom;
    this.onToggleGroup = onToggleGroup || (() => {});
    this.data = null;
    this.geom = null;
    this.selection = null; // {row, stepLo, stepHi}
    this.focusStep = null;
    this.scroll = el('div', { class: 'tl-scroll' });
    this.axis = el('div', { class: 'tl-axis' });
    container.append(this.scroll, this.axis);
  }

  /** Label column width, plot width and the number of bins to ask the server for. */
  layout(axis) {
    const width = Math.max(360, this.container.clientWidth || 1000);
    // rank groups ("\u25be ranks 1016\u20131023") need a wider label column than ranks
    const grouped = axis === 'rank' && this.data && this.data.axis === 'rank' && (this.data.group_size || 1) > 1;
    const labelW = axis === 'module' ? Math.round(Math.min(300, Math.max(150, width * 0.26))) : grouped ? 112 : 64;
    const plotW = Math.max(120, width - labelW - RIGHT);
    const bins = Math.max(1, Math.min(4000, Math.floor(plotW / 3)));
    return { width, labelW, plotW, bins };
  }

  draw(data) {
    this.data = data;
    // the width read before the old drawing is removed: read after, it laid the whole page out again
    const { width, labelW, plotW } = this.layout(data.axis);
    hideTooltip();
    clear(this.scroll);
    clear(this.axis);
    const rows = data.rows || [];
    const nb = Math.max(1, data.bins || data.edges.length - 1);
    const bw = plotW / nb;
    const n = rows.length;
    if (n === 0) {
      this.geom = null;
      this.scroll.append(
        el('div', { class: 'tl-empty' }, `No anomaly matches the filters in steps ${data.step_lo}\u2013${data.step_hi}.`),
      );
      return;
    }
    // ranks: squeeze thousands of rows into the panel (labels only from 9 px up, else in the tooltip);
    // tensor names: always readable rows, the panel scrolls
    const grouped = data.axis === 'rank' && (data.group_size || 1) > 1;
    // every row labelled, as the time heat map's: a rank row is never thinner than a label (the rows scroll)
    const minRowH = data.axis === 'module' || grouped ? 12 : 10;
    const rowH = Math.max(minRowH, Math.min(40, Math.floor(MAX_PLOT_H / n)));
    const plotH = n * rowH;
    const height = TOP + plotH + 2;
    this.geom = { labelW, plotW, bw, rowH, nb, n, width };

    const root = svg('svg', {
      class: 'tl-svg',
      id: 'timeline-svg',
      width,
      height,
      viewBox: `0 0 ${width} ${height}`,
      'data-axis': data.axis,
      'data-bins': nb,
      'data-step-lo': data.step_lo,
      'data-step-hi': data.step_hi,
      'data-rows': n,
      'data-group-size': data.group_size || 1,
    });

    // row backgrounds and labels
    const gRows = svg('g', { class: 'tl-rows' });
    const showLabels = rowH >= 9;
    const maxChars = Math.max(6, Math.floor((labelW - 10) / 6.4));
    for (let r = 0; r < n; r += 1) {
      const y = TOP + r * rowH;
      if (r % 2 === 1) {
        gRows.append(svg('rect', { class: 'tl-stripe', x: labelW, y, width: plotW, height: rowH }));
      }
      if (showLabels) {
        const kind = data.row_kinds ? data.row_kinds[r] : 'rank';
        const label = data.axis === 'rank' ? rankLabel(rows[r], kind) : ellipsizeLeft(rows[r], maxChars);
        const toggles = data.axis === 'rank' && (kind === 'group' || kind === 'open');
        const t = svg(
          'text',
          {
            class: toggles ? 'tl-label tl-group' : kind === 'member' ? 'tl-label tl-member' : 'tl-label',
            x: labelW - 6,
            y: y + rowH / 2,
            'text-anchor': 'end',
            'dominant-baseline': 'central',
            'font-size': Math.min(12, rowH - 1),
            'data-row': rows[r],
            'data-row-kind': kind,
          },
          label,
        );
        t.append(svg('title', null, toggles ? `ranks ${rows[r]}: click to ${kind === 'open' ? 'collapse' : 'show each rank'}` : String(rows[r])));
        if (toggles) {
          t.addEventListener('click', (ev) => {
            ev.stopPropagation();
            this.onToggleGroup(Number(rows[r].split('-')[0]), kind === 'group');
          });
        }
        gRows.append(t);
      }
    }
    gRows.append(svg('line', { class: 'tl-frame', x1: labelW, x2: labelW, y1: TOP, y2: TOP + plotH }));
    root.append(gRows);

    // cells: runs of bins of a row holding the same anomalies (`span` bins from `bin`), one entry per kind
    const c = data.cells || { row: [], bin: [], kind: [], count: [], span: [] };
    const kinds = data.kinds || [];
    const origins = new Set();
    const o = data.origins || { row: [], bin: [] };
    for (let i = 0; i < o.row.length; i += 1) origins.add(o.row[i] * nb + o.bin[i]);
    const groups = new Map(); // row * nb + first bin -> the run
    let maxCount = 1;
    for (let i = 0; i < c.row.length; i += 1) {
      const key = c.row[i] * nb + c.bin[i];
      let g = groups.get(key);
      if (!g) {
        g = { row: c.row[i], bin: c.bin[i], span: c.span ? c.span[i] : 1, kinds: [], total: 0, origin: origins.has(key) };
        groups.set(key, g);
      }
      g.kinds.push([kinds[c.kind[i]] ?? String(c.kind[i]), c.count[i]]);
      g.total += c.count[i];
      if (c.count[i] > maxCount) maxCount = c.count[i];
    }
    for (const key of origins) {
      if (!groups.has(key)) groups.set(key, { row: Math.floor(key / nb), bin: key % nb, span: 1, kinds: [], total: 0, origin: true });
    }
    this.groups = groups;
    this.runsOfRow = new Map(); // row -> its runs by bin (the tooltip finds the run under the pointer)
    for (const g of groups.values()) {
      if (!this.runsOfRow.has(g.row)) this.runsOfRow.set(g.row, []);
      this.runsOfRow.get(g.row).push(g);
    }
    for (const list of this.runsOfRow.values()) list.sort((a, b) => a.bin - b.bin);
    const logMax = Math.log1p(maxCount);
    const intensity = (count) => 0.15 + 0.85 * (Math.log1p(count) / logMax);
    const fc = data.first_cell || null;
    const firstKey = fc ? fc.row * nb + fc.bin : null;

    const gap = bw >= 4 ? 1 : 0;
    const vpad = rowH >= 6 ? 1 : 0;
    const gCells = svg('g', { class: 'tl-cells' });
    const gBands = svg('g', { class: 'tl-bands' });
    const gMarks = svg('g', { class: 'tl-marks' });
    const originBins = new Set();
    for (const [key, g] of groups) {
      g.kinds.sort((a, b) => b[1] - a[1]);
      const x = labelW + g.bin * bw;
      const y = TOP + g.row * rowH + vpad;
      const w = Math.max(1, g.span * bw - gap);
      const h = Math.max(1, rowH - 2 * vpad);
      const stepLo = data.edges[g.bin];
      const stepHi = data.edges[g.bin + g.span] - 1;
      const dominant = g.kinds[0];
      const first = key === firstKey;
      let cls = g.origin ? 'tl-cell tl-origin' : 'tl-cell';
      if (first) cls += ' tl-first';
      const rect = svg('rect', {
        class: cls,
        x,
        y,
        width: w,
        height: h,
        fill: dominant ? kindColor(dominant[0], intensity(dominant[1])) : '#fff',
        dataset: {
          row: rows[g.row],
          rowIndex: g.row,
          bin: g.bin,
          span: g.span,
          stepLo,
          stepHi,
          count: g.total,
          kinds: g.kinds.map((k) => k[0]).join(','),
          origin: g.origin ? '1' : '0',
          first: first ? '1' : '0',
        },
      });
      gCells.append(rect);
      if (g.kinds.length > 1 && h >= 6) {
        const bh = h / g.kinds.length;
        g.kinds.forEach(([kind, count], i) => {
          gBands.append(
            svg('rect', { class: 'tl-band', x, y: y + i * bh, width: w, height: bh, fill: kindColor(kind, intensity(count)) }),
          );
        });
      }
      if (g.origin) {
        originBins.add(g.bin);
        const r = Math.min(bw - gap, h) / 4;
        if (r >= 1.5) gMarks.append(svg('circle', { class: 'tl-origin-dot', cx: x + (bw - gap) / 2, cy: y + h / 2, r }));
      }
      if (first) {
        // the first NaN/Inf across ranks: a ring around its cell, whatever its size, and a red column marker
        const cx = x + Math.max(1, bw - gap) / 2;
        gMarks.append(svg('circle', { class: 'tl-first-ring', cx, cy: y + h / 2, r: Math.max(5, Math.min(10, rowH)) }));
      }
    }
    for (const b of originBins) {
      const cx = labelW + (b + 0.5) * bw;
      const isFirst = fc && b === fc.bin;
      gMarks.append(svg('path', { class: isFirst ? 'tl-origin-mark tl-first-mark' : 'tl-origin-mark', d: `M${cx - 5},1 L${cx + 5},1 L${cx},${TOP - 2} Z` }));
    }
    // straggler episodes: a bar over the episode's slow steps, a diamond at its first, its part and factor
    const gEpisodes = svg('g', { class: 'tl-episodes' });
    const lastStep = data.edges[nb] - 1;
    for (const e of data.episodes || []) {
      const spanned = e.from_step !== null && e.from_step !== undefined;
      const from = spanned ? Math.max(data.edges[0], e.from_step) : e.step;
      const to = spanned ? Math.min(lastStep, e.to_step) : e.step;
      const cx = spanned ? labelW + stepToX(from + 0.5, data.edges, bw) : labelW + (e.bin + 0.5) * bw;
      const cy = TOP + e.row * rowH + rowH / 2;
      const h = Math.max(4, Math.min(7, rowH / 2 + 1));
      const mark = svg('g', {
        class: 'tl-episode',
        dataset: {
          rank: e.rank,
          step: e.step,
          phase: e.phase,
          factor: e.factor ?? '',
          row: rows[e.row],
          fromStep: spanned ? e.from_step : '',
          toStep: spanned ? e.to_step : '',
        },
      });
      if (spanned && to >= from) {
        const x1 = labelW + stepToX(to + 1, data.edges, bw);
        mark.append(svg('rect', { class: 'tl-episode-span', x: cx, y: cy - 1.5, width: Math.max(1, x1 - cx), height: 3 }));
      }
      mark.append(svg('path', { class: 'tl-episode-mark', d: `M${cx},${cy - h}L${cx + h},${cy}L${cx},${cy + h}L${cx - h},${cy}Z` }));
      if (rowH >= 9) mark.append(svg('text', { class: 'tl-episode-label', x: cx + h + 3, y: cy, 'dominant-baseline': 'central' }, episodeLabel(e)));
      gEpisodes.append(mark);
    }
    root.append(gCells, gBands, gMarks, gEpisodes);

    this.focusLine = svg('line', { class: 'tl-focus', y1: TOP, y2: TOP + plotH, visibility: 'hidden' });
    this.selRect = svg('rect', { class: 'tl-sel', visibility: 'hidden' });
    this.brush = svg('rect', { class: 'tl-brush', y: TOP, height: plotH, visibility: 'hidden' });
    root.append(this.focusLine, this.selRect, this.brush);
    this.svg = root;
    this.attachPointer(root);
    this.scroll.append(root);

    // x axis (outside the scrolling area so it stays visible)
    const axis = svg('svg', { class: 'tl-axis-svg', width, height: AXIS_H });
    axis.append(svg('line', { class: 'tl-frame', x1: labelW, x2: labelW + plotW, y1: 1, y2: 1 }));
    const last = data.edges[nb] - 1;
    for (const t of niceTicks(data.edges[0], last, Math.max(2, Math.floor(plotW / 90)), true)) {
      const x = labelW + stepToX(t + 0.5, data.edges, bw);
      axis.append(svg('line', { class: 'tl-tick', x1: x, x2: x, y1: 1, y2: 5 }));
      axis.append(svg('text', { class: 'tl-tick-label', x, y: 17, 'text-anchor': 'middle' }, String(t)));
    }
    axis.append(svg('text', { class: 'tl-axis-title', x: labelW - 6, y: 17, 'text-anchor': 'end' }, 'step'));
    this.axis.append(axis);

    this.applySelection();
    this.applyFocus();
  }

  attachPointer(root) {
    let start = null;
    let moved = false;
    const local = (ev) => {
      const b = root.getBoundingClientRect();
      return [ev.clientX - b.left, ev.clientY - b.top];
    };
    root.addEventListener('pointerdown', (ev) => {
      if (ev.button !== 0 || !this.geom) return;
      const [x] = local(ev);
      this.suppressClick = false;
      if (x < this.geom.labelW) return;
      start = x;
      moved = false;
    });
    root.addEventListener('pointermove', (ev) => {
      if (!this.geom) return;
      const [x, y] = local(ev);
      if (start !== null) {
        if (!moved && Math.abs(x - start) >= 5) {
          moved = true;
          // capture only once a drag starts: a captured pointer retargets the click of a plain click
          try {
            root.setPointerCapture(ev.pointerId);
          } catch {
            // a synthetic pointer cannot be captured
          }
        }
        if (moved) {
          const { labelW, plotW } = this.geom;
          const a = Math.max(labelW, Math.min(start, x));
          const b = Math.min(labelW + plotW, Math.max(start, x));
          this.brush.setAttribute('x', a);
          this.brush.setAttribute('width', Math.max(0, b - a));
          this.brush.setAttribute('visibility', 'visible');
          hideTooltip();
          return;
        }
      }
      this.tooltip(ev, x, y);
    });
    root.addEventListener('pointerleave', () => hideTooltip());
    const finish = (ev) => {
      if (start === null) return;
      const [x] = local(ev);
      const s = start;
      start = null;
      this.brush.setAttribute('visibility', 'hidden');
      if (!moved || !this.geom) return;
      this.suppressClick = true;
      const { labelW, plotW, bw, nb } = this.geom;
      const a = Math.max(0, Math.min(s, x) - labelW);
      const b = Math.min(plotW - 1e-6, Math.max(s, x) - labelW);
      if (b <= a) return;
      const b0 = Math.max(0, Math.min(nb - 1, Math.floor(a / bw)));
      const b1 = Math.max(b0, Math.min(nb - 1, Math.floor(b / bw)));
      this.onZoom(this.data.edges[b0], this.data.edges[b1 + 1] - 1);
    };
    root.addEventListener('pointerup', finish);
    root.addEventListener('pointercancel', () => {
      start = null;
      this.brush.setAttribute('visibility', 'hidden');
    });
    root.addEventListener('click', (ev) => {
      if (this.suppressClick) {
        this.suppressClick = false;
        return;
      }
      const episode = ev.target.closest && ev.target.closest('g.tl-episode');
      if (episode) {
        const d = episode.dataset;
        const e = (this.data.episodes || []).find((x) => String(x.rank) === d.rank && String(x.step) === d.step && x.phase === d.phase);
        if (e) this.onEpisodeClick(e);
        return;
      }
      const cell = ev.target.closest && ev.target.closest('rect.tl-cell');
      if (!cell || !this.geom) return;
      const d = cell.dataset;
      // a run spans several bins: the bin under the pointer is the one clicked
      const [x] = local(ev);
      const first = Number(d.bin);
      const bin = Math.max(first, Math.min(first + Number(d.span || 1) - 1, Math.floor((x - this.geom.labelW) / this.geom.bw)));
      this.onCellClick({
        row: d.row,
        rowIndex: Number(d.rowIndex),
        bin,
        stepLo: this.data.edges[bin],
        stepHi: this.data.edges[bin + 1] - 1,
      });
    });
  }

  tooltip(ev, x, y) {
    const episode = ev.target.closest && ev.target.closest('g.tl-episode');
    if (episode) {
      const d = episode.dataset;
      const e = (this.data.episodes || []).find((x) => String(x.rank) === d.rank && String(x.step) === d.step && x.phase === d.phase);
      if (e) {
        showTooltip(ev.clientX, ev.clientY, episodeLines(e));
        return;
      }
    }
    const { labelW, bw, rowH, nb, n } = this.geom;
    if (x < labelW || y < TOP) {
      hideTooltip();
      return;
    }
    const bin = Math.floor((x - labelW) / bw);
    const row = Math.floor((y - TOP) / rowH);
    if (bin < 0 || bin >= nb || row < 0 || row >= n) {
      hideTooltip();
      return;
    }
    const d = this.data;
    const lo = d.edges[bin];
    const hi = d.edges[bin + 1] - 1;
    const kind = d.row_kinds ? d.row_kinds[row] : 'rank';
    const who = d.axis === 'rank' ? rankLabel(d.rows[row], kind).replace(/^[\u25b8\u25be] /, '') : d.rows[row];
    const lines = [who, lo === hi ? `step ${lo}` : `steps ${lo}\u2013${hi}`];
    const g = (this.runsOfRow.get(row) || []).find((r) => r.bin <= bin && bin < r.bin + r.span);
    if (g) {
      for (const [kind, count] of g.kinds) lines.push(`${kindLabel(kind)}: ${count}`);
      if (g.span > 1) lines.push(`the same in each of ${g.span} bins, steps ${d.edges[g.bin]}\u2013${d.edges[g.bin + g.span] - 1}`);
      const fc = d.first_cell;
      if (fc && fc.row === row && fc.bin === bin) lines.push('\u25c9 the first NaN/Inf of the run');
      else if (g.origin) lines.push('\u25c6 a NaN/Inf started here on this row');
      lines.push('click: list the anomalies');
    }
    showTooltip(ev.clientX, ev.clientY, lines);
  }

  /** Highlights the cell of `sel` ({row, stepLo, stepHi}) if it is drawn. */
  setSelection(sel) {
    this.selection = sel;
    this.applySelection();
  }

  applySelection() {
    if (!this.selRect) return;
    const sel = this.selection;
    const d = this.data;
    if (!sel || !this.geom || !d || sel.row === undefined) {
      this.selRect.setAttribute('visibility', 'hidden');
      return;
    }
    const r = d.axis === 'rank' ? rowOfRank(d, sel.row) : d.rows.indexOf(String(sel.row));
    if (r < 0 || sel.stepHi < d.edges[0] || sel.stepLo > d.edges[d.edges.length - 1] - 1) {
      this.selRect.setAttribute('visibility', 'hidden');
      return;
    }
    const { labelW, bw, rowH } = this.geom;
    const x0 = stepToX(Math.max(sel.stepLo, d.edges[0]), d.edges, bw);
    let x1 = stepToX(Math.min(sel.stepHi, d.edges[d.edges.length - 1] - 1) + 1, d.edges, bw);
    if (x1 - x0 < 3) x1 = x0 + 3;
    this.selRect.setAttribute('x', labelW + x0 - 1);
    this.selRect.setAttribute('y', TOP + r * rowH - 1);
    this.selRect.setAttribute('width', x1 - x0 + 2);
    this.selRect.setAttribute('height', rowH + 2);
    this.selRect.setAttribute('visibility', 'visible');
  }

  /** Scrolls the timeline so that row `r` is in view (in the middle when the rows scroll). */
  scrollToRow(r) {
    if (!this.geom || r === null || r === undefined || r < 0) return;
    const y = TOP + r * this.geom.rowH;
    // in the next frame, with its layout: right after a drawing (or a write) it laid the page out once more
    requestAnimationFrame(() => {
      const view = this.scroll.clientHeight || MAX_PLOT_H;
      this.scroll.scrollTop = Math.max(0, y - view / 2 + this.geom.rowH / 2);
    });
  }

  /** The row of a rank (its own row, else its group's); -1: none. */
  rowOf(rank) {
    return this.data ? rowOfRank(this.data, rank) : -1;
  }

  /** A dashed vertical line at one step (deep link, jump to the first NaN). */
  setFocusStep(step) {
    this.focusStep = step;
    this.applyFocus();
  }

  applyFocus() {
    if (!this.focusLine) return;
    const d = this.data;
    const s = this.focusStep;
    if (s === null || s === undefined || !this.geom || s < d.edges[0] || s > d.edges[d.edges.length - 1] - 1) {
      this.focusLine.setAttribute('visibility', 'hidden');
      return;
    }
    const x = this.geom.labelW + stepToX(s + 0.5, d.edges, this.geom.bw);
    this.focusLine.setAttribute('x1', x);
    this.focusLine.setAttribute('x2', x);
    this.focusLine.setAttribute('visibility', 'visible');
  }
}

/** The legend: one swatch ramp per kind present, the origin mark, and the straggler episodes' mark. */
export function timelineLegend(container, kinds, { episodes = false } = {}) {
  clear(container);
  for (const kind of kinds) {
    const ramp = el('span', { class: 'legend-ramp' });
    for (const t of [0.15, 0.45, 0.75, 1]) ramp.append(el('span', { style: { background: kindColor(kind, t) } }));
    container.append(el('span', { class: 'legend-item', title: 'lighter: fewer anomalies (log scale)' }, ramp, kindLabel(kind)));
  }
  const items = [
    el(
      'span',
      { class: 'legend-item' },
      el('span', { class: 'legend-origin' }),
      'where a NaN/Inf started (not where it persists)',
    ),
    el('span', { class: 'legend-item' }, el('span', { class: 'legend-first' }), 'the first NaN/Inf of the run'),
    episodes ? el('span', { class: 'legend-item' }, el('span', { class: 'legend-episode' }), 'straggler episode (click: its time)') : null,
    el('span', { class: 'legend-hint' }, 'drag to zoom \u00b7 click a cell for its anomalies'),
  ];
  container.append(...items.filter(Boolean)); // the DOM's append would write a missing item as "null"
}

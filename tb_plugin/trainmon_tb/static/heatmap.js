// Heatmap (canvas): rows x step bins, log colour scale over |value| (the server's finite_range), empty cells
// blank. The statistics heatmap: tensor names x step bins for one kind, statistic and rank; cells whose
// tensor held any NaN element magenta, any Inf red-orange (whatever statistic is shown); each row labelled
// with its tensor's shape (its dtype too in the tooltips), sent once a name with the names. The time heat map
// (app.js) draws rank rows with its own labels, tooltip and legend through the same class.
// The cells are written into an ImageData of bins x rows pixels and scaled onto the canvas, so 500 rows
// x 1000 bins draw in a few milliseconds.

import {
  INF_RGB,
  NAN_RGB,
  b64bytes,
  b64float32,
  clear,
  el,
  ellipsizeLeft,
  fmt,
  fmtTick,
  hideTooltip,
  niceTicks,
  shapeText,
  showTooltip,
  stepToX,
  svg,
  viridis,
} from './util.js';

const LABEL_W = 240;

/** A row label: the name, left-ellipsized to what the shape (muted, at its right) leaves of the width. */
function labelContent(text, shape, maxChars) {
  if (!shape) return ellipsizeLeft(text, maxChars);
  const room = Math.max(8, maxChars - shape.length - 1);
  return [el('span', { class: 'hm-name' }, ellipsizeLeft(text, room)), el('span', { class: 'hm-shape' }, shape)];
}

/** An element count: 4064, 1.2e+07 beyond a million. */
function fmtCount(n) {
  return n < 1e6 ? String(Math.round(n)) : n.toExponential(2);
}
const RIGHT = 18; // room for the scroll bar

export class Heatmap {
  /**
   * @param {HTMLElement} container
   * @param {object} opts onRowClick(name), and for another heatmap than the statistics one: onCellClick(cell),
   *   describe(cell) -> tooltip lines, legend(data) -> node, rowLabel(name, i) -> text, labelWidth, canvasId,
   *   (data.shapes/data.dtypes, beside data.names, add each tensor's shape to its label and tooltip)
   *   empty(data) -> text, pxPerBin ({row, bin, i} is a cell: row and bin indices, i = row * bins + bin)
   */
  constructor(container, opts) {
    this.container = container;
    this.opts = opts;
    this.onRowClick = opts.onRowClick;
    this.labelW = opts.labelWidth || LABEL_W;
    this.data = null;
    this.selected = null;
  }

  /** Number of bins to ask for: one per pixel of the plot (or per `pxPerBin` pixels). */
  bins() {
    const width = Math.max(360, this.container.clientWidth || 1000);
    return Math.max(1, Math.min(4000, Math.floor((width - this.labelW - RIGHT) / (this.opts.pxPerBin || 1))));
  }

  draw(data) {
    // the width read before the old drawing is removed: read after, it laid the whole page out again
    const width = Math.max(360, this.container.clientWidth || 1000);
    hideTooltip();
    clear(this.container);
    this.data = data;
    const names = data.names || [];
    const n = names.length;
    const nb = Math.max(1, data.bins || (data.edges || [0, 1]).length - 1);
    if (n === 0) {
      const text = this.opts.empty ? this.opts.empty(data) : `No ${data.kind || ''} statistics on rank ${data.rank ?? ''} in this range.`;
      this.container.append(el('div', { class: 'hm-empty' }, text));
      return;
    }
    const labelW = this.labelW;
    const plotW = Math.max(100, width - labelW - RIGHT);
    let rowH;
    if (n <= 100) rowH = Math.max(10, Math.min(18, Math.floor(520 / n)));
    else rowH = Math.max(2, Math.floor(600 / n));
    const compact = rowH < 10;
    this.geom = { plotW, rowH, nb, n };

    const values = b64float32(data.values);
    const flags = b64bytes(data.flags);
    this.values = values;
    this.flags = flags;
    // cell -> [most NaN, most Inf elements at one step of the bin], for the tooltip
    const nf = data.nonfinite || { cells: [], nans: [], infs: [] };
    this.counts = new Map(nf.cells.map((c, k) => [c, [nf.nans[k], nf.infs[k]]]));
    const [lo, hi] = data.finite_range || [null, null];
    const llo = lo > 0 ? Math.log(lo) : null;
    const lhi = hi > 0 ? Math.log(hi) : null;
    const span = llo !== null && lhi !== null && lhi > llo ? lhi - llo : null;
    const scale = (v) => {
      const a = Math.abs(v);
      if (llo === null || lhi === null) return 0.5;
      if (span === null) return a > 0 ? 1 : 0;
      if (a <= 0) return 0;
      return (Math.log(a) - llo) / span;
    };
    this.scale = scale;

    // 1 pixel per cell, scaled up without smoothing
    const off = document.createElement('canvas');
    off.width = nb;
    off.height = n;
    const octx = off.getContext('2d');
    const img = octx.createImageData(nb, n);
    const px = img.data;
    const total = Math.min(n * nb, flags.length);
    for (let i = 0; i < total; i += 1) {
      const f = flags[i];
      if (!(f & 1)) continue; // no data: transparent
      let rgb;
      if (f & 2) rgb = NAN_RGB;
      else if (f & 4) rgb = INF_RGB;
      else {
        const v = values[i];
        rgb = Number.isFinite(v) ? viridis(scale(v)) : [180, 180, 180];
      }
      const j = i * 4;
      px[j] = rgb[0];
      px[j + 1] = rgb[1];
      px[j + 2] = rgb[2];
      px[j + 3] = 255;
    }
    octx.putImageData(img, 0, 0);

    const dpr = window.devicePixelRatio || 1;
    const canvas = el('canvas', {
      id: this.opts.canvasId || 'heatmap-canvas',
      class: 'hm-canvas',
      width: Math.round(plotW * dpr),
      height: Math.round(n * rowH * dpr),
      dataset: { names: n, bins: nb, rowHeight: rowH },
      style: { width: `${plotW}px`, height: `${n * rowH}px` },
    });
    const ctx = canvas.getContext('2d');
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(off, 0, 0, canvas.width, canvas.height);

    const labels = el('div', { class: compact ? 'hm-labels compact' : 'hm-labels', style: { width: `${labelW}px` } });
    const maxChars = Math.floor((labelW - 12) / 6.6);
    // the statistics heat map's rows are tensors: their shapes and dtypes come once a name (null: unknown)
    const shapes = data.shapes || [];
    const dtypes = data.dtypes || [];
    names.forEach((name, i) => {
      const text = this.opts.rowLabel ? this.opts.rowLabel(name, i) : name;
      const shape = shapes[i] ?? null;
      const tensor = shapeText(shape, dtypes[i]);
      const dataset = { name };
      if (shape !== null) dataset.shape = shape;
      if (dtypes[i]) dataset.dtype = dtypes[i];
      labels.append(
        el(
          'div',
          {
            class: 'hm-label',
            title: tensor ? `${text} ${tensor}` : text,
            dataset,
            style: { height: `${rowH}px`, lineHeight: `${rowH}px`, fontSize: `${Math.min(12, rowH - 1)}px` },
            onclick: () => this.onRowClick(name),
          },
          compact ? '' : labelContent(text, shape, maxChars),
        ),
      );
    });
    this.labels = labels;
    this.selRow = el('div', { class: 'hm-selrow', style: { display: 'none', height: `${rowH}px` } });
    const wrap = el('div', { class: 'hm-canvas-wrap', style: { width: `${plotW}px` } }, canvas, this.selRow);
    const grid = el('div', { class: 'hm-grid' }, labels, wrap);
    const scroll = el('div', { class: 'hm-scroll' }, grid);

    canvas.addEventListener('pointermove', (ev) => this.tooltip(ev, canvas));
    canvas.addEventListener('pointerleave', () => hideTooltip());
    canvas.addEventListener('click', (ev) => {
      const cell = this.cellAt(ev, canvas);
      if (!cell) return;
      if (this.opts.onCellClick) this.opts.onCellClick({ ...cell, i: cell.row * nb + cell.bin });
      else this.onRowClick(names[cell.row]);
    });

    // x axis
    const axis = svg('svg', { class: 'hm-axis-svg', width, height: 24 });
    const bw = plotW / nb;
    const x0 = labelW;
    axis.append(svg('line', { class: 'tl-frame', x1: x0, x2: x0 + plotW, y1: 1, y2: 1 }));
    const edges = data.edges;
    for (const t of niceTicks(edges[0], edges[nb] - 1, Math.max(2, Math.floor(plotW / 90)), true)) {
      const x = x0 + stepToX(t + 0.5, edges, bw);
      axis.append(svg('line', { class: 'tl-tick', x1: x, x2: x, y1: 1, y2: 5 }));
      axis.append(svg('text', { class: 'tl-tick-label', x, y: 17, 'text-anchor': 'middle' }, String(t)));
    }
    axis.append(svg('text', { class: 'tl-axis-title', x: x0 - 6, y: 17, 'text-anchor': 'end' }, 'step'));

    this.container.append(scroll, axis, this.opts.legend ? this.opts.legend(data) : this.legend(data));
    this.setSelected(this.selected);
  }

  legend(data) {
    const [lo, hi] = data.finite_range || [null, null];
    const stops = [];
    for (let i = 0; i <= 10; i += 1) {
      const [r, g, b] = viridis(i / 10);
      stops.push(`rgb(${r | 0},${g | 0},${b | 0}) ${i * 10}%`);
    }
    const bar = el('span', { class: 'hm-colorbar', style: { background: `linear-gradient(to right, ${stops.join(',')})` } });
    const sw = (rgb) => el('span', { class: 'hm-swatch', style: { background: `rgb(${rgb.join(',')})` } });
    return el(
      'div',
      { class: 'hm-legend' },
      el('span', null, `|${data.stat}| (${data.agg || 'max'} per bin, log scale): `),
      el('span', { class: 'hm-range' }, lo === null || lo === undefined ? '\u2013' : fmtTick(lo)),
      bar,
      el('span', { class: 'hm-range' }, hi === null || hi === undefined ? '\u2013' : fmtTick(hi)),
      el('span', { class: 'legend-item' }, sw(NAN_RGB), 'NaN'),
      el('span', { class: 'legend-item' }, sw(INF_RGB), 'Inf'),
      el('span', { class: 'legend-item' }, el('span', { class: 'hm-swatch hm-blank' }), 'no data'),
      el('span', { class: 'legend-hint' }, 'click a row for its series'),
    );
  }

  cellAt(ev, canvas) {
    const b = canvas.getBoundingClientRect();
    const x = ev.clientX - b.left;
    const y = ev.clientY - b.top;
    const { plotW, rowH, nb, n } = this.geom;
    const bin = Math.floor((x / plotW) * nb);
    const row = Math.floor(y / rowH);
    if (bin < 0 || bin >= nb || row < 0 || row >= n) return null;
    return { bin, row };
  }

  tooltip(ev, canvas) {
    const cell = this.cellAt(ev, canvas);
    if (!cell) {
      hideTooltip();
      return;
    }
    if (this.opts.describe) {
      showTooltip(ev.clientX, ev.clientY, this.opts.describe({ ...cell, i: cell.row * this.geom.nb + cell.bin }));
      return;
    }
    const d = this.data;
    const i = cell.row * this.geom.nb + cell.bin;
    const f = this.flags[i] || 0;
    const lo = d.edges[cell.bin];
    const hi = d.edges[cell.bin + 1] - 1;
    const tensor = shapeText((d.shapes || [])[cell.row], (d.dtypes || [])[cell.row]);
    const lines = [tensor ? `${d.names[cell.row]} ${tensor}` : d.names[cell.row], lo === hi ? `step ${lo}` : `steps ${lo}\u2013${hi}`];
    if (!(f & 1)) lines.push('no data');
    else {
      const v = this.values[i];
      lines.push(`${d.stat} (${d.agg || 'max'}): ${Number.isFinite(v) ? fmt(v) : 'no finite value'}`);
      const [nans, infs] = this.counts.get(i) || [0, 0];
      const at = lo === hi ? '' : ' (most at one step)';
      if (f & 2) lines.push(nans > 0 ? `NaN: ${fmtCount(nans)} elements${at}` : 'has NaN');
      if (f & 4) lines.push(infs > 0 ? `Inf: ${fmtCount(infs)} elements${at}` : 'has Inf');
    }
    showTooltip(ev.clientX, ev.clientY, lines);
  }

  setSelected(name) {
    this.selected = name;
    if (!this.data || !this.labels) return;
    const idx = name === null || name === undefined ? -1 : this.data.names.indexOf(name);
    for (const node of this.labels.children) node.classList.toggle('selected', node.dataset.name === name);
    if (idx < 0) {
      this.selRow.style.display = 'none';
      return;
    }
    this.selRow.style.display = 'block';
    this.selRow.style.top = `${idx * this.geom.rowH}px`;
  }
}

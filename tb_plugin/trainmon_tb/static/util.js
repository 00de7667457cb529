// Small DOM, formatting, scale and colour helpers shared by the trainmon views.

const SVG_NS = 'http://www.w3.org/2000/svg';

/** Creates an HTML element: el('div', {class: 'x', dataset: {a: 1}, onclick: fn}, child, 'text', ...). */
export function el(tag, attrs, ...children) {
  return build(document.createElement(tag), attrs, children);
}

/** Creates an SVG element, same arguments as el(). */
export function svg(tag, attrs, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

function build(node, attrs, children) {
  if (attrs) {
    for (const [k, v] of Object.entries(attrs)) {
      if (v === undefined || v === null || v === false) continue;
      if (k === 'dataset') {
        for (const [dk, dv] of Object.entries(v)) node.dataset[dk] = String(dv);
      } else if (k === 'style' && typeof v === 'object') {
        Object.assign(node.style, v);
      } else if (k.startsWith('on') && typeof v === 'function') {
        node.addEventListener(k.slice(2), v);
      } else if (k === 'text') {
        node.textContent = String(v);
      } else if (k === 'class') {
        node.setAttribute('class', v);
      } else {
        node.setAttribute(k, v === true ? '' : String(v));
      }
    }
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

export function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
  return node;
}

/** A number as JSON gives it, or one of the strings "nan", "inf", "-inf". */
export function toNumber(v) {
  if (typeof v === 'number') return v;
  if (v === 'nan' || v === 'NaN') return NaN;
  if (v === 'inf' || v === 'Infinity') return Infinity;
  if (v === '-inf' || v === '-Infinity') return -Infinity;
  if (v === null || v === undefined) return NaN;
  return Number(v);
}

/** "1 rank", "64 ranks", "1 anomaly", "3 anomalies": a count with its noun in the number it takes. */
export function plural(n, one, many = `${one}s`) {
  return `${n} ${n === 1 ? one : many}`;
}

/** Compact display of a statistic: integers exactly, others with 6 significant digits. */
export function fmt(v) {
  if (v === null || v === undefined) return '';
  const x = toNumber(v);
  if (Number.isNaN(x)) return 'nan';
  if (x === Infinity) return 'inf';
  if (x === -Infinity) return '-inf';
  if (Number.isInteger(x) && Math.abs(x) < 1e15) return String(x);
  const s = x.toPrecision(6);
  if (s.includes('e')) {
    const [m, e] = s.split('e');
    return (m.includes('.') ? m.replace(/\.?0+$/, '') : m) + 'e' + e;
  }
  return s.includes('.') ? s.replace(/\.?0+$/, '') : s;
}

/** Short tick label. */
export function fmtTick(x) {
  if (x === 0) return '0';
  const a = Math.abs(x);
  if (a >= 1e5 || a < 1e-3) return x.toExponential(1).replace('.0e', 'e');
  return String(Number(x.toPrecision(4)));
}

export function fmtBytes(n) {
  if (n === null || n === undefined) return '';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  let x = Number(n);
  while (x >= 1024 && i < units.length - 1) {
    x /= 1024;
    i += 1;
  }
  return i === 0 ? `${x} B` : `${x.toFixed(x < 10 ? 1 : 0)} ${units[i]}`;
}

/** Around `count` "nice" ticks between lo and hi (linear). */
export function niceTicks(lo, hi, count = 6, integer = false) {
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) return [];
  if (hi < lo) [lo, hi] = [hi, lo];
  if (hi === lo) return [lo];
  const raw = (hi - lo) / Math.max(1, count);
  const mag = 10 ** Math.floor(Math.log10(raw));
  let step = mag;
  for (const m of [1, 2, 5, 10]) {
    step = m * mag;
    if (step >= raw) break;
  }
  if (integer) step = Math.max(1, Math.round(step));
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
    out.push(Math.abs(t) < step * 1e-9 ? 0 : Number(t.toPrecision(12)));
  }
  return out;
}

/** Ticks at powers of ten in [lo, hi] (lo > 0); falls back to a few log-spaced values. */
export function logTicks(lo, hi) {
  const a = Math.floor(Math.log10(lo));
  const b = Math.ceil(Math.log10(hi));
  const stride = Math.max(1, Math.ceil((b - a) / 6));
  const inside = (t) => t >= lo * (1 - 1e-9) && t <= hi * (1 + 1e-9);
  let out = [];
  for (let e = a; e <= b; e += stride) if (inside(10 ** e)) out.push(10 ** e);
  if (out.length < 3) {
    out = [];
    for (let e = a; e <= b; e += 1) for (const m of [1, 2, 5]) if (inside(m * 10 ** e)) out.push(Number((m * 10 ** e).toPrecision(6)));
  }
  if (out.length < 2) out = [lo, Math.sqrt(lo * hi), hi];
  return out;
}

/** Position of a step in a binned axis: bins of width `bw` px, edges[i] .. edges[i+1]-1 in bin i. */
export function stepToX(step, edges, bw) {
  const n = edges.length - 1;
  if (n <= 0) return 0;
  if (step <= edges[0]) return 0;
  if (step >= edges[n]) return n * bw;
  let lo = 0;
  let hi = n - 1;
  while (lo < hi) {
    const mid = (lo + hi + 1) >> 1;
    if (edges[mid] <= step) lo = mid;
    else hi = mid - 1;
  }
  const w = edges[lo + 1] - edges[lo];
  return (lo + (w > 0 ? (step - edges[lo]) / w : 0)) * bw;
}

/** Decodes base64 into bytes. */
export function b64bytes(s) {
  const bin = atob(s || '');
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i += 1) out[i] = bin.charCodeAt(i);
  return out;
}

/** Decodes base64 little-endian float32 values. */
export function b64float32(s) {
  const bytes = b64bytes(s);
  const n = bytes.length >> 2;
  const view = new DataView(bytes.buffer, bytes.byteOffset, n * 4);
  const out = new Float32Array(n);
  for (let i = 0; i < n; i += 1) out[i] = view.getFloat32(i * 4, true);
  return out;
}

export function b64int32(s) {
  const bytes = b64bytes(s);
  const n = bytes.length >> 2;
  const view = new DataView(bytes.buffer, bytes.byteOffset, n * 4);
  const out = new Int32Array(n);
  for (let i = 0; i < n; i += 1) out[i] = view.getInt32(i * 4, true);
  return out;
}

// One hue per record kind (stable across runs); unknown kinds get a hashed hue.
const KIND_HUES = {
  actv: 212,
  actv_grad: 185,
  grad_unreduced: 28,
  grad_reduced: 4,
  param_origin: 268,
  param_updated: 292,
  exp_avg: 36,
  exp_avg_sq: 60,
  update: 330,
  ratio: 150,
  comm: 110,
  scalar: 350,
  time: 85, // the straggler rule's records
};

export function kindHue(kind) {
  if (kind in KIND_HUES) return KIND_HUES[kind];
  let h = 0;
  for (const c of String(kind)) h = (h * 31 + c.charCodeAt(0)) % 360;
  return h;
}

/** Colour of `kind` at intensity t in [0, 1] (0: light, 1: saturated dark). Suppressed ("*") is grey. */
export function kindColor(kind, t) {
  t = Math.max(0, Math.min(1, t));
  const light = 80 - 48 * t;
  if (kind === '*') return `hsl(0, 0%, ${light}%)`;
  return `hsl(${kindHue(kind)}, ${62 + 20 * t}%, ${light}%)`;
}

export function kindLabel(kind) {
  return kind === '*' ? '* (suppressed)' : kind;
}

// Perceptually ordered sequential map (viridis-like), for the statistics heatmap.
const VIRIDIS = [
  [68, 1, 84],
  [72, 40, 120],
  [62, 74, 137],
  [49, 104, 142],
  [38, 130, 142],
  [31, 158, 137],
  [53, 183, 121],
  [110, 206, 88],
  [181, 222, 43],
  [253, 231, 37],
];

export function viridis(t) {
  t = Math.max(0, Math.min(1, Number.isFinite(t) ? t : 0));
  const x = t * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const f = x - i;
  const a = VIRIDIS[i];
  const b = VIRIDIS[i + 1];
  return [a[0] + (b[0] - a[0]) * f, a[1] + (b[1] - a[1]) * f, a[2] + (b[2] - a[2]) * f];
}

export const NAN_RGB = [255, 0, 255]; // magenta
export const INF_RGB = [230, 60, 0]; // red-orange
export const ANOMALY_COLOR = '#d62728';

/** A floating tooltip shared by the views. */
let tooltipNode = null;

export function showTooltip(x, y, lines) {
  if (!tooltipNode) {
    tooltipNode = el('div', { class: 'tm-tooltip', role: 'tooltip' });
    document.body.append(tooltipNode);
  }
  clear(tooltipNode);
  for (const line of lines) tooltipNode.append(el('div', null, line));
  tooltipNode.style.display = 'block';
  const pad = 14;
  const w = tooltipNode.offsetWidth;
  const h = tooltipNode.offsetHeight;
  let left = x + pad;
  let top = y + pad;
  if (left + w > window.innerWidth - 4) left = Math.max(4, x - pad - w);
  if (top + h > window.innerHeight - 4) top = Math.max(4, y - pad - h);
  tooltipNode.style.left = `${left + window.scrollX}px`;
  tooltipNode.style.top = `${top + window.scrollY}px`;
}

export function hideTooltip() {
  if (tooltipNode) tooltipNode.style.display = 'none';
}

/** Escapes fnmatch's special characters, so a tensor name used as a glob matches only itself. */
export function globEscape(name) {
  return String(name).replace(/[*?[]/g, (c) => `[${c}]`);
}

/**
 * A tensor's shape and dtype as the statistics store recorded them ("[256, 64]", "float32"; for a ZeRO or
 * DTensor shard the whole tensor's): "[256, 64] float32", or what of it is known ('' when neither).
 */
export function shapeText(shape, dtype) {
  return [shape, dtype].filter((t) => t !== null && t !== undefined && t !== '').join(' ');
}

/** Shortens a long name from the left (the end of a tensor name is the informative part). */
export function ellipsizeLeft(s, maxChars) {
  s = String(s);
  if (s.length <= maxChars) return s;
  return '\u2026' + s.slice(s.length - Math.max(1, maxChars - 1));
}

// User Timing entries are kept until the page closes: a live tab draws every 10 s, so only the first ones
// (the first view and the first clicks, what bench/plugin_first_view.py reads) are recorded
let measured = 0;

/** Records `trainmon:<what>` from `start` (performance.now()) to now in the page's User Timing entries. */
export function measure(what, start) {
  if (measured < 500) {
    measured += 1;
    performance.measure(`trainmon:${what}`, { start });
  }
}

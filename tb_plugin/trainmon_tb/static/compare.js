// The comparison view: two runs of the logdir compared from their statistics (the /compare route), one rank
// at a time, as a tensor x step heatmap of the relative difference (log colour scale; bins holding a
// divergence red; the first divergence outlined; steps on the x axis), the verdict above it, and a button
// that asks both runs for dumps of the first divergent tensor and its module at that step (/compare_dumps).
// A cell's tooltip gives the command line's decision with its parts: the bin's highest score, and at its
// step the relative difference over the tolerance plus the state allowance.

import { getJSON, postJSON } from './api.js';
import { b64bytes, b64float32, clear, el, ellipsizeLeft, fmt, hideTooltip, niceTicks, showTooltip, stepToX, svg, viridis } from './util.js';

const LABEL_W = 260;
const RIGHT = 18;
const DIVERGENT_RGB = [214, 39, 40];
const HAS_DATA = 1;
const DIVERGENT = 2;

/** A cell's decision, the command line's, with its parts: at the step of the bin's highest score, the
 * relative difference over the tolerance plus the state allowance (or the zero fraction, or a count, when
 * those decide); above 1 the tensor diverges. */
function decision(p, score, rel, slack) {
  const allowance = slack > 0 ? ` + state allowance ${fmt(slack)}` : '';
  const verdict = score > 1 ? 'DIVERGES in this bin' : 'within tolerance (score \u2264 1)';
  if (!Number.isFinite(score)) return ['a NaN, Inf or element count differs', verdict];
  const byRel = rel / (p.rtol + slack);
  const parts = Math.abs(byRel - score) <= 1e-3 * Math.max(score, 1e-30)
    ? `relative difference ${fmt(rel)} / (tolerance ${fmt(p.rtol)}${allowance})`
    : `zero fraction differs (tolerance ${fmt(p.ztol)}${allowance}); relative difference ${fmt(rel)}`;
  return [`at its highest score: ${parts}`, `score ${fmt(score)}: ${verdict}`];
}

export class ComparePanel {
  constructor({ onError, onOk }) {
    this.onError = onError;
    this.onOk = onOk;
    this.data = null;
    this.allowDumps = false;
    this.statRanks = new Map(); // run -> ranks with statistics (the run list's), for the rank list
    this.seq = 0;
    this.build();
  }

  build() {
    this.selectA = el('select', { id: 'compare-a', title: 'run A: the reference' });
    this.selectB = el('select', { id: 'compare-b', title: 'run B: the run to check' });
    this.rankSelect = el('select', { id: 'compare-rank', title: 'rank compared' });
    this.runButton = el('button', { type: 'button', id: 'compare-run' }, 'compare');
    this.runButton.addEventListener('click', () => this.load(this.rankSelect.value === '' ? null : Number(this.rankSelect.value)));
    this.selectA.addEventListener('change', () => this.fillRanks());
    this.selectB.addEventListener('change', () => this.fillRanks());
    this.rankSelect.addEventListener('change', () => this.load(Number(this.rankSelect.value)));
    this.info = el('div', { id: 'compare-info', class: 'compare-info muted' }, 'choose two runs and press compare');
    this.evidence = el('div', { id: 'compare-evidence', class: 'compare-evidence small' });
    this.dumpButton = el('button', { type: 'button', id: 'compare-dumps', disabled: true }, 'request dumps of the first divergence in both runs');
    this.dumpButton.addEventListener('click', () => this.requestDumps());
    this.dumpResult = el('span', { id: 'compare-dumps-result', class: 'small muted' });
    this.heatmapNode = el('div', { id: 'compare-heatmap', class: 'heatmap compare-heatmap' });
    this.section = el(
      'section',
      { class: 'panel', id: 'compare-panel' },
      el(
        'div',
        { class: 'panel-head' },
        el('h2', null, 'Compare runs'),
        el('label', null, 'A ', this.selectA),
        el('label', null, 'B ', this.selectB),
        el('label', null, 'rank ', this.rankSelect),
        this.runButton,
      ),
      this.info,
      this.evidence,
      el('div', { class: 'panel-head' }, this.dumpButton, this.dumpResult),
      this.heatmapNode,
    );
  }

  /** The runs of the logdir: fills the two selects, keeping what was chosen; ``runs``: their summaries (the
   * ranks with statistics fill the rank list at once, before any comparison answers). */
  setRuns(ids, allowDumps, runs = []) {
    this.statRanks = new Map(runs.map((r) => [r.run, r.stat_ranks || []]));
    this.allowDumps = Boolean(allowDumps);
    for (const [select, fallback] of [[this.selectA, 0], [this.selectB, 1]]) {
      const chosen = select.value;
      const options = [...select.options].map((o) => o.value).join('\n');
      if (options !== ids.join('\n')) {
        clear(select);
        for (const id of ids) select.append(el('option', { value: id }, id));
      }
      select.value = ids.includes(chosen) ? chosen : ids[Math.min(fallback, ids.length - 1)] || '';
    }
    this.runButton.disabled = ids.length < 1;
    this.fillRanks();
    this.updateDumpButton();
  }

  /** The rank list: the ranks both chosen runs hold statistics of (the comparison's answer confirms it). */
  fillRanks(ranks = null) {
    if (ranks === null) {
      const a = this.statRanks.get(this.selectA.value) || [];
      const b = new Set(this.statRanks.get(this.selectB.value) || []);
      ranks = a.filter((r) => b.has(r));
    }
    const chosen = this.rankSelect.value;
    if ([...this.rankSelect.options].map((o) => o.value).join(',') !== ranks.join(',')) {
      clear(this.rankSelect);
      for (const r of ranks) this.rankSelect.append(el('option', { value: r }, String(r)));
    }
    if (ranks.map(String).includes(chosen)) this.rankSelect.value = chosen;
  }

  bins() {
    const width = Math.max(360, this.heatmapNode.clientWidth || 1000);
    return Math.max(1, Math.min(2000, Math.floor(width - LABEL_W - RIGHT)));
  }

  async load(rank) {
    const seq = (this.seq += 1);
    const params = { run_a: this.selectA.value, run_b: this.selectB.value, bins: this.bins() };
    if (rank !== null && rank !== undefined) params.rank = rank;
    this.info.textContent = `comparing ${params.run_a} with ${params.run_b}\u2026`;
    try {
      const { data } = await getJSON('compare', params);
      if (seq !== this.seq) return;
      this.data = data;
      this.onOk();
      this.render();
    } catch (e) {
      if (seq !== this.seq) return;
      this.data = null;
      this.info.textContent = 'no comparison';
      clear(this.evidence);
      clear(this.heatmapNode);
      this.updateDumpButton();
      this.onError(e && e.message ? e.message : String(e));
    }
  }

  render() {
    const d = this.data;
    this.fillRanks(d.ranks || []);
    this.rankSelect.value = String(d.rank);
    const f = d.first;
    const head = `${d.run_a} vs ${d.run_b}, rank ${d.rank}: ${d.steps_compared} steps, ${d.pairs.length} tensors`;
    const unmatched = d.unmatched.only_a || d.unmatched.only_b ? `; unmatched: ${d.unmatched.only_a} only in A, ${d.unmatched.only_b} only in B` : '';
    const leftOut = (d.left_out || []).map((g) => `; not compared: ${g.kind} of ${g.tensors} tensors, whose runs hold different things (A ${g.a}, B ${g.b})`).join('');
    clear(this.info);
    clear(this.evidence);
    this.dumpResult.textContent = '';
    if (!f) {
      this.info.append(el('span', { class: 'compare-same' }, 'no divergence'), ` \u00b7 ${head}${unmatched}${leftOut}`);
    } else {
      this.info.append(
        el('span', { class: 'compare-diverged' }, `first divergence: step ${f.step}, ${f.phase}, ${f.kind} ${f.name}`),
        ` [${f.stage}] ${f.summary} \u00b7 ${head}${unmatched}${leftOut}`,
      );
      for (const e of f.evidence || []) {
        this.evidence.append(
          el(
            'div',
            { class: e.agrees ? 'ev-agrees' : 'ev-differs', dataset: { name: e.name } },
            `${e.agrees ? 'agrees' : 'DIFFERS'} \u00b7 ${e.role}: ${e.kind} ${e.name} (relative difference ${fmt(e.rel)})`,
          ),
        );
      }
    }
    this.updateDumpButton();
    this.draw();
  }

  updateDumpButton() {
    const diverged = Boolean(this.data && this.data.first);
    this.dumpButton.disabled = !(diverged && this.allowDumps);
    this.dumpButton.title = !this.allowDumps
      ? 'start TensorBoard with --trainmon_allow_dump_requests to request dumps'
      : diverged
        ? 'append dump requests for the divergent tensor and its module to both runs'
        : 'the runs do not diverge';
  }

  draw() {
    hideTooltip();
    clear(this.heatmapNode);
    const d = this.data;
    const n = d.pairs.length;
    const nb = Math.max(1, d.bins);
    const values = b64float32(d.values);
    const flags = b64bytes(d.flags);
    const scores = b64float32(d.scores);
    const relAt = b64float32(d.rel_at);
    const slackAt = b64float32(d.slack_at);
    const width = Math.max(360, this.heatmapNode.clientWidth || 1000);
    const plotW = Math.max(100, width - LABEL_W - RIGHT);
    const rowH = n <= 60 ? 14 : Math.max(2, Math.floor(700 / n));
    const [lo, hi] = d.range || [null, null];
    const llo = lo ? Math.log(lo) : 0;
    const span = lo && hi && hi > lo ? Math.log(hi) - llo : null;
    const off = document.createElement('canvas');
    off.width = nb;
    off.height = n;
    const octx = off.getContext('2d');
    const img = octx.createImageData(nb, n);
    for (let i = 0; i < n * nb; i += 1) {
      const fl = flags[i];
      if (!(fl & HAS_DATA)) continue;
      const v = values[i];
      let rgb;
      if (fl & DIVERGENT) rgb = DIVERGENT_RGB;
      else if (!(v > 0)) rgb = viridis(0);
      else rgb = viridis(span ? Math.max(0, Math.min(1, (Math.log(v) - llo) / span)) : 1);
      img.data.set([rgb[0], rgb[1], rgb[2], 255], i * 4);
    }
    octx.putImageData(img, 0, 0);
    const dpr = window.devicePixelRatio || 1;
    const canvas = el('canvas', {
      id: 'compare-canvas',
      class: 'hm-canvas',
      width: Math.round(plotW * dpr),
      height: Math.round(n * rowH * dpr),
      dataset: { pairs: n, bins: nb },
      style: { width: `${plotW}px`, height: `${n * rowH}px` },
    });
    const ctx = canvas.getContext('2d');
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(off, 0, 0, canvas.width, canvas.height);
    const marked = d.marked;
    if (marked && marked.row !== null) {
      const bw = (plotW / nb) * dpr;
      ctx.strokeStyle = '#000';
      ctx.lineWidth = 2 * dpr;
      const x = marked.bin * bw;
      const y = marked.row * rowH * dpr;
      ctx.strokeRect(x - 2 * dpr, y - 2 * dpr, Math.max(bw, 3 * dpr) + 4 * dpr, rowH * dpr + 4 * dpr);
    }
    const labels = el('div', { class: 'hm-labels', style: { width: `${LABEL_W}px` } });
    const maxChars = Math.floor((LABEL_W - 12) / 6.6);
    d.pairs.forEach((p, i) => {
      const label = `${p.kind} ${p.name}`;
      labels.append(
        el(
          'div',
          {
            class: marked && marked.row === i ? 'hm-label compare-first' : 'hm-label',
            title: p.name_b !== p.name ? `${label} (B: ${p.name_b}, paired by ${p.how})` : label,
            style: { height: `${rowH}px`, lineHeight: `${rowH}px`, fontSize: `${Math.min(12, rowH - 1)}px` },
          },
          rowH >= 8 ? ellipsizeLeft(label, maxChars) : '',
        ),
      );
    });
    canvas.addEventListener('mousemove', (ev) => {
      const rect = canvas.getBoundingClientRect();
      const b = Math.floor(((ev.clientX - rect.left) / rect.width) * nb);
      const r = Math.floor((ev.clientY - rect.top) / rowH);
      if (b < 0 || b >= nb || r < 0 || r >= n) return hideTooltip();
      const i = r * nb + b;
      const p = d.pairs[r];
      const steps = `steps ${d.edges[b]}\u2013${d.edges[b + 1] - 1}`;
      if (!(flags[i] & HAS_DATA)) return showTooltip(ev.clientX, ev.clientY, [`${p.kind} ${p.name}`, steps, 'no step compared']);
      return showTooltip(ev.clientX, ev.clientY, [
        `${p.kind} ${p.name}${p.name_b !== p.name ? ` (B: ${p.name_b})` : ''}`,
        steps,
        `largest relative difference ${fmt(values[i])}`,
        ...decision(p, scores[i], relAt[i], slackAt[i]),
        `tolerance of ${p.why || fmt(p.rtol)}`,
      ]);
    });
    canvas.addEventListener('mouseleave', hideTooltip);
    // x axis: step labels under the heatmap's bins
    const axis = svg('svg', { class: 'hm-axis-svg', id: 'compare-axis', width: LABEL_W + plotW + RIGHT, height: 24 });
    const bw = plotW / nb;
    axis.append(svg('line', { class: 'tl-frame', x1: LABEL_W, x2: LABEL_W + plotW, y1: 1, y2: 1 }));
    for (const t of niceTicks(d.edges[0], d.edges[nb] - 1, Math.max(2, Math.floor(plotW / 90)), true)) {
      const x = LABEL_W + stepToX(t + 0.5, d.edges, bw);
      axis.append(svg('line', { class: 'tl-tick', x1: x, x2: x, y1: 1, y2: 5 }));
      axis.append(svg('text', { class: 'tl-tick-label', x, y: 17, 'text-anchor': 'middle' }, String(t)));
    }
    axis.append(svg('text', { class: 'tl-axis-title', x: LABEL_W - 6, y: 17, 'text-anchor': 'end' }, 'step'));
    this.heatmapNode.append(
      el('div', { class: 'hm-scroll' }, el('div', { class: 'hm-grid' }, labels, el('div', { class: 'hm-canvas-wrap' }, canvas))),
      axis,
      el('div', { class: 'legend small muted' }, `colour: relative difference, log scale ${fmt(lo)} \u2026 ${fmt(hi)}; red: diverges; outlined: the first divergence`),
    );
  }

  async requestDumps() {
    const d = this.data;
    if (!d || !d.first) return;
    this.dumpButton.disabled = true;
    try {
      const { data } = await postJSON('compare_dumps', { run_a: d.run_a, run_b: d.run_b, rank: d.rank, bins: d.bins });
      const names = [...new Set(data.targets.map((t) => t.name_a))].join(', ');
      this.dumpResult.textContent = `${data.requests.length} dump requests written to both runs for step ${data.step}, rank ${data.rank}: ${names} (served when a job in those folders reaches that step)`;
      this.dumpResult.dataset.requests = String(data.requests.length);
      this.onOk();
    } catch (e) {
      this.onError(e && e.message ? e.message : String(e));
    } finally {
      this.updateDumpButton();
    }
  }
}

// trainmon TensorBoard plugin frontend: the application (index.js loads it). Plain modules, no build step,
// no external asset (TensorBoard's CSP allows none). Data URLs are relative to the iframe's
// <base href="plugin/trainmon/">.

import { getJSON, postJSON } from './api.js';
import { drawSeries, drawStacked, seriesLegend, stackedLegend } from './chart.js';
import { ComparePanel } from './compare.js';
import { renderEvents } from './detail.js';
import { renderDump } from './dumpview.js';
import { Heatmap } from './heatmap.js';
import { connectHost, deepLinkHref, readDeepLink } from './ipc.js';
import { Timeline, rankLabel, timelineLegend } from './timeline.js';
import { b64float32, b64int32, clear, el, fmtTick, globEscape, kindColor, kindLabel, measure, plural, shapeText, viridis } from './util.js';

const PLUGIN = 'trainmon';
const POLL_MS = 10000;
const RANKS_RE = /^\s*\d+(\s*-\s*\d+)?(\s*,\s*\d+(\s*-\s*\d+)?)*\s*,?\s*$/;

/** `runs`: the run list's answer, asked for by index.js while the modules loaded (else asked here). */
export async function render({ runs = null } = {}) {
  performance.mark('trainmon:modules'); // every module loaded (bench/plugin_first_view.py reads the marks)
  const app = new App(document.body);
  window.trainmon = app; // handy from the devtools console
  await app.start(runs);
}

class App {
  constructor(body) {
    this.body = body;
    this.runsAnswer = null;
    this.runInfo = null;
    this.run = null;
    this.rank = null;
    this.axis = 'rank';
    this.zoom = null; // {lo, hi}
    this.uncheckedKinds = new Set();
    this.uncheckedRules = new Set();
    this.nameFilter = '';
    this.ranksFilter = '';
    this.selection = null; // {type: 'cell'|'step', axis, row, stepLo, stepHi, rank}
    this.detailLimit = 200;
    this.hmKind = null;
    this.hmStat = 'norm';
    this.hmName = '';
    this.seriesName = null;
    this.dump = null;
    this.keys = {}; // last answer text per view: an unchanged answer is not redrawn
    this.expanded = new Set(); // first ranks of the timeline's expanded rank groups
    this.timeName = 'step'; // the time heat map's time (trainmon.run.timing.TIMES)
    this.timeNameChosen = false; // chosen by the user or an episode: else the worst straggler's part
    this.timeAgg = 'max'; // what its cells show: the max or the median of their values
    this.timeExpanded = new Set(); // ranks whose groups the time heat map shows with their ranks
    this.timeSelected = null; // the time heat map's highlighted row (a rank)
    this.timeVisible = false; // read only once its panel has been in view, after the first view
    this.rankOpen = null; // the rank whose time and numerics are shown side by side
    this.seqs = {};
    this.errors = new Map();
    this.refreshing = false;
    this.ready = false;
    this.busy = 0; // loads under way (guard): a click's views are drawn when it is back to 0
    this.settledAt = null; // performance.now() when the last of them ended
  }

  // ---------------------------------------------------------------- layout

  async start(runs = null) {
    const css = el('link', { rel: 'stylesheet', href: './static/style.css' });
    const cssLoaded = new Promise((resolve) => {
      css.addEventListener('load', resolve);
      css.addEventListener('error', () => {
        this.showError('static', 'static/style.css could not be loaded; the tab is unstyled');
        resolve();
      });
      setTimeout(resolve, 3000);
    });
    document.head.append(css);
    // the run list is asked for at once, while the style sheet loads (the first view waits for both)
    this.runsPromise = runs || getJSON('runs');
    this.runsPromise.catch(() => {}); // its failure is shown by loadRuns
    this.build();
    window.addEventListener('error', (e) => this.showError('script', e.message || String(e.error)));
    window.addEventListener('unhandledrejection', (e) => this.showError('script', String(e.reason?.message || e.reason)));
    await cssLoaded; // measure widths with the final layout

    this.host = connectHost({
      'experimental.DataReloaded': () => {
        this.refresh();
      },
    });
    this.deepLink = readDeepLink(PLUGIN);

    const ok = await this.guard('runs', () => this.loadRuns());
    if (ok && this.run) {
      await this.loadTimeline();
      if (this.deepLink.step !== undefined && /^\d+$/.test(this.deepLink.step)) {
        const step = Number(this.deepLink.step);
        this.timeline.setFocusStep(step);
        this.select({ type: 'step', step });
      }
      this.loadHeatmap();
    } else if (ok) {
      this.markReady();
    }
    this.updateStatus();
    setInterval(() => {
      if (this.liveBox.checked && !document.hidden) this.refresh();
    }, POLL_MS);
    let resizeTimer = null;
    window.addEventListener('resize', () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => this.relayout(), 250);
    });
  }

  build() {
    const runSelect = el('select', { id: 'run-select', title: 'trainmon run (a directory under the logdir)' });
    runSelect.addEventListener('change', () => this.setRun(runSelect.value));
    const rankSelect = el('select', { id: 'rank-select', title: 'rank shown by the statistics heatmap and the series' });
    rankSelect.addEventListener('change', () => this.followRank(Number(rankSelect.value)));
    const axisSelect = el(
      'select',
      { id: 'axis-select', title: 'rows of the timeline' },
      el('option', { value: 'rank' }, 'rank'),
      el('option', { value: 'module' }, 'module'),
    );
    axisSelect.addEventListener('change', () => {
      this.axis = axisSelect.value;
      this.keys.timeline = null;
      this.loadTimeline();
    });
    this.liveBox = el('input', { type: 'checkbox', id: 'live', checked: true });
    this.liveBox.addEventListener('change', () => {
      this.updateStatus();
      if (this.liveBox.checked) this.refresh();
    });
    const refreshBtn = el('button', { type: 'button', id: 'refresh', title: 'reload now' }, '\u21bb');
    refreshBtn.addEventListener('click', () => this.refresh());
    this.runSelect = runSelect;
    this.rankSelect = rankSelect;
    this.axisSelect = axisSelect;
    this.runInfoNode = el('span', { id: 'run-info', class: 'muted' });
    this.statusNode = el('span', { id: 'status', class: 'muted small' });

    const header = el(
      'header',
      { class: 'tm-header' },
      el('span', { class: 'brand' }, 'trainmon'),
      el('label', null, 'run ', runSelect),
      el('label', null, 'rank ', rankSelect),
      el('label', null, 'timeline rows ', axisSelect),
      el('label', { class: 'live', title: `refresh every ${POLL_MS / 1000} s` }, this.liveBox, ' live'),
      refreshBtn,
      this.runInfoNode,
      el('span', { class: 'spacer' }),
      this.statusNode,
    );

    this.errorList = el('div', { class: 'error-list' });
    this.errorBar = el(
      'div',
      { id: 'error', class: 'error-bar', role: 'alert', hidden: true },
      this.errorList,
      el('button', { type: 'button', class: 'error-close', title: 'dismiss', onclick: () => this.clearErrors() }, '\u00d7'),
    );

    // files of the run its readers could not read: named, the rest of the run shown
    this.damaged = new Map(); // path -> why, for the run shown
    this.damagedList = el('ul', { class: 'damaged-list' });
    this.damagedBar = el(
      'div',
      { id: 'damaged', class: 'notice-bar', role: 'status', hidden: true },
      el('div', { class: 'damaged-title' }, 'Damaged files: the tab shows the rest of the run without them'),
      this.damagedList,
    );

    // filters
    this.kindBoxes = el('span', { id: 'filter-kinds', class: 'chips' });
    this.ruleBoxes = el('span', { id: 'filter-rules', class: 'chips' });
    this.nameInput = el('input', {
      id: 'filter-name',
      type: 'search',
      placeholder: 'glob, e.g. layers.*.mlp.*',
      spellcheck: 'false',
      title: 'tensor name glob (fnmatch: * ? [...])',
    });
    this.ranksInput = el('input', { id: 'filter-ranks', type: 'text', placeholder: 'all, or e.g. 0,1 or 64-71', size: 12, spellcheck: 'false' });
    let nameTimer = null;
    const applyName = () => {
      clearTimeout(nameTimer);
      if (this.nameInput.value.trim() === this.nameFilter) return;
      this.nameFilter = this.nameInput.value.trim();
      this.filtersChanged();
    };
    this.nameInput.addEventListener('change', applyName);
    this.nameInput.addEventListener('input', () => {
      clearTimeout(nameTimer);
      nameTimer = setTimeout(applyName, 600);
    });
    const applyRanks = () => {
      const v = this.ranksInput.value.trim();
      if (v && !RANKS_RE.test(v)) {
        this.ranksInput.classList.add('invalid');
        this.showError('filters', `ranks: "${v}" is not a comma-separated list of ranks or ranges (e.g. 0,1 or 64-71)`);
        return;
      }
      this.ranksInput.classList.remove('invalid');
      this.clearError('filters');
      const norm = v.replace(/\s+/g, '').replace(/,$/, '');
      if (norm === this.ranksFilter) return;
      this.ranksFilter = norm;
      this.filtersChanged();
    };
    this.ranksInput.addEventListener('change', applyRanks);
    const clearBtn = el('button', { type: 'button', id: 'filters-clear', title: 'check every kind and rule, clear name and ranks' }, 'clear filters');
    clearBtn.addEventListener('click', () => {
      this.uncheckedKinds.clear();
      this.uncheckedRules.clear();
      this.nameInput.value = '';
      this.ranksInput.value = '';
      this.ranksInput.classList.remove('invalid');
      this.clearError('filters');
      this.nameFilter = '';
      this.ranksFilter = '';
      this.renderFilterBoxes();
      this.filtersChanged();
    });
    const filters = el(
      'section',
      { class: 'panel filters', id: 'filters' },
      el('div', { class: 'filter-group' }, el('span', { class: 'filter-title' }, 'kinds'), this.kindBoxes),
      el('div', { class: 'filter-group' }, el('span', { class: 'filter-title' }, 'rules'), this.ruleBoxes),
      el('div', { class: 'filter-group' }, el('label', { class: 'filter-title', for: 'filter-name' }, 'name'), this.nameInput),
      el('div', { class: 'filter-group' }, el('label', { class: 'filter-title', for: 'filter-ranks' }, 'ranks'), this.ranksInput),
      clearBtn,
    );

    // timeline
    this.jumpBtn = el('button', { type: 'button', id: 'jump-first', class: 'jump', disabled: true }, 'first anomaly: \u2013');
    this.jumpBtn.addEventListener('click', () => this.jumpFirst());
    this.resetZoomBtn = el('button', { type: 'button', id: 'reset-zoom', disabled: true, title: 'show every step' }, 'reset zoom');
    this.resetZoomBtn.addEventListener('click', () => this.setZoom(null));
    this.timelineInfo = el('span', { id: 'timeline-info', class: 'muted small' });
    this.timelineNode = el('div', { id: 'timeline', class: 'timeline' });
    this.legendNode = el('div', { id: 'timeline-legend', class: 'legend' });
    const tlPanel = el(
      'section',
      { class: 'panel', id: 'timeline-panel' },
      el('div', { class: 'panel-head' }, el('h2', null, 'Anomaly timeline'), this.jumpBtn, this.resetZoomBtn, el('span', { class: 'spacer' }), this.timelineInfo),
      this.timelineNode,
      this.legendNode,
    );
    this.timeline = new Timeline(this.timelineNode, {
      onToggleGroup: (first, open) => this.toggleGroup(first, open),
      onCellClick: (c) => {
        this.select({ type: 'cell', axis: this.axis, row: c.row, stepLo: c.stepLo, stepHi: c.stepHi });
        // a rank's own row (not a group's): the views of one rank follow it
        if (this.axis === 'rank' && /^\d+$/.test(c.row)) this.followRank(Number(c.row));
      },
      onZoom: (lo, hi) => this.setZoom({ lo, hi }),
      onEpisodeClick: (e) => this.openEpisode(e),
    });

    // detail
    this.detailTitle = el('span', { id: 'detail-title', class: 'muted' }, 'click a timeline cell (or the first-anomaly button) to list its anomalies');
    this.detailLink = el('a', { id: 'detail-link', class: 'small', target: '_top', hidden: true, title: 'link to this step' }, 'link');
    this.detailBody = el('div', { id: 'detail', class: 'detail' });
    const detailPanel = el(
      'section',
      { class: 'panel', id: 'detail-panel' },
      el('div', { class: 'panel-head' }, el('h2', null, 'Anomalies'), this.detailTitle, el('span', { class: 'spacer' }), this.detailLink),
      this.detailBody,
    );

    // dump
    this.dumpView = el('div', { id: 'dump-view', class: 'dump-view' });
    this.dumpPanel = el(
      'section',
      { class: 'panel', id: 'dump-panel', hidden: true },
      el('div', { class: 'panel-head' }, el('h2', null, 'Tensor dump')),
      this.dumpView,
    );

    // time per rank: the heat map (ranks x steps) and one rank's time beside its numerics
    this.buildTime();

    // heatmap and series
    this.hmKindSelect = el('select', { id: 'hm-kind', title: 'record kind' });
    this.hmKindSelect.addEventListener('change', () => {
      this.hmKind = this.hmKindSelect.value;
      this.seriesName = null;
      this.keys.heatmap = null;
      this.loadHeatmap();
      this.loadSeries();
    });
    this.hmStatSelect = el('select', { id: 'hm-stat', title: 'statistic' });
    this.hmStatSelect.addEventListener('change', () => {
      this.hmStat = this.hmStatSelect.value;
      this.keys.heatmap = this.keys.series = null;
      this.loadHeatmap();
      this.loadSeries();
    });
    this.hmNameInput = el('input', { id: 'hm-name', type: 'search', placeholder: 'name glob', spellcheck: 'false' });
    this.hmNameInput.addEventListener('change', () => {
      this.hmName = this.hmNameInput.value.trim();
      this.keys.heatmap = null;
      this.loadHeatmap();
    });
    this.hmInfo = el('span', { id: 'hm-info', class: 'muted small' });
    this.heatmapNode = el('div', { id: 'heatmap', class: 'heatmap' });
    // labels wider than the default: a tensor's name and its shape ("layers.2.mlp.fc2.output [16, 32, 64]")
    this.heatmap = new Heatmap(this.heatmapNode, { onRowClick: (name) => this.selectSeries(name), labelWidth: 300 });
    this.seriesTitle = el('span', { id: 'series-title', class: 'muted' }, 'click a heatmap row to chart it');
    this.seriesLog = el('input', { type: 'checkbox', id: 'series-log', checked: true });
    this.seriesLog.addEventListener('change', () => this.drawSeriesAgain());
    this.seriesNode = el('div', { id: 'series-chart', class: 'series-chart' });
    const hmPanel = el(
      'section',
      { class: 'panel', id: 'heatmap-panel' },
      el(
        'div',
        { class: 'panel-head' },
        el('h2', null, 'Statistics'),
        el('label', null, 'kind ', this.hmKindSelect),
        el('label', null, 'statistic ', this.hmStatSelect),
        el('label', null, 'name ', this.hmNameInput),
        el('span', { class: 'spacer' }),
        this.hmInfo,
      ),
      this.heatmapNode,
      el(
        'div',
        { class: 'panel-head series-head' },
        el('h3', null, 'Series'),
        this.seriesTitle,
        el('span', { class: 'spacer' }),
        el('label', { class: 'small' }, this.seriesLog, ' log y'),
      ),
      this.seriesNode,
      seriesLegend(),
    );

    // comparison of two runs
    this.compare = new ComparePanel({
      onError: (msg) => this.showError('compare', msg),
      onOk: () => this.clearError('compare'),
    });

    this.root = el(
      'div',
      { id: 'trainmon', class: 'tm' },
      header,
      this.errorBar,
      this.damagedBar,
      filters,
      tlPanel,
      detailPanel,
      this.dumpPanel,
      this.timePanel,
      this.rankPanel,
      hmPanel,
      this.compare.section,
    );
    clear(this.body).append(this.root);
    // the time data is read once the panel has been in view (never for the first view: loadTimeHeatmap
    // waits for it)
    if (typeof IntersectionObserver === 'function') {
      new IntersectionObserver((entries) => {
        if (entries.some((e) => e.isIntersecting) && !this.timeVisible) {
          this.timeVisible = true;
          this.loadTimeHeatmap();
        }
      }).observe(this.timePanel);
    } else {
      this.timeVisible = true;
    }
  }

  buildTime() {
    this.timeNameSelect = el('select', { id: 'time-name', title: 'the time shown: the step or one of its parts (docs/timing.md)' });
    this.timeNameSelect.addEventListener('change', () => {
      this.timeName = this.timeNameSelect.value;
      this.timeNameChosen = true;
      this.keys.time = null;
      this.loadTimeHeatmap();
    });
    this.timeAggSelect = el(
      'select',
      { id: 'time-agg', title: "a cell's colour: the largest or the median of its values (ranks x steps)" },
      el('option', { value: 'max' }, 'max'),
      el('option', { value: 'median' }, 'median'),
    );
    this.timeAggSelect.addEventListener('change', () => {
      this.timeAgg = this.timeAggSelect.value;
      this.drawTimeHeatmap();
    });
    this.timeInfo = el('span', { id: 'time-info', class: 'muted small' });
    this.timeNode = el('div', { id: 'time-heatmap', class: 'heatmap' });
    this.timeHeatmap = new Heatmap(this.timeNode, {
      canvasId: 'time-canvas',
      labelWidth: 130,
      // two pixels a bin: a cell holds a rank group's steps whatever the bins, and half the bins halve the
      // answer (a 1,024-rank heat map of 1,000 bins is 2 MB)
      pxPerBin: 2,
      onRowClick: (label) => this.timeRowClick(label),
      onCellClick: (cell) => this.timeCellClick(cell),
      describe: (cell) => this.timeTooltip(cell),
      legend: (data) => this.timeLegend(data),
      rowLabel: (label, i) => rankLabel(label, (this.timeData && this.timeData.row_kinds[i]) || 'rank'),
      empty: () => 'No rank timed in this range.',
    });
    this.timePanel = el(
      'section',
      { class: 'panel', id: 'time-panel' },
      el(
        'div',
        { class: 'panel-head' },
        el('h2', null, 'Time per rank'),
        el('label', null, 'time ', this.timeNameSelect),
        el('label', null, 'cell ', this.timeAggSelect),
        el('span', { class: 'spacer' }),
        this.timeInfo,
      ),
      this.timeNode,
    );

    this.rankTitle = el('span', { id: 'rank-title', class: 'muted' });
    this.rankTimeNode = el('div', { id: 'rank-time', class: 'rank-chart' });
    this.rankNumNode = el('div', { id: 'rank-numerics', class: 'rank-chart' });
    const close = el('button', { type: 'button', id: 'rank-close', title: 'close' }, '\u00d7');
    close.addEventListener('click', () => this.closeRank());
    this.rankPanel = el(
      'section',
      { class: 'panel', id: 'rank-panel', hidden: true },
      el('div', { class: 'panel-head' }, el('h2', null, 'Rank'), this.rankTitle, el('span', { class: 'spacer' }), close),
      el(
        'div',
        { class: 'rank-grid' },
        el('div', { class: 'rank-col' }, el('h3', null, 'time a step (ms)'), this.rankTimeNode, stackedLegend()),
        el('div', { class: 'rank-col' }, el('h3', null, 'gradient norm'), this.rankNumNode, seriesLegend()),
      ),
    );
  }

  // ---------------------------------------------------------------- errors

  showError(source, message) {
    this.errors.set(source, String(message));
    this.renderErrors();
  }

  clearError(source) {
    if (this.errors.delete(source)) this.renderErrors();
  }

  clearErrors() {
    this.errors.clear();
    this.renderErrors();
  }

  renderErrors() {
    clear(this.errorList);
    for (const [source, msg] of this.errors) this.errorList.append(el('div', { dataset: { source } }, msg));
    this.errorBar.hidden = this.errors.size === 0;
  }

  /** Runs fn; a failure is shown in the error bar under `source`, a success clears that source's error. */
  async guard(source, fn) {
    this.busy += 1;
    try {
      await fn();
      this.clearError(source);
      return true;
    } catch (e) {
      if (e && e.name === 'AbortError') return false;
      this.showError(source, e && e.message ? e.message : String(e));
      return false;
    } finally {
      this.busy -= 1;
      this.settledAt = performance.now();
    }
  }

  /** Fetches a route for a view; resolves to {data, changed} or null when a newer request superseded it. */
  async fetchView(view, route, params, force) {
    const seq = (this.seqs[view] = (this.seqs[view] || 0) + 1);
    const { data, text } = await getJSON(route, params);
    if (seq !== this.seqs[view]) return null;
    const key = `${route}?${JSON.stringify(params)}#${text}`;
    const changed = force || key !== this.keys[view];
    this.keys[view] = key;
    return { data, changed };
  }

  /** Adds the damaged files an answer names ([{path, why}], paths relative to the run) to the notice. */
  noteDamaged(list) {
    let changed = false;
    for (const d of list || []) {
      if (this.damaged.get(d.path) !== d.why) {
        this.damaged.set(d.path, d.why);
        changed = true;
      }
    }
    if (changed) this.renderDamaged();
  }

  renderDamaged() {
    clear(this.damagedList);
    for (const [path, why] of [...this.damaged].sort((a, b) => (a[0] < b[0] ? -1 : 1))) {
      this.damagedList.append(el('li', { dataset: { path } }, el('span', { class: 'mono damaged-path' }, path), ` \u2013 ${why}`));
    }
    this.damagedBar.hidden = this.damaged.size === 0;
  }

  // ---------------------------------------------------------------- runs and filters

  async loadRuns() {
    const pending = this.runsPromise;
    this.runsPromise = null; // a refresh asks again
    const { data } = await (pending || getJSON('runs'));
    this.runsAnswer = data;
    const runs = data.runs || [];
    const ids = runs.map((r) => r.run);
    const options = [...this.runSelect.options].map((o) => o.value);
    if (options.join('\n') !== ids.join('\n')) {
      clear(this.runSelect);
      for (const id of ids) this.runSelect.append(el('option', { value: id }, id));
    }
    if (!this.run || !ids.includes(this.run)) {
      const wanted = this.deepLink && this.deepLink.run;
      if (wanted && !this.run && !ids.includes(wanted)) {
        this.showError('deep link', `run "${wanted}" from the URL is not under the logdir; showing ${ids[0] ?? 'nothing'}`);
      }
      this.run = wanted && ids.includes(wanted) ? wanted : ids[0] || null;
      this.resetRunState();
    }
    if (this.run) this.runSelect.value = this.run;
    this.compare.setRuns(ids, data.allow_dump_requests, runs);
    this.runInfo = runs.find((r) => r.run === this.run) || null;
    if (this.runInfo) {
      // the files named damaged now (one repaired since drops out)
      this.damaged = new Map((this.runInfo.damaged || []).map((d) => [d.path, d.why]));
      this.renderDamaged();
    }
    if (!this.runInfo) {
      clear(this.timeline.axis);
      clear(this.timeline.scroll).append(
        el('div', { class: 'tl-empty' }, 'No trainmon run under the logdir yet. Runs appear here once a monitored job has written plugins/trainmon/.'),
      );
    }
    this.updateRunControls();
  }

  resetRunState() {
    this.zoom = null;
    this.scrolledToFirst = false;
    if (this.damaged) {
      this.damaged.clear();
      this.renderDamaged();
    }
    this.expanded = new Set();
    this.selection = null;
    this.seriesName = null;
    this.rank = null;
    this.keys = {};
    this.closeDump();
    this.renderDetailPlaceholder();
    this.timeExpanded = new Set();
    this.timeSelected = null;
    this.timeData = null;
    this.timeNameChosen = false;
    this.hmData = null;
    this.hmAsked = null;
    this.closeRank();
  }

  updateRunControls() {
    const info = this.runInfo;
    const ranks = info ? info.ranks || [] : [];
    const rankOpts = [...this.rankSelect.options].map((o) => o.value).join(',');
    if (rankOpts !== ranks.join(',')) {
      clear(this.rankSelect);
      for (const r of ranks) this.rankSelect.append(el('option', { value: r }, String(r)));
    }
    if (this.rank === null || !ranks.includes(this.rank)) this.rank = ranks.length ? ranks[0] : null;
    if (this.rank !== null) this.rankSelect.value = String(this.rank);

    if (info) {
      const steps = info.steps ? `steps ${info.steps[0]}\u2013${info.steps[1]}` : 'no step yet';
      const suppressed = info.suppressed ? ` (+${info.suppressed} dropped by the per-step cap)` : '';
      // the numbers `trainmon analyze` gives: straggler episodes said apart from the anomalies
      const episodes = info.stragglers ? ` \u00b7 ${plural(info.stragglers, 'straggler episode')}` : '';
      this.runInfoNode.textContent = `${plural(info.world_size ?? ranks.length, 'rank')} \u00b7 ${steps} \u00b7 ${plural(info.anomalies ?? 0, 'anomaly', 'anomalies')}${suppressed}${episodes} \u00b7 ${plural(info.dumps ?? 0, 'dump')}`;
    } else {
      this.runInfoNode.textContent = '';
    }
    this.renderFilterBoxes();

    // heatmap selectors
    const statKinds = info ? info.stat_kinds || [] : [];
    if ([...this.hmKindSelect.options].map((o) => o.value).join(',') !== statKinds.join(',')) {
      clear(this.hmKindSelect);
      for (const k of statKinds) this.hmKindSelect.append(el('option', { value: k }, k));
    }
    if (!this.hmKind || !statKinds.includes(this.hmKind)) {
      this.hmKind = statKinds.includes('grad_reduced') ? 'grad_reduced' : statKinds[0] || null;
    }
    if (this.hmKind) this.hmKindSelect.value = this.hmKind;
    const stats = (this.runsAnswer && this.runsAnswer.stats) || ['min', 'max', 'mean', 'norm', 'zeros', 'nans', 'infs'];
    if ([...this.hmStatSelect.options].map((o) => o.value).join(',') !== stats.join(',')) {
      clear(this.hmStatSelect);
      for (const s of stats) this.hmStatSelect.append(el('option', { value: s }, s));
    }
    if (!stats.includes(this.hmStat)) this.hmStat = stats.includes('norm') ? 'norm' : stats[0];
    this.hmStatSelect.value = this.hmStat;

    // time heat map selector
    const times = (this.runsAnswer && this.runsAnswer.times) || ['step'];
    if ([...this.timeNameSelect.options].map((o) => o.value).join(',') !== times.join(',')) {
      clear(this.timeNameSelect);
      for (const t of times) this.timeNameSelect.append(el('option', { value: t }, t));
    }
    if (!times.includes(this.timeName)) this.timeName = times[0];
    this.timeNameSelect.value = this.timeName;
  }

  renderFilterBoxes() {
    const info = this.runInfo;
    const mk = (container, values, unchecked, name, colored) => {
      const current = [...container.querySelectorAll('input')].map((i) => `${i.value}:${i.checked}`).join(',');
      const wanted = values.map((v) => `${v}:${!unchecked.has(v)}`).join(',');
      if (current === wanted) return;
      clear(container);
      for (const v of values) {
        const box = el('input', { type: 'checkbox', name, value: v, checked: !unchecked.has(v) });
        box.addEventListener('change', () => {
          if (box.checked) unchecked.delete(v);
          else unchecked.add(v);
          this.filtersChanged();
        });
        const sw = colored ? el('span', { class: 'swatch', style: { background: kindColor(v, 0.8) } }) : null;
        container.append(el('label', { class: 'chip', title: name === 'kind' ? `record kind ${v}` : `rule ${v}` }, box, sw, kindLabel(v)));
      }
      if (!values.length) container.append(el('span', { class: 'muted small' }, 'none yet'));
    };
    mk(this.kindBoxes, info ? info.kinds || [] : [], this.uncheckedKinds, 'kind', true);
    mk(this.ruleBoxes, info ? info.rules || [] : [], this.uncheckedRules, 'rule', false);
  }

  /** The filter query parameters, or null when every kind or every rule is unchecked (nothing to show). */
  filterParams() {
    const info = this.runInfo || {};
    const p = {};
    const kinds = info.kinds || [];
    const rules = info.rules || [];
    const keptKinds = kinds.filter((k) => !this.uncheckedKinds.has(k));
    const keptRules = rules.filter((r) => !this.uncheckedRules.has(r));
    if (kinds.length && !keptKinds.length) return null;
    if (rules.length && !keptRules.length) return null;
    if (keptKinds.length < kinds.length) p.kinds = keptKinds;
    if (keptRules.length < rules.length) p.rules = keptRules;
    if (this.nameFilter) p.name = this.nameFilter;
    if (this.ranksFilter) p.ranks = this.ranksFilter;
    return p;
  }

  filtersChanged() {
    this.keys.timeline = this.keys.detail = null;
    this.loadTimeline();
    this.loadDetail();
  }

  setRun(run) {
    if (run === this.run) return;
    this.run = run;
    this.resetRunState();
    this.runInfo = (this.runsAnswer?.runs || []).find((r) => r.run === run) || null;
    this.updateRunControls();
    this.loadTimeline();
    this.loadHeatmap();
    this.loadSeries();
    this.loadTimeHeatmap();
  }

  /** Show (open) or hide the ranks of the timeline's group that starts at rank `first`. */
  toggleGroup(first, open) {
    if (open) this.expanded.add(first);
    else this.expanded.delete(first);
    this.keys.timeline = null;
    this.loadTimeline();
  }

  setZoom(zoom) {
    this.zoom = zoom;
    this.keys.timeline = this.keys.heatmap = this.keys.time = this.keys.rank = null;
    this.loadTimeline();
    this.loadHeatmap();
    this.loadTimeHeatmap();
    this.loadRank();
  }

  // ---------------------------------------------------------------- timeline

  async loadTimeline({ force = false } = {}) {
    if (!this.run) return;
    await this.guard('timeline', async () => {
      const lay = this.timeline.layout(this.axis);
      const filters = this.filterParams();
      if (filters === null) {
        this.resetZoomBtn.disabled = !this.zoom;
        this.seqs.timeline = (this.seqs.timeline || 0) + 1;
        this.keys.timeline = null;
        this.timelineData = null;
        clear(this.timeline.axis);
        clear(this.timeline.scroll).append(el('div', { class: 'tl-empty' }, 'Every kind or every rule is unchecked: nothing to show.'));
        this.timelineInfo.textContent = '';
        this.updateJump(null);
        this.markReady();
        return;
      }
      const params = { run: this.run, axis: this.axis, bins: lay.bins, ...filters };
      if (this.axis === 'rank' && this.expanded.size) params.expand = [...this.expanded].sort((a, b) => a - b);
      if (this.zoom) {
        params.step_lo = this.zoom.lo;
        params.step_hi = this.zoom.hi;
      }
      // the same question as the last answer's: send its key, and the server says "unchanged" in a few bytes
      const asked = JSON.stringify(params);
      const redraw = force || lay.width !== this.timelineWidth;
      if (!redraw && this.timelineData && this.timelineAsked === asked && this.timelineData.key) {
        params.since = this.timelineData.key;
      }
      // written once the click's requests are all sent: a write before the next view reads its width lays
      // out the whole page there
      queueMicrotask(() => {
        this.resetZoomBtn.disabled = !this.zoom;
      });
      const got = await this.fetchView('timeline', 'timeline', params, redraw);
      if (!got) return;
      this.timelineWidth = lay.width;
      if (got.data && got.data.unchanged) {
        this.root.dataset.timelineUnchanged = String(Number(this.root.dataset.timelineUnchanged || 0) + 1);
        this.markReady();
        return;
      }
      this.timelineAsked = asked;
      if (!got.changed) return;
      const data = got.data;
      this.timelineData = data;
      this.noteDamaged(data.damaged);
      const drawStart = performance.now();
      this.timeline.draw(data);
      measure('draw timeline', drawStart);
      if (!this.scrolledToFirst && data.first_cell) {
        // the first view: the row where the first NaN/Inf is, wherever it is among the ranks
        this.scrolledToFirst = true;
        this.timeline.scrollToRow(data.first_cell.row);
      }
      if (this.scrollToRank !== null && this.scrollToRank !== undefined) {
        // a straggler episode opened: its rank's row stays in view in the zoomed timeline
        this.timeline.scrollToRow(this.timeline.rowOf(this.scrollToRank));
        this.scrollToRank = null;
      }
      this.timeline.setSelection(this.highlightFor(this.selection));
      timelineLegend(this.legendNode, data.kinds || [], { episodes: (data.episodes || []).length > 0 });
      const grouped = data.axis === 'rank' && (data.group_size || 1) > 1;
      const rowsNote = grouped
        ? ` \u00b7 ${data.rows_total} ranks in groups of ${data.group_size} (click a group to show its ranks)`
        : data.rows_total !== undefined && data.rows_total > (data.rows || []).length
          ? ` \u00b7 top ${(data.rows || []).length} of ${data.rows_total} ${data.axis === 'module' ? 'tensors' : 'ranks'}`
          : '';
      const zoomNote = this.zoom ? ' (zoomed)' : '';
      const count = data.anomalies ?? data.total;
      const capped = data.suppressed ? ` (+${data.suppressed} dropped by the per-step cap)` : '';
      const episodes = data.stragglers ? ` \u00b7 ${plural(data.stragglers, 'straggler episode')}` : '';
      this.timelineInfo.textContent = `steps ${data.step_lo}\u2013${data.step_hi}${zoomNote} \u00b7 ${plural(data.bins, 'bin')} \u00b7 ${plural(count, 'anomaly', 'anomalies')}${capped}${episodes}${rowsNote}`;
      this.updateJump(data.first || null);
      this.markReady();
    });
  }

  markReady() {
    if (this.ready) return;
    this.ready = true;
    this.drawnAt = performance.now(); // the first view (bench/plugin_first_view.py reads it)
    performance.mark('trainmon:drawn');
    this.root.dataset.ready = '1';
    this.loadTimeHeatmap(); // if its panel is in view: after the first view, never for it
  }

  updateJump(first) {
    this.first = first;
    if (!first) {
      this.jumpBtn.textContent = 'no anomaly';
      this.jumpBtn.disabled = true;
      this.jumpBtn.title = '';
      return;
    }
    this.jumpBtn.disabled = false;
    this.jumpBtn.textContent = `first ${first.rule}: step ${first.step}, rank ${first.rank}, ${first.kind} ${first.name}${first.origin ? ' (origin)' : ''}`;
    this.jumpBtn.title = 'list the anomalies of that step on that rank';
  }

  jumpFirst() {
    const f = this.first;
    if (!f) return;
    // the requests first (each reads its view's width before any write here lays the page out again)
    this.select({ type: 'step', step: f.step, rank: f.rank, name: f.name });
    // the header's rank, the statistics (the origin's kind, its series) and an open rank panel follow it
    this.followRank(f.rank, { kind: f.kind, name: f.name });
    const fc = this.timelineData && this.timelineData.first_cell;
    this.timeline.scrollToRow(fc ? fc.row : this.axis === 'rank' ? this.timeline.rowOf(f.rank) : -1);
    this.timeline.setFocusStep(f.step);
  }

  /**
   * A click that names a rank (and maybe a tensor): the header's rank, the statistics heat map and series
   * (of that kind and tensor, when the run has their statistics) and an open rank panel follow it. True
   * when the statistics heat map was asked again.
   */
  followRank(rank, { kind = null, name = null } = {}) {
    const info = this.runInfo || {};
    const statKinds = info.stat_kinds || [];
    let changed = false;
    let kindChanged = false;
    if ((info.ranks || []).includes(rank) && rank !== this.rank) {
      this.rank = rank;
      changed = true;
    }
    if (kind && statKinds.includes(kind)) {
      if (kind !== this.hmKind) {
        this.hmKind = kind;
        kindChanged = true;
        this.seriesName = null;
        changed = true;
      }
      if (name && name !== this.seriesName) {
        this.seriesName = name;
        changed = true;
      }
    }
    if (changed) {
      this.keys.heatmap = this.keys.series = null;
      this.loadHeatmap();
      this.loadSeries();
    }
    if (this.rankOpen !== null && this.rankOpen !== rank) this.openRank(rank, { scroll: false });
    // the selects written once the click's requests are all sent (a write before a later view reads its
    // width lays out the whole page there)
    queueMicrotask(() => {
      if (this.rank !== null) this.rankSelect.value = String(this.rank);
      if (kindChanged) this.hmKindSelect.value = kind;
    });
    return changed; // whether the statistics were asked again
  }

  /** Which timeline cell to outline for a selection. */
  highlightFor(sel) {
    if (!sel) return null;
    if (sel.type === 'cell') return sel.axis === this.axis ? { row: sel.row, stepLo: sel.stepLo, stepHi: sel.stepHi } : null;
    const row = this.axis === 'rank' ? (sel.rank !== undefined ? String(sel.rank) : undefined) : sel.name;
    return row === undefined ? null : { row, stepLo: sel.step, stepHi: sel.step };
  }

  // ---------------------------------------------------------------- detail

  select(sel, { scroll = true } = {}) {
    this.selection = sel;
    this.detailLimit = 200;
    this.keys.detail = null;
    this.loadDetail({ scroll });
    // outlined once the click's requests are all sent (the other views read their widths before any write)
    queueMicrotask(() => this.timeline.setSelection(this.highlightFor(this.selection)));
  }

  renderDetailPlaceholder() {
    if (!this.detailBody) return;
    this.detailTitle.textContent = 'click a timeline cell (or the first-anomaly button) to list its anomalies';
    this.detailLink.hidden = true;
    clear(this.detailBody);
  }

  async loadDetail({ force = false, scroll = false } = {}) {
    const sel = this.selection;
    if (!this.run || !sel) return;
    await this.guard('events', async () => {
      const filters = this.filterParams() || {};
      const params = { run: this.run, ...filters, limit: this.detailLimit };
      let where;
      if (sel.type === 'cell') {
        params.step_lo = sel.stepLo;
        params.step_hi = sel.stepHi;
        if (sel.axis === 'rank') {
          params.ranks = sel.row;
          where = `rank ${sel.row}`;
        } else {
          params.name = globEscape(sel.row);
          where = sel.row;
        }
      } else {
        params.step_lo = params.step_hi = sel.step;
        if (sel.rank !== undefined) {
          params.ranks = String(sel.rank);
          where = `rank ${sel.rank}`;
        } else {
          where = filters.ranks ? `ranks ${filters.ranks}` : 'all ranks';
        }
      }
      const got = await this.fetchView('detail', 'events', params, force);
      if (!got || !got.changed) return;
      const data = got.data;
      const steps = params.step_lo === params.step_hi ? `step ${params.step_lo}` : `steps ${params.step_lo}\u2013${params.step_hi}`;
      this.detailTitle.textContent = `${where} \u00b7 ${steps} \u00b7 ${data.total} anomal${data.total === 1 ? 'y' : 'ies'}`;
      const href = deepLinkHref(PLUGIN, { run: this.run, step: params.step_lo });
      if (href) {
        this.detailLink.href = href;
        this.detailLink.hidden = false;
      }
      const drawStart = performance.now();
      renderEvents(this.detailBody, data, {
        allowDump: !!(this.runsAnswer && this.runsAnswer.allow_dump_requests),
        limit: this.detailLimit,
        onMore: () => {
          this.detailLimit = Math.min(5000, this.detailLimit * 4);
          this.loadDetail({ force: true });
        },
        onOpenDump: (d) => this.openDump(d),
        onRequestDump: (ev) => this.requestDump(ev),
      });
      measure('draw events', drawStart);
      if (scroll) this.detailBody.closest('section').scrollIntoView({ block: 'nearest', behavior: 'smooth' });
    });
  }

  async requestDump(ev) {
    try {
      const { data } = await postJSON('request_dump', { run: this.run, name: ev.name, kind: ev.kind, rank: ev.rank });
      this.clearError('request_dump');
      return data.id;
    } catch (e) {
      this.showError('request_dump', e.message || String(e));
      throw e;
    }
  }

  // ---------------------------------------------------------------- dump

  async openDump(d) {
    const run = this.run;
    this.dump = d;
    await this.guard('dump_meta', async () => {
      const { data } = await getJSON('dump_meta', { run, path: d.path });
      if (this.dump !== d) return;
      this.dumpPanel.hidden = false;
      renderDump(this.dumpView, data, {
        run,
        onClose: () => this.closeDump(),
        onOpenDump: (path) => this.openDump({ path }),
        // the module call's other tensors, each from its own /dump_meta (a failure shows in its card)
        loadMeta: async (path) => (await getJSON('dump_meta', { run, path })).data,
      });
      this.dumpView.dataset.path = d.path;
      this.dumpPanel.scrollIntoView({ block: 'nearest', behavior: 'smooth' });
    });
  }

  closeDump() {
    this.dump = null;
    if (!this.dumpPanel) return;
    this.dumpPanel.hidden = true;
    clear(this.dumpView);
    delete this.dumpView.dataset.path;
  }

  // ---------------------------------------------------------------- heatmap and series

  async loadHeatmap({ force = false } = {}) {
    if (!this.run) return;
    if (!this.hmKind || this.rank === null) {
      clear(this.heatmapNode).append(el('div', { class: 'hm-empty' }, 'No statistics recorded in this run yet.'));
      this.hmInfo.textContent = '';
      return;
    }
    await this.guard('heatmap', async () => {
      const params = { run: this.run, rank: this.rank, kind: this.hmKind, stat: this.hmStat, bins: this.heatmap.bins() };
      if (this.zoom) {
        params.step_lo = this.zoom.lo;
        params.step_hi = this.zoom.hi;
      }
      if (this.hmName) params.name = this.hmName;
      // the same question as the last answer's: send its key, and the server says "unchanged" in a few bytes
      const asked = JSON.stringify(params);
      if (!force && this.hmData && this.hmAsked === asked && this.hmData.key) params.since = this.hmData.key;
      const got = await this.fetchView('heatmap', 'heatmap', params, force);
      if (!got) return;
      if (got.data && got.data.unchanged) {
        this.heatmapNode.dataset.unchanged = String(Number(this.heatmapNode.dataset.unchanged || 0) + 1);
        return;
      }
      this.hmAsked = asked;
      if (!got.changed) return;
      const data = got.data;
      this.hmData = data;
      this.noteDamaged(data.damaged);
      const t0 = performance.now();
      this.heatmap.draw(data);
      this.heatmap.setSelected(this.seriesName);
      const ms = performance.now() - t0;
      measure('draw heatmap', t0);
      this.heatmapNode.dataset.drawMs = ms.toFixed(1);
      this.heatmapNode.dataset.rank = data.rank;
      this.heatmapNode.dataset.kind = data.kind;
      this.hmInfo.textContent = `${plural((data.names || []).length, 'tensor')} \u00b7 steps ${data.step_lo}\u2013${data.step_hi} \u00b7 ${plural(data.bins, 'bin')} \u00b7 rank ${data.rank}`;
    });
  }

  selectSeries(name) {
    this.seriesName = name;
    this.heatmap.setSelected(name);
    this.keys.series = null;
    this.loadSeries({ scroll: true });
  }

  async loadSeries({ force = false, scroll = false } = {}) {
    if (!this.run || !this.seriesName || !this.hmKind) {
      this.seriesData = null;
      clear(this.seriesNode);
      this.seriesTitle.textContent = 'click a heatmap row to chart it';
      return;
    }
    await this.guard('series', async () => {
      const params = { run: this.run, rank: this.rank, kind: this.hmKind, name: this.seriesName, stat: this.hmStat };
      const got = await this.fetchView('series', 'series', params, force);
      if (!got || !got.changed) return;
      this.noteDamaged(got.data.damaged);
      this.seriesData = got.data;
      this.seriesParams = params;
      this.drawSeriesAgain();
      if (scroll) this.seriesNode.scrollIntoView({ block: 'nearest', behavior: 'smooth' });
    });
  }

  drawSeriesAgain() {
    const data = this.seriesData;
    if (!data) return;
    const p = this.seriesParams;
    const n = (data.anomalies || []).length;
    // NaN/Inf steps said apart: a rule may not have recorded them (the per-step cap), the chart marks them
    const bad = [];
    if ((data.nan_steps || []).length) bad.push(`NaN at ${plural(data.nan_steps.length, 'step')}`);
    if ((data.inf_steps || []).length) bad.push(`Inf at ${plural(data.inf_steps.length, 'step')}`);
    const badNote = bad.length ? ` \u00b7 ${bad.join(', ')}` : '';
    // the tensor's shape and dtype as the store recorded them, after its name ("[256, 64] float32")
    const tensor = shapeText(data.shape, data.dtype);
    this.seriesTitle.textContent = `${p.kind} ${p.name}${tensor ? ` ${tensor}` : ''} \u00b7 ${p.stat} \u00b7 rank ${p.rank} \u00b7 ${plural(data.steps.length, 'point')} \u00b7 ${plural(n, 'anomaly', 'anomalies')}${badNote}`;
    drawSeries(this.seriesNode, data, { logY: this.seriesLog.checked });
  }

  // ---------------------------------------------------------------- time per rank

  async loadTimeHeatmap({ force = false } = {}) {
    if (!this.run || !this.ready || !this.timeVisible) return;
    if (!this.runInfo || !this.runInfo.timed) {
      this.timeData = null;
      this.keys.time = null;
      clear(this.timeNode).append(
        el('div', { class: 'hm-empty' }, 'No timing tables in this run (timing.enable: true writes them; docs/timing.md).'),
      );
      this.timeInfo.textContent = '';
      return;
    }
    this.defaultTimeName();
    await this.guard('time_heatmap', async () => {
      const params = { run: this.run, time: this.timeName, bins: this.timeHeatmap.bins() };
      if (this.zoom) {
        params.step_lo = this.zoom.lo;
        params.step_hi = this.zoom.hi;
      }
      if (this.timeExpanded.size) params.expand = [...this.timeExpanded].sort((a, b) => a - b);
      // the same question as the last answer's: send its key, and the server says "unchanged" in a few bytes
      const asked = JSON.stringify(params);
      const redraw = force || this.timeHeatmap.bins() !== this.timeBins;
      if (!redraw && this.timeData && this.timeAsked === asked && this.timeData.key) params.since = this.timeData.key;
      const got = await this.fetchView('time', 'time_heatmap', params, redraw);
      if (!got) return;
      this.timeBins = this.timeHeatmap.bins();
      if (got.data && got.data.unchanged) {
        this.timeNode.dataset.unchanged = String(Number(this.timeNode.dataset.unchanged || 0) + 1);
        return;
      }
      this.timeAsked = asked;
      if (!got.changed) return;
      this.timeData = got.data;
      this.noteDamaged(got.data.damaged);
      this.drawTimeHeatmap();
    });
  }

  /**
   * Until the user picks a time, the heat map shows the part of the step the worst straggler episode was
   * slow in (the rule knows it): every rank waits for a straggler, so its whole step stands out nowhere.
   */
  defaultTimeName() {
    if (this.timeNameChosen) return;
    const episodes = (this.timelineData && this.timelineData.episodes) || [];
    const times = (this.runsAnswer && this.runsAnswer.times) || [];
    const part = episodes.length ? episodes[0].phase : 'step';
    if (times.includes(part) && part !== this.timeName) {
      this.timeName = part;
      this.timeNameSelect.value = part;
      this.keys.time = null;
    }
  }

  drawTimeHeatmap() {
    const d = this.timeData;
    if (!d) return;
    const agg = this.timeAgg;
    this.timeMax = b64float32(d.max);
    this.timeMedian = b64float32(d.median);
    this.timeMaxRank = b64int32(d.max_rank);
    const t0 = performance.now();
    this.timeHeatmap.draw({ ...d, names: d.rows, values: d[agg], finite_range: d.ranges[agg], agg });
    this.timeHeatmap.setSelected(this.timeSelected);
    this.timeNode.dataset.drawMs = (performance.now() - t0).toFixed(1);
    measure('draw time heatmap', t0);
    this.timeNode.dataset.time = d.time;
    this.timeNode.dataset.agg = agg;
    this.timeNode.dataset.stepLo = d.step_lo;
    this.timeNode.dataset.stepHi = d.step_hi;
    const width = d.bins > 1 ? d.edges[2] - d.edges[1] : d.edges[1] - d.edges[0];
    const grouped = d.group_size > 1 ? ` in groups of ${d.group_size} (click a group to show its ranks)` : '';
    const source = d.source === 'rank_times' ? '' : ' \u00b7 from each rank\'s own table';
    this.timeInfo.textContent = `${plural(d.rows_total, 'rank')}${grouped} \u00b7 steps ${d.step_lo}\u2013${d.step_hi} \u00b7 ${d.bins} bins of ${width} step${width === 1 ? '' : 's'}${source}`;
  }

  /** The row's rank label without the group arrow: "rank 5", "ranks 0–7". */
  timeRowName(row) {
    const d = this.timeData;
    return rankLabel(d.rows[row], d.row_kinds[row]).replace(/^[\u25b8\u25be] /, '');
  }

  timeTooltip(cell) {
    const d = this.timeData;
    const lo = d.edges[cell.bin];
    const hi = d.edges[cell.bin + 1] - 1;
    const lines = [this.timeRowName(cell.row), lo === hi ? `step ${lo}` : `steps ${lo}\u2013${hi}`];
    const max = this.timeMax[cell.i];
    if (!Number.isFinite(max)) {
      lines.push('no timed step');
      return lines;
    }
    const rank = this.timeMaxRank[cell.i];
    const single = d.row_kinds[cell.row] === 'rank' || d.row_kinds[cell.row] === 'member';
    lines.push(`${d.time}: max ${max.toFixed(2)} ms${single ? '' : ` (rank ${rank})`}`);
    lines.push(`${d.time}: median ${this.timeMedian[cell.i].toFixed(2)} ms`);
    lines.push(`click: rank ${rank}'s time and numerics`);
    return lines;
  }

  timeLegend(data) {
    const [lo, hi] = data.finite_range || [null, null];
    const stops = [];
    for (let i = 0; i <= 10; i += 1) {
      const [r, g, b] = viridis(i / 10);
      stops.push(`rgb(${r | 0},${g | 0},${b | 0}) ${i * 10}%`);
    }
    const bar = el('span', { class: 'hm-colorbar', style: { background: `linear-gradient(to right, ${stops.join(',')})` } });
    const end = (v) => el('span', { class: 'hm-range' }, v === null || v === undefined ? '\u2013' : `${fmtTick(v)} ms`);
    return el(
      'div',
      { class: 'hm-legend', id: 'time-legend' },
      el('span', null, `${data.time} time, ms (${data.agg} of each cell's ranks and steps, log scale): `),
      end(lo),
      bar,
      end(hi),
      el('span', { class: 'legend-item' }, el('span', { class: 'hm-swatch hm-blank' }), 'no data'),
      el('span', { class: 'legend-hint' }, 'click a cell or a rank for its time and numerics, a group to show its ranks'),
    );
  }

  timeRowClick(label) {
    const d = this.timeData;
    const i = d ? d.rows.indexOf(label) : -1;
    const kind = i >= 0 ? d.row_kinds[i] : 'rank';
    if (kind === 'group' || kind === 'open') {
      const [a, b] = label.split('-').map(Number);
      if (kind === 'group') this.timeExpanded.add(a);
      else for (const r of [...this.timeExpanded]) if (r >= a && r <= b) this.timeExpanded.delete(r);
      this.keys.time = null;
      this.loadTimeHeatmap();
      return;
    }
    this.openRank(Number(label));
  }

  timeCellClick(cell) {
    const rank = this.timeMaxRank ? this.timeMaxRank[cell.i] : -1;
    if (rank >= 0) this.openRank(rank);
    else this.timeRowClick(this.timeData.rows[cell.row]);
  }

  /** A straggler episode (timeline): the time heat map around it, its part, its rank's row shown and marked. */
  openEpisode(e) {
    const steps = (this.runInfo && this.runInfo.steps) || [e.step, e.step];
    const first = e.from_step ?? e.step;
    const span = Math.max(100, Math.round((steps[1] - steps[0] + 1) / 20));
    const lo = Math.max(steps[0], first - Math.round(span / 4));
    const hi = Math.max(lo, Math.min(steps[1], lo + span - 1));
    const times = (this.runsAnswer && this.runsAnswer.times) || [];
    const phaseKnown = times.includes(e.phase);
    if (phaseKnown) {
      this.timeName = e.phase;
      this.timeNameChosen = true;
    }
    // the anomaly panel lists the episode's record; the views of one rank follow its rank, zoomed at once
    // (following the rank, then zooming, asked the statistics twice: the unzoomed answer thrown away).
    // Every request is sent before the page is written to (the select, the outline, the scroll): a write
    // before a view's width is read lays the page out there, 40-50 ms at 1,024 ranks before the last request
    this.select({ type: 'step', step: e.step, rank: e.rank }, { scroll: false });
    this.zoom = { lo, hi };
    this.keys.timeline = this.keys.heatmap = this.keys.time = this.keys.rank = null;
    this.timeExpanded.add(e.rank); // its group shown with its ranks (nothing to do up to 200 ranks)
    this.timeSelected = String(e.rank);
    this.scrollToRank = e.rank;
    this.timeVisible = true;
    const followed = this.followRank(e.rank);
    this.loadTimeline();
    if (!followed) this.loadHeatmap();
    this.loadTimeHeatmap();
    this.loadRank();
    if (phaseKnown) this.timeNameSelect.value = e.phase;
    // at once, not smoothly: a smooth scroll painted the page every frame while the answers were drawn
    this.timePanel.scrollIntoView({ block: 'start' });
  }

  /** A rank's time and numerics side by side; the statistics below follow the rank when it has some. */
  openRank(rank, { scroll = true } = {}) {
    this.rankOpen = rank;
    this.timeSelected = String(rank);
    this.timeHeatmap.setSelected(this.timeSelected);
    this.rankPanel.hidden = false;
    this.keys.rank = null;
    const ranks = (this.runInfo && this.runInfo.ranks) || [];
    if (this.hmKind && ranks.includes(rank) && rank !== this.rank) {
      this.rank = rank;
      this.rankSelect.value = String(rank);
      this.keys.heatmap = this.keys.series = null;
      this.loadHeatmap();
      this.loadSeries();
    }
    this.loadRank({ scroll });
  }

  closeRank() {
    this.rankOpen = null;
    if (!this.rankPanel) return;
    this.rankPanel.hidden = true;
    clear(this.rankTimeNode);
    clear(this.rankNumNode);
  }

  async loadRank({ force = false, scroll = false } = {}) {
    if (!this.run || this.rankOpen === null) return;
    const rank = this.rankOpen;
    await this.guard('rank_steps', async () => {
      const width = this.rankTimeNode.clientWidth || 600;
      const params = { run: this.run, rank, points: Math.max(50, Math.min(4000, Math.floor(width - 90))) };
      if (this.zoom) {
        params.step_lo = this.zoom.lo;
        params.step_hi = this.zoom.hi;
      }
      const got = await this.fetchView('rank', 'rank_steps', params, force);
      if (!got || !got.changed || this.rankOpen !== rank) return;
      const d = got.data;
      this.noteDamaged(d.damaged);
      this.rankPanel.dataset.rank = String(rank);
      const binned = d.edges ? ` \u00b7 ${d.steps.length} points (bins of steps: each part's mean, the largest norm)` : '';
      this.rankTitle.textContent = `rank ${rank} \u00b7 ${d.timed_steps} timed steps${binned}`;
      drawStacked(this.rankTimeNode, d);
      const num = d.numerics;
      if (num) {
        const anomalies = [];
        num.steps.forEach((step, i) => {
          const n = num.anomalies[i];
          if (n > 0) anomalies.push({ step, rule: `${n} anomal${n === 1 ? 'y' : 'ies'}`, stat: 'gradient norm', value: num.grad_norm[i] });
        });
        drawSeries(this.rankNumNode, { steps: num.steps, values: num.grad_norm, anomalies }, { logY: true });
      } else {
        clear(this.rankNumNode).append(el('div', { class: 'hm-empty' }, `No steps table for rank ${rank} (no numerics per step).`));
      }
      if (scroll) this.rankPanel.scrollIntoView({ block: 'nearest', behavior: 'smooth' });
    });
  }

  // ---------------------------------------------------------------- live

  async refresh() {
    if (this.refreshing) return;
    this.refreshing = true;
    this.root.dataset.refreshes = String(Number(this.root.dataset.refreshes || 0) + 1);
    try {
      const ok = await this.guard('runs', () => this.loadRuns());
      if (ok && this.run) {
        await Promise.all([
          this.loadTimeline(),
          this.loadDetail(),
          this.loadHeatmap(),
          this.loadSeries(),
          this.loadTimeHeatmap(),
          this.loadRank(),
        ]);
      }
      this.lastRefresh = new Date();
      this.updateStatus();
    } finally {
      this.refreshing = false;
    }
  }

  relayout() {
    this.loadTimeline({ force: true });
    this.loadHeatmap({ force: true });
    this.drawSeriesAgain();
    this.loadTimeHeatmap({ force: true });
    this.loadRank({ force: true });
  }

  updateStatus() {
    const t = this.lastRefresh || new Date();
    const hh = t.toLocaleTimeString();
    this.statusNode.textContent = this.liveBox.checked ? `live \u00b7 updated ${hh}` : `paused \u00b7 updated ${hh}`;
  }
}

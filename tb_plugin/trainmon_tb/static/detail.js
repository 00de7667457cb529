// Anomaly detail: the /events answer for the selected cell or step as a table, origin first, each anomaly
// with its dumps (links that open the dump panel; those of the anomaly's own step first, in bold) and a
// "dump at the next step" button.

import { el, fmt, fmtBytes } from './util.js';

// `shape`: the tensor's shape and dtype as the statistics store recorded them on the anomaly's rank
const COLUMNS = ['step', 'rank', 'phase', 'micro_step', 'kind', 'name', 'shape', 'stat', 'value', 'rule', 'message'];

// the rows drawn with the answer (the table scrolls at 420 px: about 15 rows in view); the rest are appended
// once that frame is painted and the page is idle (the click's other answers drawn), so that a click's frames
// lay out 40 rows, not up to 5,000 (200: 120 ms of style and layout on the 2-core VM)
const FIRST_ROWS = 40;
const pendingRows = new WeakMap(); // body -> the answer whose later rows are still to be appended

export const DUMP_FLAG_HELP =
  'Dump requests are off: start TensorBoard with --trainmon_allow_dump_requests to enable this button ' +
  '(TensorBoard has no authentication; never on a shared network with --bind_all). ' +
  'From a shell: trainmon dump request RUN --name NAME';

/**
 * @param {HTMLElement} body where the table goes
 * @param {object} answer the /events answer
 * @param {object} opts {allowDump, onOpenDump(dump), onRequestDump(event) -> Promise<id>, onMore, limit}
 */
export function renderEvents(body, answer, opts) {
  const events = answer.events || [];
  const table = el('table', { class: 'events', id: 'events-table' });
  const head = el('tr', null, COLUMNS.map((c) => el('th', null, c.replace('_', ' '))), el('th', null, 'dumps'), el('th', null, ''));
  table.append(el('thead', null, head));
  const tbody = el('tbody');
  for (const ev of events.slice(0, FIRST_ROWS)) tbody.append(eventRow(ev, opts));
  table.append(tbody);
  const nodes = [];
  if (events.length === 0) {
    nodes.push(el('div', { class: 'detail-empty' }, 'No anomaly here with the current filters.'));
  } else {
    nodes.push(el('div', { class: 'table-scroll' }, table));
  }
  const total = answer.total ?? events.length;
  const shown = (answer.offset || 0) + events.length;
  if (total > shown) {
    nodes.push(
      el(
        'div',
        { class: 'detail-more' },
        `showing ${shown} of ${total} anomalies `,
        opts.limit < 5000 ? el('button', { type: 'button', class: 'more-events', onclick: () => opts.onMore() }, 'show more') : null,
      ),
    );
  }
  body.replaceChildren(...nodes);
  pendingRows.set(body, answer);
  if (events.length > FIRST_ROWS) {
    requestAnimationFrame(() =>
      requestIdleCallback(
        () => {
          if (pendingRows.get(body) !== answer) return; // drawn again since
          const rest = document.createDocumentFragment();
          for (const ev of events.slice(FIRST_ROWS)) rest.append(eventRow(ev, opts));
          tbody.append(rest);
        },
        { timeout: 500 },
      ),
    );
  }
}

function dumpLink(d, label, opts, sameStep) {
  return el(
    'a',
    {
      href: '#',
      class: sameStep ? 'dump-open dump-same-step' : 'dump-open dump-later',
      title: `${d.path}\n${d.dtype} [${(d.shape || []).join(', ')}], ${fmtBytes(d.bytes)}${d.reason ? `\nreason: ${d.reason}` : ''}`,
      dataset: { path: d.path, step: d.step, sameStep: sameStep ? '1' : '0' },
      onclick: (e) => {
        e.preventDefault();
        opts.onOpenDump(d);
      },
    },
    label,
  );
}

function eventRow(ev, opts) {
  const origin = !!ev.origin;
  const tr = el('tr', {
    class: origin ? 'event origin' : 'event',
    dataset: {
      name: ev.name,
      kind: ev.kind,
      origin: origin ? '1' : '0',
      step: ev.step,
      rank: ev.rank,
      rule: ev.rule,
    },
  });
  if (ev.shape !== null && ev.shape !== undefined) tr.dataset.shape = ev.shape;
  if (ev.dtype) tr.dataset.dtype = ev.dtype;
  for (const c of COLUMNS) {
    let content;
    if (c === 'name') {
      content = [el('span', { class: 'mono' }, ev.name)];
      if (origin) content.push(el('span', { class: 'badge badge-origin', title: 'first module to go non-finite with clean inputs' }, 'origin'));
      else if (ev.propagated) content.push(el('span', { class: 'badge badge-prop', title: 'non-finite input propagated here' }, 'propagated'));
    } else if (c === 'shape') {
      content = ev.shape === null || ev.shape === undefined ? '' : [el('span', { class: 'mono' }, ev.shape)];
      if (content && ev.dtype) content.push(' ', el('span', { class: 'muted' }, ev.dtype));
    } else if (c === 'value') {
      content = fmt(ev.value);
      if (ev.baseline !== null && ev.baseline !== undefined) content += ` (baseline ${fmt(ev.baseline)})`;
    } else if (c === 'rule') {
      content = el('span', { class: `rule rule-${String(ev.rule).replace(/[^a-z0-9_-]/gi, '')}` }, ev.rule);
    } else {
      content = ev[c] === null || ev[c] === undefined ? '' : String(ev[c]);
    }
    tr.append(el('td', { class: `col-${c}` }, content));
  }
  // the dumps of this tensor first, its own step before later ones; the others (the module call and
  // scalars an exact capture saved at this step, the rest of a dump request) folded under "+N related"
  const dumpCell = el('td', { class: 'col-dumps' });
  const dumps = ev.dumps || [];
  const own = dumps.filter((d) => d.name === ev.name && d.kind === ev.kind);
  const related = dumps.filter((d) => !(d.name === ev.name && d.kind === ev.kind));
  for (const d of own) {
    const same = d.step === ev.step;
    dumpCell.append(dumpLink(d, `step ${d.step}${d.micro_step ? ` m${d.micro_step}` : ''}`, opts, same), ' ');
  }
  // a request-based dump is taken at the tensor's next occurrence: say so when that is all there is
  if (own.length && ev.dump_step !== undefined && ev.dump_step !== null && ev.dump_step !== ev.step) {
    // why the dump is late, and how to get one at the anomaly's step, said in the row (not only on hover)
    const late = ev.dump_step - ev.step;
    dumpCell.append(
      el(
        'div',
        {
          class: 'dump-later-note small',
          title:
            `No dump of this tensor at step ${ev.step}: a dump request is served at the tensor's next collected step. ` +
            "With alert.capture: exact the monitor dumps at the anomaly's own step.",
        },
        `later step only: step ${ev.dump_step}, ${late} after (a dump request is served at the next collected step ` +
          `once the job has read it); alert.capture: exact dumps at step ${ev.step} itself`,
      ),
    );
  }
  if (related.length) {
    const list = el('div', { class: 'dump-related-list' });
    for (const d of related) {
      list.append(dumpLink(d, `${d.kind} ${d.name} @${d.step}${d.micro_step ? ` m${d.micro_step}` : ''}`, opts, d.step === ev.step));
    }
    const sameStep = related.filter((d) => d.step === ev.step).length;
    const label = sameStep && sameStep < related.length ? `+${related.length} related (${sameStep} at step ${ev.step})` : `+${related.length} related`;
    dumpCell.append(el('details', { class: 'dump-related' }, el('summary', null, label), list));
  }
  if (!dumps.length) dumpCell.append(el('span', { class: 'muted' }, '\u2013'));
  tr.append(dumpCell);

  const status = el('span', { class: 'request-status' });
  const summary = ev.name === '*' || ev.rule === 'suppressed';
  const time = ev.kind === 'time'; // a straggler record: its name is a part of the step, not a tensor
  const btn = el(
    'button',
    {
      type: 'button',
      class: 'request-dump',
      disabled: !opts.allowDump || summary || time,
      title: summary
        ? 'a summary line of suppressed anomalies names no tensor'
        : time
          ? 'a straggler record names a part of the step, not a tensor (its time: the diamond on the timeline)'
          : opts.allowDump
          ? `dump ${ev.kind} ${ev.name} on rank ${ev.rank} at the next collected step`
          : DUMP_FLAG_HELP,
    },
    'dump next step',
  );
  btn.addEventListener('click', async () => {
    btn.disabled = true;
    status.className = 'request-status';
    status.textContent = 'requesting\u2026';
    try {
      const id = await opts.onRequestDump(ev);
      status.textContent = `requested (id ${id})`;
      status.classList.add('ok');
      status.dataset.requestId = id;
    } catch (e) {
      status.textContent = String(e.message || e);
      status.classList.add('err');
    } finally {
      btn.disabled = false;
    }
  });
  tr.append(el('td', { class: 'col-action' }, btn, status));
  return tr;
}

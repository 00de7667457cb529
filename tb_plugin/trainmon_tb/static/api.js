// Fetch helpers for the plugin's routes. URLs are relative: the iframe's <base href="plugin/trainmon/">
// makes `./runs` resolve to /data/plugin/trainmon/runs (also under --path_prefix).

import { measure } from './util.js';

export class ApiError extends Error {
  constructor(route, status, message) {
    super(`${route}: ${status ? `HTTP ${status}: ` : ''}${message}`);
    this.route = route;
    this.status = status;
  }
}

/** Query string from an object; null/undefined/'' values are left out, arrays are comma-joined. */
export function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) {
    if (v === undefined || v === null || v === '') continue;
    q.set(k, Array.isArray(v) ? v.join(',') : String(v));
  }
  const s = q.toString();
  return s ? `?${s}` : '';
}

export function routeUrl(route, params) {
  return `./${route}${query(params)}`;
}

async function parse(route, resp) {
  const text = await resp.text();
  let data = null;
  try {
    const t0 = performance.now();
    data = text ? JSON.parse(text) : null;
    measure(`parse ${route}`, t0);
  } catch (e) {
    if (!resp.ok) throw new ApiError(route, resp.status, text.slice(0, 300) || resp.statusText);
    throw new ApiError(route, resp.status, `invalid JSON answer (${e.message})`);
  }
  if (!resp.ok) {
    const msg = data && typeof data === 'object' && data.error ? data.error : text.slice(0, 300);
    throw new ApiError(route, resp.status, msg || resp.statusText);
  }
  if (data && typeof data === 'object' && !Array.isArray(data) && 'error' in data) {
    throw new ApiError(route, resp.status, String(data.error));
  }
  return { data, text };
}

/** GET ./<route>?<params>; resolves to {data, text}; rejects with an ApiError naming the route. */
export async function getJSON(route, params, { signal } = {}) {
  let resp;
  try {
    resp = await fetch(routeUrl(route, params), { signal, headers: { Accept: 'application/json' } });
  } catch (e) {
    if (e.name === 'AbortError') throw e;
    throw new ApiError(route, 0, `request failed (${e.message}); is TensorBoard still running?`);
  }
  return parse(route, resp);
}

/** POST a JSON body to ./<route>. */
export async function postJSON(route, body) {
  let resp;
  try {
    resp = await fetch(`./${route}`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json', Accept: 'application/json' },
      body: JSON.stringify(body),
    });
  } catch (e) {
    throw new ApiError(route, 0, `request failed (${e.message})`);
  }
  return parse(route, resp);
}

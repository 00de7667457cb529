// Minimal guest side of TensorBoard's experimental plugin IPC (the protocol of
// tensorboard/components/experimental/plugin_lib): the guest opens a MessageChannel and hands one port to
// the host with `window.parent.postMessage('experimental.bootstrap', '*', [port])`. Messages are JSON
// strings {type, id, payload, error, isReply}; every non-reply message gets a reply. The host broadcasts
// `experimental.DataReloaded` when its reload button (or auto-reload) fires.

export function connectHost(listeners) {
  if (!window.parent || window.parent === window) return null;
  const channel = new MessageChannel();
  const port = channel.port1;
  const waits = new Map();
  let nextId = 0;

  port.onmessage = async (event) => {
    let msg;
    try {
      msg = JSON.parse(event.data);
    } catch {
      return; // not ours
    }
    if (!msg || typeof msg !== 'object') return;
    if (msg.isReply) {
      const w = waits.get(msg.id);
      if (!w) return;
      waits.delete(msg.id);
      if (msg.error) w.reject(new Error(String(msg.error)));
      else w.resolve(msg.payload);
      return;
    }
    let payload = null;
    let error = null;
    const cb = listeners[msg.type];
    if (cb) {
      try {
        payload = (await cb(msg.payload)) ?? null;
      } catch (e) {
        error = String(e && e.message ? e.message : e);
      }
    }
    port.postMessage(JSON.stringify({ type: msg.type, id: msg.id, payload, error, isReply: true }));
  };

  try {
    window.parent.postMessage('experimental.bootstrap', '*', [channel.port2]);
  } catch {
    return null;
  }

  return {
    send(type, payload = null) {
      const id = nextId++;
      port.postMessage(JSON.stringify({ type, id, payload, error: null, isReply: false }));
      return new Promise((resolve, reject) => waits.set(id, { resolve, reject }));
    },
  };
}

/** `p.<plugin>.<key>` values from the parent's URL hash (deep links), e.g. #trainmon&p.trainmon.step=140. */
export function readDeepLink(plugin) {
  const out = {};
  let hash = '';
  try {
    hash = window.parent.location.hash || '';
  } catch {
    return out; // not same-origin: no deep link
  }
  const prefix = `p.${plugin}.`;
  for (const part of hash.replace(/^#/, '').split('&')) {
    const eq = part.indexOf('=');
    if (eq < 0) continue;
    let key;
    let value;
    try {
      key = decodeURIComponent(part.slice(0, eq));
      value = decodeURIComponent(part.slice(eq + 1).replace(/\+/g, ' '));
    } catch {
      continue;
    }
    if (key.startsWith(prefix)) out[key.slice(prefix.length)] = value;
  }
  return out;
}

/** A link to the plugin in the parent page with the given deep-link keys, or null. */
export function deepLinkHref(plugin, params) {
  let base;
  try {
    base = window.parent.location.href.split('#')[0];
  } catch {
    return null;
  }
  const parts = [plugin];
  for (const [k, v] of Object.entries(params)) {
    if (v === null || v === undefined || v === '') continue;
    parts.push(`p.${plugin}.${k}=${encodeURIComponent(String(v))}`);
  }
  return `${base}#${parts.join('&')}`;
}

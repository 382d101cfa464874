// The public API, spoken with fetch (and the WebSocket attach, terminal.js). The key lives in this tab's
// sessionStorage only: never a cookie, never a URL, never a log line. Every error is the server's own
// {error: {code, message}}, shown as it is.

const KEY = "sbx.key";
const ORG = "sbx.org";

export const session = {
  get key() {
    return sessionStorage.getItem(KEY);
  },
  get org() {
    return sessionStorage.getItem(ORG) || "";
  },
  signIn(key) {
    sessionStorage.setItem(KEY, key);
  },
  setOrg(org) {
    if (org) sessionStorage.setItem(ORG, org);
    else sessionStorage.removeItem(ORG);
  },
  signOut() {
    sessionStorage.removeItem(KEY);
    sessionStorage.removeItem(ORG);
  },
  /** Who signed in (GET /v1/whoami of the key, in the chosen organisation), set by main.js. */
  me: null,
};

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
  /** How the console shows it: the server's code and message as sent. */
  toString() {
    return this.status ? `${this.status} ${this.code}: ${this.message}` : this.message;
  }
}

/** Listeners told when a call answers 401 (the key is gone or revoked): main.js signs out. */
export const onUnauthorized = [];

function headers(extra = {}) {
  const found = { ...extra };
  if (session.key) found.Authorization = `Bearer ${session.key}`;
  if (session.org) found["X-Sandbox-Org"] = session.org;
  return found;
}

export function query(params) {
  const search = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    if (value === undefined || value === null || value === "") continue;
    for (const one of Array.isArray(value) ? value : [value]) search.append(name, String(one));
  }
  const text = search.toString();
  return text ? `?${text}` : "";
}

/**
 * One call. `json` is sent as a JSON body, `body` as raw bytes. Answers: the parsed JSON, null for 204, or
 * the Response itself with `raw` (files, streams). Throws ApiError with the server's code and message.
 */
export async function call(method, path, { json, body, raw = false, signal } = {}) {
  const init = { method, headers: headers(), signal, cache: "no-store" };
  if (json !== undefined) {
    init.body = JSON.stringify(json);
    init.headers["Content-Type"] = "application/json";
  } else if (body !== undefined) {
    init.body = body;
    init.headers["Content-Type"] = "application/octet-stream";
  }
  let resp;
  try {
    resp = await fetch(path, init);
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ApiError(0, "network", `the gateway did not answer: ${error.message}`);
  }
  if (!resp.ok) {
    let code = "error";
    let message = `${resp.status} ${resp.statusText}`;
    try {
      const answer = await resp.json();
      code = answer.error.code;
      message = answer.error.message;
    } catch {
      // not the error body: keep the status line
    }
    if (resp.status === 401) for (const listener of onUnauthorized) listener(message);
    throw new ApiError(resp.status, code, message);
  }
  if (raw) return resp;
  if (resp.status === 204) return null;
  return resp.json();
}

export const get = (path, options) => call("GET", path, options);
export const post = (path, json, options = {}) => call("POST", path, { json, ...options });
export const patch = (path, json) => call("PATCH", path, { json });
export const put = (path, json) => call("PUT", path, { json });
export const del = (path) => call("DELETE", path);

/** The lines of an ndjson stream (followed process output) as they come, parsed. */
export async function* ndjson(path, signal) {
  const resp = await call("GET", path, { raw: true, signal });
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffered += decoder.decode(value, { stream: true });
    let newline;
    while ((newline = buffered.indexOf("\n")) >= 0) {
      const line = buffered.slice(0, newline).trim();
      buffered = buffered.slice(newline + 1);
      if (line) yield JSON.parse(line);
    }
  }
}

export function base64Bytes(text) {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

export const enc = encodeURIComponent;

// The service's read endpoints. Ids always go through encodeURIComponent.
import { readStream } from "./arrow.js";
import { showTokenForm, renderSession } from "./signin.js";

export const enc = encodeURIComponent;

export class ApiError extends Error {
  constructor(status, detail, url) {
    super(typeof detail === "string" ? detail : JSON.stringify(detail));
    this.status = status;
    this.detail = detail;
    this.url = url;
  }
}

async function check(response, url) {
  if (response.ok) return response;
  let detail = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.detail !== undefined) detail = body.detail;
  } catch (_) { /* not JSON */ }
  throw new ApiError(response.status, detail, url);
}

// A service started with REPLAY_TOKENS_FILE answers 401 without a bearer token: the page asks for a read
// token through a form in the page (signin.js) and keeps it for this tab (sessionStorage: gone when the
// tab closes, never sent elsewhere). The header then offers "change token" and "sign out".
export const TOKEN_KEY = "routing-replay-token";
let asking = null; // one form for the 401s of calls made at the same time
let rerender = () => {}; // app.js: draw the current page again (after a sign-out or a token change)

export function heldToken() {
  return sessionStorage.getItem(TOKEN_KEY);
}

function withToken(headers, token = heldToken()) {
  return token ? { ...headers, Authorization: `Bearer ${token}` } : headers;
}

// Is the token known to the service? Any answer but 401 says yes (403: known, but not for that run).
async function accepted(url, headers, token) {
  const response = await fetch(url, { headers: withToken(headers, token) });
  return response.status !== 401;
}

function askToken(url, headers, refused) {
  if (!asking) {
    asking = showTokenForm({ refused, check: (token) => accepted(url, headers, token) }).then((token) => {
      sessionStorage.setItem(TOKEN_KEY, token);
      asking = null;
      showSession();
      return token;
    });
  }
  return asking;
}

// fetch with the tab's token; on a 401 ask for one through the form (one form for concurrent calls) and
// try again with it, as often as the service refuses it.
async function authorizedFetch(url, headers, signal) {
  for (;;) {
    const sent = heldToken();
    const response = await fetch(url, { headers: withToken(headers, sent), signal });
    if (response.status !== 401) return response;
    const current = heldToken();
    if (current && current !== sent) continue; // another call got a token meanwhile
    if (sent) {
      sessionStorage.removeItem(TOKEN_KEY); // refused: drop it
      showSession();
    }
    await askToken(url, headers, Boolean(sent));
  }
}

function showSession() {
  renderSession(Boolean(heldToken()), { onChange: changeToken, onSignOut: signOut });
}

// The header's "sign out": drop the token, draw the page again (its first read brings the form back).
export function signOut() {
  sessionStorage.removeItem(TOKEN_KEY);
  showSession();
  rerender();
}

// The header's "change token": the form (cancellable), checked against the runs list.
export async function changeToken() {
  if (asking) return;
  const url = paths.runs();
  const headers = { Accept: "application/json" };
  asking = showTokenForm({ cancellable: true, check: (token) => accepted(url, headers, token) });
  const token = await asking;
  asking = null;
  if (token === null) return;
  sessionStorage.setItem(TOKEN_KEY, token);
  showSession();
  rerender();
}

// app.js: how to draw the current page again; shows the header's controls when a token is held.
export function setRerender(fn) {
  rerender = fn;
  showSession();
}

export async function getJSON(url, options = {}) {
  const response = await authorizedFetch(url, { Accept: "application/json" }, options.signal);
  return (await check(response, url)).json();
}

export async function getArrow(url, options = {}) {
  const response = await authorizedFetch(url, { Accept: "application/vnd.apache.arrow.stream" }, options.signal);
  const buffer = await (await check(response, url)).arrayBuffer();
  return readStream(buffer);
}

export const paths = {
  runs: () => "/v1/runs",
  run: (run) => `/v1/runs/${enc(run)}`,
  requests: (run, { flag, cursor, limit } = {}) => {
    const q = new URLSearchParams();
    if (flag) q.set("flag", flag);
    if (cursor) q.set("cursor", cursor);
    if (limit) q.set("limit", String(limit));
    const qs = q.toString();
    return `/v1/runs/${enc(run)}/requests${qs ? "?" + qs : ""}`;
  },
  request: (run, req) => `/v1/runs/${enc(run)}/requests/${enc(req)}`,
  routes: (run, req, start, end, format) =>
    `/v1/runs/${enc(run)}/requests/${enc(req)}/routes?start=${start}&end=${end}${format ? "&format=" + format : ""}`,
  expertLoad: (run) => `/v1/runs/${enc(run)}/expert-load`,
  compares: (run) => `/v1/runs/${enc(run)}/compares`,
  health: (run) => `/v1/runs/${enc(run)}/health`,
  healthSeries: (run) => `/v1/runs/${enc(run)}/health/series`,
  agreement: (run) => `/v1/runs/${enc(run)}/agreement`,
  compare: (run, id) => `/v1/runs/${enc(run)}/compares/${enc(id)}`,
  compareRequest: (run, id, req, start, end) =>
    `/v1/runs/${enc(run)}/compares/${enc(id)}/requests/${enc(req)}?start=${start}&end=${end}`,
};

// Comparisons are optional (the endpoint may be absent or the run may have none): [] then.
export async function listCompares(run) {
  try {
    const doc = await getJSON(paths.compares(run));
    return Array.isArray(doc) ? doc : (doc.compares || doc.items || []);
  } catch (err) {
    if (err instanceof ApiError && (err.status === 404 || err.status === 405)) return [];
    throw err;
  }
}

// Hash links, for <a href>.
export const hashes = {
  runs: () => "#/",
  run: (run, query) => `#/runs/${enc(run)}${queryString(query)}`,
  request: (run, req, query) => `#/runs/${enc(run)}/requests/${enc(req)}${queryString(query)}`,
  compare: (run, id) => `#/runs/${enc(run)}/compares/${enc(id)}`,
};

export function queryString(query) {
  if (!query) return "";
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(query)) if (v !== undefined && v !== null && v !== "") q.set(k, String(v));
  const s = q.toString();
  return s ? "?" + s : "";
}

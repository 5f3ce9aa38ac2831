// The service's read endpoints. Ids always go through encodeURIComponent.
import { readStream } from "./arrow.js";

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
// token once and keeps it for this tab (sessionStorage: gone when the tab closes, never sent elsewhere).
export const TOKEN_KEY = "routing-replay-token";
let asking = null; // one prompt for the 401s of calls made at the same time

function withToken(headers) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? { ...headers, Authorization: `Bearer ${token}` } : headers;
}

function askToken(refused) {
  if (!asking) {
    asking = Promise.resolve().then(() => {
      const message = refused
        ? "The service refused the token. Enter a read token for routing-replay:"
        : "This routing-replay service needs a read token (ask its operator):";
      const token = (window.prompt(message) || "").trim();
      if (token) sessionStorage.setItem(TOKEN_KEY, token);
      else sessionStorage.removeItem(TOKEN_KEY);
      asking = null;
      return Boolean(token);
    });
  }
  return asking;
}

// fetch with the tab's token; on a 401 ask for one (once) and try again with it.
async function authorizedFetch(url, headers, signal) {
  const sent = sessionStorage.getItem(TOKEN_KEY);
  const response = await fetch(url, { headers: withToken(headers), signal });
  if (response.status !== 401) return response;
  const current = sessionStorage.getItem(TOKEN_KEY);
  if (current && current !== sent) return fetch(url, { headers: withToken(headers), signal }); // asked meanwhile
  if (!(await askToken(Boolean(sent)))) return response;
  return fetch(url, { headers: withToken(headers), signal });
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

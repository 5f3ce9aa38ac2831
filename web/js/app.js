// routing-replay debugging view: hash router and page shell.
import { h, clear } from "./dom.js";
import { ApiError, setRerender } from "./api.js";
import { renderRuns } from "./pages/runs.js";
import { renderRun } from "./pages/run.js";
import { renderRequest } from "./pages/request.js";
import { renderCompare } from "./pages/compare.js";

const main = document.getElementById("main");
const crumbs = document.getElementById("crumbs");
let cleanup = null;
let generation = 0;

function parseHash() {
  const raw = location.hash.replace(/^#/, "") || "/";
  const [path, qs] = raw.split("?", 2);
  const parts = path.split("/").filter(Boolean).map((p) => {
    try { return decodeURIComponent(p); } catch (_) { return p; }
  });
  const query = Object.fromEntries(new URLSearchParams(qs || ""));
  if (parts.length === 0) return { page: "runs", query };
  if (parts[0] === "runs" && parts.length === 2) return { page: "run", run: parts[1], query };
  if (parts[0] === "runs" && parts[2] === "requests" && parts.length === 4) return { page: "request", run: parts[1], request: parts[3], query };
  if (parts[0] === "runs" && parts[2] === "compares" && parts.length === 4) return { page: "compare", run: parts[1], compare: parts[3], query };
  return { page: "missing", query, path: raw };
}

export function showError(container, err) {
  const detail = err instanceof ApiError ? err.detail : (err && err.message) || String(err);
  container.append(h("div", { class: "error", role: "alert" },
    h("b", null, err instanceof ApiError ? `HTTP ${err.status}` : "Error"), " ",
    typeof detail === "string" ? detail : JSON.stringify(detail)));
}

async function route() {
  const gen = ++generation;
  if (cleanup) { try { cleanup(); } catch (_) { /* ignore */ } cleanup = null; }
  const r = parseHash();
  clear(main);
  clear(crumbs);
  document.body.dataset.page = r.page;
  document.body.dataset.ready = "0";
  const ctx = {
    main, crumbs, query: r.query,
    alive: () => gen === generation,
    setCleanup: (fn) => { cleanup = fn; },
    title: (...parts) => { document.title = [...parts, "routing-replay"].join(" · "); },
  };
  try {
    if (r.page === "runs") await renderRuns(ctx);
    else if (r.page === "run") await renderRun(ctx, r.run);
    else if (r.page === "request") await renderRequest(ctx, r.run, r.request);
    else if (r.page === "compare") await renderCompare(ctx, r.run, r.compare);
    else {
      ctx.title("not found");
      main.append(h("div", { class: "error" }, "No page at ", h("code", null, r.path), ". ", h("a", { href: "#/" }, "All runs")));
    }
  } catch (err) {
    if (gen !== generation) return;
    console.error(err);
    showError(main, err);
  }
  if (gen === generation) document.body.dataset.ready = "1";
}

window.addEventListener("hashchange", route);
setRerender(route);
route();

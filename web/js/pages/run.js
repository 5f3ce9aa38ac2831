// One run: summary with the health verdict, health view (plots), requests table (sortable, filter by flag, cursor pages), expert-load heatmap, comparisons.
import { h, clear, fmtInt, fmtBytes, fmtTime, fmtPct, fmtNum, flagChips, FLAGS, FLAG_SHORT, FLAG_COLORS, FLAG_HELP } from "../dom.js";
import { getJSON, paths, hashes, listCompares } from "../api.js";
import { breadcrumbs, kv, sortableTable, sortRows, spinner } from "./common.js";
import { drawHeatmap } from "../heatmap.js";
import { fetchHealth, verdictBadge, renderHealth } from "./health.js";


export async function renderRun(ctx, runId) {
  ctx.title(runId);
  breadcrumbs(ctx, [[runId, null]]);
  const health = fetchHealth(runId); // not awaited here: the head's badge fills in when it comes
  const [run, compares] = await Promise.all([getJSON(paths.run(runId)), listCompares(runId).catch(() => [])]);
  if (!ctx.alive()) return;
  const tab = ctx.query.tab || "requests";
  const setQuery = (patch) => {
    const q = { ...ctx.query, ...patch };
    location.hash = hashes.run(runId, q);
  };

  const badge = h("span", { class: "muted", id: "health-badge", dataset: { verdict: "loading" } }, "…");
  ctx.main.append(h("div", { class: "head" },
    h("h1", null, runId),
    kv([
      ["shape", `${run.num_moe_layers} MoE layers × top-${run.top_k} of ${run.num_experts} experts (${run.dtype})`],
      ["source", run.source],
      ["created", fmtTime(run.created_at)],
      ["requests", `${fmtInt(run.requests)} (${fmtInt(run.requests - run.requests_ended)} open)`],
      ["tokens", fmtInt(run.rows)],
      ["stored", fmtBytes(run.bytes)],
    ]),
    h("div", { class: "flagline" }, h("span", { class: "label" }, "flagged rows"),
      flagChips(run.flagged, (name) => setQuery({ tab: "requests", flag: name }))),
    h("div", { class: "flagline" }, h("span", { class: "label" }, "health"), badge)));
  health.then((result) => { if (ctx.alive()) badge.replaceWith(verdictBadge(runId, result)); });

  const tabs = [["requests", "Requests"], ["health", "Health"], ["load", "Expert load"], ["compares", `Comparisons (${compares.length})`]];
  ctx.main.append(h("nav", { class: "tabs" }, tabs.map(([key, label]) =>
    h("a", { href: hashes.run(runId, { ...ctx.query, tab: key }), class: key === tab ? "active" : "", dataset: { tab: key } }, label))));
  const body = h("div", { class: "tabbody" });
  ctx.main.append(body);
  if (tab === "health") await renderHealth(ctx, runId, body, health);
  else if (tab === "load") await renderLoad(ctx, runId, body);
  else if (tab === "compares") renderCompares(runId, compares, body);
  else await renderRequests(ctx, runId, body, setQuery);
}

async function renderRequests(ctx, runId, body, setQuery) {
  const flag = ctx.query.flag || "";
  const PAGE = Math.max(1, Math.min(1000, Number(ctx.query.limit) || 100));
  const state = { items: [], cursor: null, done: false, sortKey: ctx.query.sort || "request_id", sortDir: Number(ctx.query.dir || 1) };
  const select = h("select", { id: "flag-filter", onchange: (e) => setQuery({ flag: e.target.value, tab: "requests" }) },
    h("option", { value: "" }, "all requests"),
    FLAGS.map((f) => h("option", { value: f, selected: f === flag }, `with ${f} rows`)));
  const status = h("span", { class: "muted", id: "req-status" });
  const more = h("button", { id: "load-more", onclick: () => loadPage() }, `Load ${PAGE} more`);
  const all = h("button", { id: "load-all", onclick: async () => { while (!state.done && ctx.alive()) await loadPage(); } }, "Load all");
  const tableBox = h("div", { class: "panel scroll-x" }, spinner());
  body.append(h("div", { class: "toolbar" }, h("label", null, "filter ", select), status, more, all), tableBox);

  const columns = [
    { key: "request_id", label: "request", render: (r) => h("a", { href: hashes.request(runId, r.request_id), class: "strong" }, r.request_id) },
    { key: "status", label: "status", render: (r) => h("span", { class: `status ${r.status}` }, r.status) },
    { key: "rows", label: "rows", num: true, render: (r) => fmtInt(r.rows) },
    { key: "expected_rows", label: "expected", num: true, render: (r) => fmtInt(r.expected_rows) },
    { key: "flagged_total", label: "flag hits", num: true, title: "flagged rows summed over kinds (a row with two flags counts twice; PADDING excluded)", render: (r) => r.flagged_total ? fmtInt(r.flagged_total) : h("span", { class: "ok" }, "0") },
    ...FLAGS.map((f) => ({
      key: f, label: h("span", { class: "flaghead", style: { borderColor: FLAG_COLORS[f] } }, FLAG_SHORT[f]), num: true, title: `${f}: ${FLAG_HELP[f]}`,
      render: (r) => (r.flagged[f] ? h("span", { class: "count", style: { color: FLAG_COLORS[f] } }, fmtInt(r.flagged[f])) : h("span", { class: "zero" }, "·")),
    })),
    { key: "first_flagged_position", label: "first flagged", num: true, render: (r) => r.first_flagged_position === null || r.first_flagged_position === undefined ? "–"
      : h("a", { href: hashes.request(runId, r.request_id, { pos: r.first_flagged_position }) }, fmtInt(r.first_flagged_position)) },
  ];
  const valueOf = (key) => (r) => (FLAGS.includes(key) ? r.flagged[key] || 0 : r[key]);

  function draw() {
    clear(tableBox);
    const rows = sortRows(state.items, state.sortKey, state.sortDir, valueOf(state.sortKey));
    if (!rows.length && state.done) {
      tableBox.append(h("p", { class: "muted pad" }, flag ? `No request has ${flag} rows.` : "No requests."));
    } else {
      tableBox.append(sortableTable({
        columns, rows, sortKey: state.sortKey, sortDir: state.sortDir,
        onSort: (key, dir) => { state.sortKey = key; state.sortDir = dir; draw(); },
        rowAttrs: (r) => ({ class: r.clean ? "" : "flagged", dataset: { request: r.request_id } }),
      }));
    }
    status.textContent = `${fmtInt(state.items.length)} loaded${state.done ? " (all)" : ", more on the server"}` +
      (state.sortKey !== "request_id" && !state.done ? " · sorted among loaded" : "");
    more.disabled = all.disabled = state.done;
  }

  async function loadPage() {
    if (state.done || state.loading) return;
    state.loading = true;
    try {
      const page = await getJSON(paths.requests(runId, { flag, cursor: state.cursor, limit: PAGE }));
      if (!ctx.alive()) return;
      for (const item of page.items) {
        item.flagged = item.flagged || {};
        item.flagged_total = Object.entries(item.flagged).filter(([k]) => k !== "PADDING").reduce((s, [, v]) => s + v, 0);
      }
      state.items.push(...page.items);
      state.cursor = page.next_cursor;
      state.done = !page.next_cursor;
      draw();
    } finally {
      state.loading = false;
    }
  }
  await loadPage();
}

async function renderLoad(ctx, runId, body) {
  body.append(spinner());
  const load = await getJSON(paths.expertLoad(runId));
  if (!ctx.alive()) return;
  clear(body);
  const L = load.counts.length;
  const E = L ? load.counts[0].length : 0;
  const order = [...load.imbalance.keys()].sort((a, b) => load.imbalance[b] - load.imbalance[a]);
  const worst = order.slice(0, 5);
  const mean = L ? load.imbalance.reduce((s, x) => s + x, 0) / L : 0;
  body.append(h("div", { class: "toolbar" },
    h("span", null, `${fmtInt(load.rows)} clean rows counted · ${L} MoE layers × ${E} experts · imbalance = max/mean tokens per expert`),
    h("span", { class: "muted" }, `mean imbalance ${fmtNum(mean, 2)} · worst: `,
      worst.map((l, i) => [i ? ", " : "", `L${l} ${fmtNum(load.imbalance[l], 2)}`]))));
  const tip = h("div", { class: "tooltip", hidden: true });
  const wrap = h("div", { class: "panel heatmap-wrap", id: "expert-load" });
  body.append(wrap, tip);
  drawHeatmap(wrap, load, tip);
}

function renderCompares(runId, compares, body) {
  if (!compares.length) {
    body.append(h("p", { class: "muted pad", id: "no-compares" }, "No comparisons stored for this run."));
    return;
  }
  body.append(h("div", { class: "panel" }, sortableTable({
    columns: [
      { key: "label", label: "comparison", render: (c) => h("a", { href: hashes.compare(runId, c.compare_id), class: "strong" }, c.label || c.compare_id) },
      { key: "created_at", label: "created", render: (c) => fmtTime(c.created_at) },
      { key: "requests", label: "requests", num: true, render: (c) => fmtInt(c.requests) },
      { key: "tokens", label: "tokens", num: true, render: (c) => fmtInt(c.tokens) },
      { key: "router_mismatch", label: "router mismatch", num: true, render: (c) => fmtPct(c.router_mismatch) },
      { key: "token_mismatch", label: "tokens differing", num: true, render: (c) => fmtPct(c.token_mismatch) },
      { key: "jaccard", label: "jaccard", num: true, render: (c) => fmtNum(c.jaccard) },
      { key: "missing_rows", label: "missing rows", num: true, render: (c) => fmtInt(c.missing_rows) },
    ],
    rows: compares,
  })));
}

// A stored comparison: per-layer mismatch, worst layers, worst tokens.
import { h, fmtInt, fmtPct, fmtNum, fmtTime } from "../dom.js";
import { getJSON, paths, hashes, ApiError } from "../api.js";
import { breadcrumbs, kv, sortableTable, sortRows } from "./common.js";

export async function renderCompare(ctx, runId, compareId) {
  ctx.title(compareId, runId);
  breadcrumbs(ctx, [[runId, hashes.run(runId)], ["comparisons", hashes.run(runId, { tab: "compares" })], [compareId, null]]);
  let c;
  try {
    c = await getJSON(paths.compare(runId, compareId));
  } catch (err) {
    if (err instanceof ApiError && err.status === 404) {
      ctx.main.append(h("h1", null, "comparison ", compareId),
        h("p", { class: "muted", id: "no-compares" }, "No comparisons: this run has no stored comparison with this id (or the service does not serve comparisons)."));
      return;
    }
    throw err;
  }
  if (!ctx.alive()) return;
  c = c.compare || c;
  ctx.main.append(h("div", { class: "head" },
    h("h1", null, h("span", { class: "muted" }, "comparison "), c.label || c.compare_id),
    kv([
      ["id", c.compare_id],
      ["created", fmtTime(c.created_at)],
      ["requests", fmtInt(c.requests)],
      ["tokens", fmtInt(c.tokens)],
      ["router mismatch", h("b", null, fmtPct(c.router_mismatch))],
      ["tokens differing in ≥1 layer", fmtPct(c.token_mismatch)],
      ["mean jaccard", fmtNum(c.jaccard)],
      ["missing rows", fmtInt(c.missing_rows)],
    ])));
  const perLayer = c.per_layer || [];
  const maxMm = Math.max(1e-9, ...perLayer.map((p) => p.router_mismatch || 0));
  const worst = new Set((c.worst_layers || []).map((w) => (typeof w === "object" ? w.layer : w)));
  ctx.main.append(h("h2", null, "Router mismatch per layer"),
    h("div", { class: "panel bars", id: "per-layer" }, perLayer.map((p) => h("div", { class: "bar-row" + (worst.has(p.layer) ? " worst" : ""), title: `layer ${p.layer} (model ${p.model_layer}): mismatch ${fmtPct(p.router_mismatch)}, jaccard ${fmtNum(p.jaccard)}` },
      h("span", { class: "mono muted lbl" }, `L${p.model_layer ?? p.layer}`),
      h("span", { class: "bar" }, h("span", { class: "fill", style: { width: `${(100 * (p.router_mismatch || 0)) / maxMm}%` } })),
      h("span", { class: "mono val" }, fmtPct(p.router_mismatch)),
      h("span", { class: "mono muted val" }, `J ${fmtNum(p.jaccard)}`)))));
  const tokens = c.worst_tokens || [];
  if (tokens.length) {
    ctx.main.append(h("h2", null, "Tokens differing in the most layers"), h("div", { class: "panel" }, sortableTable({
      columns: [
        { key: "request_id", label: "request", render: (t) => h("a", { href: hashes.request(runId, t.request_id, { pos: t.position, compare: c.compare_id }) }, t.request_id) },
        { key: "position", label: "position", num: true },
        { key: "layers_differing", label: "layers differing", num: true },
        { key: "jaccard", label: "jaccard", num: true, render: (t) => fmtNum(t.jaccard) },
      ],
      rows: sortRows(tokens, "layers_differing", -1),
    })));
  }
}

// All runs, with health at a glance.
import { h, fmtInt, fmtBytes, fmtTime, fmtPct, flagChips } from "../dom.js";
import { getJSON, paths, hashes, listCompares } from "../api.js";
import { breadcrumbs } from "./common.js";

export async function renderRuns(ctx) {
  ctx.title("runs");
  breadcrumbs(ctx, []);
  const { runs } = await getJSON(paths.runs());
  if (!ctx.alive()) return;
  ctx.main.append(h("h1", null, "Runs ", h("span", { class: "muted" }, `${runs.length}`)));
  if (!runs.length) {
    ctx.main.append(h("p", { class: "muted" }, "No runs stored yet. Start the service with --demo for a synthetic run."));
    return;
  }
  const compareCells = new Map();
  const table = h("table", { class: "grid runs" },
    h("thead", null, h("tr", null,
      h("th", null, "run"), h("th", null, "shape"), h("th", null, "source"), h("th", null, "created"),
      h("th", { class: "num" }, "requests"), h("th", { class: "num" }, "tokens (rows)"), h("th", { class: "num" }, "stored"),
      h("th", null, "flagged rows"), h("th", null, "comparisons"))),
    h("tbody", null, runs.map((run) => {
      const cmp = h("td", { class: "compares muted" }, "…");
      compareCells.set(run.run_id, cmp);
      const flagged = { ...run.flagged };
      return h("tr", { dataset: { run: run.run_id } },
        h("td", null, h("a", { href: hashes.run(run.run_id), class: "strong" }, run.run_id)),
        h("td", { class: "mono" }, `${run.num_moe_layers}L × top-${run.top_k} of ${run.num_experts} (${run.dtype})`),
        h("td", null, run.source),
        h("td", { class: "mono" }, fmtTime(run.created_at)),
        h("td", { class: "num" }, fmtInt(run.requests), h("span", { class: "muted" }, ` (${fmtInt(run.requests - run.requests_ended)} open)`)),
        h("td", { class: "num" }, fmtInt(run.rows)),
        h("td", { class: "num" }, fmtBytes(run.bytes)),
        h("td", { class: "flags" }, flagChips(flagged, (name) => { location.hash = hashes.run(run.run_id, { flag: name }); })),
        cmp);
    })));
  ctx.main.append(h("div", { class: "panel" }, table));
  await Promise.all(runs.map(async (run) => {
    const cell = compareCells.get(run.run_id);
    let compares;
    try { compares = await listCompares(run.run_id); } catch (err) { cell.textContent = "?"; cell.title = err.message; return; }
    if (!ctx.alive()) return;
    cell.textContent = "";
    cell.classList.toggle("muted", !compares.length);
    if (!compares.length) { cell.textContent = "none"; return; }
    for (const c of compares.slice(0, 3)) {
      cell.append(h("a", { href: hashes.compare(run.run_id, c.compare_id), class: "chip clickable" },
        c.label || c.compare_id, h("b", { title: "router mismatch: (token, layer) top-k sets that differ" }, fmtPct(c.router_mismatch))));
    }
    if (compares.length > 3) cell.append(` +${compares.length - 3}`);
  }));
}

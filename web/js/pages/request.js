// One request: token x layer route view (canvas), flagged rows, next flagged row, row detail.
import { h, append, clear, fmtInt, flagChips, flagChip, flagNames, FLAG_COLORS, FLAG_HELP, expertPalette, rgbCss, fmtPct } from "../dom.js";
import { getJSON, paths, hashes, listCompares } from "../api.js";
import { breadcrumbs, kv } from "./common.js";
import { RouteData, NO_TOKEN } from "../routedata.js";
import { RouteView, ROW_HEIGHTS } from "../routeview.js";

const LIST_MAX = 500;
const SCAN_AFTER_MS = 5000; // the background scan starts by then even if the rows in view never drew

export async function renderRequest(ctx, runId, reqId) {
  const t0 = performance.now();
  ctx.title(reqId, runId);
  breadcrumbs(ctx, [[runId, hashes.run(runId)], [reqId, null]]);
  const [run, summary, compares] = await Promise.all([
    getJSON(paths.run(runId)), getJSON(paths.request(runId, reqId)), listCompares(runId).catch(() => []),
  ]);
  if (!ctx.alive()) return;
  const data = new RouteData({ run: runId, request: reqId, rows: summary.expected_rows, layers: run.num_moe_layers, topK: run.top_k, numExperts: run.num_experts });
  const palette = expertPalette(run.num_experts);
  const q = ctx.query;
  const setHashQuiet = (patch) => { // keep position/compare in the URL without re-rendering
    Object.assign(q, patch);
    history.replaceState(null, "", hashes.request(runId, reqId, q));
  };

  // ---- header ----
  ctx.main.append(h("div", { class: "head compact" },
    h("h1", null, h("span", { class: "muted" }, "request "), reqId),
    kv([
      ["status", h("span", { class: `status ${summary.status}` }, summary.status)],
      ["rows", `${fmtInt(summary.rows)} stored / ${fmtInt(summary.expected_rows)} expected`],
      ["tokens", summary.num_tokens === null ? "open" : fmtInt(summary.num_tokens)],
      ["shape", `${run.num_moe_layers} MoE layers × top-${run.top_k} of ${run.num_experts}`],
      ["first flagged", summary.first_flagged_position === null ? "–" : String(summary.first_flagged_position)],
    ]),
    h("div", { class: "flagline", id: "request-flags" }, h("span", { class: "label" }, "flagged rows"), flagChips(summary.flagged))));

  // ---- toolbar ----
  const flagStatus = h("span", { class: "muted", id: "flag-status" });
  const zoomLabel = h("span", { class: "mono" });
  const modeSelect = h("select", { id: "color-mode", title: "cell colour" },
    h("option", { value: "expert" }, "colour: expert id"),
    compares.map((c) => h("option", { value: `agree:${c.compare_id}` }, `colour: agreement with ${c.label || c.compare_id}`)));
  const jump = h("input", { type: "number", min: 0, max: Math.max(0, data.n - 1), placeholder: "position", id: "jump", class: "jump" });
  const toolbar = h("div", { class: "toolbar sticky" },
    h("button", { id: "prev-flagged", title: "previous flagged row (p)", onclick: () => goFlagged(-1) }, "◀ prev flagged"),
    h("button", { id: "next-flagged", class: "primary", title: "next flagged row (n)", onclick: () => goFlagged(1) }, "next flagged row ▶"),
    flagStatus,
    h("span", { class: "spacer" }),
    h("form", { onsubmit: (ev) => { ev.preventDefault(); const v = Number(jump.value); if (Number.isFinite(v)) view.select(Math.max(0, Math.min(data.n - 1, v))); } },
      jump, h("button", { type: "submit" }, "go")),
    h("button", { title: "shorter rows", onclick: () => zoom(-1) }, "−"), zoomLabel,
    h("button", { title: "taller rows", onclick: () => zoom(1) }, "+"),
    modeSelect);
  ctx.main.append(toolbar);

  const legend = h("div", { class: "legendline", id: "route-legend" });
  const detail = h("div", { class: "detail", id: "row-detail" }, h("p", { class: "muted" }, "Click a row, or use “next flagged row”."));
  const list = h("div", { class: "flaglist", id: "flagged-list" });
  const listHead = h("div", { class: "side-head" }, "Flagged rows");
  const tip = h("div", { class: "tooltip", hidden: true });
  const viewHost = h("div", { class: "route-host" });
  ctx.main.append(h("div", { class: "route-layout" },
    h("div", { class: "route-main" }, viewHost, legend),
    h("aside", { class: "side" }, h("div", { class: "side-head" }, "Row detail"), detail, listHead, list)), tip);

  if (data.n === 0) {
    viewHost.append(h("p", { class: "muted pad" }, "This request has no rows."));
    return;
  }

  const view = new RouteView(viewHost, data, {
    moeLayers: run.moe_layers,
    rowHeight: Number(q.rows) || (data.n > 4000 ? 2 : 4),
    onSelect: (row) => { showDetail(row); setHashQuiet({ pos: row }); document.body.dataset.selectedPos = String(row); },
    onHover: (hit, ev) => {
      if (!hit) { tip.hidden = true; return; }
      const f = flagNames(data.flags[hit.row]);
      const tok = data.tokens[hit.row];
      let text = `pos ${hit.row} · token ${tok === NO_TOKEN ? "–" : tok}`;
      if (hit.layer >= 0) {
        const ids = data.row(hit.row);
        text += ` · layer ${hit.layer} (model ${run.moe_layers[hit.layer] ?? hit.layer})`;
        if (ids) text += ` · ids ${ids[hit.layer].join(" ")} · slot ${hit.slot}: expert ${ids[hit.layer][hit.slot]}`;
        if (view.mode === "agree") {
          const mm = data.peekMismatch(data.chunkOf(hit.row));
          const m = mm ? mm[(hit.row - data.chunkOf(hit.row) * data.chunkRows) * data.L + hit.layer] : 255;
          text += m === 1 ? " · DIFFERS" : m === 0 ? " · agrees" : " · not compared";
        }
      }
      if (f.length) text += ` · ${f.join(", ")}`;
      tip.textContent = text;
      tip.hidden = false;
      tip.style.left = `${ev.clientX + 14}px`;
      tip.style.top = `${ev.clientY + 14}px`;
    },
  });
  window.__routeView = { view, data, t0 };
  let opened = false;
  let scanLater = () => {}; // set below: the background scan, started once what is in view is drawn
  view.onComplete = () => {
    if (opened) return;
    opened = true;
    const ms = performance.now() - t0;
    document.body.dataset.routeOpenMs = ms.toFixed(1);
    document.body.dataset.routeOpenFetches = String(data.fetches);
    document.body.dataset.routeReady = "1";
    scanLater();
  };
  document.body.dataset.routeReady = "0";
  const updateZoom = () => { zoomLabel.textContent = `${view.rowH}px`; };
  updateZoom();
  function zoom(dir) {
    const i = ROW_HEIGHTS.indexOf(view.rowH);
    const next = ROW_HEIGHTS[Math.max(0, Math.min(ROW_HEIGHTS.length - 1, (i < 0 ? 2 : i) + dir))];
    view.setRowHeight(next);
    setHashQuiet({ rows: next });
    updateZoom();
  }
  // colour mode
  const setMode = (value) => {
    if (value.startsWith("agree:")) {
      data.setCompare(value.slice(6));
      view.setMode("agree");
    } else {
      view.setMode("expert");
    }
    drawLegend(value);
    if (view.selected >= 0) showDetail(view.selected);
  };
  modeSelect.addEventListener("change", () => { setMode(modeSelect.value); setHashQuiet({ compare: modeSelect.value.startsWith("agree:") ? modeSelect.value.slice(6) : "" }); });
  if (q.compare && compares.some((c) => c.compare_id === q.compare)) modeSelect.value = `agree:${q.compare}`;
  setMode(modeSelect.value);

  function drawLegend(mode) {
    clear(legend);
    if (mode.startsWith("agree:")) {
      legend.append(h("span", { class: "swatch", style: { background: "rgb(255,64,64)" } }), "layer's top-k differs ",
        h("span", { class: "swatch", style: { background: "rgb(60,60,70)" } }), "not compared ",
        h("span", { class: "muted" }, "· dimmed expert colours: agrees · "));
    } else {
      legend.append(h("span", { class: "muted" }, `colour = expert id (${run.num_experts} experts; white = out of range) · each layer column is ${run.top_k} ids wide · `));
    }
    append(legend, [h("span", { class: "muted" }, "marker strip: "),
      ["ZERO", "DUPLICATE", "OUT_OF_RANGE", "STALE", "CONFLICT", "GAP"].map((f) => flagChip(f)),
      h("span", { class: "muted" }, " · keys: n / p flagged, ↑ ↓ rows")]);
  }

  // ---- row detail ----
  function showDetail(row) {
    clear(detail);
    const flags = flagNames(data.flags[row]);
    const tok = data.tokens[row];
    const ids = data.row(row);
    detail.dataset.pos = String(row);
    detail.append(kv([
      ["position", String(row)],
      ["token id", tok === NO_TOKEN ? "– (none)" : String(tok)],
      ["flags", flags.length ? h("span", { class: "chips" }, flags.map((f) => flagChip(f))) : h("span", { class: "ok" }, "none")],
    ]));
    for (const f of flags) detail.append(h("p", { class: "reason" }, h("b", { style: { color: FLAG_COLORS[f] } }, f), ": ", FLAG_HELP[f]));
    if (!ids) {
      detail.append(h("p", { class: "muted" }, "loading ids…"));
      data.ensure(data.chunkOf(row))?.then(() => { if (view.selected === row) showDetail(row); });
      return;
    }
    if (flags.includes("GAP")) { detail.append(h("p", { class: "muted" }, "No ids: this position was never received.")); return; }
    const agree = view.mode === "agree" ? data.peekMismatch(data.chunkOf(row)) : null;
    const mOff = (row - data.chunkOf(row) * data.chunkRows) * data.L;
    const tbody = h("tbody");
    ids.forEach((layerIds, l) => {
      const seen = new Map();
      for (const id of layerIds) seen.set(id, (seen.get(id) || 0) + 1);
      const m = agree ? agree[mOff + l] : 255;
      tbody.append(h("tr", { class: m === 1 ? "differs" : "" },
        h("td", { class: "num muted" }, String(l)),
        h("td", { class: "num muted" }, String(run.moe_layers[l] ?? l)),
        h("td", { class: "ids" }, layerIds.map((id) => h("span", {
          class: "id" + (seen.get(id) > 1 ? " dup" : "") + (id >= run.num_experts ? " oor" : ""),
          style: { borderColor: id < run.num_experts ? rgbCss(palette[id]) : "#fff" },
          title: seen.get(id) > 1 ? "repeated in this layer" : id >= run.num_experts ? "out of range" : `expert ${id}`,
        }, String(id)))),
        agree ? h("td", { class: m === 1 ? "bad" : "muted", title: m === 1 ? "top-k differs from the comparison" : m === 0 ? "agrees" : "not compared" }, m === 1 ? "≠" : m === 0 ? "=" : "?") : null));
    });
    detail.append(h("table", { class: "grid ids-table" },
      h("thead", null, h("tr", null, h("th", { class: "num" }, "layer"), h("th", { class: "num" }, "model"), h("th", null, `top-${run.top_k} ids`), agree ? h("th", { title: "agreement with the comparison" }, "cmp") : null)),
      tbody));
  }

  // ---- flagged rows list (from the chunks fetched so far) ----
  let listTimer = 0;
  function refreshList() {
    listTimer = 0;
    const rows = data.flagged();
    const known = data.knownRows();
    clear(listHead).append("Flagged rows ", h("span", { class: "muted" },
      `${fmtInt(rows.length)} found · ${known < data.n ? `scanned ${fmtPct(known / data.n, 0)}` : "all rows scanned"}`));
    list.dataset.complete = known >= data.n ? "1" : "0";
    clear(list);
    const items = rows.slice(0, LIST_MAX).map((r) => {
      const names = flagNames(data.flags[r]);
      return h("div", { class: "flagrow" + (r === view.selected ? " sel" : ""), dataset: { pos: String(r), flags: names.join(",") }, onclick: () => view.select(r) },
        h("span", { class: "mono pos" }, String(r)),
        names.map((n) => h("span", { class: "tag", style: { borderColor: FLAG_COLORS[n], color: FLAG_COLORS[n] } }, n)));
    });
    list.append(...items);
    if (rows.length > LIST_MAX) list.append(h("p", { class: "muted" }, `… and ${fmtInt(rows.length - LIST_MAX)} more (use next flagged row)`));
    if (!rows.length && known >= data.n) list.append(h("p", { class: "ok" }, "No flagged rows."));
    flagStatus.textContent = view.selected >= 0 && data.flags[view.selected]
      ? `flagged row ${rows.indexOf(view.selected) + 1} of ${rows.length}${known < data.n ? "+" : ""}` : `${rows.length}${known < data.n ? "+" : ""} flagged rows`;
  }
  const unlisten = data.onChange((ev) => {
    if ((ev.chunk !== undefined || ev.scanned) && !listTimer) listTimer = setTimeout(refreshList, 120);
    if (ev.mismatch !== undefined && view.selected >= 0 && data.chunkOf(view.selected) === ev.mismatch) showDetail(view.selected);
  });

  async function goFlagged(dir) {
    const from = view.selected >= 0 ? view.selected : (dir > 0 ? view.firstRow() - 1 : view.firstRow());
    flagStatus.textContent = "searching…";
    const { row, wrapped } = await data.nextFlagged(from, dir);
    if (!ctx.alive()) return;
    if (row < 0) { flagStatus.textContent = "no flagged rows"; return; }
    view.select(row);
    refreshList();
    if (wrapped) flagStatus.textContent += " (wrapped)";
  }

  const onKey = (ev) => {
    if (ev.target instanceof HTMLInputElement || ev.target instanceof HTMLSelectElement) return;
    if (ev.key === "n") goFlagged(1);
    else if (ev.key === "p") goFlagged(-1);
    else if (ev.key === "ArrowDown" && view.selected >= 0) { ev.preventDefault(); view.select(Math.min(data.n - 1, view.selected + 1)); view.scrollToRow(view.selected, "nearest"); }
    else if (ev.key === "ArrowUp" && view.selected >= 0) { ev.preventDefault(); view.select(Math.max(0, view.selected - 1)); view.scrollToRow(view.selected, "nearest"); }
  };
  document.addEventListener("keydown", onKey);
  const origSelect = view.onSelect;
  view.onSelect = (row) => { origSelect(row); if (!listTimer) listTimer = setTimeout(refreshList, 0); };

  let stopped = false;
  ctx.setCleanup(() => { stopped = true; document.removeEventListener("keydown", onKey); unlisten(); view.destroy(); delete window.__routeView; delete document.body.dataset.routeReady; delete document.body.dataset.selectedPos; });

  if (q.pos !== undefined && q.pos !== "") view.select(Math.max(0, Math.min(data.n - 1, Number(q.pos) || 0)));
  refreshList();
  // Fetch the rest in the background so all flagged rows get listed: once what is in view is drawn (its fetches go
  // first however slow the machine), or after SCAN_AFTER_MS where the view cannot draw it (a chunk that failed).
  let scanning = false;
  const scan = () => {
    if (scanning) return;
    scanning = true;
    data.scan(() => stopped || !ctx.alive());
  };
  scanLater = () => setTimeout(scan, 0);
  if (opened) scanLater();
  setTimeout(scan, SCAN_AFTER_MS);
}

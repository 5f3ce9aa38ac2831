// A run's health: the verdict (what failed or warned, where), and plots of flag rates over ingest time,
// agreement over training steps and expert-load imbalance over time and per weight version.
// Endpoints (issue 24): GET /v1/runs/{run}/health, /health/series, /agreement. An older service answers
// 404 for them: the view says so and shows what it has.
import { h, fmtInt, fmtPct, fmtNum, FLAG_COLORS, FLAG_HELP } from "../dom.js";
import { getJSON, paths, hashes, enc, ApiError } from "../api.js";
import { spinner } from "./common.js";
import { loadUPlot, linePlot, fitWidths, registry } from "../charts.js";

export const LEVEL_COLORS = { ok: "#5ccf8a", warn: "#f2c94c", fail: "#ff5c5c" };
const INGEST_FLAGS = ["ZERO", "STALE", "OUT_OF_RANGE", "DUPLICATE", "CONFLICT"];
const CHECK_HELP = {
  ...FLAG_HELP,
  GAP: "rows expected but never received",
  FALLBACK: "rows a trainer slice would fill: expected rows without a clean row (flagged or GAP)",
  UNRESOLVED: "prefix-cache references whose source rows are not stored",
  OPEN: "requests not ended (batch scope)",
  MISSING: "batch requests the run does not hold",
  RECOMPUTED: "positions recomputed / rows expected",
  STALENESS: "versioned rows not of the current weight version",
  ROUTER_MISMATCH: "newest comparison: (token, layer) top-k sets that differ from the trainer's",
  TOKEN_MISMATCH: "newest comparison: tokens differing in at least one layer",
};

// An endpoint this service may not have: { doc } or { missing: true } (404/405), errors rethrown.
async function optional(url) {
  try {
    return { doc: await getJSON(url) };
  } catch (err) {
    if (err instanceof ApiError && (err.status === 404 || err.status === 405)) return { missing: true, err };
    throw err;
  }
}

// The run's report (GET /health), shared by the run page's badge and the health tab.
export function fetchHealth(runId) {
  return optional(paths.health(runId)).catch((err) => ({ error: err }));
}

// The head's badge: verdict and the checks that fail, linking to the health tab.
export function verdictBadge(runId, result) {
  if (result.missing) return h("span", { class: "muted", id: "health-badge", dataset: { verdict: "none" } }, "no health endpoint");
  if (result.error) return h("span", { class: "muted", id: "health-badge", dataset: { verdict: "error" }, title: result.error.message }, "health unavailable");
  const r = result.doc;
  const names = [...(r.failed || []), ...(r.warned || [])].map((f) => f.check);
  return h("a", { class: `verdict ${r.verdict}`, id: "health-badge", href: hashes.run(runId, { tab: "health" }), dataset: { verdict: r.verdict } },
    h("b", null, r.verdict.toUpperCase()), names.length ? ` ${names.join(", ")}` : "");
}

export async function renderHealth(ctx, runId, body, healthPromise) {
  body.append(spinner());
  const [health, series, agreement] = await Promise.all([
    healthPromise,
    optional(paths.healthSeries(runId)).catch((err) => ({ error: err })),
    optional(paths.agreement(runId)).catch((err) => ({ error: err })),
  ]);
  if (!ctx.alive()) return;
  body.replaceChildren();
  window.__healthPlots = {};
  body.append(verdictPanel(runId, health));
  const grid = h("div", { class: "plot-grid" });
  body.append(grid);
  const cards = {
    flags: card(grid, "flags", "Flag rates over ingest time", "flagged rows of each kind / rows received, per ingest bucket"),
    agreement: card(grid, "agreement", "Agreement over training steps", "comparisons posted with a step: rollout routing vs the trainer's"),
    imbalance: card(grid, "imbalance", "Expert-load imbalance over time", "max/mean tokens per expert over clean rows: mean over MoE layers, and the worst layer"),
    versions: card(grid, "versions", "Expert-load imbalance per weight version", "same measure, over the clean rows of each weight version"),
  };
  let uPlot;
  try {
    uPlot = await loadUPlot();
  } catch (err) {
    for (const c of Object.values(cards)) say(c, "error", `The plots could not be drawn: ${err.message}.`);
    return;
  }
  if (!ctx.alive()) return;
  const plots = [];
  const draw = (c, spec) => {
    c.state("plot");
    plots.push(linePlot(uPlot, c.plot, spec));
  };

  // flag rates over ingest time
  const older = (url) => `This service does not answer GET ${url} (an older release): nothing to plot here.`;
  if (series.missing) {
    for (const key of ["flags", "imbalance", "versions"]) say(cards[key], "missing", older(paths.healthSeries(runId)));
  } else if (series.error) {
    for (const key of ["flags", "imbalance", "versions"]) say(cards[key], "error", `Could not read the series: ${series.error.message}`);
  } else {
    const ingest = series.doc.ingest || [];
    const bucket = series.doc.bucket_s;
    if (!ingest.length) {
      say(cards.flags, "empty", "No rows ingested yet: no flag rates to plot.");
      say(cards.imbalance, "empty", "No rows ingested yet: no expert load to plot.");
    } else {
      cards.flags.note(`${plural(ingest.length, "bucket")} of ${Number(bucket.toPrecision(3))} s; flagged rows ${fmtInt(ingest.reduce((s, b) => s + INGEST_FLAGS.reduce((t, k) => t + ((b.flagged || {})[k] || 0), 0), 0))} of ${fmtInt(ingest.reduce((s, b) => s + b.rows, 0))}`);
      // each point is a bucket's start: the axis spans the buckets, half a bucket either side (from the data:
      // uPlot widens a one-point time axis to 1000 days before asking)
      const xRange = (u) => {
        const xs = u.data[0];
        return [xs[0] - bucket / 2, xs[xs.length - 1] + bucket / 2 + (xs.length === 1 ? bucket : 0)];
      };
      draw(cards.flags, {
        name: "flags", xKind: "time", xLabel: "ingest time", x: ingest.map((b) => b.t), xRange,
        scales: { y: { label: "flagged / rows", format: "pct", range: (u, min, max) => [0, max > 0 ? max * 1.15 : 0.01] } },
        series: INGEST_FLAGS.map((k) => ({ label: k, color: FLAG_COLORS[k], values: ingest.map((b) => (b.rows ? ((b.flagged || {})[k] || 0) / b.rows : null)) })),
      });
      if (ingest.every((b) => b.imbalance === null && b.imbalance_max === null)) {
        say(cards.imbalance, "empty", "No bucket has a clean row: no expert load to plot.");
      } else {
        draw(cards.imbalance, {
          name: "imbalance", xKind: "time", xLabel: "ingest time", x: ingest.map((b) => b.t), xRange,
          scales: { y: { label: "max / mean load", format: "num", range: imbalanceRange } },
          series: [
            { label: "mean over layers", color: "#5fb3ff", values: ingest.map((b) => b.imbalance) },
            { label: "worst layer", color: "#f2994a", values: ingest.map((b) => b.imbalance_max) },
          ],
        });
      }
    }
    const versions = series.doc.versions || [];
    if (!versions.length) {
      say(cards.versions, "empty", "No rows carry a weight version: nothing to plot per version.");
    } else {
      cards.versions.note(`${fmtInt(versions.length)} weight versions; rows ${versions.map((v) => `${v.version}: ${fmtInt(v.rows)}`).slice(0, 6).join(", ")}${versions.length > 6 ? ", …" : ""}`);
      draw(cards.versions, {
        name: "versions", xKind: "index", xLabel: "weight version", x: versions.map((_, i) => i), xLabels: versions.map((v) => v.version),
        scales: { y: { label: "max / mean load", format: "num", range: imbalanceRange } },
        series: [
          { label: "mean over layers", color: "#5fb3ff", values: versions.map((v) => v.imbalance) },
          { label: "worst layer", color: "#f2994a", values: versions.map((v) => v.imbalance_max) },
        ],
      });
    }
  }

  // agreement over training steps
  if (agreement.missing) say(cards.agreement, "missing", older(paths.agreement(runId)));
  else if (agreement.error) say(cards.agreement, "error", `Could not read the agreement series: ${agreement.error.message}`);
  else {
    const points = agreement.doc.points || [];
    if (!points.length) {
      say(cards.agreement, "empty", `No comparisons posted with a training step yet (POST /v1/runs/${enc(runId)}/compare?step=N): nothing to plot.`);
    } else {
      const last = points[points.length - 1];
      cards.agreement.note(`${fmtInt(points.length)} comparisons, steps ${points[0].step}–${last.step}; newest: router mismatch ${fmtPct(last.router_mismatch)}, tokens differing ${fmtPct(last.token_mismatch)}, Jaccard ${fmtNum(last.jaccard)}${(last.worst_layers || []).length ? `, worst layers ${last.worst_layers.map((w) => `L${w.model_layer ?? w.layer}`).join(" ")}` : ""}`);
      const limit = health.doc && health.doc.checks ? health.doc.checks.ROUTER_MISMATCH : null;
      draw(cards.agreement, {
        name: "agreement", xKind: "number", xLabel: "training step", x: points.map((p) => p.step),
        scales: {
          y: { label: "router mismatch, 1 − Jaccard", format: "pct", range: zeroUp },
          tok: { label: "tokens differing", format: "pct", range: zeroUp, color: "#c17cf0" },
        },
        series: [
          { label: "router mismatch", color: "#5fb3ff", values: points.map((p) => p.router_mismatch) },
          { label: "1 − Jaccard", color: "#5ccf8a", values: points.map((p) => (p.jaccard === null || p.jaccard === undefined ? null : 1 - p.jaccard)) },
          { label: "tokens differing", color: "#c17cf0", dash: [6, 3], scale: "tok", values: points.map((p) => p.token_mismatch) },
        ],
        limits: limit ? [
          { value: limit.warn, label: `warn > ${fmtPct(limit.warn, 1)}`, color: LEVEL_COLORS.warn },
          { value: limit.fail, label: `fail > ${fmtPct(limit.fail, 1)}`, color: LEVEL_COLORS.fail },
        ] : [],
      });
      // what the plot's "1 − Jaccard" series was made from, for readers of window.__healthPlots
      registry().agreement.jaccard = points.map((p) => p.jaccard);
    }
  }
  const unfit = fitWidths(plots);
  ctx.setCleanup(() => { unfit(); window.__healthPlots = {}; });
  body.dataset.plots = plots.length ? Object.keys(registry()).join(" ") : "";
}

function zeroUp(u, min, max) {
  return [0, max > 0 ? max * 1.15 : 0.01];
}
function imbalanceRange(u, min, max) {
  if (min === null || max === null) return [0, 2];
  const lo = Math.max(0, Math.min(1, min) - 0.05);
  return [lo, max > lo ? max + (max - lo) * 0.1 : lo + 1];
}

function card(grid, key, title, subtitle) {
  const plot = h("div", { class: "plot" });
  const note = h("div", { class: "plot-note muted" });
  const el = h("section", { class: "panel plot-card", id: `plot-${key}`, dataset: { state: "loading" } },
    h("h2", null, title), h("div", { class: "plot-sub muted" }, subtitle), note, plot);
  grid.append(el);
  return {
    el, plot,
    note: (text) => { note.textContent = text; },
    state: (s) => { el.dataset.state = s; },
  };
}

function say(c, state, text) {
  c.state(state);
  c.plot.replaceChildren(h("p", { class: `plot-empty ${state === "error" ? "bad" : "muted"}` }, text));
}

function verdictPanel(runId, health) {
  if (health.missing) {
    return h("section", { class: "panel verdict-panel", id: "health-verdict", dataset: { verdict: "none" } },
      h("p", { class: "muted" }, `This service has no health endpoint (GET ${paths.health(runId)} answered ${health.err.status}: an older release), so there is no verdict.`));
  }
  if (health.error) {
    return h("section", { class: "panel verdict-panel", id: "health-verdict", dataset: { verdict: "error" } },
      h("p", { class: "bad" }, `Could not read the run's health: ${health.error.message}`));
  }
  const r = health.doc;
  const findings = [...(r.failed || []), ...(r.warned || [])];
  const wv = r.weight_versions || {};
  const facts = [
    `scope ${r.scope}${r.window_s ? ` (last ${fmtInt(r.window_s)} s)` : ""}`,
    `${fmtInt(r.requests)} requests (${fmtInt(r.requests_open)} open)`,
    `${fmtInt(r.rows)} of ${fmtInt(r.rows_expected)} expected rows`,
    wv.current !== null && wv.current !== undefined ? `weight version ${wv.current}${wv.max_lag !== null && wv.max_lag !== undefined ? `, max lag ${wv.max_lag}` : ""}, ${fmtInt(wv.stale_rows)} stale rows` : null,
  ].filter(Boolean);
  return h("section", { class: `panel verdict-panel ${r.verdict}`, id: "health-verdict", dataset: { verdict: r.verdict } },
    h("div", { class: "verdict-head" },
      h("span", { class: `verdict-big ${r.verdict}`, id: "verdict-level" }, r.verdict.toUpperCase()),
      h("div", null,
        h("div", { class: "strong" }, findings.length
          ? `${plural((r.failed || []).length, "check")} failed, ${plural((r.warned || []).length, "check")} warned`
          : "every check is within its limits"),
        h("div", { class: "muted" }, facts.join(" · ")))),
    findings.length ? h("ul", { class: "findings" }, findings.map((f) => findingItem(runId, f))) : null,
    h("div", { class: "checks-line" }, h("span", { class: "muted" }, "checks "), Object.entries(r.checks || {}).map(([name, c]) =>
      h("span", { class: `chip check ${c.level}`, dataset: { check: name, level: c.level }, title: `${name}: ${CHECK_HELP[name] || ""}\nvalue ${fmtVal(c.value)} (count ${fmtInt(c.count)}); warn > ${fmtVal(c.warn)}, fail > ${fmtVal(c.fail)}` },
        h("span", { class: "dot" }), name, h("b", null, fmtVal(c.value))))));
}

function findingItem(runId, f) {
  const requests = f.requests || [];
  return h("li", { class: `finding ${f.level}`, dataset: { check: f.check, level: f.level } },
    h("span", { class: `level ${f.level}` }, f.level), " ",
    h("b", { title: CHECK_HELP[f.check] || f.check }, f.check), " ",
    h("span", { class: "mono" }, `${f.count === null || f.count === undefined ? "" : `${fmtInt(f.count)} · `}${fmtVal(f.value)} > ${fmtVal(f.limit)}`),
    f.compare_id ? [" ", h("a", { href: hashes.compare(runId, f.compare_id), class: "finding-compare" }, "comparison")] : null,
    requests.length ? h("span", { class: "finding-requests" }, " in ", requests.map((q, i) => [i ? ", " : "",
      h("a", {
        class: "finding-request", href: hashes.request(runId, q.request_id, q.first_position === null || q.first_position === undefined ? undefined : { pos: q.first_position }),
        dataset: { request: q.request_id, pos: q.first_position ?? "" },
        title: `${fmtInt(q.count)} in this request${q.first_position === null || q.first_position === undefined ? "" : `, first at position ${q.first_position}`}`,
      }, q.request_id, q.first_position === null || q.first_position === undefined ? null : h("span", { class: "muted" }, ` @${q.first_position}`))]),
    requests.length >= 20 ? h("span", { class: "muted" }, " (the first 20 by id)") : null) : null);
}

function fmtVal(v) {
  if (v === null || v === undefined) return "–";
  return v === 0 ? "0" : fmtPct(v, v < 0.001 ? 3 : 2);
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

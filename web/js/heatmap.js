// Expert load heatmap: layer (rows) x expert (columns), coloured by tokens / layer mean
// on a log scale (blue: under-used, grey: balanced, red: hot), imbalance (max/mean) per layer at right.
import { h, fmtInt, fmtNum } from "./dom.js";

const STOPS = [[0, [40, 90, 200]], [0.5, [58, 64, 76]], [0.75, [220, 120, 50]], [1, [255, 230, 120]]];

export function divergingColor(t) {
  t = Math.max(0, Math.min(1, t));
  for (let i = 1; i < STOPS.length; i++) {
    if (t <= STOPS[i][0]) {
      const [t0, a] = STOPS[i - 1];
      const [t1, b] = STOPS[i];
      const u = (t - t0) / (t1 - t0);
      return a.map((v, j) => Math.round(v + (b[j] - v) * u));
    }
  }
  return STOPS[STOPS.length - 1][1];
}

export function ratioToT(ratio) {
  return 0.5 + Math.log2(Math.max(ratio, 1e-6)) / 4; // 1/4x .. 4x of the mean
}

export function drawHeatmap(wrap, load, tip) {
  const counts = load.counts;
  const L = counts.length;
  const E = L ? counts[0].length : 0;
  const moe = load.moe_layers || [...Array(L).keys()];
  const labelW = 56, barW = 120, headH = 18;
  const avail = Math.max(400, (wrap.clientWidth || 1000) - labelW - barW - 24);
  const cellW = Math.max(2, Math.min(14, Math.floor(avail / Math.max(E, 1))));
  const cellH = L > 64 ? 6 : 12;
  const width = labelW + E * cellW + barW;
  const height = headH + L * cellH + 4;
  const dpr = window.devicePixelRatio || 1;
  const canvas = h("canvas", { class: "heatmap", width: Math.round(width * dpr), height: Math.round(height * dpr) });
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  g.fillStyle = "#11161d";
  g.fillRect(0, 0, width, height);
  const means = counts.map((row) => row.reduce((s, x) => s + x, 0) / Math.max(E, 1));
  const maxImb = Math.max(1, ...load.imbalance);
  g.font = "10px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace";
  g.textBaseline = "middle";
  // expert axis
  g.fillStyle = "#8b96a5";
  const every = Math.ceil(28 / cellW / 8) * 8 || 8;
  for (let e = 0; e < E; e += every) g.fillText(String(e), labelW + e * cellW, headH / 2);
  g.fillText("max/mean", labelW + E * cellW + 8, headH / 2);
  for (let l = 0; l < L; l++) {
    const y = headH + l * cellH;
    const mean = means[l];
    for (let e = 0; e < E; e++) {
      const c = counts[l][e];
      g.fillStyle = c === 0 ? "#000" : rgb(divergingColor(ratioToT(mean > 0 ? c / mean : 0)));
      g.fillRect(labelW + e * cellW, y, cellW - (cellW > 3 ? 1 : 0), cellH - 1);
    }
    if (cellH >= 10 || l % 4 === 0) {
      g.fillStyle = "#8b96a5";
      g.fillText(`L${moe[l] ?? l}`, 6, y + cellH / 2);
    }
    const imb = load.imbalance[l];
    const bx = labelW + E * cellW + 8;
    const bw = ((barW - 48) * (imb - 1)) / Math.max(maxImb - 1, 1e-9);
    g.fillStyle = imb > 2 ? "#e0703a" : "#4f7fd0";
    g.fillRect(bx, y + 1, Math.max(1, bw), cellH - 3);
    if (cellH >= 10) {
      g.fillStyle = "#c9d1dc";
      g.fillText(fmtNum(imb, 2), bx + Math.max(1, bw) + 4, y + cellH / 2);
    }
  }
  wrap.append(canvas, legend());
  canvas.addEventListener("mousemove", (ev) => {
    const r = canvas.getBoundingClientRect();
    const x = ev.clientX - r.left, y = ev.clientY - r.top;
    const l = Math.floor((y - headH) / cellH);
    const e = Math.floor((x - labelW) / cellW);
    if (l < 0 || l >= L || x < labelW) { tip.hidden = true; return; }
    const imb = load.imbalance[l];
    if (e >= E) {
      tip.textContent = `layer ${l} (model layer ${moe[l] ?? l}): imbalance max/mean ${fmtNum(imb, 3)}`;
    } else {
      const c = counts[l][e];
      tip.textContent = `layer ${l} (model layer ${moe[l] ?? l}) · expert ${e}: ${fmtInt(c)} tokens, ${fmtNum(means[l] > 0 ? c / means[l] : 0, 2)}× layer mean · layer imbalance ${fmtNum(imb, 2)}`;
    }
    tip.hidden = false;
    tip.style.left = `${ev.clientX + 14}px`;
    tip.style.top = `${ev.clientY + 14}px`;
  });
  canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
  return canvas;
}

function rgb([r, g, b]) { return `rgb(${r},${g},${b})`; }

function legend() {
  const c = h("canvas", { width: 240, height: 12, class: "legend-bar" });
  const g = c.getContext("2d");
  for (let x = 0; x < 240; x++) {
    g.fillStyle = rgb(divergingColor(x / 239));
    g.fillRect(x, 0, 1, 12);
  }
  return h("div", { class: "legend" },
    h("span", { class: "swatch", style: { background: "#000" } }), "0 tokens ",
    h("span", { class: "muted" }, "≤¼×"), c, h("span", { class: "muted" }, "≥4× layer mean"),
    h("span", { class: "muted" }, " (1× = grey: balanced)"));
}

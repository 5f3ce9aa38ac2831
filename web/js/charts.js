// Line plots for the health view, drawn by the vendored uPlot (web/vendor/uplot/, MIT; its README names
// the version). uPlot is loaded once, on first use, from this origin (a classic script: window.uPlot).
// Every plot drawn is registered in window.__healthPlots[name] = { labels, data, xLabels } (data is the
// uPlot instance's own `data`: x first, then one array per series), so tests read back what is drawn.

const THEME = { text: "#d5dce5", muted: "#8592a3", grid: "#26303c", font: "11px system-ui, sans-serif" };
let loading = null;

export function loadUPlot() {
  if (window.uPlot) return Promise.resolve(window.uPlot);
  if (!loading) {
    loading = new Promise((resolve, reject) => {
      const css = document.createElement("link");
      css.rel = "stylesheet";
      css.href = "vendor/uplot/uPlot.min.css";
      // before style.css, so the page's own rules (dark legend, fonts) win over uPlot's defaults
      document.head.insertBefore(css, document.querySelector('link[rel="stylesheet"]'));
      const script = document.createElement("script");
      script.src = "vendor/uplot/uPlot.iife.min.js";
      script.onload = () => (window.uPlot ? resolve(window.uPlot) : reject(new Error("uPlot did not load")));
      script.onerror = () => { loading = null; reject(new Error("could not load vendor/uplot/uPlot.iife.min.js")); };
      document.head.append(script);
    });
  }
  return loading;
}

export function registry() {
  if (!window.__healthPlots) window.__healthPlots = {};
  return window.__healthPlots;
}

// Tick labels with as many decimals as the tick spacing needs.
function decimalsFor(splits, scale = 1) {
  if (splits.length < 2) return 0;
  const step = Math.abs(splits[1] - splits[0]) * scale;
  for (let d = 0; d < 6; d++) {
    const shifted = step * 10 ** d;
    if (Math.abs(Math.round(shifted) - shifted) < 1e-6 * Math.max(1, shifted)) return d;
  }
  return 6;
}
export const tickFormats = {
  pct: (u, splits) => { const d = decimalsFor(splits, 100); return splits.map((v) => (v === null ? "" : `${(100 * v).toFixed(d)}%`)); },
  num: (u, splits) => { const d = decimalsFor(splits); return splits.map((v) => (v === null ? "" : v.toFixed(d))); },
};
export const valueFormats = {
  pct: (v) => (v === null || v === undefined ? "–" : `${(100 * v).toPrecision(3)}%`),
  num: (v) => (v === null || v === undefined ? "–" : Number(v).toFixed(3)),
};

function axis(extra) {
  return {
    stroke: THEME.muted, font: THEME.font, labelFont: THEME.font, labelSize: 16,
    grid: { stroke: THEME.grid, width: 1 }, ticks: { stroke: THEME.grid, width: 1, size: 4 }, ...extra,
  };
}

// Horizontal dashed lines at fixed y values (a check's warn/fail limits), drawn after the series.
function limitLines(lines) {
  return (u) => {
    const { ctx, bbox } = u;
    for (const line of lines) {
      const scale = u.scales[line.scale || "y"];
      if (line.value === null || line.value === undefined || scale.min === undefined) continue;
      if (line.value < scale.min || line.value > scale.max) continue;
      const y = Math.round(u.valToPos(line.value, line.scale || "y", true)) + 0.5;
      ctx.save();
      ctx.strokeStyle = line.color;
      ctx.lineWidth = 1 * devicePixelRatio;
      ctx.setLineDash([5 * devicePixelRatio, 4 * devicePixelRatio]);
      ctx.beginPath();
      ctx.moveTo(bbox.left, y);
      ctx.lineTo(bbox.left + bbox.width, y);
      ctx.stroke();
      ctx.fillStyle = line.color;
      ctx.font = `${10 * devicePixelRatio}px system-ui, sans-serif`;
      ctx.textAlign = "right";
      ctx.fillText(line.label, bbox.left + bbox.width - 4 * devicePixelRatio, y - 3 * devicePixelRatio);
      ctx.restore();
    }
  };
}

// A line plot in `host`. spec: { name, x: [...], xLabel, xKind: "time"|"number"|"index", xLabels (index:
// the label of each x), xRange (u, min, max) => [lo, hi], series: [{ label, values, color, dash, scale }], scales: { y: { label, format,
// range } , y2: {...} }, limits: [{ value, label, color, scale }], height }. Returns the uPlot instance.
export function linePlot(uPlot, host, spec) {
  const { name, x, xKind = "number", xLabels, series, limits = [], height = 230 } = spec;
  const scales = spec.scales || { y: { format: "num" } };
  const indexed = xKind === "index"; // x = 0..n-1, each named by xLabels[i] (weight versions)
  const xValue = xKind === "time" ? (u, v) => (v === null ? "–" : new Date(v * 1000).toLocaleString())
    : indexed ? (u, v) => (v === null ? "–" : String(xLabels[v] ?? v))
      : (u, v) => (v === null ? "–" : String(v));
  const wholeTicks = (u, splits) => splits.map((v) => (Number.isInteger(v) ? String(indexed ? xLabels[v] ?? "" : v) : ""));
  const opts = {
    width: Math.max(280, host.clientWidth || 600),
    height,
    scales: { x: { time: xKind === "time", ...(spec.xRange ? { range: spec.xRange } : indexed ? { range: (u, min, max) => [min - 0.5, max + 0.5] } : {}) } },
    series: [{ label: spec.xLabel, value: xValue }],
    axes: [axis({ label: spec.xLabel, space: xKind === "time" ? 90 : 60,
      ...(xKind === "time" ? {} : { values: wholeTicks, incrs: [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 1e4, 2e4, 5e4, 1e5, 1e6] }) })],
    cursor: { drag: { x: true, y: false }, points: { size: 6 } },
    legend: { live: true },
    hooks: limits.length ? { draw: [limitLines(limits)] } : {},
  };
  Object.entries(scales).forEach(([key, sc], i) => {
    opts.scales[key] = { auto: true, ...(sc.range ? { range: sc.range } : {}) };
    opts.axes.push(axis({ scale: key, label: sc.label, side: i === 0 ? 3 : 1, size: 64,
      values: tickFormats[sc.format || "num"], ...(sc.color ? { stroke: sc.color } : {}),
      ...(i > 0 ? { grid: { show: false } } : {}) }));
  });
  for (const s of series) {
    const fmt = valueFormats[(scales[s.scale || "y"] || {}).format || "num"];
    opts.series.push({
      label: s.label, scale: s.scale || "y", stroke: s.color, width: 1.5, dash: s.dash,
      spanGaps: false, value: (u, v) => fmt(v),
      points: { size: 5, fill: s.color, stroke: s.color },
    });
  }
  const data = [x, ...series.map((s) => s.values)];
  const u = new uPlot(opts, data, host);
  registry()[name] = { labels: series.map((s) => s.label), data: u.data, xLabels: xLabels || null };
  host.dataset.points = String(x.length);
  return u;
}

// Keep plots as wide as their boxes; returns a cleanup that stops watching and frees the plots.
export function fitWidths(plots) {
  const observer = new ResizeObserver((entries) => {
    for (const entry of entries) {
      const u = plots.find((p) => p.root.parentElement === entry.target);
      const width = Math.floor(entry.contentRect.width);
      if (u && width > 0 && Math.abs(width - u.width) > 1) u.setSize({ width, height: u.height });
    }
  });
  for (const u of plots) observer.observe(u.root.parentElement);
  return () => {
    observer.disconnect();
    for (const u of plots) u.destroy();
  };
}

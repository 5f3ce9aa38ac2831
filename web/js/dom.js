// DOM helpers. Every piece of data reaches the page as a Text node or a
// property (textContent, title, href built from encodeURIComponent): never as
// HTML. There is no innerHTML anywhere in web/.

export function h(tag, props, ...children) {
  const el = document.createElement(tag);
  if (props) {
    for (const [key, value] of Object.entries(props)) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "class") el.className = value;
      else if (key === "style") Object.assign(el.style, value);
      else if (key === "dataset") Object.assign(el.dataset, value);
      else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
      else if (key === "text") el.textContent = String(value);
      else if (key in el && typeof value !== "string") el[key] = value;
      else el.setAttribute(key, String(value));
    }
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

// The flag bits of replay_format.Flag (replay_format/rows.md, "Flags"), in bit order; FLAGS lists
// their names. tests/test_web_static.py fails when this table and Flag drift apart.
export const FLAG_BITS = { ZERO: 1, DUPLICATE: 2, OUT_OF_RANGE: 4, STALE: 8, CONFLICT: 16, GAP: 32, PADDING: 64 };
export const FLAGS = Object.keys(FLAG_BITS);
export const FLAG_SHORT = { ZERO: "zero", DUPLICATE: "dup", OUT_OF_RANGE: "oor", STALE: "stale", CONFLICT: "conflict", GAP: "gap", PADDING: "pad" };
export const FLAG_COLORS = {
  ZERO: "#f2c94c", DUPLICATE: "#f2994a", OUT_OF_RANGE: "#ff5c5c", STALE: "#c17cf0",
  CONFLICT: "#ff6fb5", GAP: "#9aa7b8", PADDING: "#56ccf2",
};
export const FLAG_HELP = {
  ZERO: "every id of the row is 0: a never-written, zero-initialised buffer row",
  DUPLICATE: "one layer's top-k repeats an id",
  OUT_OF_RANGE: "an id >= num_experts (e.g. padding -1 cast to 255)",
  STALE: "not written in this step (write stamp), or a copy of a row recorded for another token",
  CONFLICT: "the same position arrived twice with different ids",
  GAP: "position never received",
  PADDING: "writer padding row: dropped at ingest, counted, never served",
};

export function flagNames(bits) {
  return FLAGS.filter((name) => bits & FLAG_BITS[name]);
}

export function flagChip(name, count, onclick) {
  const chip = h("span", { class: "chip" + (onclick ? " clickable" : ""), title: FLAG_HELP[name] || name, onclick },
    h("span", { class: "dot", style: { background: FLAG_COLORS[name] || "#888" } }),
    name, count === undefined ? null : h("b", null, fmtInt(count)));
  return chip;
}

export function flagChips(flagged, onclick) {
  const names = FLAGS.filter((n) => flagged && flagged[n] > 0);
  for (const n of Object.keys(flagged || {})) if (!FLAGS.includes(n) && flagged[n] > 0) names.push(n);
  if (!names.length) return h("span", { class: "ok" }, "clean");
  return h("span", { class: "chips" }, names.map((n) => flagChip(n, flagged[n], onclick ? () => onclick(n) : undefined)));
}

const intFmt = new Intl.NumberFormat("en-US");
export function fmtInt(n) {
  return n === null || n === undefined ? "–" : intFmt.format(n);
}
export function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}
export function fmtPct(x, digits = 2) {
  return x === null || x === undefined || Number.isNaN(x) ? "–" : `${(100 * x).toFixed(digits)}%`;
}
export function fmtNum(x, digits = 3) {
  return x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(digits);
}
export function fmtTime(epochSeconds) {
  if (!epochSeconds) return "–";
  const d = new Date(epochSeconds * 1000);
  const pad = (v) => String(v).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}`;
}

// Categorical colours for expert ids: golden-angle hues, three lightness bands.
export function expertPalette(numExperts) {
  const size = Math.max(numExperts, 256);
  const out = new Array(size);
  for (let id = 0; id < size; id++) {
    const hue = (id * 137.508) % 360;
    const light = [58, 44, 70][id % 3];
    const sat = [70, 62, 55][(id >> 2) % 3];
    out[id] = hslToRgb(hue, sat, light);
  }
  return out;
}

export function hslToRgb(hue, sat, light) {
  const s = sat / 100, l = light / 100;
  const k = (n) => (n + hue / 30) % 12;
  const a = s * Math.min(l, 1 - l);
  const f = (n) => l - a * Math.max(-1, Math.min(k(n) - 3, Math.min(9 - k(n), 1)));
  return [Math.round(255 * f(0)), Math.round(255 * f(8)), Math.round(255 * f(4))];
}

export function rgbCss([r, g, b]) {
  return `rgb(${r},${g},${b})`;
}

// RGBA packed for a little-endian Uint32Array over ImageData.
export function packRGB([r, g, b], a = 255) {
  return ((a << 24) | (b << 16) | (g << 8) | r) >>> 0;
}

export function link(hash, ...children) {
  return h("a", { href: hash }, ...children);
}

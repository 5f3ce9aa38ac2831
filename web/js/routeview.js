// Token x layer view of one route on a canvas: rows are token positions (scrolling down),
// columns are MoE layers, each layer K slots wide (one per top-k id). Only the rows in view
// are drawn, from the chunks in memory; chunks in view are fetched as the view scrolls.
import { h, expertPalette, packRGB, flagNames, FLAG_COLORS } from "./dom.js";

const HEAD = 22;       // layer axis band (CSS px)
const POS_W = 58;      // position labels
const FLAG_W = 10;     // flag marker strip
const LEFT = POS_W + FLAG_W + 4;
export const ROW_HEIGHTS = [1, 2, 3, 4, 6, 8, 12, 16];

const BG = packRGB([17, 22, 29]);
const MISSING = packRGB([40, 46, 56]);
const GAP_ROW = packRGB([70, 76, 88]);
const OUT_OF_RANGE = packRGB([255, 255, 255]);
const AGREE_DIM = 0.22;
const DIFF = packRGB([255, 64, 64]);
const UNKNOWN = packRGB([60, 60, 70]);

export class RouteView {
  constructor(host, data, { moeLayers, rowHeight = 3, onSelect, onHover } = {}) {
    this.data = data;
    this.moe = moeLayers || [...Array(data.L).keys()];
    this.rowH = rowHeight;
    this.mode = "expert";
    this.selected = -1;
    this.onSelect = onSelect;
    this.onHover = onHover;
    const pal = expertPalette(data.E);
    this.palette = new Uint32Array(65536).fill(OUT_OF_RANGE);
    this.paletteDim = new Uint32Array(65536).fill(OUT_OF_RANGE);
    for (let i = 0; i < data.E; i++) {
      this.palette[i] = packRGB(pal[i]);
      this.paletteDim[i] = packRGB(pal[i].map((v, j) => Math.round(v * AGREE_DIM + [17, 22, 29][j] * (1 - AGREE_DIM))));
    }
    this.canvas = h("canvas", { class: "route-canvas" });
    this.spacer = h("div", { class: "route-spacer" });
    this.scroller = h("div", { class: "route-scroll", tabIndex: 0 }, this.spacer);
    this.overview = h("canvas", { class: "route-overview", title: "whole request: flagged rows and the part in view; click to jump" });
    this.stage = h("div", { class: "route-stage" }, this.canvas, this.scroller);
    this.el = h("div", { class: "route-view" }, this.stage, this.overview);
    host.append(this.el);
    this.g = this.canvas.getContext("2d", { alpha: false });
    this.og = this.overview.getContext("2d");
    this.drawStats = { frames: 0, totalMs: 0, maxMs: 0 };
    this.pendingFrame = 0;
    this.scroller.addEventListener("scroll", () => this.schedule(), { passive: true });
    this.scroller.addEventListener("mousemove", (ev) => this.hover(ev));
    this.scroller.addEventListener("mouseleave", () => this.onHover && this.onHover(null));
    this.scroller.addEventListener("click", (ev) => {
      const hit = this.hit(ev);
      if (hit && hit.row >= 0) this.select(hit.row, false);
    });
    this.overview.addEventListener("click", (ev) => {
      const r = this.overview.getBoundingClientRect();
      const row = Math.floor(((ev.clientY - r.top) / r.height) * this.data.n);
      this.scrollToRow(row, "center");
    });
    this.unlisten = data.onChange(() => this.schedule());
    this.resizeObserver = new ResizeObserver(() => this.layout());
    this.resizeObserver.observe(this.stage);
    this.layout();
  }

  destroy() {
    this.unlisten();
    this.resizeObserver.disconnect();
    cancelAnimationFrame(this.pendingFrame);
  }

  layout() {
    const w = this.scroller.clientWidth || this.stage.clientWidth;
    const hgt = this.scroller.clientHeight || this.stage.clientHeight;
    const { L, K } = this.data;
    // slot width: fit all layers if possible, 1..6 px per id
    const fit = Math.floor((w - LEFT - 8) / L) - 1;
    this.slotW = Math.max(1, Math.min(6, Math.floor(fit / K)));
    this.layerW = this.slotW * K + 1;
    this.totalW = LEFT + L * this.layerW + 8;
    this.setRowHeight(this.rowH, false);
    const dpr = window.devicePixelRatio || 1;
    this.dpr = dpr;
    this.viewW = w;
    this.viewH = hgt;
    this.canvas.width = Math.max(1, Math.round(w * dpr));
    this.canvas.height = Math.max(1, Math.round(hgt * dpr));
    this.canvas.style.width = `${w}px`;
    this.canvas.style.height = `${hgt}px`;
    const oh = this.overview.clientHeight || hgt;
    this.overview.width = Math.round(14 * dpr);
    this.overview.height = Math.max(1, Math.round(oh * dpr));
    this.image = null;
    this.schedule();
  }

  setRowHeight(px, keep = true) {
    const anchor = keep ? this.firstRow() + Math.floor(this.visibleRows() / 2) : 0;
    this.rowH = px;
    // browsers cap element heights (~16M px): shrink rows for very long routes
    while (this.rowH > 1 && this.data.n * this.rowH > 15e6) this.rowH--;
    this.spacer.style.height = `${HEAD + this.data.n * this.rowH + 4}px`;
    this.spacer.style.width = `${this.totalW}px`;
    if (keep) this.scrollToRow(anchor, "center");
    this.schedule();
  }

  setMode(mode) { this.mode = mode; this.schedule(); }

  firstRow() { return Math.floor(this.scroller.scrollTop / this.rowH); }
  visibleRows() { return Math.ceil((this.viewH - HEAD) / this.rowH) + 1; }

  scrollToRow(row, where = "center") {
    const y = row * this.rowH;
    const view = this.viewH - HEAD;
    if (where === "center") this.scroller.scrollTop = Math.max(0, y - view / 2);
    else if (where === "nearest") {
      if (y < this.scroller.scrollTop) this.scroller.scrollTop = y;
      else if (y + this.rowH > this.scroller.scrollTop + view) this.scroller.scrollTop = y + this.rowH - view;
    }
    this.schedule();
  }

  select(row, scroll = true) {
    if (row < 0 || row >= this.data.n) return;
    this.selected = row;
    if (scroll) this.scrollToRow(row, "center");
    this.schedule();
    if (this.onSelect) this.onSelect(row);
  }

  hit(ev) {
    const r = this.scroller.getBoundingClientRect();
    const x = ev.clientX - r.left + this.scroller.scrollLeft;
    const y = ev.clientY - r.top;
    if (y < HEAD) return null;
    const row = Math.floor((y - HEAD + this.scroller.scrollTop) / this.rowH);
    if (row < 0 || row >= this.data.n) return null;
    const cx = x - LEFT;
    const layer = cx >= 0 ? Math.floor(cx / this.layerW) : -1;
    const slot = layer >= 0 ? Math.min(this.data.K - 1, Math.floor((cx - layer * this.layerW) / this.slotW)) : -1;
    return { row, layer: layer < this.data.L ? layer : -1, slot };
  }

  hover(ev) {
    if (!this.onHover) return;
    const hit = this.hit(ev);
    this.onHover(hit, ev);
  }

  schedule() {
    if (this.pendingFrame) return;
    this.pendingFrame = requestAnimationFrame(() => {
      this.pendingFrame = 0;
      this.draw();
    });
  }

  // true when every row in view has its ids in memory
  draw() {
    const t0 = performance.now();
    const d = this.data;
    const dpr = this.dpr;
    const W = this.canvas.width, H = this.canvas.height;
    if (!this.image || this.image.width !== W || this.image.height !== H) {
      this.image = this.g.createImageData(W, H);
      this.u32 = new Uint32Array(this.image.data.buffer);
    }
    const px = this.u32;
    px.fill(BG);
    const top = this.scroller.scrollTop, left = this.scroller.scrollLeft;
    const first = Math.max(0, Math.floor(top / this.rowH));
    const last = Math.min(d.n, Math.ceil((top + this.viewH - HEAD) / this.rowH));
    const headPx = Math.round(HEAD * dpr);
    const leftPx = Math.round(LEFT * dpr);
    const gapPx = this.rowH >= 4 ? 1 : 0;
    const { L, K, width } = d;
    const agree = this.mode === "agree" && d.compareId;
    let complete = true;
    // chunks in view (and one either side) are fetched
    const c0 = d.chunkOf(first), c1 = d.chunkOf(Math.max(first, last - 1));
    for (let c = Math.max(0, c0 - 1); c <= Math.min(d.nChunks - 1, c1 + 1); c++) {
      if (c >= c0 && c <= c1 && !d.ids.has(c)) complete = false;
      d.ensure(c);
      if (agree) {
        d.ensureMismatch(c);
        if (c >= c0 && c <= c1 && !d.mismatch.has(c)) complete = false;
      }
    }
    // x extent of each slot in device pixels (clipped)
    const xs = new Int32Array(L * K), xe = new Int32Array(L * K);
    for (let l = 0; l < L; l++) {
      for (let k = 0; k < K; k++) {
        const x = LEFT + l * this.layerW + k * this.slotW - left;
        xs[l * K + k] = Math.max(leftPx, Math.round(x * dpr));
        xe[l * K + k] = Math.min(W, Math.round((x + this.slotW) * dpr));
      }
    }
    for (let r = first; r < last; r++) {
      const y0 = HEAD + r * this.rowH - top;
      const Y0 = Math.max(headPx, Math.round(y0 * dpr));
      const Y1 = Math.min(H, Math.round((y0 + this.rowH) * dpr) - gapPx);
      if (Y1 <= Y0) continue;
      const c = d.chunkOf(r);
      const ids = d.peek(c);
      const line = Y0 * W;
      if (!ids) {
        px.fill(MISSING, line + leftPx, line + Math.min(W, Math.round((this.totalW - left) * dpr)));
      } else if (d.flags[r] & 32) { // GAP: no data
        px.fill(GAP_ROW, line + leftPx, line + Math.min(W, Math.round((LEFT + L * this.layerW - left) * dpr)));
      } else {
        const off = (r - c * d.chunkRows) * width;
        const mm = agree ? d.peekMismatch(c) : null;
        const mOff = (r - c * d.chunkRows) * L;
        for (let l = 0; l < L; l++) {
          let pal = this.palette, solid = 0;
          if (agree) {
            const m = mm ? mm[mOff + l] : 255;
            if (m === 1) solid = DIFF;
            else if (m === 0) pal = this.paletteDim;
            else solid = UNKNOWN;
          }
          for (let k = 0; k < K; k++) {
            const i = l * K + k;
            if (xe[i] <= xs[i]) continue;
            px.fill(solid || pal[ids[off + i]], line + xs[i], line + xe[i]);
          }
        }
      }
      for (let y = Y0 + 1; y < Y1; y++) px.copyWithin(y * W + leftPx, line + leftPx, line + W);
    }
    this.g.putImageData(this.image, 0, 0);
    this.overlay(first, last, top, left);
    this.drawOverview(first, last);
    const ms = performance.now() - t0;
    this.drawStats.frames++;
    this.drawStats.totalMs += ms;
    this.drawStats.maxMs = Math.max(this.drawStats.maxMs, ms);
    this.lastComplete = complete;
    if (complete && this.onComplete) this.onComplete();
    return complete;
  }

  overlay(first, last, top, left) {
    const g = this.g, dpr = this.dpr, d = this.data;
    g.save();
    g.scale(dpr, dpr);
    // header: layer numbers
    g.fillStyle = "#161c24";
    g.fillRect(0, 0, this.viewW, HEAD);
    g.font = "10px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace";
    g.textBaseline = "middle";
    g.fillStyle = "#8b96a5";
    g.fillText("pos", 6, HEAD / 2);
    g.fillText("⚑", POS_W + 1, HEAD / 2);
    const labelEvery = Math.max(1, Math.ceil(22 / this.layerW));
    g.save();
    g.beginPath();
    g.rect(LEFT, 0, this.viewW - LEFT, HEAD);
    g.clip();
    for (let l = 0; l < d.L; l += labelEvery) {
      const x = LEFT + l * this.layerW - left;
      g.fillText(String(this.moe[l] ?? l), x + 1, HEAD / 2);
    }
    g.restore();
    // left gutter: positions and flag markers
    g.fillStyle = "#11161d";
    g.fillRect(0, HEAD, LEFT, this.viewH - HEAD);
    const labelRows = Math.max(1, niceStep(Math.ceil(14 / this.rowH)));
    g.fillStyle = "#8b96a5";
    g.textAlign = "right";
    for (let r = Math.ceil(first / labelRows) * labelRows; r < last; r += labelRows) {
      const y = HEAD + r * this.rowH - top + Math.min(this.rowH, 12) / 2;
      if (y > HEAD + 5) g.fillText(String(r), POS_W - 4, y);
    }
    g.textAlign = "left";
    const markH = Math.max(2, this.rowH);
    for (let r = first; r < last; r++) {
      const f = d.flags[r];
      if (!f) continue;
      const names = flagNames(f);
      const y = HEAD + r * this.rowH - top;
      const w = FLAG_W / names.length;
      names.forEach((name, i) => {
        g.fillStyle = FLAG_COLORS[name];
        g.fillRect(POS_W + i * w, y - (markH - this.rowH) / 2, w, markH);
      });
      // a tick at the row's right end too, so a flagged row is visible inside the grid
      g.fillStyle = FLAG_COLORS[names[0]];
      g.fillRect(LEFT + d.L * this.layerW - left, y - (markH - this.rowH) / 2, 6, markH);
    }
    // selection
    if (this.selected >= first && this.selected < last) {
      const y = HEAD + this.selected * this.rowH - top;
      g.strokeStyle = "#ffffff";
      g.lineWidth = 1.5;
      g.strokeRect(1, y - 1.5, LEFT + d.L * this.layerW - left + 8, this.rowH + 3);
      g.fillStyle = "#ffffff";
      g.textAlign = "right";
      g.fillRect(0, y - 1, POS_W - 1, Math.max(this.rowH, 12) + 2);
      g.fillStyle = "#11161d";
      g.fillText(String(this.selected), POS_W - 4, y + Math.max(this.rowH, 12) / 2);
      g.textAlign = "left";
    }
    g.restore();
  }

  drawOverview(first, last) {
    const g = this.og, d = this.data;
    const W = this.overview.width, H = this.overview.height;
    g.fillStyle = "#11161d";
    g.fillRect(0, 0, W, H);
    if (!d.n) return;
    const scale = H / d.n;
    g.fillStyle = "#2a313c";
    for (let c = 0; c < d.nChunks; c++) {
      if (d.known[c]) continue;
      const [s, e] = d.range(c);
      g.fillRect(0, s * scale, W, Math.max(1, (e - s) * scale));
    }
    for (const r of d.flagged()) {
      g.fillStyle = FLAG_COLORS[flagNames(d.flags[r])[0]];
      g.fillRect(0, Math.floor(r * scale), W, Math.max(2, Math.ceil(scale)));
    }
    g.strokeStyle = "#5fb3ff";
    g.lineWidth = 2;
    g.strokeRect(1, first * scale, W - 2, Math.max(3, (last - first) * scale));
    if (this.selected >= 0) {
      g.fillStyle = "#ffffff";
      g.fillRect(0, this.selected * scale - 1, W, 2);
    }
  }
}

function niceStep(n) {
  for (const s of [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]) if (s >= n) return s;
  return 10000;
}

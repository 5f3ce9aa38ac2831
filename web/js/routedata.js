// A request's route, fetched in chunks of rows as route answers (replay_format/route.md: Arrow IPC,
// one fetch carries ids, flags and token ids), kept zero-copy, with an LRU bound on ids in memory.
// Flags and token ids of every chunk seen are kept (2 + 4 bytes per row) so "next flagged row" and
// the overview need no refetch.
import { getArrow, getJSON, paths } from "./api.js";

// An unknown token id: null on the wire, NO_TOKEN in memory (replay_format.NO_TOKEN), as in Python.
export const NO_TOKEN = -1;
// What this page reads (replay_format/route.py FORMAT and VERSION.major; a test ties them).
export const ROUTE_FORMAT = "routing-replay.route";
export const ROUTE_MAJOR = 1;

// The route answer's metadata checked as replay_format.route.RouteMeta.from_metadata does:
// another format, or a newer major version, is an error that says so.
export function checkRouteAnswer(metadata) {
  const md = metadata || {};
  if (md.format !== undefined && md.format !== ROUTE_FORMAT) {
    throw new Error(`route answer: format ${md.format}, expected ${ROUTE_FORMAT}`);
  }
  if (md.format_version !== undefined && !(Number(md.format_version.split(".")[0]) <= ROUTE_MAJOR)) {
    throw new Error(`route answer: format_version ${md.format_version} is newer than this page reads ` +
      `(${ROUTE_MAJOR}.x); reload the page`);
  }
  return md;
}
const CHUNK_BYTES = 1.5 * 2 ** 20;
const CACHE_BYTES = 256 * 2 ** 20;

export class RouteData {
  constructor({ run, request, rows, layers, topK, numExperts }) {
    this.run = run;
    this.request = request;
    this.n = rows;
    this.L = layers;
    this.K = topK;
    this.E = numExperts;
    this.width = layers * topK;
    const bpe = numExperts > 256 ? 2 : 1;
    let cr = 256;
    while (cr * 2 * this.width * bpe <= CHUNK_BYTES && cr < 16384) cr *= 2;
    this.chunkRows = cr;
    this.nChunks = Math.ceil(rows / cr);
    this.flags = new Uint16Array(rows);
    this.tokens = new Int32Array(rows).fill(NO_TOKEN);
    this.known = new Uint8Array(this.nChunks); // flags/tokens of chunk i are here
    this.ids = new Map(); // chunk -> Uint8Array|Uint16Array (rows*L*K), LRU by insertion order
    this.maxCached = Math.max(8, Math.floor(CACHE_BYTES / (cr * this.width * bpe)));
    this.pending = new Map();
    this.listeners = new Set();
    this.mismatch = new Map(); // compare chunk -> Uint8Array(rows*L): 0 agree, 1 differ, 255 unknown
    this.mismatchPending = new Map();
    this.compareId = null;
    this.errors = [];
    this.fetches = 0;
    this.flaggedCache = null;
  }

  onChange(fn) { this.listeners.add(fn); return () => this.listeners.delete(fn); }
  emit(what) { for (const fn of this.listeners) fn(what); }

  chunkOf(row) { return Math.floor(row / this.chunkRows); }
  range(idx) { return [idx * this.chunkRows, Math.min(this.n, (idx + 1) * this.chunkRows)]; }

  peek(idx) {
    const v = this.ids.get(idx);
    if (v) { this.ids.delete(idx); this.ids.set(idx, v); }
    return v;
  }

  ensure(idx) {
    if (idx < 0 || idx >= this.nChunks || this.ids.has(idx) || this.pending.has(idx)) return this.pending.get(idx);
    const p = this.load(idx).finally(() => this.pending.delete(idx));
    this.pending.set(idx, p);
    p.catch(() => {});
    return p;
  }

  async load(idx) {
    const [start, end] = this.range(idx);
    this.fetches++;
    let table;
    try {
      table = await getArrow(paths.routes(this.run, this.request, start, end));
      checkRouteAnswer(table.schema.metadata);
    } catch (err) {
      this.errors.push(err);
      this.emit({ error: err });
      throw err;
    }
    let ids = null;
    let at = start;
    for (const batch of table.batches) {
      const { position, flags, token_id: tok, experts } = batch.columns;
      const n = batch.length;
      const base = position.values[0];
      if (n && base !== at) throw new Error(`route rows start at ${base}, expected ${at}`);
      this.flags.set(flags.values.subarray(0, n), at);
      for (let i = 0; i < n; i++) this.tokens[at + i] = tok.get(i) ?? NO_TOKEN;
      const values = experts.values.subarray(0, n * this.width);
      if (table.batches.length === 1) ids = values;
      else {
        if (!ids) ids = new values.constructor((end - start) * this.width);
        ids.set(values, (at - start) * this.width);
      }
      at += n;
    }
    if (!ids) ids = new Uint8Array(0);
    this.known[idx] = 1;
    this.flaggedCache = null;
    this.ids.set(idx, ids);
    while (this.ids.size > this.maxCached) this.ids.delete(this.ids.keys().next().value);
    this.emit({ chunk: idx });
    return ids;
  }

  knownRows() {
    let n = 0;
    for (let i = 0; i < this.nChunks; i++) if (this.known[i]) n += this.range(i)[1] - this.range(i)[0];
    return n;
  }

  // Load every chunk once (in order, one at a time) so all flags are known.
  async scan(shouldStop) {
    for (let i = 0; i < this.nChunks; i++) {
      if (shouldStop && shouldStop()) return;
      if (!this.known[i]) {
        try { await (this.pending.get(i) || this.ensure(i)); } catch (_) { /* reported via errors */ }
      }
    }
    this.emit({ scanned: true });
  }

  flagged() { // positions with any flag, among known chunks (sorted)
    if (this.flaggedCache) return this.flaggedCache;
    const out = [];
    for (let i = 0; i < this.n; i++) if (this.flags[i]) out.push(i);
    this.flaggedCache = out;
    return out;
  }

  // The next (dir=1) or previous (dir=-1) flagged row after `from`, loading chunks on the way.
  async nextFlagged(from, dir = 1, wrap = true) {
    const step = async (lo, hi) => {
      if (dir > 0) {
        for (let c = this.chunkOf(Math.max(lo, 0)); c < this.nChunks; c++) {
          if (!this.known[c]) await (this.pending.get(c) || this.ensure(c));
          const [s, e] = this.range(c);
          for (let r = Math.max(s, lo); r < Math.min(e, hi); r++) if (this.flags[r]) return r;
          if (e >= hi) break;
        }
      } else {
        for (let c = this.chunkOf(Math.min(hi, this.n) - 1); c >= 0; c--) {
          if (!this.known[c]) await (this.pending.get(c) || this.ensure(c));
          const [s, e] = this.range(c);
          for (let r = Math.min(e, hi) - 1; r >= Math.max(s, lo); r--) if (this.flags[r]) return r;
          if (s <= lo) break;
        }
      }
      return -1;
    };
    if (this.n === 0) return { row: -1, wrapped: false };
    let row = dir > 0 ? await step(from + 1, this.n) : await step(0, Math.max(from, 0));
    if (row >= 0 || !wrap) return { row, wrapped: false };
    row = dir > 0 ? await step(0, Math.min(from + 1, this.n)) : await step(Math.max(from, 0), this.n);
    return { row, wrapped: row >= 0 };
  }

  // ---- comparison (agreement per token and layer) ----
  setCompare(id) {
    if (this.compareId === id) return;
    this.compareId = id;
    this.mismatch.clear();
    this.mismatchPending.clear();
    this.emit({ compare: id });
  }

  peekMismatch(idx) { return this.mismatch.get(idx); }

  ensureMismatch(idx) {
    if (!this.compareId || this.mismatch.has(idx) || this.mismatchPending.has(idx)) return;
    const id = this.compareId;
    const [start, end] = this.range(idx);
    const p = getJSON(paths.compareRequest(this.run, id, this.request, start, end)).then((doc) => {
      if (this.compareId !== id) return;
      const out = new Uint8Array((end - start) * this.L).fill(255);
      const positions = doc.positions || [];
      const mm = doc.mismatch || [];
      for (let i = 0; i < positions.length; i++) {
        const r = positions[i] - start;
        if (r < 0 || r >= end - start || !mm[i]) continue;
        for (let l = 0; l < this.L; l++) out[r * this.L + l] = mm[i][l] ? 1 : 0;
      }
      this.mismatch.set(idx, out);
      this.emit({ mismatch: idx });
    }).catch((err) => {
      this.mismatch.set(idx, new Uint8Array((end - start) * this.L).fill(255));
      this.errors.push(err);
      this.emit({ error: err });
    }).finally(() => this.mismatchPending.delete(idx));
    this.mismatchPending.set(idx, p);
  }

  row(r) { // ids of row r as [L][K] arrays, or null if its chunk is not in memory
    const idx = this.chunkOf(r);
    const ids = this.peek(idx);
    if (!ids) return null;
    const off = (r - idx * this.chunkRows) * this.width;
    const out = [];
    for (let l = 0; l < this.L; l++) out.push(Array.from(ids.subarray(off + l * this.K, off + (l + 1) * this.K)));
    return out;
  }
}

// A small reader for Apache Arrow IPC *streams* (the service's route answers).
//
// It reads what the service writes: a Schema message, dictionary batches and
// record batches, uncompressed, little-endian, with columns of fixed-width
// integers, utf8, dictionary-encoded utf8 and fixed_size_list of integers.
// Column data are zero-copy typed-array views into the fetched ArrayBuffer.
// Anything else (compressed bodies, big-endian, other types) throws, naming it.
// Format: https://arrow.apache.org/docs/format/Columnar.html (IPC streaming format).

const MESSAGE_SCHEMA = 1;
const MESSAGE_DICTIONARY = 2;
const MESSAGE_RECORD_BATCH = 3;

// Type union tags (Schema.fbs)
const T_NULL = 1, T_INT = 2, T_FLOAT = 3, T_BINARY = 4, T_UTF8 = 5, T_BOOL = 6,
  T_LIST = 12, T_STRUCT = 13, T_FIXED_LIST = 16;

// ---- a minimal FlatBuffers table reader ----------------------------------
class Table {
  constructor(view, pos) {
    this.view = view;
    this.pos = pos;
    this.vtable = pos - view.getInt32(pos, true);
    this.vsize = view.getUint16(this.vtable, true);
  }
  static root(view, pos) {
    return new Table(view, pos + view.getUint32(pos, true));
  }
  offset(field) {
    const at = 4 + 2 * field;
    if (at >= this.vsize) return 0;
    return this.view.getUint16(this.vtable + at, true);
  }
  int8(field, dflt = 0) { const o = this.offset(field); return o ? this.view.getInt8(this.pos + o) : dflt; }
  uint8(field, dflt = 0) { const o = this.offset(field); return o ? this.view.getUint8(this.pos + o) : dflt; }
  int16(field, dflt = 0) { const o = this.offset(field); return o ? this.view.getInt16(this.pos + o, true) : dflt; }
  int32(field, dflt = 0) { const o = this.offset(field); return o ? this.view.getInt32(this.pos + o, true) : dflt; }
  bool(field) { return this.uint8(field, 0) !== 0; }
  int64(field, dflt = 0) {
    const o = this.offset(field);
    return o ? readInt64(this.view, this.pos + o) : dflt;
  }
  indirect(field) {
    const o = this.offset(field);
    if (!o) return 0;
    const at = this.pos + o;
    return at + this.view.getUint32(at, true);
  }
  table(field) {
    const at = this.indirect(field);
    return at ? new Table(this.view, at) : null;
  }
  string(field) {
    const at = this.indirect(field);
    if (!at) return null;
    const len = this.view.getUint32(at, true);
    return new TextDecoder().decode(new Uint8Array(this.view.buffer, this.view.byteOffset + at + 4, len));
  }
  vector(field) { // -> {start, length} or null
    const at = this.indirect(field);
    if (!at) return null;
    return { start: at + 4, length: this.view.getUint32(at, true) };
  }
  tables(field) {
    const v = this.vector(field);
    if (!v) return [];
    const out = [];
    for (let i = 0; i < v.length; i++) {
      const at = v.start + 4 * i;
      out.push(new Table(this.view, at + this.view.getUint32(at, true)));
    }
    return out;
  }
}

function readInt64(view, at) {
  const lo = view.getUint32(at, true);
  const hi = view.getInt32(at + 4, true);
  return hi * 4294967296 + lo;
}

// ---- schema ---------------------------------------------------------------
function readField(t) {
  const field = {
    name: t.string(0) || "",
    nullable: t.bool(1),
    typeTag: t.uint8(2),
    children: t.tables(5).map(readField),
    dictionary: null,
  };
  const type = t.table(3);
  if (field.typeTag === T_INT) {
    field.bitWidth = type.int32(0);
    field.signed = type.bool(1);
  } else if (field.typeTag === T_FLOAT) {
    field.precision = type.int16(0);
  } else if (field.typeTag === T_FIXED_LIST) {
    field.listSize = type.int32(0);
  }
  const dict = t.table(4);
  if (dict) {
    const index = dict.table(1);
    field.dictionary = {
      id: dict.int64(0),
      indexBitWidth: index ? index.int32(0) : 32,
      indexSigned: index ? index.bool(1) : true,
    };
  }
  return field;
}

function readMetadata(t, field) {
  const out = {};
  for (const kv of t.tables(field)) out[kv.string(0)] = kv.string(1);
  return out;
}

// ---- record batches ---------------------------------------------------------
function intArray(buffer, byteOffset, bitWidth, signed, length) {
  const ctor = {
    "8true": Int8Array, "8false": Uint8Array, "16true": Int16Array, "16false": Uint16Array,
    "32true": Int32Array, "32false": Uint32Array, "64true": BigInt64Array, "64false": BigUint64Array,
  }[`${bitWidth}${signed}`];
  if (!ctor) throw new Error(`arrow: int${bitWidth} is not supported`);
  if (byteOffset % ctor.BYTES_PER_ELEMENT) { // copy when unaligned (never for Arrow-written streams)
    const bytes = new Uint8Array(buffer, byteOffset, length * ctor.BYTES_PER_ELEMENT).slice();
    return new ctor(bytes.buffer);
  }
  return new ctor(buffer, byteOffset, length);
}

function validityAt(bitmap, i) {
  return bitmap === null || (bitmap[i >> 3] >> (i & 7)) & 1;
}

class Reader {
  constructor(batch, body, buffer, bodyOffset) {
    this.nodes = batch.nodes;
    this.buffers = batch.buffers;
    this.buffer = buffer;
    this.bodyOffset = bodyOffset;
    this.nodeIndex = 0;
    this.bufferIndex = 0;
  }
  node() { return this.nodes[this.nodeIndex++]; }
  buf() {
    const b = this.buffers[this.bufferIndex++];
    return { offset: this.bodyOffset + b.offset, length: b.length };
  }
  bitmap(node) {
    const b = this.buf();
    if (node.nullCount === 0 || b.length === 0) return null;
    return new Uint8Array(this.buffer, b.offset, b.length);
  }
}

function readColumn(field, r, dictionaries) {
  const node = r.node();
  const length = node.length;
  if (field.dictionary) {
    const validity = r.bitmap(node);
    const b = r.buf();
    const indices = intArray(r.buffer, b.offset, field.dictionary.indexBitWidth, field.dictionary.indexSigned, length);
    const dict = dictionaries.get(field.dictionary.id);
    return { kind: "dictionary", length, validity, indices, dictionary: dict,
      get(i) { return validityAt(validity, i) ? dict.get(indices[i]) : null; } };
  }
  switch (field.typeTag) {
    case T_NULL:
      return { kind: "null", length, get: () => null };
    case T_INT: {
      const validity = r.bitmap(node);
      const b = r.buf();
      const values = intArray(r.buffer, b.offset, field.bitWidth, field.signed, length);
      return { kind: "int", length, validity, values,
        get(i) { return validityAt(validity, i) ? values[i] : null; } };
    }
    case T_UTF8:
    case T_BINARY: {
      const validity = r.bitmap(node);
      const ob = r.buf();
      const db = r.buf();
      const offsets = intArray(r.buffer, ob.offset, 32, true, length + 1);
      const data = new Uint8Array(r.buffer, db.offset, db.length);
      const dec = new TextDecoder();
      return { kind: "utf8", length, validity,
        get(i) { return validityAt(validity, i) ? dec.decode(data.subarray(offsets[i], offsets[i + 1])) : null; } };
    }
    case T_FIXED_LIST: {
      const validity = r.bitmap(node);
      const child = readColumn(field.children[0], r, dictionaries);
      const size = field.listSize;
      return { kind: "fixed_size_list", length, validity, size, child, values: child.values,
        get(i) { return validityAt(validity, i) ? Array.from(child.values.subarray(i * size, (i + 1) * size)) : null; } };
    }
    case T_STRUCT: {
      const validity = r.bitmap(node);
      const children = field.children.map((f) => readColumn(f, r, dictionaries));
      return { kind: "struct", length, validity, children, get: () => null };
    }
    default:
      throw new Error(`arrow: column ${JSON.stringify(field.name)} has a type (tag ${field.typeTag}) this reader does not read`);
  }
}

function readRecordBatch(t) {
  const nodes = [];
  const nv = t.vector(1);
  for (let i = 0; nv && i < nv.length; i++) {
    const at = nv.start + 16 * i;
    nodes.push({ length: readInt64(t.view, at), nullCount: readInt64(t.view, at + 8) });
  }
  const buffers = [];
  const bv = t.vector(2);
  for (let i = 0; bv && i < bv.length; i++) {
    const at = bv.start + 16 * i;
    buffers.push({ offset: readInt64(t.view, at), length: readInt64(t.view, at + 8) });
  }
  if (t.table(3)) throw new Error("arrow: compressed record batches are not supported");
  return { length: t.int64(0), nodes, buffers };
}

/**
 * Read an Arrow IPC stream.
 * @param {ArrayBuffer} buffer
 * @returns {{schema: {fields: object[], metadata: object}, batches: {length: number, columns: object}[]}}
 */
export function readStream(buffer) {
  const view = new DataView(buffer);
  let pos = 0;
  let schema = null;
  const dictionaries = new Map();
  const batches = [];
  while (pos + 4 <= buffer.byteLength) {
    let len = view.getInt32(pos, true);
    pos += 4;
    if (len === -1) { // continuation marker
      if (pos + 4 > buffer.byteLength) break;
      len = view.getInt32(pos, true);
      pos += 4;
    }
    if (len === 0) break; // end of stream
    const message = Table.root(view, pos);
    const metaEnd = pos + len;
    const version = message.int16(0);
    if (version < 3) throw new Error(`arrow: metadata version ${version} is too old`);
    const headerType = message.uint8(1);
    const header = message.table(2);
    const bodyLength = message.int64(3);
    const bodyOffset = metaEnd;
    if (headerType === MESSAGE_SCHEMA) {
      if (header.int16(0) !== 0) throw new Error("arrow: big-endian streams are not supported");
      schema = { fields: header.tables(1).map(readField), metadata: readMetadata(header, 2) };
    } else if (headerType === MESSAGE_DICTIONARY) {
      const id = header.int64(0);
      const field = findDictionaryField(schema.fields, id);
      const batch = readRecordBatch(header.table(1));
      const valueField = { ...field, dictionary: null };
      const r = new Reader(batch, null, buffer, bodyOffset);
      const column = readColumn(valueField, r, dictionaries);
      if (header.bool(2) && dictionaries.has(id)) {
        const prev = dictionaries.get(id);
        const n = prev.length;
        dictionaries.set(id, { length: n + column.length, get: (i) => (i < n ? prev.get(i) : column.get(i - n)) });
      } else {
        dictionaries.set(id, column);
      }
    } else if (headerType === MESSAGE_RECORD_BATCH) {
      if (!schema) throw new Error("arrow: record batch before schema");
      const batch = readRecordBatch(header);
      const r = new Reader(batch, null, buffer, bodyOffset);
      const columns = {};
      for (const field of schema.fields) columns[field.name] = readColumn(field, r, dictionaries);
      batches.push({ length: batch.length, columns });
    }
    pos = bodyOffset + bodyLength;
  }
  if (!schema) throw new Error("arrow: no schema in stream");
  return { schema, batches };
}

function findDictionaryField(fields, id) {
  const found = dictionaryField(fields, id);
  if (!found) throw new Error(`arrow: dictionary ${id} has no field`);
  return found;
}

function dictionaryField(fields, id) { // depth first; null when no field (nor child) has dictionary `id`
  for (const f of fields) {
    if (f.dictionary && f.dictionary.id === id) return f;
    const inner = dictionaryField(f.children, id);
    if (inner) return inner;
  }
  return null;
}

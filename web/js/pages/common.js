import { h, append } from "../dom.js";
import { hashes } from "../api.js";

export function breadcrumbs(ctx, items) {
  // items: [label, hash|null]
  const out = [h("a", { href: hashes.runs() }, "runs")];
  for (const [label, href] of items) {
    out.push(h("span", { class: "sep" }, "/"));
    out.push(href ? h("a", { href }, label) : h("span", { class: "here" }, label));
  }
  append(ctx.crumbs, out);
}

export function kv(pairs) {
  return h("dl", { class: "kv" }, pairs.filter(Boolean).map(([k, v]) => [h("dt", null, k), h("dd", null, v)]));
}

export function sortableTable({ columns, rows, sortKey, sortDir = 1, onSort, rowAttrs }) {
  const thead = h("thead", null, h("tr", null, columns.map((c) => {
    const active = c.key === sortKey;
    return h("th", {
      class: [c.num ? "num" : "", c.sort !== false ? "sortable" : "", active ? "sorted" : ""].join(" "),
      title: c.title || (c.sort !== false ? "sort" : undefined),
      dataset: { key: c.key },
      onclick: c.sort !== false && onSort ? () => onSort(c.key, active ? -sortDir : (c.num ? -1 : 1)) : undefined,
    }, c.label, active ? (sortDir > 0 ? " ▲" : " ▼") : "");
  })));
  const tbody = h("tbody", null, rows.map((row) => h("tr", rowAttrs ? rowAttrs(row) : null,
    columns.map((c) => h("td", { class: c.num ? "num" : c.cls || "" }, c.render ? c.render(row) : row[c.key])))));
  return h("table", { class: "grid" }, thead, tbody);
}

export function sortRows(rows, key, dir, valueOf) {
  const get = valueOf || ((r) => r[key]);
  return [...rows].sort((a, b) => {
    const x = get(a), y = get(b);
    if (x === y) return 0;
    if (x === null || x === undefined) return 1;
    if (y === null || y === undefined) return -1;
    return (x < y ? -1 : 1) * dir;
  });
}

export function spinner(text = "loading…") {
  return h("div", { class: "loading" }, text);
}

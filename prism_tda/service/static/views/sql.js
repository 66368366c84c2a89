// SQL console: one read-only SELECT over the index's tables and the audit results.

import { api } from "../api.js";
import { clear, h } from "../dom.js";
import { busy, errorBox } from "../ui.js";

const TABLES = ["documents", "sequences", "tokens", "activations", "prototypes", "vocab", "shards", "audit_results"];
export const EXAMPLES = [
  ["Most used prototypes",
    "SELECT proto_id, n_tokens, round(mass / sum(mass) OVER (), 4) AS share, top_tokens[1:5] AS signature\n" +
    "FROM prototypes ORDER BY mass DESC LIMIT 10"],
  ["Documents that most activate a prototype",
    "SELECT a.doc_id, d.external_id, max(a.act) AS act, count(*) AS tokens\nFROM activations a JOIN documents d USING (doc_id)\n" +
    "WHERE a.proto_id = 17\nGROUP BY a.doc_id, d.external_id ORDER BY act DESC LIMIT 10"],
  ["Tokens a prototype fires on",
    "SELECT v.token, count(*) AS n FROM activations a JOIN vocab v USING (token_id)\n" +
    "WHERE a.proto_id = 17 GROUP BY v.token ORDER BY n DESC LIMIT 10"],
  ["Longest documents", "SELECT doc_id, external_id, n_tokens FROM documents ORDER BY n_tokens DESC LIMIT 10"],
  ["Flagged audit results",
    "SELECT r.job_id, r.item_id, r.flagged_prototypes, r.rank, d.external_id, r.score\n" +
    "FROM audit_results r JOIN documents d USING (doc_id)\nWHERE r.flagged ORDER BY r.job_id, r.item_no, r.rank LIMIT 100"],
];

function cell(v) {
  if (v === null || v === undefined) return h("span", { class: "null" }, "NULL");
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : String(Number(v.toPrecision(6)));
  if (typeof v === "object") return h("code", {}, JSON.stringify(v));
  return String(v);
}

export async function render(root, { params }) {
  const box = h("textarea", { id: "sql-box", class: "mono", rows: 7, spellcheck: "false", "aria-describedby": "sql-help",
    value: params.get("q") || EXAMPLES[0][1] });
  const run = h("button", { type: "submit", class: "primary" }, "Run");
  const status = h("p", { class: "status", role: "status", id: "sql-status" });
  const out = h("div", { id: "sql-out" });
  const form = h("form", { class: "card form", "aria-label": "SQL query" },
    h("label", { for: "sql-box" }, "Query"), box,
    h("p", { class: "hint", id: "sql-help" }, "One SELECT; Ctrl+Enter runs it. Tables: ",
      TABLES.map((t, i) => [i ? ", " : "", h("button", { type: "button", class: "link",
        onclick: () => { box.value = `SELECT * FROM ${t} LIMIT 20`; box.focus(); } }, t)])),
    h("div", { class: "row" }, run, status));
  box.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); form.requestSubmit(); }
  });
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    await busy(run, status, "Running…", async () => {
      try {
        const res = await api("POST", "/v1/sql", { body: { sql: box.value } });
        status.textContent = `${res.row_count} row${res.row_count === 1 ? "" : "s"} · ${res.elapsed_ms.toFixed(1)} ms`;
        clear(out, h("div", { class: "table-wrap" }, h("table", { class: "sql" },
          h("thead", {}, h("tr", {}, res.columns.map((c) => h("th", { scope: "col" }, c.name, h("small", {}, c.type))))),
          h("tbody", {}, res.rows.map((r) => h("tr", {}, r.map((v) => h("td", {}, cell(v)))))))));
      } catch (err) {
        clear(out, errorBox(err));
      }
    });
  });
  root.append(h("h1", {}, "SQL"),
    h("p", { class: "lede" }, "Read-only DuckDB over the index's tables: no file, network or extension access."),
    h("div", { class: "sql-layout" }, form,
      h("nav", { class: "card examples", "aria-label": "Example queries" }, h("h2", {}, "Examples"),
        h("ul", { class: "plain" }, EXAMPLES.map(([title, q]) => h("li", {},
          h("button", { type: "button", class: "link", onclick: () => { box.value = q; form.requestSubmit(); } }, title)))))),
    out);
  // a link may carry a query (#/sql?q=...): it is shown, never run, until the user presses Run
  if (params.get("q")) status.textContent = "Query loaded from the link: read it, then press Run.";
}

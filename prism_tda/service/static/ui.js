// Pieces shared by the views: error boxes, busy states, document cards.

import { ApiError } from "./api.js";
import { h, hashLink, marked, num, pct } from "./dom.js";

const HINTS = {
  unauthorized: "This server needs an API key: enter it under “API key” at the top of the page.",
  "sql-forbidden": "Only one read-only SELECT over the index's tables is allowed: no COPY, ATTACH, " +
    "INSTALL, LOAD, SET, PRAGMA, and no file or network access.",
  "sql-one-statement": "Send one statement at a time.",
  "sql-too-many-rows": "Add a LIMIT, or aggregate.",
  "sql-timeout": "The query ran out of time: narrow it down (WHERE, LIMIT) or aggregate first.",
  "rate-limited": "Too many requests: wait a moment and try again.",
};

/** An error as a readable alert: title, detail, a hint when there is one, status and request id. */
export function errorBox(err) {
  if (!(err instanceof ApiError)) {
    return h("div", { class: "error", role: "alert" }, h("strong", {}, "Error"), h("p", {}, String(err.message || err)));
  }
  const p = err.problem;
  if (err.status === 401) document.getElementById("key-box")?.setAttribute("open", "");
  const hint = HINTS[err.kind];
  const meta = [err.status ? `HTTP ${err.status}` : null, err.kind || null,
    p.request_id ? `request ${p.request_id}` : null].filter(Boolean).join(" · ");
  return h("div", { class: "error", role: "alert" },
    h("strong", { class: "error-title" }, p.title || "Error"),
    p.detail ? h("p", { class: "error-detail" }, p.detail) : null,
    hint ? h("p", { class: "error-hint" }, hint) : null,
    meta ? h("p", { class: "error-meta" }, meta) : null);
}

/** Run `fn` with `button` disabled and a status message; errors land in `out`. */
export async function busy(button, status, message, fn) {
  button.disabled = true;
  button.setAttribute("aria-busy", "true");
  status.textContent = message;
  try {
    return await fn();
  } finally {
    button.disabled = false;
    button.removeAttribute("aria-busy");
    if (status.textContent === message) status.textContent = "";
  }
}

export function protoLink(id, text) {
  return h("a", { href: `#/prototype/${id}`, class: "proto" }, text ?? `p${id}`);
}

/** One attributed training document: rank, score, snippet with its highlighted tokens, prototypes. */
export function docCard(d) {
  const shares = (d.prototypes || []).slice(0, 8);
  return h("li", { class: "doc" },
    h("div", { class: "doc-head" },
      h("span", { class: "rank" }, `#${d.rank}`),
      h("span", { class: "score", title: "cosine of preconditioned prototype-space gradients" },
        "score ", h("b", {}, num(d.score))),
      h("a", { href: `#/document/${d.doc_id}` }, d.external_id || `document ${d.doc_id}`),
      d.raw_influence != null ? h("span", { class: "muted", title: "raw influence: breaks ties of the score" },
        `raw ${num(d.raw_influence, 1)}`) : null,
      d.value != null ? h("span", { class: "muted", title: "value: the prototype-space influences of every token "
        + "of the document, summed: its predicted effect on the output's loss (positive: lowered it)" },
        `value ${num(d.value, 1)}`) : null,
      d.influence != null ? h("span", { class: "chip", title: "full-model influence (EK-FAC, every linear layer): "
        + "how much training on this document lowered the output's loss; negative: raised it" },
        `effect ${num(d.influence, 2)}`) : null,
      d.trained === false ? h("span", { class: "chip untrained", title: "the checkpoint did not train on this "
        + "document (validation split)" }, "not trained on") : null),
    d.snippet != null ? h("p", { class: "snippet" }, marked(d.snippet, d.highlights || [])) : null,
    shares.length ? h("p", { class: "shares" }, h("span", { class: "muted" }, "prototypes "),
      shares.map((s) => h("span", { class: "chip" }, protoLink(s.proto_id), ` ${pct(s.share)}`))) : null);
}

export function docList(docs) {
  if (!docs.length) return h("p", { class: "muted" }, "No training document shares a prototype with this output.");
  return h("ol", { class: "docs" }, docs.map(docCard));
}

export function table(columns, rows) {
  return h("div", { class: "table-wrap" }, h("table", {},
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, rows.map((r) => h("tr", {}, r.map((c) => h("td", {}, c)))))));
}

export { hashLink };

// Audits: submit a batch of (prompt, output) items, watch the job, browse its results.

import { api, download, session } from "../api.js";
import { clear, field, h, num, parseIds } from "../dom.js";
import { busy, errorBox, protoLink, table } from "../ui.js";

const PAGE = 20;
const EXAMPLE = [
  { id: "a", prompt: "The king of France", max_new_tokens: 8 },
  { id: "b", prompt: "A computer is", completion: " a machine that does what you tell it" },
].map((x) => JSON.stringify(x)).join("\n");

/** This key's audits from the server (every key's for an admin key), newest first, a page at a time. */
async function listAudits(section, offset = 0) {
  const list = h("div", { id: "audit-list" }, h("p", { class: "muted" }, "Loading…"));
  clear(section, h("h2", {}, "Your audits"), list);
  try {
    const query = { limit: PAGE, offset, ...(session.index ? { index: session.index } : {}) };
    const res = await api("GET", "/v1/audits", { query });
    const rows = res.audits.map((j) => [
      h("a", { href: `#/audits/${encodeURIComponent(j.id)}` }, j.id), j.index,
      h("span", { class: `badge ${j.status}` }, j.status),
      `${j.n_done + j.n_failed} / ${j.n_items}`, new Date(j.created_at * 1000).toLocaleString()]);
    clear(list, res.total ? table(["audit", "index", "status", "items", "created"], rows)
      : h("p", { class: "muted" }, "No audits yet."),
    h("p", { class: "actions" },
      offset > 0 ? h("button", { type: "button", onclick: () => listAudits(section, Math.max(0, offset - PAGE)) }, "Newer") : null,
      res.next_offset != null ? h("button", { type: "button", onclick: () => listAudits(section, res.next_offset) }, "Older") : null,
      res.total ? h("span", { class: "muted" }, ` ${offset + 1}–${offset + res.audits.length} of ${res.total}`) : null));
  } catch (err) {
    clear(list, errorBox(err));
  }
}

/** JSONL text -> items, or an Error naming the first bad line. */
export function parseJsonl(text) {
  const items = [];
  text.split(/\r?\n/).forEach((line, n) => {
    if (!line.trim()) return;
    let obj;
    try { obj = JSON.parse(line); } catch (e) { throw new Error(`line ${n + 1}: not JSON (${e.message})`); }
    if (!obj || typeof obj !== "object" || Array.isArray(obj)) throw new Error(`line ${n + 1}: expected a JSON object`);
    if (typeof obj.prompt !== "string") throw new Error(`line ${n + 1}: needs a "prompt" string`);
    items.push(obj);
  });
  if (!items.length) throw new Error("No items: paste one JSON object per line, or choose a file.");
  return items;
}

export async function render(root, { args }) {
  if (args[0]) return renderJob(root, args[0]);
  const text = h("textarea", { id: "audit-jsonl", rows: 8, class: "mono", spellcheck: "false", placeholder: EXAMPLE });
  const file = h("input", { id: "audit-file", type: "file", accept: ".jsonl,.json,.ndjson,.txt,application/x-ndjson" });
  const topK = h("input", { id: "audit-topk", type: "number", min: 1, max: 100, value: 5 });
  const flag = h("input", { id: "audit-flag", type: "text", placeholder: "e.g. 17, 42", spellcheck: "false" });
  const effect = h("input", { id: "audit-influence", type: "checkbox" });
  const submit = h("button", { type: "submit", class: "primary" }, "Start audit");
  const status = h("p", { class: "status", role: "status" });
  const out = h("div");
  file.addEventListener("change", async () => {
    if (file.files[0]) text.value = await file.files[0].text();
  });
  const form = h("form", { class: "card form", "aria-label": "New audit" },
    field("Items (JSONL: one object per line with prompt, and completion or max_new_tokens; id optional)", text),
    h("div", { class: "row" }, field("…or upload a JSONL file", file),
      h("button", { type: "button", onclick: () => { text.value = EXAMPLE; } }, "Use an example")),
    h("div", { class: "row" }, field("Documents per item", topK),
      field("Flag items using prototypes", flag, "Optional ids; flagged items are marked in the results."),
      h("label", { class: "check", title: "EK-FAC through every linear layer: a backward pass per window of "
        + "each cited document (the index needs `prism index --out IDX --influence`)" },
        effect, " each document's full-model influence (slower; what predicts its effect best)")),
    h("div", { class: "row" }, submit, status));
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    let body;
    try {
      body = { items: parseJsonl(text.value), n_documents: Number(topK.value) };
      if (effect.checked) body.influence = true;
      const ids = parseIds(flag.value);
      if (ids.length) body.flag_prototypes = ids;
    } catch (err) {
      clear(out, errorBox(err));
      return;
    }
    await busy(submit, status, "Submitting…", async () => {
      try {
        const job = await api("POST", "/v1/audits", { body });
        location.hash = `#/audits/${encodeURIComponent(job.id)}`;
      } catch (err) {
        clear(out, errorBox(err));
      }
    });
  });
  const openId = h("input", { id: "audit-open", type: "text", spellcheck: "false", placeholder: "audit id" });
  const listed = h("section", { class: "card", id: "audit-mine" });
  root.append(h("h1", {}, "Audits"),
    h("p", { class: "lede" }, "Attribute many outputs at once in the background; the results are also in SQL as audit_results."),
    form, out, listed,
    h("section", { class: "card" },
      h("form", { class: "row inline", "aria-label": "Open an audit",
        onsubmit: (e) => { e.preventDefault(); if (openId.value.trim()) location.hash = `#/audits/${encodeURIComponent(openId.value.trim())}`; } },
      field("Open by id", openId), h("button", { type: "submit" }, "Open"))));
  listAudits(listed);
}

function renderJob(root, id) {
  const progress = h("progress", { id: "audit-progress", max: 1, value: 0 });
  const line = h("p", { class: "status", role: "status", id: "audit-status" }, "Loading…");
  const cancel = h("button", { type: "button", hidden: true }, "Cancel");
  const results = h("div", { id: "audit-results" });
  const downloads = h("p", { class: "actions" },
    h("button", { type: "button", onclick: () => download(`/v1/audits/${id}/results`, { format: "jsonl" }, `${id}.jsonl`).catch((e) => results.prepend(errorBox(e))) }, "Download JSONL"),
    h("button", { type: "button", onclick: () => download(`/v1/audits/${id}/results`, { format: "parquet" }, `${id}.parquet`).catch((e) => results.prepend(errorBox(e))) }, "Download Parquet"));
  root.append(h("h1", {}, "Audit ", h("code", {}, id)),
    h("p", {}, h("a", { href: "#/audits" }, "← all audits")),
    h("section", { class: "card" }, h("div", { class: "row" }, progress, line, cancel), downloads), results);
  let stopped = false;
  let timer = null;
  let shown = -1;
  cancel.addEventListener("click", async () => {
    try { await api("POST", `/v1/audits/${id}/cancel`); } catch (e) { results.prepend(errorBox(e)); }
  });

  async function poll() {
    if (stopped) return;
    try {
      const job = await api("GET", `/v1/audits/${id}`);
      if (stopped) return;
      progress.value = job.progress;
      const finished = job.status === "completed" || job.status === "cancelled";
      line.textContent = `${job.status} · ${job.n_done} of ${job.n_items} done` +
        `${job.n_failed ? `, ${job.n_failed} failed` : ""} · ${Math.round(100 * job.progress)}%`;
      line.dataset.status = job.status;
      cancel.hidden = finished;
      const seen = job.n_done + job.n_failed;
      if (seen !== shown || finished) {
        shown = seen;
        const res = await api("GET", `/v1/audits/${id}/items`, { query: { limit: 200 } });
        if (stopped) return;
        showItems(results, res);
        results.dataset.status = job.status;  // the job state these rows answer (the status line is set one request earlier)
      }
      if (!finished) timer = setTimeout(poll, 500);
    } catch (e) {
      clear(results, errorBox(e));
      line.textContent = "";
    }
  }
  poll();
  return () => { stopped = true; clearTimeout(timer); };
}

function showItems(el, res) {
  const rows = res.items.map((it) => [
    String(it.item_no), it.id ?? "", h("span", { class: `badge ${it.status}` }, it.status),
    it.error ? h("span", { class: "error-inline" }, it.error) : h("code", { class: "wrap" }, it.target_text ?? ""),
    it.flagged ? h("span", { class: "badge flagged" }, "flagged ", it.flagged_prototypes.map((p) => [" ", protoLink(p)])) : "",
    h("span", { class: "chips" }, it.used_prototypes.slice(0, 10).map((p) => [protoLink(p), " "]),
      it.used_prototypes.length > 10 ? `+${it.used_prototypes.length - 10}` : null),
    it.documents.length ? h("ol", { class: "mini" }, it.documents.slice(0, 3).map((d) => h("li", {},
      d.removed  // taken down since the audit ran: the citation stays, the document is gone
        ? h("span", { class: "muted", title: "taken down" }, `${d.external_id || `doc ${d.doc_id}`} (removed)`)
        : h("a", { href: `#/document/${d.doc_id}` }, d.external_id || `doc ${d.doc_id}`), ` ${num(d.score)}`,
      d.influence != null ? [" ", h("span", { class: "chip", title: "full-model influence: how much training on "
        + "it lowered the output's loss" }, `effect ${num(d.influence, 2)}`)] : null))) : "",
  ]);
  clear(el, h("section", { class: "card" }, h("h2", {}, `Items (${res.job.n_items})`),
    table(["#", "id", "status", "output", "flag", "prototypes used", "top documents"], rows),
    res.items.length < res.job.n_items ? h("p", { class: "muted" }, `Showing the first ${res.items.length}; download for all.`) : null));
}

// Prototypes: the list by usage, and one prototype's signature, usage and top training contexts.

import { api } from "../api.js";
import { clear, field, h, hashLink, num, pct, showToken } from "../dom.js";
import { errorBox, protoLink, table } from "../ui.js";

const PAGE = 25;

export async function renderList(root, { params }) {
  const order = params.get("order") || "mass";
  const offset = Math.max(0, Number(params.get("offset")) || 0);
  const q = params.get("q") || "";
  const search = h("input", { id: "proto-q", type: "search", value: q, placeholder: "e.g. orchestra", spellcheck: "false" });
  const find = h("form", { class: "row inline", role: "search", "aria-label": "Search prototypes by label",
    onsubmit: (e) => { e.preventDefault(); location.hash = hashLink("prototypes", { order, ...(search.value.trim() ? { q: search.value.trim() } : {}) }); } },
  field("Label or token", search), h("button", { type: "submit" }, "Search"));
  const goId = h("input", { id: "proto-go", type: "number", min: 0, placeholder: "id" });
  const go = h("form", { class: "row inline", "aria-label": "Open a prototype",
    onsubmit: (e) => { e.preventDefault(); if (goId.value !== "") location.hash = `#/prototype/${Number(goId.value)}`; } },
  field("Open prototype", goId), h("button", { type: "submit" }, "Open"));
  const orderSel = h("select", { id: "proto-order", onchange: () => { location.hash = hashLink("prototypes", { order: orderSel.value, ...(q ? { q } : {}) }); } },
    ["mass", "n_tokens", "proto_id"].map((o) => h("option", { value: o, selected: o === order },
      { mass: "activation mass", n_tokens: "tokens", proto_id: "id" }[o])));
  const body = h("div", {}, h("p", { class: "muted", role: "status" }, "Loading…"));
  root.append(h("h1", {}, "Prototypes"),
    h("p", { class: "lede" }, "Each prototype is a direction the model reads its next token from; " +
      "open one to see what it stands for."),
    h("div", { class: "row" }, go, find, field("Order by", orderSel)), body);
  try {
    const extra = q ? { q } : {};
    const res = await api("GET", "/v1/prototypes", { query: { order, limit: PAGE, offset, ...extra } });
    const pager = h("nav", { class: "pager", "aria-label": "Pages" },
      offset > 0 ? h("a", { href: hashLink("prototypes", { order, ...extra, offset: Math.max(0, offset - PAGE) }) }, "← previous") : null,
      h("span", { class: "muted", id: "proto-count", dataset: { q } }, res.total ? `${offset + 1}–${offset + res.prototypes.length} of ${res.total}` : "No prototype matches."),
      offset + PAGE < res.total ? h("a", { href: hashLink("prototypes", { order, ...extra, offset: offset + PAGE }) }, "next →") : null);
    clear(body, table(["Prototype", "Tokens", "Activation mass", "Mean activation", "Signature"],
      res.prototypes.map((p) => [protoLink(p.proto_id, `prototype ${p.proto_id}${p.label ? ` (${p.label})` : ""}`),
        p.n_tokens.toLocaleString(), num(p.mass, 1), num(p.mean_act),
        h("span", { class: "chips" }, p.top_tokens.slice(0, 8).map((t) => h("code", { class: "chip" }, showToken(t))))])),
    pager);
  } catch (e) {
    clear(body, errorBox(e));
  }
}

async function usage(el, sqlText) {
  const out = el.lastChild;
  try {
    const res = await api("POST", "/v1/sql", { body: { sql: sqlText } });
    const total = res.rows.reduce((s, r) => s + r[1], 0) || 1;
    const max = Math.max(1, ...res.rows.map((r) => r[1]));
    el.replaceChild(h("ol", { class: "signature" }, res.rows.map(([token, n]) => h("li", {},
      h("code", { class: "sig-token" }, showToken(token)),
      h("span", { class: "bar usage", style: { "--v": (n / max).toFixed(3) }, "aria-hidden": "true" }),
      h("span", { class: "n", title: `${pct(n / total, 1)} of these` }, n.toLocaleString())))), out);
  } catch (e) {
    el.replaceChild(errorBox(e), out);
  }
}

export async function renderOne(root, { args }) {
  const id = Number(args[0]);
  const body = h("div", {}, h("p", { class: "muted", role: "status" }, "Loading…"));
  root.append(h("h1", {}, `Prototype ${id}`), body);
  try {
    const p = await api("GET", `/v1/prototypes/${id}`, { query: { contexts: 12, signature: 16 } });
    if (p.label) root.querySelector("h1").append(h("span", { class: "muted" }, ` · ${p.label}`));
    const firesOn = h("section", { class: "card", id: "fires-on" }, h("h2", {}, "Fires on"),
      h("p", { class: "hint" }, "The training tokens it is most often active on (from SQL over the activations)."),
      h("p", { class: "muted", role: "status" }, "Counting…"));
    const maxSig = Math.max(...p.signature.map((s) => Math.abs(s.logit)), 1e-9);
    const sqlText = `SELECT v.token, count(*) AS n, round(avg(a.act), 3) AS mean_act\nFROM activations a JOIN vocab v USING (token_id)\n` +
      `WHERE a.proto_id = ${id} GROUP BY v.token ORDER BY n DESC LIMIT 20`;
    clear(body,
      h("dl", { class: "stats" },
        h("div", {}, h("dt", {}, "training tokens"), h("dd", {}, p.n_tokens.toLocaleString())),
        h("div", {}, h("dt", {}, "activation mass"), h("dd", {}, num(p.mass, 1))),
        h("div", {}, h("dt", {}, "share of all mass"), h("dd", {}, pct(p.share, 2))),
        h("div", {}, h("dt", {}, "mean activation"), h("dd", {}, num(p.mean_act)))),
      h("p", { class: "actions" },
        h("a", { class: "button", id: "suppress-proto", href: hashLink("generate", { suppress: String(id) }) },
          `Suppress prototype ${id} in a generation`),
        h("a", { class: "button", href: hashLink("sql", { q: sqlText }) }, "Its tokens in SQL"),
        id > 0 ? h("a", { href: `#/prototype/${id - 1}` }, `← prototype ${id - 1}`) : null,
        h("a", { href: `#/prototype/${id + 1}` }, `prototype ${id + 1} →`)),
      h("div", { class: "two" },
        h("section", { class: "card" }, h("h2", {}, "Signature"),
          h("p", { class: "hint" }, "The tokens this prototype pushes up: its logits W pᵢ over the vocabulary."),
          h("ol", { class: "signature" }, p.signature.map((s) => h("li", {},
            h("code", { class: "sig-token" }, showToken(s.token)),
            h("span", { class: "bar", style: { "--v": (Math.abs(s.logit) / maxSig).toFixed(3) }, "aria-hidden": "true" }),
            h("span", { class: "n" }, num(s.logit)))))),
        firesOn),
      h("section", { class: "card" }, h("h2", {}, "Top activating training contexts"),
        p.top_contexts.length ? h("ol", { class: "contexts" }, p.top_contexts.map((c) => h("li", {},
          h("span", { class: "act", title: "activation" }, num(c.act, 2)),
          h("span", { class: "ctx" }, c.before, h("mark", { class: "active" }, c.token), c.after),
          h("a", { href: `#/document/${c.doc_id}`, class: "muted" }, `doc ${c.doc_id}`))))
          : h("p", { class: "muted" }, "No training token activates this prototype.")));
    usage(firesOn, sqlText);
  } catch (e) {
    clear(body, errorBox(e));
  }
}

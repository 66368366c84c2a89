// Attribute: an output token by token, each token's logit split into prototype slices plus the
// residual, and the training documents behind one token or the whole output.

import { api } from "../api.js";
import { clear, field, h, hashLink, num, pct, showToken } from "../dom.js";
import { busy, docList, errorBox, protoLink } from "../ui.js";

export const PALETTE = ["#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#999933", "#7e57c2"];

// kept across route changes, so coming back shows the last result
let last = null;  // {req, res, selected, scope, tokenDocs: Map}

/** The share of a token's logit carried by prototypes: |prototype parts| / (|prototype parts| + |residual|). */
export function explained(t) {
  const p = t.prototypes.reduce((s, x) => s + Math.abs(x.contribution), 0);
  const total = p + Math.abs(t.residual);
  return total > 0 ? p / total : 0;
}

function usedPrototypes(tokens) {
  const ids = new Set();
  for (const t of tokens) for (const p of t.prototypes) if (p.contribution > 0) ids.add(p.proto_id);
  return [...ids].sort((a, b) => a - b);
}

export async function render(root, { params }) {
  const prompt = h("textarea", { id: "attr-prompt", rows: 3, required: true, placeholder: "The king of France" });
  const completion = h("textarea", { id: "attr-completion", rows: 2, placeholder: "Text the model produced after the prompt" });
  const nNew = h("input", { id: "attr-new", type: "number", min: 1, max: 4096, value: 8 });
  const topK = h("input", { id: "attr-topk", type: "number", min: 1, max: 100, value: 5 });
  const mode = h("select", { id: "attr-mode" }, h("option", { value: "fast" }, "fast (candidates, exact re-rank)"),
    h("option", { value: "exact" }, "exact (every training token sharing a prototype)"));
  const opponents = h("input", { id: "attr-opp", type: "checkbox" });
  const untrained = h("input", { id: "attr-untrained", type: "checkbox" });
  const effect = h("input", { id: "attr-influence", type: "checkbox" });
  const choice = (value, label, checked) => h("label", { class: "radio" },
    h("input", { type: "radio", name: "target", value, checked }), ` ${label}`);
  const targets = h("fieldset", { class: "targets" }, h("legend", {}, "Output to attribute"),
    h("div", { class: "radio-row" }, choice("generate", "generate", true), nNew,
      h("label", { for: "attr-new", class: "muted" }, "new tokens (greedy)")),
    choice("completion", "this completion:"), completion,
    choice("prompt", "the prompt's own next-token predictions"));
  const submit = h("button", { type: "submit", class: "primary" }, "Attribute");
  const status = h("p", { class: "status", role: "status" });
  const out = h("div", { class: "results" });
  const form = h("form", { class: "card form", "aria-label": "Attribution query" },
    field("Prompt", prompt), targets,
    h("div", { class: "row" }, field("Documents", topK), field("Search", mode),
      h("label", { class: "check" }, opponents, " documents that oppose the output instead"),
      h("label", { class: "check" }, untrained, " include documents the model did not train on"),
      h("label", { class: "check", title: "EK-FAC through every linear layer: a backward pass per window of "
        + "each returned document (the index needs `prism index --out IDX --influence`)" },
        effect, " each document's full-model influence (slower)")),
    h("div", { class: "row" }, submit, status));
  completion.addEventListener("focus", () => { targets.querySelector("input[value=completion]").checked = true; });
  nNew.addEventListener("focus", () => { targets.querySelector("input[value=generate]").checked = true; });

  if (params.get("prompt")) prompt.value = params.get("prompt");
  else if (last) {
    const r = last.req;
    prompt.value = r.prompt;
    if (r.completion != null) { completion.value = r.completion; targets.querySelector("input[value=completion]").checked = true; }
    else if (r.max_new_tokens == null) targets.querySelector("input[value=prompt]").checked = true;
    if (r.max_new_tokens != null) nNew.value = r.max_new_tokens;
    topK.value = r.n_documents ?? r.top_k; mode.value = r.mode; opponents.checked = r.opponents;
    untrained.checked = !!r.include_untrained;
    effect.checked = !!r.influence;
  }

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const req = { prompt: prompt.value, n_documents: Number(topK.value), mode: mode.value, opponents: opponents.checked,
      include_untrained: untrained.checked, influence: effect.checked };
    const which = form.querySelector("input[name=target]:checked").value;
    if (which === "generate") req.max_new_tokens = Number(nNew.value);
    if (which === "completion") {
      if (!completion.value) { clear(out, errorBox(new Error("Enter the completion to attribute."))); return; }
      req.completion = completion.value;
    }
    clear(out);  // no stale result while the new one is computed
    await busy(submit, status, "Attributing…", async () => {
      try {
        const res = await api("POST", "/v1/attribute", { body: req });
        last = { req, res, selected: null, scope: "output", tokenDocs: new Map() };
        const ties = res.tied_beyond_last
          ? ` · ${res.tied_beyond_last}${res.mode === "fast" ? "+" : ""} more documents tie at the cut (within 0.1%)` +
            (req.tie_break === "score" ? "" : "; of the tied, those whose tokens' cosines sum highest are shown") +
            (res.unsettled_beyond_last ? ` (${res.unsettled_beyond_last} not separated by that either)` : "")
          : "";
        const opposed = res.opposed_by_influence
          ? ` · ${res.opposed_by_influence} left out: their full-model influence pushes the other way`
          : res.opposed_by_value
            ? ` · ${res.opposed_by_value} left out: their value (the whole document's influence) pushes the other way`
            : "";
        status.textContent = `${res.per_token.length} tokens · ${res.tokens_scored} training tokens scored · ` +
          `${Math.round(res.timings_ms.total ?? 0)} ms${ties}${opposed}`;
        showResult(out);
      } catch (err) {
        clear(out, errorBox(err));
      }
    });
  });

  root.append(h("h1", {}, "Attribute an output"),
    h("p", { class: "lede" }, "Which training documents drove each token, through which prototypes."), form, out);
  if (last && !params.get("prompt")) showResult(out);
}

function showResult(out) {
  const { req, res } = last;
  const tokens = res.per_token;
  const panel = h("section", { class: "card token-panel", "aria-live": "polite", id: "token-panel" });
  const docs = h("section", { class: "card docs-panel", id: "docs-panel" });
  const ids = usedPrototypes(tokens);
  const tokenButtons = tokens.map((t, i) => {
    const share = explained(t);
    const b = h("button", {
      type: "button", class: "tok", dataset: { index: i }, "aria-pressed": String(last.selected === i),
      style: { "--share": share.toFixed(3) },
      "aria-label": `token ${i + 1}: ${JSON.stringify(t.token)}, prototypes explain ${pct(share)} of its logit`,
      title: `logit ${num(t.logit)} · prototypes explain ${pct(share)}`,
      onclick: () => select(i),
    }, showToken(t.token));
    return t.token.includes("\n") ? [b, h("br")] : b;
  });
  const promptShown = req.completion != null || req.max_new_tokens != null;

  function select(i) {
    last.selected = i;
    last.scope = i == null ? "output" : "token";
    for (const b of out.querySelectorAll("button.tok")) b.setAttribute("aria-pressed", String(Number(b.dataset.index) === i));
    clear(panel, i == null ? h("p", { class: "muted" }, "Choose a token to see its logit split into prototypes.")
      : tokenView(tokens[i], i, tokens.length, req.prompt));
    showDocs();
  }

  async function showDocs() {
    const i = last.selected;
    const scopeButtons = h("div", { class: "seg", role: "group", "aria-label": "Documents for" },
      h("button", { type: "button", "aria-pressed": String(last.scope === "token"), disabled: i == null,
        onclick: () => { last.scope = "token"; showDocs(); } }, i == null ? "this token" : `token ${i + 1}`),
      h("button", { type: "button", "aria-pressed": String(last.scope === "output"),
        onclick: () => { last.scope = "output"; showDocs(); } }, "whole output"));
    const heading = h("h2", {}, last.scope === "token" ? `Top documents for token ${i + 1}` : "Top documents for the whole output");
    const body = h("div", { class: "docs-body" });
    clear(docs, h("div", { class: "panel-head" }, heading, scopeButtons), body);
    if (last.scope === "output") { clear(body, docList(res.documents)); return; }
    let found = last.tokenDocs.get(i);
    if (!found) {
      clear(body, h("p", { class: "muted", role: "status" }, "Attributing this token…"));
      try {
        found = (await api("POST", "/v1/attribute", { body: { ...req, target_index: i } })).documents;
        last.tokenDocs.set(i, found);
      } catch (err) {
        clear(body, errorBox(err));
        return;
      }
    }
    if (last.selected === i && last.scope === "token") clear(body, docList(found));
  }

  clear(out,
    h("section", { class: "card output-panel" },
      h("div", { class: "panel-head" }, h("h2", {}, "Output"),
        h("span", { class: "legend", "aria-hidden": "true" }, "prototypes explain ",
          h("span", { class: "ramp" }, h("span", {}, "0%"), h("span", {}, "100%")), " of the logit")),
      h("p", { class: "hint" }, "Each token is coloured by the share of its logit that prototypes carry. " +
        "Choose a token to see the split."),
      h("div", { class: "tokens", id: "tokens" },
        promptShown ? h("span", { class: "prompt-text" }, req.prompt) : null, tokenButtons),
      ids.length ? h("p", {}, h("a", { href: hashLink("generate", { prompt: req.prompt, suppress: ids.join(","),
        n: req.max_new_tokens ?? tokens.length }), id: "suppress-output" },
      `Generate without the ${ids.length} prototypes behind this output →`)) : null),
    panel, docs);
  select(last.selected);
}

function tokenView(t, i, n, prompt) {
  const protoSum = t.prototypes.reduce((s, p) => s + p.contribution, 0);
  const parts = [...t.prototypes].sort((a, b) => b.contribution - a.contribution);
  const colour = (k) => PALETTE[k % PALETTE.length];
  const absTotal = parts.reduce((s, p) => s + Math.abs(p.contribution), 0) + Math.abs(t.residual);
  const slice = (value, bg, label, cls) => h("span", {
    class: `slice ${cls || ""} ${value < 0 ? "neg" : ""}`, title: `${label}: ${num(value)}`,
    style: { "flex-grow": String(Math.abs(value) / (absTotal || 1)), "--c": bg },
  });
  const ids = parts.filter((p) => p.contribution > 0).map((p) => p.proto_id);
  return [
    h("h2", {}, `Token ${i + 1} of ${n}: `, h("code", { class: "tok-name" }, JSON.stringify(t.token))),
    h("p", { class: "equation" },
      "logit ", h("b", { class: "logit", dataset: { value: t.logit } }, num(t.logit)),
      " = prototypes ", h("b", { class: "proto-sum" }, num(protoSum)),
      " + residual ", h("b", { class: "residual" }, num(t.residual)),
      h("span", { class: "muted" }, ` · prototypes explain ${pct(explained(t))}`)),
    h("div", { class: "slices", role: "img", "aria-label": `logit ${num(t.logit)} split into ${parts.length} prototypes and the residual` },
      parts.map((p, k) => slice(p.contribution, colour(k), `prototype ${p.proto_id}`)),
      slice(t.residual, "#b0b0b0", "residual", "resid")),
    h("div", { class: "table-wrap" }, h("table", { class: "split" },
      h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "Part of the logit"), h("th", { scope: "col", class: "n" }, "activation"),
        h("th", { scope: "col", class: "n" }, "contribution"), h("th", { scope: "col", class: "n" }, "share"))),
      h("tbody", {},
        parts.map((p, k) => h("tr", { class: "part" },
          h("th", { scope: "row" }, h("span", { class: "swatch", style: { "--c": colour(k) }, "aria-hidden": "true" }),
            protoLink(p.proto_id, `prototype ${p.proto_id}`)),
          h("td", { class: "n" }, num(p.act)),
          h("td", { class: "n contribution" }, num(p.contribution)),
          h("td", { class: "n" }, t.logit ? pct(p.contribution / t.logit, 1) : "–"))),
        h("tr", { class: "part" }, h("th", { scope: "row" }, h("span", { class: "swatch resid", "aria-hidden": "true" }), "residual"),
          h("td", { class: "n" }, ""), h("td", { class: "n contribution" }, num(t.residual)),
          h("td", { class: "n" }, t.logit ? pct(t.residual / t.logit, 1) : "–"))),
      h("tfoot", {}, h("tr", {}, h("th", { scope: "row" }, "logit"), h("td", {}), h("td", { class: "n total" }, num(t.logit)),
        h("td", { class: "n" }, "100%"))))),
    ids.length ? h("p", {}, h("a", { href: hashLink("generate", { prompt, suppress: ids.join(",") }) },
      `Generate without these ${ids.length} prototypes →`)) : null,
  ];
}

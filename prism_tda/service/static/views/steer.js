// Steer: find the prototypes that carry a topic, save them as a named set, and generate with and
// without it side by side.

import { api } from "../api.js";
import { alphaSlider, clear, field, h, num, pct } from "../dom.js";
import { busy, errorBox, protoLink, table } from "../ui.js";
import { showCompare } from "./generate.js";

const PICKED = 10; // prototypes ticked by default

/** A set name no other save is likely to take: "topic-" and 6 random hex digits. */
function defaultSetName() {
  const bytes = crypto.getRandomValues(new Uint8Array(3));
  return "topic-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

export async function render(root, { params }) {
  const page = { left: false }; // set when the page is left: a task's polling stops
  const examples = h("textarea", { id: "steer-texts", rows: 6, placeholder: "One example per paragraph (blank line between examples)." });
  const filter = h("input", { id: "steer-sql", type: "text", spellcheck: "false", value: params.get("sql") || "",
    placeholder: "SELECT doc_id FROM documents WHERE external_id LIKE 'zippy/%'" });
  const topN = h("input", { id: "steer-top", type: "number", min: 1, max: 200, value: 20 });
  const byEffect = h("input", { id: "steer-effect", type: "checkbox" });
  const submit = h("button", { type: "submit", class: "primary" }, "Discover");
  const status = h("p", { class: "status", role: "status" });
  const found = h("div", { id: "steer-found" });
  const form = h("form", { class: "card form", "aria-label": "Topic" },
    field("Example texts of the topic", examples, "Or leave empty and pick training documents with SQL below."),
    field("or training documents (SQL returning doc_id)", filter),
    h("div", { class: "row" }, field("Prototypes to show", topN),
      h("label", { class: "check", for: "steer-effect" }, byEffect, " tick the set chosen by its measured effect " +
        "(the model measures what suppressing them does; slower)"), submit, status));
  root.append(h("h1", {}, "Steer"),
    h("p", { class: "lede" }, "Find the prototypes that carry a topic (more activation per token on the examples than " +
      "on the rest of the corpus), save them as a set, and see what generation does without them."), form, found);

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const texts = examples.value.split(/\n\s*\n/).map((t) => t.trim()).filter(Boolean);
    const sql = filter.value.trim();
    if (!texts.length && !sql) {
      clear(found, errorBox(new Error("Paste example texts or give a SQL filter of documents.")));
      return;
    }
    const topic = texts.length ? { texts } : { sql };
    const body = { topic, top_n: Number(topN.value), min_docs: texts.length === 1 ? 1 : 2 };
    await busy(submit, status, "Discovering…", async () => {
      try {
        if (byEffect.checked) {  // the model runs over the topic and the contrast: a background task
          await runTask(found, { ...body, select: "effect" }, page);
        } else {
          showFound(found, await api("POST", "/v1/prototypes/discover", { body }));
        }
      } catch (err) {
        clear(found, errorBox(err));
      }
    });
  });
  return () => { page.left = true; };
}

const STAGES = { ranking: "ranking prototypes", model: "running the model over the topic and the contrast",
  selection: "measuring candidate sets" };

/** Submit a background discovery, show its progress with a cancel button, then its result. */
async function runTask(out, body, page) {
  let task = await api("POST", "/v1/prototypes/discover/tasks", { body });
  const bar = h("progress", { id: "steer-progress", max: 1, value: 0 });
  const line = h("p", { class: "status", role: "status", id: "steer-task" }, "Queued…");
  const cancel = h("button", { type: "button", id: "steer-cancel" }, "Cancel");
  cancel.addEventListener("click", async () => {
    try { await api("DELETE", `/v1/prototypes/discover/tasks/${task.id}`); } catch (e) { out.prepend(errorBox(e)); }
  });
  clear(out, h("section", { class: "card" }, h("div", { class: "row" }, bar, line, cancel)));
  while (!page.left && (task.status === "queued" || task.status === "running")) {
    bar.value = task.progress;
    line.textContent = task.status === "queued" ? "Queued…" : `${STAGES[task.stage] || task.stage || "starting"}` +
      (task.stage_total ? ` (${task.stage_done} of ${task.stage_total})` : "") + ` · ${Math.round(100 * task.progress)}%`;
    await new Promise((r) => setTimeout(r, 400));
    task = await api("GET", `/v1/prototypes/discover/tasks/${task.id}`);
  }
  if (page.left) return;
  if (task.status === "completed") showFound(out, task.result);
  else if (task.status === "cancelled") clear(out, h("p", { class: "muted", id: "steer-cancelled" }, "Cancelled."));
  else clear(out, errorBox(new Error(task.error || `the task ${task.status}`)));
}

function selectionText(sel) {
  if (!sel.prototypes.length) {
    return `No prototype raised the topic's loss more than the contrast's within ×${num(sel.max_ppl_ratio, 2)} ` +
      "contrast perplexity: nothing ticked.";
  }
  const last = sel.steps[sel.steps.length - 1];
  return `Ticked by measured effect: ${sel.prototypes.length} of ${sel.candidates} (budget ${sel.budget}). With them ` +
    `suppressed, the topic's loss rises by ${num(last.topic_loss_increase, 3)} nats per token and the contrast's by ` +
    `${num(last.contrast_loss_increase, 3)} (effect ${num(last.effect, 3)}; contrast perplexity ×` +
    `${num(last.contrast_ppl_ratio, 3)}; contrast: ${sel.contrast}; ${num(sel.seconds, 1)} s).`;
}

function costList(costs) {
  // the contrast texts the set's perplexity cost falls on most: what else the set writes
  return h("div", { id: "steer-cost" }, h("p", { class: "muted" }, "Where that cost falls on the contrast:"),
    h("ul", {}, costs.map((c) => h("li", {}, `${pct(c.share, 0)} of it on `,
      c.doc_id != null ? h("a", { href: `#/document/${c.doc_id}` }, `document ${c.doc_id}`) : `text ${c.text_index + 1}`,
      ` (${c.tokens} tokens): `, h("span", { class: "ctx" }, `${c.snippet}…`)))));
}

function strengthText(rows) {
  // the chosen set at lower strengths: how much of its effect each keeps, at what cost on the contrast
  const full = rows.find((r) => r.alpha === 0);
  const parts = rows.filter((r) => r.alpha > 0).map((r) => `×${num(r.alpha, 2)}: ` +
    (full && full.effect > 0 ? `${pct(r.effect / full.effect, 0)} of the loss effect` : `effect ${num(r.effect, 3)}`) +
    ` at contrast perplexity ×${num(r.contrast_ppl_ratio, 3)}`);
  return h("p", { class: "muted", id: "steer-strengths" }, `At a lower strength (the slider below): ${parts.join("; ")}.`);
}

function context(c) {
  if (!c) return "";
  return h("span", { class: "ctx" }, c.before.slice(-30), h("mark", {}, c.token), c.after.slice(0, 20));
}

function showFound(out, res) {
  if (!res.prototypes.length) {
    clear(out, h("p", { class: "muted", id: "steer-none" }, "No prototype is active often enough on these examples; " +
      "give more or longer examples."));
    return;
  }
  const picked = res.selection ? new Set(res.selection.prototypes) : null;
  const boxes = res.prototypes.map((p, i) => h("input", { type: "checkbox", value: String(p.proto_id),
    checked: picked ? picked.has(p.proto_id) : i < PICKED, "aria-label": `use prototype ${p.proto_id}` }));
  const rows = res.prototypes.map((p, i) => [boxes[i], protoLink(p.proto_id), p.label || "", `${num(p.ratio, 2)}×`,
    pct(p.topic_share, 1), String(p.topic_support), String(p.topic_docs), context(p.contexts[0])]);
  const name = h("input", { id: "steer-name", type: "text", required: true, pattern: "[A-Za-z0-9_.\\-]{1,64}", value: defaultSetName() });
  const save = h("button", { type: "submit", class: "primary" }, "Save set");
  const saved = h("p", { class: "status", role: "status", id: "steer-saved" });
  const prompt = h("textarea", { id: "steer-prompt", rows: 2, value: "The" });
  const nNew = h("input", { id: "steer-new", type: "number", min: 1, max: 4096, value: 24 });
  const temp = h("input", { id: "steer-temp", type: "number", min: 0, max: 10, step: 0.1, value: 1 });
  const seed = h("input", { id: "steer-seed", type: "number", min: 0, value: 0 });
  const strength = alphaSlider("steer-alpha", 0, 2);
  const gate = h("input", { id: "steer-gate", type: "number", min: 0, max: 1, step: 0.05, placeholder: "everywhere" });
  const compare = h("button", { type: "submit", disabled: true }, "Generate with and without");
  const genStatus = h("p", { class: "status", role: "status" });
  const genOut = h("div", { class: "compare-out" });
  const chosen = () => boxes.filter((b) => b.checked).map((b) => Number(b.value));
  const saveForm = h("form", { class: "row", "aria-label": "Save set" }, field("Set name", name), save, saved);
  const genForm = h("form", { class: "card form", "aria-label": "Compare generations" }, field("Prompt", prompt),
    h("div", { class: "row" }, field("New tokens", nNew), field("Temperature", temp), field("Seed", seed)),
    h("div", { class: "row" }, field("Strength of the set", strength.wrap, "×0 removes it, ×1 leaves the model as it is, " +
      "above 1 boosts it."), field("Only where the context carries it", gate, "A share of the activation mass " +
      "(0-1) the set must hold over the last 16 tokens for the strength to apply; empty: everywhere. Leaves " +
      "other text as the model writes it."), compare, genStatus));
  clear(out,
    h("p", { class: "muted", id: "steer-summary" }, `Topic: ${res.topic.tokens} tokens of ${res.topic.documents} ` +
      `${res.topic.source}; against ${res.contrast.source} (${res.contrast.tokens} tokens).`),
    res.selection ? h("p", { id: "steer-selection" }, selectionText(res.selection)) : null,
    res.selection && (res.selection.cost_by_text || []).length ? costList(res.selection.cost_by_text) : null,
    res.selection && (res.selection.strengths || []).length ? strengthText(res.selection.strengths) : null,
    table(["use", "prototype", "label", "ratio", "share of topic", "tokens", "docs", "strongest topic context"], rows),
    h("div", { class: "card" }, saveForm), genForm, genOut);

  saveForm.addEventListener("submit", async (e) => {
    e.preventDefault();
    const ids = chosen();
    if (!ids.length) { saved.textContent = "Tick at least one prototype."; return; }
    await busy(save, saved, "Saving…", async () => {
      try {
        await api("PUT", `/v1/prototype-sets/${encodeURIComponent(name.value)}`,
          { body: { prototypes: ids, description: `discovered from ${res.topic.source}` } });
        saved.textContent = `Saved “${name.value}” (${ids.length} prototypes).`;
        compare.disabled = false;
      } catch (err) {
        saved.textContent = "";
        clear(genOut, errorBox(err));
      }
    });
  });

  genForm.addEventListener("submit", async (e) => {
    e.preventDefault();
    const base = { prompt: prompt.value, max_new_tokens: Number(nNew.value), temperature: Number(temp.value), seed: Number(seed.value) };
    await busy(compare, genStatus, "Generating…", async () => {
      try {
        const [plain, supp] = await Promise.all([api("POST", "/v1/generate", { body: base }),
          api("POST", "/v1/generate", { body: { ...base, suppress: name.value, alpha: Number(strength.input.value),
            ...(gate.value === "" ? {} : { gate: Number(gate.value) }) } })]);
        showCompare(genOut, base.prompt, plain, supp);
      } catch (err) {
        clear(genOut, errorBox(err));
      }
    });
  });
}

// Generate with suppression: the same prompt with and without a set of prototypes, side by side.

import { api } from "../api.js";
import { clear, field, h, hashLink, parseIds } from "../dom.js";
import { busy, errorBox, protoLink } from "../ui.js";

let lastPrompt = "";

export async function render(root, { params }) {
  const prompt = h("textarea", { id: "gen-prompt", rows: 3, required: true, value: params.get("prompt") || lastPrompt });
  const ids = h("input", { id: "gen-suppress", type: "text", inputmode: "numeric", value: params.get("suppress") || "",
    placeholder: "e.g. 17, 42", spellcheck: "false" });
  const sets = h("select", { id: "gen-set" }, h("option", { value: "" }, "— none —"));
  const nNew = h("input", { id: "gen-new", type: "number", min: 1, max: 4096, value: params.get("n") || 16 });
  const temp = h("input", { id: "gen-temp", type: "number", min: 0, max: 10, step: 0.1, value: 0 });
  const seed = h("input", { id: "gen-seed", type: "number", min: 0, value: 0 });
  const submit = h("button", { type: "submit", class: "primary" }, "Compare");
  const status = h("p", { class: "status", role: "status" });
  const out = h("div", { class: "compare-out" });
  const form = h("form", { class: "card form", "aria-label": "Generation" },
    field("Prompt", prompt),
    h("div", { class: "row" }, field("Suppress prototypes", ids, "Ids, separated by commas or spaces."),
      field("or a stored set", sets)),
    h("div", { class: "row" }, field("New tokens", nNew), field("Temperature (0 = greedy)", temp), field("Seed", seed)),
    h("div", { class: "row" }, submit, status));
  root.append(h("h1", {}, "Generate with suppression"),
    h("p", { class: "lede" }, "Suppressed prototypes contribute nothing to the logits; everything else stays as it is. " +
      "Compare the output with and without them."), form, out);

  api("GET", "/v1/prototype-sets").then((res) => {
    for (const s of res.sets) {
      sets.append(h("option", { value: s.name }, `${s.name} (${s.prototypes.length})`));
    }
  }).catch(() => { /* the set list is optional */ });

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    let suppress;
    try {
      suppress = sets.value || parseIds(ids.value);
    } catch (err) {
      clear(out, errorBox(err));
      return;
    }
    if (!sets.value && !suppress.length) {
      clear(out, errorBox(new Error("Give at least one prototype id to suppress, or choose a stored set.")));
      return;
    }
    lastPrompt = prompt.value;
    const base = { prompt: prompt.value, max_new_tokens: Number(nNew.value), temperature: Number(temp.value), seed: Number(seed.value) };
    await busy(submit, status, "Generating…", async () => {
      try {
        const [plain, supp] = await Promise.all([api("POST", "/v1/generate", { body: base }),
          api("POST", "/v1/generate", { body: { ...base, suppress } })]);
        showCompare(out, base.prompt, plain, supp);
      } catch (err) {
        clear(out, errorBox(err));
      }
    });
  });
}

function commonPrefix(a, b) {
  let i = 0;
  while (i < a.length && i < b.length && a[i] === b[i]) i++;
  return i;
}

export function showCompare(out, prompt, plain, supp) {
  const sameTokens = commonPrefix(plain.token_ids, supp.token_ids);
  const identical = sameTokens === plain.token_ids.length && sameTokens === supp.token_ids.length;
  const cut = commonPrefix(Array.from(plain.completion), Array.from(supp.completion));
  const column = (title, res, cls) => {
    const chars = Array.from(res.completion);
    return h("section", { class: `card gen ${cls}` }, h("h2", {}, title),
      h("p", { class: "gen-text" }, h("span", { class: "prompt-text" }, prompt),
        h("span", { class: "same" }, chars.slice(0, cut).join("")),
        cut < chars.length ? h("mark", { class: "diff" }, chars.slice(cut).join("")) : null),
      h("p", { class: "muted" }, `${res.token_ids.length} tokens${res.stopped ? ", ended at end-of-text" : ""}`));
  };
  const named = supp.suppress_set ? `set “${supp.suppress_set}”: ` : "";
  clear(out,
    h("p", { class: identical ? "verdict same" : "verdict differs", role: "status", id: "verdict" },
      identical ? "Identical: suppressing these prototypes does not change this output."
        : `The outputs differ from generated token ${sameTokens + 1} on.`),
    h("div", { class: "two compare" },
      column("Without suppression", plain, "plain"),
      column(`With ${supp.suppressed.length} prototypes suppressed`, supp, "suppressed")),
    h("p", { class: "chips" }, h("span", { class: "muted" }, `Suppressed (${named}${supp.suppressed.length}): `),
      supp.suppressed.slice(0, 64).map((id) => h("span", { class: "chip" }, protoLink(id))),
      supp.suppressed.length > 64 ? ` … and ${supp.suppressed.length - 64} more` : null),
    h("p", {}, h("a", { href: hashLink("attribute", { prompt }) }, "Attribute this prompt →")));
}

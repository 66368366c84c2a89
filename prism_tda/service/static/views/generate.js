// Generate with suppression or graded strength: the same prompt with and without prototypes, side by side.

import { api } from "../api.js";
import { alphaSlider, clear, field, h, hashLink, num, parseIds, pct } from "../dom.js";
import { busy, errorBox, protoLink } from "../ui.js";

let lastPrompt = "";

export async function render(root, { params }) {
  const prompt = h("textarea", { id: "gen-prompt", rows: 3, required: true, value: params.get("prompt") || lastPrompt });
  const ids = h("input", { id: "gen-suppress", type: "text", inputmode: "numeric", value: params.get("suppress") || "",
    placeholder: "e.g. 17, 42", spellcheck: "false" });
  const sets = h("select", { id: "gen-set" }, h("option", { value: "" }, "— none —"));
  const strength = alphaSlider("gen-alpha", Number(params.get("alpha") || 0));
  const perSet = h("div", { id: "gen-sets", class: "set-sliders" });
  const sliders = new Map(); // set name -> its slider
  const nNew = h("input", { id: "gen-new", type: "number", min: 1, max: 4096, value: params.get("n") || 16 });
  const temp = h("input", { id: "gen-temp", type: "number", min: 0, max: 10, step: 0.1, value: 0 });
  const seed = h("input", { id: "gen-seed", type: "number", min: 0, value: 0 });
  const submit = h("button", { type: "submit", class: "primary" }, "Compare");
  const status = h("p", { class: "status", role: "status" });
  const out = h("div", { class: "compare-out" });
  const form = h("form", { class: "card form", "aria-label": "Generation" },
    field("Prompt", prompt),
    h("div", { class: "row" }, field("Suppress prototypes", ids, "Ids, separated by commas or spaces."),
      field("or a stored set", sets), field("at strength", strength.wrap, "×0 removes them (suppression), ×1 leaves " +
        "the model as it is, above 1 boosts them.")),
    perSet,
    h("div", { class: "row" }, field("New tokens", nNew), field("Temperature (0 = greedy)", temp), field("Seed", seed)),
    h("div", { class: "row" }, submit, status));
  root.append(h("h1", {}, "Generate with suppression"),
    h("p", { class: "lede" }, "Suppressed prototypes contribute nothing to the logits; at another strength their " +
      "activations are scaled instead. Everything else stays as it is. Compare the output with and without them."),
    form, out);

  api("GET", "/v1/prototype-sets").then((res) => {
    for (const s of res.sets) {
      sets.append(h("option", { value: s.name }, `${s.name} (${s.prototypes.length})`));
    }
    if (res.sets.length) {
      const rows = res.sets.map((s) => {
        const slider = alphaSlider(`gen-set-${s.name}`, 1);
        sliders.set(s.name, slider);
        return h("div", { class: "row set-slider" }, h("label", { for: slider.input.id }, `${s.name} (${s.prototypes.length})`),
          slider.wrap);
      });
      perSet.append(h("p", { class: "hint" }, "Each stored set at its own strength (×1: untouched):"), ...rows);
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
    const steer = [...sliders].filter(([, s]) => Number(s.input.value) !== 1)
      .map(([name, s]) => ({ prototypes: name, alpha: Number(s.input.value) }));
    if (!sets.value && !suppress.length && !steer.length) {
      clear(out, errorBox(new Error("Give at least one prototype id to suppress, choose a stored set, or move a " +
        "set's strength away from ×1.")));
      return;
    }
    lastPrompt = prompt.value;
    const base = { prompt: prompt.value, max_new_tokens: Number(nNew.value), temperature: Number(temp.value), seed: Number(seed.value) };
    const steered = { ...base, ...(sets.value || suppress.length ? { suppress, alpha: Number(strength.input.value) } : {}),
      ...(steer.length ? { steer } : {}) };
    await busy(submit, status, "Generating…", async () => {
      try {
        const [plain, supp] = await Promise.all([api("POST", "/v1/generate", { body: base }),
          api("POST", "/v1/generate", { body: steered })]);
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
  const terms = supp.steered || [];
  const n = new Set(terms.flatMap((t) => t.prototypes)).size;
  const allZero = terms.every((t) => t.alpha === 0);
  const where = supp.gate == null ? "" : ` where they hold ${pct(supp.gate, 0)} of the last ${supp.gate_window} tokens`;
  const what = (allZero ? `${n} prototypes suppressed` : `${n} prototypes scaled`) + where;
  clear(out,
    h("p", { class: identical ? "verdict same" : "verdict differs", role: "status", id: "verdict" },
      identical ? `Identical: ${allZero ? "suppressing" : "scaling"} these prototypes does not change this output.`
        : `The outputs differ from generated token ${sameTokens + 1} on.`),
    h("div", { class: "two compare" },
      column("The model as it is", plain, "plain"),
      column(`With ${what}`, supp, "suppressed")),
    terms.map((t) => h("p", { class: "chips" },
      h("span", { class: "muted" }, `×${num(t.alpha, 2)}${t.set ? ` set “${t.set}”` : ""} (${t.prototypes.length}): `),
      t.prototypes.slice(0, 64).map((id) => h("span", { class: "chip" }, protoLink(id))),
      t.prototypes.length > 64 ? ` … and ${t.prototypes.length - 64} more` : null)),
    h("p", {}, h("a", { href: hashLink("attribute", { prompt }) }, "Attribute this prompt →")));
}

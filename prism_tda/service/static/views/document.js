// One training document.

import { api } from "../api.js";
import { clear, h } from "../dom.js";
import { errorBox } from "../ui.js";

export async function render(root, { args }) {
  const id = Number(args[0]);
  const body = h("div", {}, h("p", { class: "muted", role: "status" }, "Loading…"));
  root.append(h("h1", {}, `Document ${id}`), body);
  try {
    const d = await api("GET", `/v1/documents/${id}`);
    const meta = [["corpus id", d.external_id], ["source", d.source], ["title", d.title], ["url", d.url],
      ["tokens", d.n_tokens]].filter(([, v]) => v != null && v !== "");
    clear(body,
      h("dl", { class: "stats" }, meta.map(([k, v]) => h("div", {}, h("dt", {}, k), h("dd", {}, String(v))))),
      h("pre", { class: "doc-text card" }, d.text),
      h("p", {}, h("button", { type: "button", onclick: () => history.back() }, "← back")));
  } catch (e) {
    clear(body, errorBox(e));
  }
}

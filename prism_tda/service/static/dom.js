// Small DOM helpers. Text always goes in as text nodes: nothing from the server is parsed as HTML.

export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "style") for (const [p, val] of Object.entries(v)) el.style.setProperty(p, val);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "value") el.value = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const c of [children].flat(Infinity)) {
    if (c == null || c === false) continue;
    el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

export function clear(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

/** A number with `d` decimals (no "-0.000"). */
export function num(x, d = 3) {
  if (x == null || Number.isNaN(x)) return "–";
  const s = Number(x).toFixed(d);
  return /^-0\.?0*$/.test(s) ? s.slice(1) : s;
}

export function pct(x, d = 0) {
  return x == null ? "–" : `${(100 * x).toFixed(d)}%`;
}

/** A token as text with its whitespace made visible (newline, tab) but kept readable. */
export function showToken(t) {
  return t.replace(/\n/g, "↵").replace(/\t/g, "⇥");
}

/** Text with `<mark>`s over [start, end) code-point ranges, each with a weight in [0, 1]. */
export function marked(text, spans) {
  const chars = Array.from(text);  // offsets count code points, as the server does
  const out = [];
  let at = 0;
  for (const s of [...spans].sort((a, b) => a.start - b.start)) {
    if (s.start < at || s.end > chars.length) continue;
    if (s.start > at) out.push(chars.slice(at, s.start).join(""));
    const w = Math.max(0, Math.min(1, s.weight ?? 1));
    out.push(h("mark", { style: { "--w": w.toFixed(3) }, title: `weight ${num(s.weight)}` },
      chars.slice(s.start, s.end).join("")));
    at = s.end;
  }
  if (at < chars.length) out.push(chars.slice(at).join(""));
  return out;
}

export function field(label, control, hint) {
  const id = control.id || (control.id = `f-${Math.random().toString(36).slice(2, 9)}`);
  return h("div", { class: "field" }, h("label", { for: id }, label), control,
    hint ? h("p", { class: "hint" }, hint) : null);
}

/** Parse "1, 2 3" into unique non-negative integers; throws on anything else. */
export function parseIds(text) {
  const parts = String(text || "").split(/[\s,]+/).filter(Boolean);
  const ids = parts.map((p) => {
    if (!/^\d+$/.test(p)) throw new Error(`"${p}" is not a prototype id (a whole number)`);
    return Number(p);
  });
  return [...new Set(ids)];
}

export function hashLink(path, params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) if (v != null && v !== "") q.set(k, v);
  const s = q.toString();
  return `#/${path}${s ? `?${s}` : ""}`;
}

/** A strength slider (0 removes, 1 leaves as is, above 1 boosts) with its value shown beside it. */
export function alphaSlider(id, value = 0, max = 4) {
  const input = h("input", { id, type: "range", min: 0, max, step: 0.05, value, "aria-valuetext": `×${value}` });
  const shown = h("output", { for: id, class: "alpha-value" }, `×${Number(value).toFixed(2)}`);
  input.addEventListener("input", () => {
    shown.textContent = `×${Number(input.value).toFixed(2)}`;
    input.setAttribute("aria-valuetext", shown.textContent);
  });
  return { input, shown, wrap: h("span", { class: "alpha" }, input, shown) };
}

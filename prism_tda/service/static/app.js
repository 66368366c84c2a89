// The page's shell: hash routes, the index choice, the API key field.

import { api, session } from "./api.js";
import { clear, h } from "./dom.js";
import { errorBox } from "./ui.js";
import * as attribute from "./views/attribute.js";
import * as audits from "./views/audits.js";
import * as documents from "./views/document.js";
import * as generate from "./views/generate.js";
import * as prototypes from "./views/prototypes.js";
import * as sql from "./views/sql.js";
import * as steer from "./views/steer.js";

const ROUTES = {
  attribute: attribute.render,
  prototypes: prototypes.renderList,
  prototype: prototypes.renderOne,
  generate: generate.render,
  steer: steer.render,
  audits: audits.render,
  document: documents.render,
  sql: sql.render,
};
const NAV = { prototype: "prototypes", document: "attribute" };

const main = document.getElementById("view");
let cleanup = null;
let first = true;

function parseHash() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [path, query] = raw.split("?");
  const parts = (path || "attribute").split("/").filter(Boolean).map(decodeURIComponent);
  return { name: parts[0], args: parts.slice(1), params: new URLSearchParams(query || "") };
}

async function route() {
  if (cleanup) { cleanup(); cleanup = null; }
  const { name, args, params } = parseHash();
  const view = ROUTES[name];
  for (const a of document.querySelectorAll("nav a[data-view]")) {
    a.toggleAttribute("aria-current", a.dataset.view === (NAV[name] || name));
    if (a.hasAttribute("aria-current")) a.setAttribute("aria-current", "page");
  }
  clear(main);
  if (!view) {
    main.append(h("h1", {}, "Not found"), h("p", {}, "No such view. ", h("a", { href: "#/attribute" }, "Attribute an output")));
    return;
  }
  // each route renders into its own element: a view still loading after the user moved on writes nowhere
  const root = h("div", { class: "page" });
  main.append(root);
  try {
    cleanup = (await view(root, { args, params })) || null;
  } catch (e) {
    root.append(errorBox(e));
  }
  if (!first && root.isConnected) {
    const heading = root.querySelector("h1");
    if (heading) { heading.tabIndex = -1; heading.focus(); } else main.focus();
  }
  first = false;
}

function setupKey() {
  const input = document.getElementById("api-key");
  const state = document.getElementById("key-state");
  const show = () => {
    state.textContent = session.key ? "A key is set for this tab (sessionStorage)." :
      "No key set. Kept in this browser tab only (sessionStorage).";
  };
  input.value = session.key;
  show();
  document.getElementById("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    session.key = input.value.trim();
    show();
    route();
  });
  document.getElementById("key-forget").addEventListener("click", () => {
    session.key = "";
    input.value = "";
    show();
  });
}

async function setupIndexes() {
  const status = document.getElementById("server-state");
  try {
    const ready = await api("GET", "/readyz");
    const names = ready.indexes.map((i) => i.name);
    if (!names.includes(session.index)) session.index = ready.default_index;
    const select = document.getElementById("index-select");
    clear(select, ready.indexes.map((i) => h("option", { value: i.name }, `${i.name} (${i.documents} documents)`)));
    select.value = session.index;
    document.getElementById("index-label").hidden = names.length < 2;
    select.addEventListener("change", () => { session.index = select.value; route(); });
    const ix = ready.indexes.find((i) => i.name === session.index);
    status.textContent = ix ? `${ix.name}: ${ix.documents} documents, ${ix.tokens} tokens, ${ix.prototypes} prototypes` : "";
  } catch (e) {
    status.textContent = `The server is not ready: ${e.message}`;
  }
}

setupKey();
window.addEventListener("hashchange", route);
setupIndexes().then(route);

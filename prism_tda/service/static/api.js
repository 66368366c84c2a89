// The HTTP API: bearer key from sessionStorage, the chosen index, and problem+json errors.

const KEY = "prism.apiKey";
const INDEX = "prism.index";

export const session = {
  get key() { return sessionStorage.getItem(KEY) || ""; },
  set key(v) { v ? sessionStorage.setItem(KEY, v) : sessionStorage.removeItem(KEY); },
  get index() { return sessionStorage.getItem(INDEX) || ""; },
  set index(v) { v ? sessionStorage.setItem(INDEX, v) : sessionStorage.removeItem(INDEX); },
};

/** An RFC 9457 problem returned by the server (or made up here when the answer was not one). */
export class ApiError extends Error {
  constructor(problem, status) {
    super(problem.detail || problem.title || `HTTP ${status}`);
    this.problem = problem;
    this.status = status;
  }
  get kind() { return (this.problem.type || "").replace("urn:prism-tda:problem:", ""); }
}

/** Call the API. GET requests carry the index as a query parameter, others in the JSON body. */
export async function api(method, path, { body, query, raw = false, signal } = {}) {
  const url = new URL(path, location.origin);
  const q = { ...(query || {}) };
  if (method === "GET" && session.index && path.startsWith("/v1/")) q.index = session.index;
  for (const [k, v] of Object.entries(q)) if (v != null) url.searchParams.set(k, v);
  const headers = { Accept: "application/json, application/problem+json" };
  if (session.key) headers.Authorization = `Bearer ${session.key}`;
  let payload;
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    payload = JSON.stringify(session.index && !("index" in body) ? { ...body, index: session.index } : body);
  }
  let res;
  try {
    res = await fetch(url, { method, headers, body: payload, signal });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError({ title: "The server cannot be reached", detail: String(e.message || e) }, 0);
  }
  if (!res.ok) {
    const text = await res.text();
    let problem;
    try { problem = JSON.parse(text); } catch { problem = null; }
    if (!problem || typeof problem !== "object") problem = { title: res.statusText || "Error", detail: text.slice(0, 500) };
    if (Array.isArray(problem.detail)) problem.detail = problem.detail.map((d) => d.msg || JSON.stringify(d)).join("; ");
    throw new ApiError(problem, res.status);
  }
  return raw ? res : res.json();
}

/** Download an API response as a file (links cannot carry the Authorization header). */
export async function download(path, query, filename) {
  const res = await api("GET", path, { query, raw: true });
  const url = URL.createObjectURL(await res.blob());
  const a = Object.assign(document.createElement("a"), { href: url, download: filename });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

// Shared by every page: calls to the API through the session, errors in plain words, small DOM helpers.

const CSRF = document.querySelector('meta[name="csrf-token"]')?.content ?? "";
export const app = document.getElementById("app");

/** A JSON call to the public API (`/v1` + path) as the signed-in key; throws Error(the API's message). */
export async function api(path, { method = "GET", body, signal } = {}) {
  const response = await send(path, { method, body, signal });
  if (response.status === 204) return null;
  return response.json();
}

/** The raw Response of an API call (for streams); throws Error(the API's message) on an error status. */
export async function send(path, { method = "GET", body, signal } = {}) {
  const headers = { accept: "application/json" };
  if (method !== "GET") headers["x-csrf-token"] = CSRF;
  if (body !== undefined) headers["content-type"] = "application/json";
  const response = await fetch(`/dashboard/api/v1${path}`, {
    method, headers, signal, credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!response.ok) throw await apiError(response);
  return response;
}

/** A dashboard route of its own (not the public API), with the same error handling. */
export async function dashboard(path) {
  const response = await fetch(`/dashboard${path}`, { credentials: "same-origin", headers: { accept: "application/json" } });
  if (!response.ok) throw await apiError(response);
  return response.json();
}

async function apiError(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    if (body?.error?.message) message = body.error.message;
    code = body?.error?.code ?? null;
  } catch { /* not JSON: keep the status line */ }
  if (code === "no_dashboard_session") location.assign("/dashboard/login");
  const error = new Error(message);
  error.status = response.status;
  return error;
}

/** Show an error in the page's alert box (null hides it). */
export function showError(error) {
  const box = document.getElementById("error");
  if (!error) { box.hidden = true; box.textContent = ""; return; }
  const text = error instanceof Error ? error.message : String(error);
  box.textContent = error?.status === 404 ? `Not found: ${text}` : text;
  box.hidden = false;
}

/** Run `fn`, showing any error it throws instead of a blank page. */
export async function guard(fn) {
  try { return await fn(); } catch (error) { showError(error); return undefined; }
}

/** `el("a", {href}, "text", child)`: an element; text is always text, never HTML. */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/** A table of `rows` with `columns`: [[heading, row => cell content], ...]. */
export function table(columns, rows, empty = "Nothing yet.") {
  if (!rows.length) return el("p", { class: "muted" }, empty);
  return el("div", { class: "scroll" }, el("table", {},
    el("thead", {}, el("tr", {}, columns.map(([head]) => el("th", { scope: "col" }, head)))),
    el("tbody", {}, rows.map((row) => el("tr", {}, columns.map(([, cell]) => el("td", {}, cell(row))))))));
}

export const when = (seconds) => (seconds ? new Date(seconds * 1000).toLocaleString() : "—");
export const money = (usd) => (usd === undefined || usd === null ? "—" : `$${Number(usd).toFixed(4)}`);
export const bytes = (n) => (n < 1024 ? `${n} B` : n < 1048576 ? `${(n / 1024).toFixed(1)} KiB` : `${(n / 1048576).toFixed(1)} MiB`);
export const isAdmin = app?.dataset.admin === "true";

/** Replace the page's content with `nodes`. */
export function render(...nodes) { app.replaceChildren(...nodes.flat().filter((n) => n !== null && n !== undefined)); }

/** Call `fn` now and every `ms` while the page is visible. */
export function every(ms, fn) {
  let timer;
  const tick = async () => { await fn(); timer = setTimeout(tick, ms); };
  tick();
  return () => clearTimeout(timer);
}

document.getElementById("sign-out")?.addEventListener("click", async () => {
  await fetch("/dashboard/session", { method: "DELETE", headers: { "x-csrf-token": CSRF }, credentials: "same-origin" });
  location.assign("/dashboard/login");
});

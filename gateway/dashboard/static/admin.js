// Administration (admin key): organisations, their keys (a new key is shown once; revoke), rate limits
// and the monthly budget.
import { api, el, guard, isAdmin, money, render, showError, table, when } from "./common.js";

const orgSelect = el("select", { id: "org", "aria-label": "Organisation" });
const keys = el("section", { id: "keys", "aria-label": "API keys" });
const created = el("div", { "aria-live": "polite" });
const limits = el("section", { class: "card", "aria-label": "Limits and budget" });
const org = () => orgSelect.value;

async function loadOrgs(selected) {
  const orgs = (await api("/admin/organizations")).data;
  orgSelect.replaceChildren(...orgs.map((o) => el("option", { value: o.id, selected: o.id === selected }, `${o.name} (${o.id})`)));
  return orgs;
}

async function loadKeys() {
  if (!org()) return;
  const listed = (await api(`/admin/organizations/${org()}/api_keys`)).data;
  keys.replaceChildren(table([
    ["Name", (k) => k.name ?? "—"],
    ["Key", (k) => k.redacted_value],
    ["Created", (k) => when(k.created_at)],
    ["Last used", (k) => when(k.last_used_at)],
    ["", (k) => k.revoked_at ? el("span", { class: "muted" }, `revoked ${when(k.revoked_at)}`) : el("button", {
      type: "button", class: "plain",
      onclick: () => guard(async () => {
        if (!confirm(`Revoke ${k.name ?? k.redacted_value}? Every client using it stops working.`)) return;
        await api(`/admin/api_keys/${k.id}`, { method: "DELETE" });
        await loadKeys();
      }),
    }, "Revoke")],
  ], listed, "No keys."));
}

async function loadLimits() {
  if (!org()) return;
  const got = await api(`/admin/organizations/${org()}/limits`);
  const rpm = el("input", { id: "rpm", type: "number", min: 1, value: got.organization.max_requests_per_1_minute ?? "" });
  const tpm = el("input", { id: "tpm", type: "number", min: 1, value: got.organization.max_tokens_per_1_minute ?? "" });
  const budget = el("input", { id: "budget", type: "number", min: 0, step: "0.01", value: got.billing.monthly_budget_usd ?? "" });
  const num = (input) => (input.value === "" ? null : Number(input.value));
  const form = el("form", {},
    el("div", { class: "row" },
      el("label", { for: "rpm" }, "Requests / min"), rpm,
      el("label", { for: "tpm" }, "Tokens / min"), tpm,
      el("label", { for: "budget" }, "Monthly budget (USD)"), budget),
    el("button", { type: "submit", id: "save-limits" }, "Save limits and budget"));
  form.addEventListener("submit", (event) => guard(async () => {
    event.preventDefault();
    await api(`/admin/organizations/${org()}/limits`, { method: "POST", body: { max_requests_per_1_minute: num(rpm), max_tokens_per_1_minute: num(tpm) } });
    await api(`/admin/organizations/${org()}/billing`, { method: "POST", body: { monthly_budget_usd: num(budget) } });
    showError(null);
    await loadLimits();
  }));
  limits.replaceChildren(el("h2", {}, "Limits and budget"),
    el("p", {}, `Spent this month: ${money(got.billing.month_to_date_usd)}. Empty fields mean unlimited.`), form);
}

async function refresh() {
  created.replaceChildren();
  await Promise.all([loadKeys(), loadLimits()]);
}

async function start() {
  if (!isAdmin) {
    render(el("p", {}, "Administration needs the admin key."));
    return;
  }
  const name = el("input", { id: "new-org-name", type: "text", required: true, maxlength: 200 });
  const newOrg = el("form", { class: "card" }, el("label", { for: "new-org-name" }, "New organisation"), name,
    el("button", { type: "submit", id: "create-org" }, "Create organisation"));
  newOrg.addEventListener("submit", (event) => guard(async () => {
    event.preventDefault();
    const made = await api("/admin/organizations", { method: "POST", body: { name: name.value } });
    name.value = "";
    await loadOrgs(made.id);
    await refresh();
  }));
  const keyName = el("input", { id: "new-key-name", type: "text", maxlength: 200 });
  const newKey = el("form", { class: "card" }, el("label", { for: "new-key-name" }, "New API key for this organisation (name)"), keyName,
    el("button", { type: "submit", id: "create-key" }, "Create key"), created);
  newKey.addEventListener("submit", (event) => guard(async () => {
    event.preventDefault();
    const made = await api(`/admin/organizations/${org()}/api_keys`, { method: "POST", body: { name: keyName.value || null } });
    keyName.value = "";
    await loadKeys();
    created.replaceChildren(el("p", {}, "Copy the key now: it is not shown again."), el("div", { class: "key-once" }, made.key));
  }));
  orgSelect.addEventListener("change", () => guard(refresh));
  render(newOrg, el("label", { for: "org" }, "Organisation"), orgSelect, newKey, el("h2", {}, "API keys"), keys, limits);
  await loadOrgs();
  await refresh();
}

guard(start);

// Jobs: every job of the organisation with status, method, model, progress and cost, refreshed every 3 s.
import { api, el, every, guard, isAdmin, money, render, showError, table, when } from "./common.js";

function progress(job) {
  const steps = job.usage?.steps ?? 0;
  const hp = job.method?.[job.method?.type]?.hyperparameters ?? {};
  const total = typeof hp.max_steps === "number" && hp.max_steps > 0 ? hp.max_steps : null;
  const bar = total ? el("progress", { max: total, value: Math.min(steps, total), "aria-label": "steps done" }) : null;
  return el("span", { class: "progress" }, bar, total ? ` ${steps} / ${total}` : `${steps} steps`);
}

async function refresh() {
  const page = await api("/fine_tuning/jobs?limit=100");
  showError(null);
  render(table([
    ["Job", (j) => el("a", { href: `/dashboard/jobs/${encodeURIComponent(j.id)}` }, j.id)],
    ["Status", (j) => el("span", { class: `status ${j.status}` }, j.status)],
    ["Method", (j) => j.method?.type ?? "—"],
    ["Model", (j) => j.fine_tuned_model ?? j.model],
    ["Progress", progress],
    ["Cost", (j) => money(j.usage?.cost_usd)],
    ["Created", (j) => when(j.created_at)],
  ], page.data, "No fine-tuning jobs yet: create one with the API or `tunegate quickstart`."));
}

if (isAdmin) {
  render(el("p", {}, "Signed in with the admin key: jobs belong to organisations. See ",
    el("a", { href: "/dashboard/admin" }, "Administration"), " or sign in with an organisation's key."));
} else {
  every(3000, () => guard(refresh));
}

// Evals: each eval with its runs, their status and pass rates (the evals API), refreshed every 5 s.
import { api, el, every, guard, isAdmin, render, showError, table, when } from "./common.js";

const rate = (counts) => (counts && counts.total ? `${((100 * counts.passed) / counts.total).toFixed(1)} %` : "—");

async function refresh() {
  const evals = (await api("/evals?limit=50")).data;
  const sections = await Promise.all(evals.map(async (ev) => {
    const runs = (await api(`/evals/${ev.id}/runs?limit=20`)).data;
    return el("section", { class: "card", "aria-label": ev.name ?? ev.id },
      el("h2", {}, ev.name ?? ev.id), el("p", { class: "muted" }, `${ev.id}, created ${when(ev.created_at)}`),
      table([
        ["Run", (r) => r.name ?? r.id],
        ["Model", (r) => r.model ?? "—"],
        ["Status", (r) => el("span", { class: `status ${r.status}` }, r.status)],
        ["Pass rate", (r) => rate(r.result_counts)],
        ["Passed / failed / errored", (r) => r.result_counts ? `${r.result_counts.passed} / ${r.result_counts.failed} / ${r.result_counts.errored}` : "—"],
        ["Created", (r) => when(r.created_at)],
      ], runs, "No runs yet."));
  }));
  showError(null);
  render(...(sections.length ? sections : [el("p", { class: "muted" }, "No evals yet.")]));
}

if (isAdmin) render(el("p", {}, "Evals belong to organisations: sign in with an organisation's key."));
else every(5000, () => guard(refresh));

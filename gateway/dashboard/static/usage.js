// Usage and costs: by day, model and key (the usage and costs API), training jobs' costs, the monthly
// budget and what is spent of it, and the rate limits.
import { api, dashboard, el, guard, isAdmin, money, render, table } from "./common.js";
import { lineChart } from "./chart.js";

const DAYS = 30;

/** The admin key reads any organisation's usage: `[query parameter, organisation picker]`. */
async function orgParam() {
  if (!isAdmin) return ["", null];
  const orgs = (await api("/admin/organizations")).data;
  const chosen = new URLSearchParams(location.search).get("organization_id") ?? orgs[0]?.id;
  const picker = el("select", { id: "usage-org", "aria-label": "Organisation" },
    orgs.map((o) => el("option", { value: o.id, selected: o.id === chosen }, `${o.name} (${o.id})`)));
  picker.addEventListener("change", () => { location.search = `?organization_id=${encodeURIComponent(picker.value)}`; });
  return [chosen ? `&organization_id=${encodeURIComponent(chosen)}` : "", el("label", {}, "Organisation ", picker)];
}

function sums(buckets, field, value) {
  const out = new Map();
  for (const b of buckets) for (const r of b.results) {
    const name = r[field] ?? "—";
    out.set(name, (out.get(name) ?? 0) + value(r));
  }
  return [...out.entries()].sort((a, b) => b[1] - a[1]);
}

async function start() {
  const [org, picker] = await orgParam();
  const since = Math.floor(Date.now() / 1000 / 86400 - DAYS + 1) * 86400;
  const window = `start_time=${since}&bucket_width=1d&limit=${DAYS}${org}`;
  const [costs, byModel, byKey] = await Promise.all([
    api(`/organization/costs?${window}&group_by=line_item`),
    api(`/organization/usage/completions?${window}&group_by=model`),
    api(`/organization/usage/completions?${window}&group_by=api_key_id`),
  ]);
  const charts = el("section", { class: "grid", "aria-label": "Charts" });
  const budget = el("section", { class: "card", "aria-label": "Budget and limits" });
  const jobs = el("section", { id: "job-costs", "aria-label": "Training jobs" });
  const total = costs.data.reduce((s, b) => s + b.results.reduce((t, r) => t + r.amount.value, 0), 0);
  render(
    picker,
    el("p", {}, `Last ${DAYS} days: `, el("strong", {}, money(total)), "."),
    budget, charts,
    el("h2", {}, "Costs by line item"),
    table([["Line item", ([n]) => n], ["Cost", ([, v]) => money(v)]], sums(costs.data, "line_item", (r) => r.amount.value)),
    el("h2", {}, "Tokens by model"),
    table([["Model", ([n]) => n], ["Tokens", ([, v]) => v.toLocaleString()]],
      sums(byModel.data, "model", (r) => r.input_tokens + r.output_tokens), "No model calls yet."),
    el("h2", {}, "Requests by key"),
    table([["API key", ([n]) => n], ["Requests", ([, v]) => v.toLocaleString()]],
      sums(byKey.data, "api_key_id", (r) => r.num_model_requests), "No model calls yet."),
    el("h2", {}, "Training jobs"), jobs,
  );
  const xs = costs.data.map((b) => b.start_time);
  lineChart(charts, "Cost per day (USD)", ["cost"], { timeAxis: true, bars: true })
    .setData([xs, costs.data.map((b) => b.results.reduce((t, r) => t + r.amount.value, 0))]);
  const models = sums(byModel.data, "model", () => 0).map(([n]) => n);
  if (models.length) {
    lineChart(charts, "Tokens per day by model", models, { timeAxis: true }).setData([
      byModel.data.map((b) => b.start_time),
      ...models.map((m) => byModel.data.map((b) => b.results.filter((r) => r.model === m)
        .reduce((t, r) => t + r.input_tokens + r.output_tokens, 0))),
    ]);
  }
  await guard(() => limits(budget, org));
  if (!isAdmin) {
    const page = await api("/fine_tuning/jobs?limit=100");
    jobs.replaceChildren(table([
      ["Job", (j) => el("a", { href: `/dashboard/jobs/${encodeURIComponent(j.id)}` }, j.id)],
      ["Model", (j) => j.fine_tuned_model ?? j.model],
      ["Trained tokens", (j) => (j.usage?.trained_tokens ?? 0).toLocaleString()],
      ["Training time", (j) => `${(j.usage?.training_seconds ?? 0).toFixed(1)} s`],
      ["Cost", (j) => money(j.usage?.cost_usd)],
    ], page.data, "No training jobs yet."));
  }
}

async function limits(box, org) {
  const id = new URLSearchParams(org.slice(1)).get("organization_id");
  const got = isAdmin ? (id ? await api(`/admin/organizations/${id}/limits`) : null) : await dashboard("/data/limits");
  if (!got) return;
  const b = got.billing;
  const spent = b.month_to_date_usd ?? 0;
  const per = (l) => `${l.max_requests_per_1_minute ?? "unlimited"} requests / min, ${l.max_tokens_per_1_minute ?? "unlimited"} tokens / min`;
  box.replaceChildren(el("h2", {}, "Budget and limits"), el("dl", { class: "facts" },
    el("dt", {}, "Monthly budget"), el("dd", {}, b.monthly_budget_usd === null ? "none" : money(b.monthly_budget_usd)),
    el("dt", {}, "Spent this month"), el("dd", {}, money(spent),
      b.monthly_budget_usd ? [" ", el("progress", { max: b.monthly_budget_usd, value: Math.min(spent, b.monthly_budget_usd), "aria-label": "budget spent" })] : null),
    el("dt", {}, "Organisation"), el("dd", {}, per(got.organization)),
    got.api_keys.map((k) => [el("dt", {}, `Key ${k.api_key_id}`), el("dd", {}, per(k))]),
  ));
}

guard(start);

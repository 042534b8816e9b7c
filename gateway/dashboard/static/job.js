// One job: live curves from its metrics events, its events log, checkpoints, controls and settings.
import { api, dashboard, el, guard, money, render, showError, table, when } from "./common.js";
import { lineChart } from "./chart.js";

const jobId = document.getElementById("app").dataset.jobId;
const FINAL = new Set(["succeeded", "failed", "cancelled"]);
/** Curves and the metrics that feed them (the first of each that a job reports is drawn). */
const GROUPS = [
  ["Reward", (n) => n === "reward_mean" || /^(full_)?valid_.*reward/.test(n) || (/^rewards\//.test(n) && !n.endsWith("/std"))],
  ["Loss", (n) => n === "train_loss" || /^(full_)?valid_loss$/.test(n)],
  ["KL", (n) => n === "kl"],
  ["Completion length", (n) => n === "completion_length_mean"],
];

const state = { cursor: 0, steps: [], series: {}, charts: new Map(), eventsAfter: null };
const parts = {
  summary: el("section", { class: "card", "aria-label": "Summary" }),
  controls: el("div", { class: "buttons" }),
  curves: el("section", { id: "curves", class: "grid", "aria-label": "Curves" }),
  checkpoints: el("section", { "aria-label": "Checkpoints" }),
  settings: el("section", { "aria-label": "Settings" }),
  events: el("section", { "aria-label": "Events" }),
};

function stepsDone(job) {
  const done = Math.max(job.usage?.steps ?? 0, state.steps.at(-1) ?? 0);
  const total = job.method?.[job.method?.type]?.hyperparameters?.max_steps ?? state.total;
  return total ? `${done} of ${total}` : String(done);
}

/** The job's cost as the API gives it: accrued, projected total, the estimate made when it was queued, and
 * its max_cost (with how much of it is spent) when it has one. */
function costFacts(job) {
  const cost = job.cost ?? {};
  const limit = typeof job.max_cost === "number" ? job.max_cost : null;
  // The shown amount is rounded; `data-usd` keeps the API's number.
  const usd = (id, value, ...more) => el("dd", { id, "data-usd": value ?? null }, money(value), ...more);
  return [
    el("dt", {}, "Cost so far"), usd("job-cost-accrued", cost.accrued),
    el("dt", {}, FINAL.has(job.status) ? "Total cost" : "Projected total"), usd("job-cost-projected", cost.projected_total),
    el("dt", {}, "Estimated when queued"), usd("job-cost-estimated", job.estimated_cost),
    limit === null ? null : [
      el("dt", {}, "Max cost"),
      usd("job-cost-max", limit, " ",
        el("progress", { max: limit, value: Math.min(cost.accrued ?? 0, limit), "aria-label": "share of max cost spent" })),
    ],
  ].flat();
}

function summary(job) {
  const hp = job.method?.[job.method.type] ?? {};
  parts.summary.replaceChildren(
    el("dl", { class: "facts" },
      el("dt", {}, "Job"), el("dd", {}, job.id),
      el("dt", {}, "Status"), el("dd", {}, el("span", { class: `status ${job.status}`, id: "job-status" }, job.status)),
      el("dt", {}, "Method"), el("dd", {}, job.method?.type ?? "—"),
      el("dt", {}, "Base model"), el("dd", {}, job.model),
      el("dt", {}, "Fine-tuned model"), el("dd", {}, job.fine_tuned_model
        ? el("a", { href: `/dashboard/playground?model=${encodeURIComponent(job.fine_tuned_model)}&compare=${encodeURIComponent(job.model)}` }, job.fine_tuned_model)
        : "—"),
      el("dt", {}, "Steps"), el("dd", { id: "job-steps" }, stepsDone(job)),
      el("dt", {}, "Trained tokens"), el("dd", {}, String(job.trained_tokens ?? job.usage?.trained_tokens ?? 0)),
      costFacts(job),
      el("dt", {}, "Created"), el("dd", {}, when(job.created_at)),
      el("dt", {}, "Finished"), el("dd", {}, when(job.finished_at)),
      job.error ? [el("dt", {}, "Error"), el("dd", { class: "bad" }, job.error.message)] : null,
    ),
    parts.controls,
  );
  const act = (verb) => el("button", {
    type: "button", id: `${verb}-job`,
    onclick: () => guard(async () => { await api(`/fine_tuning/jobs/${jobId}/${verb}`, { method: "POST" }); await tick(); }),
  }, verb[0].toUpperCase() + verb.slice(1));
  parts.controls.replaceChildren(
    ...(["queued", "running"].includes(job.status) ? [act("pause")] : []),
    ...(job.status === "paused" ? [act("resume")] : []),
    ...(!FINAL.has(job.status) ? [act("cancel")] : []),
  );
  parts.settings.replaceChildren(...[el("h2", {}, "Settings"),
    el("h3", {}, "Hyperparameters (resolved)"), el("pre", { class: "code" }, JSON.stringify(hp.hyperparameters ?? {}, null, 2)),
    hp.grader ? [el("h3", {}, "Grader"), el("pre", { class: "code" }, JSON.stringify(hp.grader, null, 2))] : null,
    hp.environment ? [el("h3", {}, "Environment"), el("pre", { class: "code" }, JSON.stringify(hp.environment, null, 2))] : null,
    el("p", { class: "muted" }, `Training file ${job.training_file}`, job.validation_file ? `, validation file ${job.validation_file}` : "", `, seed ${job.seed}.`),
  ].flat().filter(Boolean));
}

function plot() {
  const names = Object.keys(state.series);
  for (const [title, matches] of GROUPS) {
    const mine = names.filter(matches);
    if (!mine.length) continue;
    let chart = state.charts.get(title);
    if (!chart || chart.names.join() !== mine.join()) {
      chart?.plot.root.parentElement.remove();
      chart = { names: mine, plot: lineChart(parts.curves, title, mine) };
      state.charts.set(title, chart);
    }
    chart.plot.setData([state.steps, ...mine.map((n) => state.series[n])]);
  }
  if (!state.charts.size) parts.curves.replaceChildren(el("p", { class: "muted" }, "No metrics yet."));
  else parts.curves.querySelector(":scope > p.muted")?.remove();
}

async function curves() {
  const got = await dashboard(`/data/jobs/${encodeURIComponent(jobId)}/metrics?after=${state.cursor}`);
  if (got.count === 0 && state.cursor) return;
  const before = state.steps.length;
  for (const name of Object.keys(got.series)) {
    state.series[name] ??= new Array(before).fill(null);
  }
  state.steps.push(...got.steps);
  for (const name of Object.keys(state.series)) {
    state.series[name].push(...(got.series[name] ?? new Array(got.steps.length).fill(null)));
  }
  state.cursor = got.cursor;
  state.total = got.total_steps ?? state.total;
  parts.curves.dataset.points = String(state.steps.length);
  plot();
}

async function checkpoints() {
  const page = await api(`/fine_tuning/jobs/${jobId}/checkpoints?limit=100`);
  parts.checkpoints.replaceChildren(el("h2", {}, "Checkpoints"), table([
    ["Step", (c) => String(c.step_number)],
    ["Model", (c) => c.fine_tuned_model_checkpoint],
    ["Metrics", (c) => Object.entries(c.metrics ?? {}).filter(([k, v]) => k !== "step" && typeof v === "number")
      .map(([k, v]) => `${k} ${Number(v).toPrecision(4)}`).join(", ")],
    ["", (c) => el("a", { class: "chat-link", href: `/dashboard/playground?model=${encodeURIComponent(c.fine_tuned_model_checkpoint)}` }, "Chat with this checkpoint")],
  ], page.data, "No checkpoints yet."));
}

async function events() {
  const page = await api(`/fine_tuning/jobs/${jobId}/events?limit=200`);
  parts.events.replaceChildren(el("h2", {}, "Events"), el("ol", { class: "log", reversed: true },
    page.data.map((e) => el("li", { class: e.level }, el("time", {}, when(e.created_at)), " ", e.message))));
}

let job;
async function tick() {
  job = await api(`/fine_tuning/jobs/${jobId}`);
  showError(null);
  await curves();
  summary(job);
  await Promise.all([checkpoints(), events()]);
}

async function loop() {
  try {
    await tick();
  } catch (error) {
    showError(error);
    if (error.status === 404 || error.status === 403) {
      render(el("p", {}, el("a", { href: "/dashboard/jobs" }, "Back to the jobs")));
      return;
    }
  }
  setTimeout(loop, job && FINAL.has(job.status) ? 15000 : 1500);
}

render(parts.summary, el("h2", {}, "Curves"), parts.curves, parts.checkpoints, parts.settings, parts.events);
loop();

// Files and environments: uploads with purpose and size; an environment package's manifest (read from the
// package itself), and "Test it": a few tasks through environments/run with a model, and their rewards.
import { api, bytes, el, guard, render, send, table, when } from "./common.js";

/** The text of `wanted` (a file name, at any depth) inside a .tar.gz, read in the browser. */
async function fromTarGz(response, wanted) {
  const tar = new Uint8Array(await new Response(response.body.pipeThrough(new DecompressionStream("gzip"))).arrayBuffer());
  const text = (from, length) => new TextDecoder().decode(tar.subarray(from, from + length)).replace(/\0.*$/s, "");
  for (let at = 0; at + 512 <= tar.length;) {
    const name = text(at, 100);
    if (!name) break;
    const size = parseInt(text(at + 124, 12).trim() || "0", 8);
    const prefix = text(at + 345, 155);
    const path = prefix ? `${prefix}/${name}` : name;
    if (path === wanted || path.endsWith(`/${wanted}`)) return text(at + 512, size);
    at += 512 + Math.ceil(size / 512) * 512;
  }
  return null;
}

async function tasksOf(fileId, count) {
  const response = await send(`/files/${fileId}/content`);
  return (await response.text()).split("\n").filter((l) => l.trim()).slice(0, count).join("\n");
}

async function environment(file, files, models) {
  const manifest = el("pre", { class: "code", id: "manifest" }, "Reading the package…");
  const taskFiles = files.filter((f) => f.purpose === "fine-tune");
  const source = el("select", { id: "task-file", "aria-label": "Tasks from a file" },
    el("option", { value: "" }, "Paste tasks, or take the first three rows of a file…"),
    taskFiles.map((f) => el("option", { value: f.id }, `${f.filename} (${f.id})`)));
  const tasks = el("textarea", { id: "tasks", rows: 5, placeholder: '{"messages": [{"role": "user", "content": "What is 2 + 3?"}], "answer": 5}' });
  const model = el("select", { id: "env-model", "aria-label": "Model that plays" }, models.map((m) => el("option", { value: m }, m)));
  const results = el("div", { id: "env-results", "aria-live": "polite" });
  source.addEventListener("change", () => guard(async () => { if (source.value) tasks.value = await tasksOf(source.value, 3); }));
  const test = el("button", { type: "button", id: "test-env", onclick: () => guard(async () => {
    const rows = tasks.value.split("\n").filter((l) => l.trim()).slice(0, 10).map((l) => JSON.parse(l));
    test.disabled = true;
    results.replaceChildren(el("p", { class: "muted" }, `Running ${rows.length} task(s)…`));
    try {
      const outcomes = [];
      for (const task of rows) {
        outcomes.push([task, await api("/fine_tuning/alpha/environments/run", { method: "POST", body: { file_id: file.id, task, model: model.value } })]);
      }
      results.replaceChildren(table([
        ["Task", ([task]) => String(task.messages?.at(-1)?.content ?? JSON.stringify(task)).slice(0, 120)],
        ["Reward", ([, out]) => (out.reward === null ? el("span", { class: "bad" }, out.error ?? "failed") : String(out.reward))],
        ["Turns", ([, out]) => String(out.turns)],
        ["Stop", ([, out]) => out.stop_reason ?? "—"],
      ], outcomes));
    } finally { test.disabled = false; }
  }) }, "Test it");
  const box = el("section", { class: "card", "aria-label": `Environment ${file.filename}` },
    el("h2", {}, `Environment ${file.filename}`), el("h3", {}, "Manifest (environment.toml)"), manifest,
    el("h3", {}, "Test it"), source, el("label", { for: "tasks" }, "Tasks (JSON lines, up to 10)"), tasks,
    el("label", { for: "env-model" }, "Model"), model, test, results);
  guard(async () => { manifest.textContent = (await fromTarGz(await send(`/files/${file.id}/content`), "environment.toml")) ?? "No environment.toml found."; });
  return box;
}

async function start() {
  const [files, models] = await Promise.all([api("/files?limit=100"), api("/models")]);
  const detail = el("div", {});
  render(table([
    ["File", (f) => f.id],
    ["Name", (f) => f.filename],
    ["Purpose", (f) => f.purpose],
    ["Size", (f) => bytes(f.bytes)],
    ["Status", (f) => f.status],
    ["Uploaded", (f) => when(f.created_at)],
    ["", (f) => f.purpose === "environment" ? el("button", { type: "button", class: "plain", onclick: () => guard(async () => {
      detail.replaceChildren(await environment(f, files.data, models.data.map((m) => m.id)));
    }) }, "Open") : ""],
  ], files.data, "No files yet: upload with the API (purpose fine-tune, evals or environment)."), detail);
}

guard(start);

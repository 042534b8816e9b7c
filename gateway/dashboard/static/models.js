// Models and aliases: the organisation's fine-tuned models with their version and where they are loaded
// (what this gateway knows: loaded, last used, load time, per engine), and its aliases, each movable to
// another model from here (POST /v1/aliases). Refreshed every 5 s.
import { api, el, every, guard, isAdmin, render, showError, table, when } from "./common.js";

const residency = (m) => {
  const engines = m.tunegate?.engines ?? [];
  if (!engines.length) return el("span", { class: "muted" }, "not loaded yet");
  return engines.map((e) => el("div", {},
    `engine ${e.engine}: ${e.loaded ? "loaded" : "not loaded"}`,
    e.load_s === null ? "" : `, load ${e.load_s.toFixed(2)} s`,
    e.last_used === null ? "" : `, last used ${when(e.last_used)}`));
};

/** While a move is being chosen, the refresh leaves the page alone. */
let editing = false;

function moveForm(alias, choices) {
  const select = el("select", { "aria-label": `Move ${alias.name} to`, class: "move-to" },
    choices.map((id) => el("option", { value: id, selected: id === alias.model }, id)));
  select.addEventListener("focus", () => { editing = true; });
  select.addEventListener("blur", () => { editing = false; });
  const button = el("button", { type: "button", class: "plain move", onclick: () => guard(async () => {
    button.disabled = true;
    try {
      await api("/aliases", { method: "POST", body: { name: alias.name, model: select.value } });
      editing = false;
      await refresh();
    } finally { button.disabled = false; }
  }) }, "Move");
  return el("span", {}, select, " ", button);
}

async function refresh() {
  if (editing) return;
  const [models, aliases] = await Promise.all([api("/models"), api("/aliases")]);
  const tuned = models.data.filter((m) => m.tunegate);
  const choices = models.data.map((m) => m.id);
  showError(null);
  render(
    el("section", { class: "card", "aria-label": "Aliases" }, el("h2", {}, "Aliases"),
      el("div", { id: "aliases" }, table([
        ["Alias", (a) => a.name],
        ["Points at", (a) => a.model],
        ["Version", (a) => a.version ?? el("span", { class: "bad" }, "model deleted")],
        ["Moved", (a) => when(a.updated_at)],
        ["Move to", (a) => moveForm(a, choices)],
      ], aliases.data, "No aliases yet: create one with POST /v1/aliases."))),
    el("section", { class: "card", "aria-label": "Fine-tuned models" }, el("h2", {}, "Fine-tuned models"),
      el("div", { id: "models" }, table([
        ["Model", (m) => m.id],
        ["Version", (m) => m.tunegate.version ?? "—"],
        ["Engines", residency],
        ["Created", (m) => when(m.created)],
      ], tuned, "No fine-tuned models yet."))));
}

if (isAdmin) render(el("p", {}, "Models belong to organisations: sign in with an organisation's key."));
else every(5000, () => guard(refresh));

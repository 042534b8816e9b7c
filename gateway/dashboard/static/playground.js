// Playground: chat with any model the organisation may call, one or two side by side, streamed.
import { api, el, guard, render, send, showError } from "./common.js";

const query = new URLSearchParams(location.search);

/** Yield the `data:` payloads of a server-sent event stream. */
async function* sse(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) if (line.startsWith("data:")) yield line.slice(5).trim();
    }
  }
}

function pane(index, models, chosen) {
  const select = el("select", { id: `model-${index}`, "aria-label": `Model ${index + 1}` },
    models.map((m) => el("option", { value: m, selected: m === chosen }, m)));
  const log = el("div", { class: "chat", id: `chat-${index}`, "aria-live": "polite" });
  const box = el("section", { class: "card pane" }, el("label", { for: `model-${index}` }, `Model ${index + 1}`), select, log);
  return { box, select, log, messages: [] };
}

async function ask(p, prompt, settings) {
  p.messages.push({ role: "user", content: prompt });
  p.log.append(el("p", { class: "user" }, prompt));
  const answer = el("p", { class: "assistant", "data-done": "false" });
  p.log.append(answer);
  try {
    const response = await send("/chat/completions", {
      method: "POST",
      body: { model: p.select.value, messages: p.messages, stream: true, ...settings },
    });
    for await (const data of sse(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      answer.append(chunk.choices?.[0]?.delta?.content ?? "");
    }
    p.messages.push({ role: "assistant", content: answer.textContent });
  } catch (error) {
    answer.classList.add("bad");
    answer.textContent = error.message;
    p.messages.pop();
  }
  answer.dataset.done = "true";
}

async function start() {
  const listed = (await api("/models")).data.map((m) => m.id);
  const wanted = [query.get("model"), query.get("compare")].filter(Boolean);
  const models = [...new Set([...wanted, ...listed])];
  const panes = [pane(0, models, query.get("model") ?? models[0]), pane(1, models, query.get("compare") ?? models[0])];
  const compare = el("input", { type: "checkbox", id: "compare", checked: query.has("compare") });
  const showPanes = () => { panes[1].box.hidden = !compare.checked; };
  compare.addEventListener("change", showPanes);
  const temperature = el("input", { id: "temperature", type: "number", min: 0, max: 2, step: 0.1, value: 0.7 });
  const maxTokens = el("input", { id: "max-tokens", type: "number", min: 1, max: 4096, step: 1, value: 64 });
  const prompt = el("textarea", { id: "prompt", rows: 3, required: true, placeholder: "Ask something (Ctrl+Enter sends)" });
  const go = el("button", { type: "submit", id: "send" }, "Send");
  const form = el("form", { class: "card" },
    el("div", { class: "row" },
      el("label", {}, compare, " Compare side by side"),
      el("label", { for: "temperature" }, "Temperature"), temperature,
      el("label", { for: "max-tokens" }, "Max tokens"), maxTokens),
    el("label", { for: "prompt" }, "Message"), prompt, go);
  prompt.addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) form.requestSubmit(); });
  form.addEventListener("submit", (event) => guard(async () => {
    event.preventDefault();
    showError(null);
    const text = prompt.value.trim();
    if (!text) return;
    prompt.value = "";
    go.disabled = true;
    const settings = { temperature: Number(temperature.value), max_tokens: Number(maxTokens.value) };
    await Promise.all(panes.filter((p) => !p.box.hidden).map((p) => ask(p, text, settings)));
    go.disabled = false;
    prompt.focus();
  }));
  showPanes();
  render(el("div", { class: "grid two" }, panes.map((p) => p.box)), form);
}

guard(start);

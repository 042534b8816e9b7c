// The sign-in form: the key goes in a POST body to /dashboard/session, never into a URL or storage.
import { showError } from "./common.js";

const form = document.getElementById("sign-in");
form.addEventListener("submit", async (event) => {
  event.preventDefault();
  showError(null);
  const key = form.elements.key.value;
  const response = await fetch("/dashboard/session", {
    method: "POST", credentials: "same-origin",
    headers: { "content-type": "application/json" }, body: JSON.stringify({ key }),
  });
  if (response.ok) {
    form.reset();
    location.assign("/dashboard");
    return;
  }
  let message = `${response.status} ${response.statusText}`;
  try { message = (await response.json()).error.message; } catch { /* keep the status */ }
  showError(message);
});

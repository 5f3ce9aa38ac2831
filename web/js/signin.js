// The read-token form and the header's session controls (a service started with REPLAY_TOKENS_FILE).
// The form lives in #signin, outside #main, so a page re-render never drops it; while it is shown the
// page below is hidden. Nothing here is a native dialog: the token is typed into a password field.
import { h, clear } from "./dom.js";

const box = () => document.getElementById("signin");
const page = () => document.getElementById("main");

// Show the form and resolve with the token the service accepted, or null when cancelled (only offered
// when a token is already held). `check(token)` answers true (accepted), false (the service answered
// 401) or throws (the service could not be reached: the error line says so and the form stays).
export function showTokenForm({ refused = false, cancellable = false, check }) {
  return new Promise((resolve) => {
    const host = box();
    clear(host);
    const input = h("input", {
      id: "token-input", type: "password", name: "token", autocomplete: "off", spellcheck: "false",
      required: true, "aria-describedby": "token-help token-error",
    });
    const error = h("p", { id: "token-error", class: "token-error", role: "alert" });
    const submit = h("button", { type: "submit", class: "primary", id: "token-submit" }, "Sign in");
    const sayRefused = () => {
      error.textContent = "The service refused this token (HTTP 401): it is not in the service's tokens file. Check it and try again.";
      error.hidden = false;
    };
    error.hidden = true;
    if (refused) sayRefused();
    const done = (token) => {
      clear(host);
      host.hidden = true;
      page().hidden = false;
      resolve(token);
    };
    const form = h("form", {
      id: "token-form", class: "panel signin", novalidate: true, "aria-labelledby": "token-title",
      onsubmit: async (event) => {
        event.preventDefault(); // never a navigation (the page's CSP has form-action 'none')
        const token = input.value.trim();
        if (!token) {
          error.textContent = "Enter a token.";
          error.hidden = false;
          input.focus();
          return;
        }
        submit.disabled = input.disabled = true;
        error.hidden = true;
        form.setAttribute("aria-busy", "true");
        let ok;
        try {
          ok = await check(token);
        } catch (err) {
          error.textContent = `Could not reach the service: ${(err && err.message) || err}`;
          error.hidden = false;
          ok = null;
        }
        form.removeAttribute("aria-busy");
        submit.disabled = input.disabled = false;
        if (ok) { done(token); return; }
        if (ok === false) sayRefused();
        input.select();
        input.focus();
      },
    },
    h("h1", { id: "token-title" }, "Sign in"),
    h("p", { id: "token-help", class: "muted" },
      "This routing-replay service needs a read token (ask its operator). ",
      "It is kept for this browser tab only and sent to this service only."),
    h("div", { class: "signin-row" },
      h("label", { for: "token-input" }, "Read token"), input, submit,
      cancellable ? h("button", { type: "button", id: "token-cancel", onclick: () => done(null) }, "Cancel") : null),
    error);
    host.append(form);
    host.hidden = false;
    page().hidden = true;
    input.focus();
  });
}

// The header's controls: shown while this tab holds a token.
export function renderSession(held, { onChange, onSignOut }) {
  const host = document.getElementById("session");
  if (!host) return;
  clear(host);
  host.hidden = !held;
  if (!held) return;
  host.append(
    h("span", { class: "muted", title: "a read token is held for this tab (sessionStorage)" }, "signed in"),
    h("button", { type: "button", id: "change-token", onclick: onChange }, "change token"),
    h("button", { type: "button", id: "sign-out", onclick: onSignOut }, "sign out"));
}

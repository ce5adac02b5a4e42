// Entry point: wire the panels to the page and keep the service status in the top bar fresh.

import { apiKey, setApiKey } from "./api.js";
import { AskPanel } from "./ask.js";
import { DocumentsPanel } from "./documents.js";

const READY_POLL_MS = 2000;
const STATUS_POLL_MS = 15000;

/** Shows /readyz's component map; polls fast while loading, slowly once ready. */
class StatusBar {
  constructor(list) {
    this.list = list;
  }

  async refresh() {
    let isReady = false;
    try {
      const response = await fetch("/readyz");
      const body = await response.json();
      isReady = response.ok;
      this.render(body.components || {}, body.model);
    } catch (err) {
      this.render({ server: `unreachable: ${err.message}` });
    }
    setTimeout(() => this.refresh(), isReady ? STATUS_POLL_MS : READY_POLL_MS);
    return isReady;
  }

  /** One item per component; the LLM's, once loaded, names the model that answers. */
  render(components, model) {
    const items = Object.entries(components).map(([name, status]) => {
      const item = document.createElement("li");
      const kind = componentKind(status);
      item.className = `component component-${kind}`;
      item.dataset.component = name;
      item.title = `${name}: ${status}`;
      const label = name === "llm" && model ? `llm: ${model}` : name;
      item.textContent = kind === "ok" ? label : `${name}: ${status}`;
      return item;
    });
    this.list.replaceChildren(...items);
  }
}

/** ok, loading, missing (an optional model not installed: the service works without it) or problem. */
function componentKind(status) {
  if (status === "ok" || status === "loading") return status;
  return status.includes("not installed") ? "missing" : "problem";
}

function main() {
  const field = document.querySelector("#collection");
  const collection = () => (field.checkValidity() && field.value.trim()) || "default";
  const documents = new DocumentsPanel(document.querySelector(".docs"), collection);
  new AskPanel(document.querySelector(".ask"), collection);
  const status = new StatusBar(document.querySelector("#components"));
  field.addEventListener("change", () => documents.refresh());
  wireApiKey(document.querySelector("#api-key"), () => documents.refresh());
  status.refresh().then(() => documents.refresh());
}

/** The API key field: saved on change; focused (and flagged) when the server answers 401. */
function wireApiKey(input, onChange) {
  input.value = apiKey();
  input.addEventListener("change", () => {
    setApiKey(input.value.trim());
    input.removeAttribute("aria-invalid");
    onChange();
  });
  document.addEventListener("prefixrag:unauthorized", () => {
    input.setAttribute("aria-invalid", "true");
    input.focus();
  });
}

main();

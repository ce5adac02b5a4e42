// The documents panel: upload (drag and drop or picker), list, delete, and poll until every
// document has finished ingesting.

import { ApiError, requestJSON } from "./api.js";

const POLL_MS = 1000;
const PAGE_SIZE = 100;
const BUSY = new Set(["pending", "processing"]);

/** Owns the documents panel; `collection()` names the collection to show and upload into. */
export class DocumentsPanel {
  constructor(root, collection) {
    this.collection = collection;
    this.list = root.querySelector("#doc-list");
    this.summary = root.querySelector("#doc-summary");
    this.error = root.querySelector("#docs-error");
    this.status = root.querySelector("#upload-status");
    this.dropzone = root.querySelector("#dropzone");
    this.input = root.querySelector("#file-input");
    this.template = document.querySelector("#doc-template");
    this.pollTimer = null;
    this.bind();
  }

  bind() {
    this.input.addEventListener("change", () => {
      this.upload([...this.input.files]);
      this.input.value = "";
    });
    for (const name of ["dragenter", "dragover"]) {
      this.dropzone.addEventListener(name, (e) => {
        e.preventDefault();
        this.dropzone.classList.add("dragging");
      });
    }
    this.dropzone.addEventListener("dragleave", () => this.dropzone.classList.remove("dragging"));
    this.dropzone.addEventListener("drop", (e) => {
      e.preventDefault();
      this.dropzone.classList.remove("dragging");
      this.upload([...e.dataTransfer.files]);
    });
  }

  /** Upload each file in turn; errors are collected and shown, the rest still go up. */
  async upload(files) {
    if (files.length === 0) return;
    const problems = [];
    for (const [i, file] of files.entries()) {
      this.status.textContent = `Uploading ${file.name} (${i + 1} of ${files.length})…`;
      const form = new FormData();
      form.append("file", file);
      form.append("collection", this.collection());
      try {
        await requestJSON("/v1/documents", { method: "POST", body: form });
      } catch (err) {
        problems.push(`${file.name}: ${err.message}`);
      }
    }
    this.status.textContent = "";
    this.showError(problems);
    await this.refresh();
  }

  async remove(doc, button) {
    button.disabled = true;
    try {
      await requestJSON(`/v1/documents/${doc.id}`, { method: "DELETE" });
      this.showError([]);
    } catch (err) {
      button.disabled = false;
      this.showError([`Could not delete ${doc.title}: ${err.message}`]);
    }
    await this.refresh();
  }

  /** Reload the list; keeps polling while any document is still being ingested. */
  async refresh() {
    clearTimeout(this.pollTimer);
    const query = new URLSearchParams({ collection: this.collection(), limit: PAGE_SIZE });
    let page;
    try {
      page = await requestJSON(`/v1/documents?${query}`);
    } catch (err) {
      this.summary.textContent = err.message;
      // 503 while the service loads: try again shortly.
      if (err instanceof ApiError && err.status === 503) this.schedule();
      return;
    }
    this.render(page);
    if (page.items.some((doc) => BUSY.has(doc.status))) this.schedule();
  }

  schedule() {
    clearTimeout(this.pollTimer);
    this.pollTimer = setTimeout(() => this.refresh(), POLL_MS);
  }

  render(page) {
    this.list.replaceChildren(...page.items.map((doc) => this.row(doc)));
    const shown = page.items.length;
    const where = `in “${this.collection()}”`;
    if (page.total === 0) this.summary.textContent = `No documents ${where} yet.`;
    else if (shown < page.total) this.summary.textContent = `${shown} of ${page.total} ${where}`;
    else this.summary.textContent = `${plural(page.total, "document")} ${where}`;
  }

  row(doc) {
    const item = this.template.content.firstElementChild.cloneNode(true);
    item.dataset.documentId = doc.id;
    item.dataset.status = doc.status;
    item.querySelector(".doc-title").textContent = doc.title;
    const chunks = doc.status === "ready" ? ` · ${plural(doc.num_chunks, "chunk")}` : "";
    item.querySelector(".doc-meta").textContent = `${formatBytes(doc.num_bytes)}${chunks}`;
    const badge = item.querySelector(".badge");
    badge.textContent = doc.status;
    badge.classList.add(`status-${doc.status}`);
    if (doc.error) {
      const error = item.querySelector(".doc-error");
      error.textContent = doc.error;
      error.hidden = false;
    }
    const button = item.querySelector(".delete");
    button.setAttribute("aria-label", `Delete ${doc.title}`);
    button.addEventListener("click", () => this.remove(doc, button));
    return item;
  }

  showError(messages) {
    this.error.hidden = messages.length === 0;
    this.error.replaceChildren(
      ...messages.map((text) => Object.assign(document.createElement("p"), { textContent: text })),
    );
  }
}

function plural(n, noun) {
  return `${n} ${noun}${n === 1 ? "" : "s"}`;
}

function formatBytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KB`;
  return `${(n / 1024 / 1024).toFixed(1)} MB`;
}

// The question panel: POST /v1/query with stream=true, render deltas as they arrive, turn [n]
// markers into links to the numbered sources, and show cache and latency figures when done.
// Questions form one conversation: each follow-up sends the earlier turns back as `history`
// (question, answer, chunk_ids), so its prompt extends the previous one and the server's prefix
// cache serves it; "New conversation" starts over.

import { request } from "./api.js";
import { readEvents } from "./sse.js";

const CITE_MARK = /\[(\d+)\]/g;

/** Owns the ask form and the list of answers; `collection()` names the collection to search. */
export class AskPanel {
  constructor(root, collection) {
    this.collection = collection;
    this.form = root.querySelector("#ask-form");
    this.question = root.querySelector("#question");
    this.askButton = root.querySelector("#ask-button");
    this.stopButton = root.querySelector("#stop-button");
    this.error = root.querySelector("#ask-error");
    this.answers = root.querySelector("#answers");
    this.template = document.querySelector("#turn-template");
    this.newButton = root.querySelector("#new-conversation");
    this.controller = null;
    this.numTurns = 0;
    this.history = [];
    this.historyCollection = null;
    this.newButton.addEventListener("click", () => this.newConversation());
    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.ask();
    });
    this.question.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) this.form.requestSubmit();
    });
    this.stopButton.addEventListener("click", () => this.controller?.abort());
  }

  body() {
    // An empty field is left out, so the server's default applies.
    const number = (id) => {
      const value = this.form.querySelector(id).value.trim();
      return value === "" ? undefined : Number(value);
    };
    return {
      question: this.question.value.trim(),
      collection: this.collection(),
      top_k: number("#top-k"),
      max_tokens: number("#max-tokens"),
      temperature: number("#temperature"),
      stream: true,
      history: this.history,
    };
  }

  newConversation() {
    this.history = [];
    this.historyCollection = null;
    this.answers.replaceChildren();
    this.showError("");
    this.newButton.disabled = true;
  }

  async ask() {
    // Earlier turns cite chunks of their collection only: another collection starts over.
    if (this.history.length && this.historyCollection !== this.collection()) this.newConversation();
    const body = this.body();
    if (!body.question) return;
    this.showError("");
    const turn = new Turn(this.template, ++this.numTurns, body.question);
    this.answers.prepend(turn.root);
    this.setBusy(true);
    try {
      const response = await request("/v1/query", {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
        body: JSON.stringify(body),
        signal: this.controller.signal,
      });
      await readEvents(response, (name, data) => turn.on(name, data));
      turn.finish();
      this.remember(body, turn);
    } catch (err) {
      const message = err.name === "AbortError" ? "Stopped." : err.message;
      turn.fail(message);
      if (err.name !== "AbortError") this.showError(message);
    } finally {
      this.setBusy(false);
    }
  }

  remember(body, turn) {
    if (!turn.isDone) return;
    // The server left out the oldest turns to fit: so does the conversation from now on.
    this.history = [...this.history.slice(turn.droppedTurns), turn.record()];
    this.historyCollection = body.collection;
    this.newButton.disabled = false;
  }

  setBusy(isBusy) {
    this.controller = isBusy ? new AbortController() : null;
    this.askButton.disabled = isBusy;
    this.newButton.disabled = isBusy || this.history.length === 0;
    this.askButton.textContent = isBusy ? "Answering…" : "Ask";
    this.stopButton.hidden = !isBusy;
  }

  showError(message) {
    this.error.hidden = !message;
    this.error.textContent = message;
  }
}

/** One question and its streamed answer, sources and figures. */
class Turn {
  constructor(template, index, question) {
    this.root = template.content.firstElementChild.cloneNode(true);
    this.root.dataset.turn = index;
    this.index = index;
    this.question = question;
    this.text = "";
    this.chunkIds = [];
    this.droppedTurns = 0;
    this.isDone = false;
    this.citations = new Map();
    this.root.querySelector(".question").textContent = question;
    this.answer = this.root.querySelector(".answer");
  }

  on(name, data) {
    if (name === "citations") this.showCitations(data);
    else if (name === "delta") this.append(data.text);
    else if (name === "done") this.done(data);
    else if (name === "error") throw new Error(data.detail || "the answer failed");
  }

  showCitations({ citations, chunk_ids: chunkIds, dropped_chunks: dropped, dropped_turns: droppedTurns }) {
    this.chunkIds = chunkIds || [];
    this.droppedTurns = droppedTurns || 0;
    if (this.droppedTurns > 0) {
      const n = this.droppedTurns;
      this.notice(`The ${n} oldest turn${n === 1 ? " was" : "s were"} left out to fit the model's context window.`);
    }
    const list = this.root.querySelector(".citations");
    list.replaceChildren(...citations.map((c) => this.citation(c)));
    this.root.querySelector(".sources-heading").hidden = citations.length === 0;
    if (dropped > 0) {
      this.notice(`${dropped} lower-ranked source${dropped === 1 ? " was" : "s were"} left out to fit the model's context window.`);
    }
    this.answer.querySelector(".typing").textContent = citations.length
      ? "Generating…"
      : "No sources found; generating…";
  }

  citation(c) {
    const item = document.createElement("li");
    item.id = this.citeId(c.n);
    item.className = "citation";
    item.value = c.n;
    const details = document.createElement("details");
    const summary = document.createElement("summary");
    const meta = [`score ${Number(c.score).toFixed(3)}`];
    if (c.page != null) meta.unshift(`page ${c.page}`);
    summary.append(
      span("cite-n", `[${c.n}]`),
      span("cite-title", c.title),
      span("cite-meta muted", meta.join(" · ")),
    );
    const source = document.createElement("blockquote");
    source.className = "cite-text";
    source.replaceChildren(...highlighted(c.text, c.evidence || []));
    const where = span("muted cite-where", `document ${c.document_id}, characters ${c.start}–${c.end}`);
    details.append(summary, source, where);
    item.append(details);
    this.citations.set(String(c.n), details);
    return item;
  }

  citeId(n) {
    return `cite-${this.index}-${n}`;
  }

  append(text) {
    this.text += text;
    this.render(true);
  }

  render(isStreaming) {
    const nodes = [];
    let last = 0;
    for (const match of this.text.matchAll(CITE_MARK)) {
      nodes.push(this.text.slice(last, match.index), this.citeLink(match[1], match[0]));
      last = match.index + match[0].length;
    }
    nodes.push(this.text.slice(last));
    if (isStreaming) nodes.push(span("cursor", "▍"));
    this.answer.replaceChildren(...nodes);
  }

  citeLink(n, label) {
    const details = this.citations.get(n);
    if (!details) return label;
    const link = document.createElement("a");
    link.href = `#${this.citeId(n)}`;
    link.className = "cite-ref";
    link.textContent = label;
    link.setAttribute("aria-label", `Source ${n}`);
    link.addEventListener("click", (e) => {
      e.preventDefault();
      details.open = true;
      details.scrollIntoView({ block: "nearest", behavior: "smooth" });
      details.querySelector("summary").focus();
    });
    return link;
  }

  /** The turn as the next question's `history` entry: the answer exactly as the server sent it. */
  record() {
    return { question: this.question, answer: this.text, chunk_ids: this.chunkIds };
  }

  done({ answer, usage, timings, finish_reason: reason, grounding }) {
    if (typeof answer === "string") this.text = answer;
    this.isDone = true;
    this.render(false);
    if (grounding && !grounding.grounded) this.showSupport(grounding);
    const stats = this.root.querySelector(".stats");
    const pct = (n) => (usage.prompt_tokens ? Math.round((100 * n) / usage.prompt_tokens) : 0);
    // reused: served from the exact prefix cache, or cached source bodies placed anew (blended)
    const blended = usage.blended_tokens || 0;
    const reused = usage.cached_tokens + blended;
    const rows = [
      ["Cached tokens", `${usage.cached_tokens} of ${usage.prompt_tokens} (${pct(usage.cached_tokens)}%)`, "cached"],
      ["Reused share", `${pct(reused)}% (${blended} blended, ${usage.recomputed_tokens || 0} recomputed)`, "reused"],
      ["TTFT", ms(timings.ttft_ms), "ttft"],
      ["Tokens out", `${usage.completion_tokens}`, "completion"],
      ["Per token", ms(timings.tpot_ms), "tpot"],
      ["Retrieval", ms((timings.embed_ms || 0) + (timings.search_ms || 0) + (timings.rerank_ms || 0)), "retrieval"],
      ["Total", ms(timings.total_ms), "total"],
    ];
    stats.replaceChildren(...rows.map(([term, value, key]) => statRow(term, value, key)));
    stats.hidden = false;
    if (reason === "length") this.notice("The answer stopped at the max tokens limit.");
  }

  /** Under an answer that does not rest on its sources: why, and the best evidence line in the
   * source's own words (the answer itself is never rewritten). */
  showSupport({ reason, support }) {
    const block = this.root.querySelector(".support");
    const parts = [span("support-reason muted", `Not grounded: ${reason}.`)];
    if (support) {
      const quote = document.createElement("blockquote");
      quote.className = "support-text";
      quote.textContent = support.text;
      const from = span("support-from", "From the sources ");
      from.append(this.citeLink(String(support.n), `[${support.n}]`), ` ${support.title}:`);
      parts.push(from, quote);
    }
    block.replaceChildren(...parts);
    block.hidden = false;
  }

  finish() {
    this.answer.setAttribute("aria-busy", "false");
    if (this.answer.querySelector(".cursor")) this.render(false);
    if (!this.text) this.answer.replaceChildren(span("muted", "(empty answer)"));
  }

  fail(message) {
    this.answer.setAttribute("aria-busy", "false");
    this.render(false);
    this.root.classList.add("failed");
    this.notice(message);
  }

  notice(text) {
    const notice = this.root.querySelector(".notice");
    notice.textContent = notice.hidden ? text : `${notice.textContent} ${text}`;
    notice.hidden = false;
  }
}

function span(className, text) {
  const el = document.createElement("span");
  el.className = className;
  el.textContent = text;
  return el;
}

function statRow(term, value, key) {
  const row = document.createElement("div");
  const dt = document.createElement("dt");
  dt.textContent = term;
  const dd = document.createElement("dd");
  dd.textContent = value;
  dd.dataset.stat = key;
  row.append(dt, dd);
  return row;
}

function ms(value) {
  if (value == null || Number.isNaN(value)) return "–";
  return value >= 1000 ? `${(value / 1000).toFixed(2)} s` : `${Math.round(value)} ms`;
}

/**
 * The chunk's text as nodes, with its evidence spans (offsets into the text, best first) in
 * <mark> elements; the best span is marked "top" so a reader finds it first.
 */
function highlighted(text, evidence) {
  const spans = evidence
    .map((e, rank) => ({ start: e.start, end: e.end, rank }))
    .filter((e) => 0 <= e.start && e.start < e.end && e.end <= text.length)
    .sort((a, b) => a.start - b.start);
  const nodes = [];
  let last = 0;
  for (const { start, end, rank } of spans) {
    if (start < last) continue; // overlapping spans: the earlier one is shown
    nodes.push(text.slice(last, start));
    const mark = document.createElement("mark");
    mark.className = rank === 0 ? "evidence top" : "evidence";
    mark.title = rank === 0 ? "Best evidence for the question" : "Evidence for the question";
    mark.textContent = text.slice(start, end);
    nodes.push(mark);
    last = end;
  }
  nodes.push(text.slice(last));
  return nodes;
}

// Server-sent events read from a fetch() body. EventSource can only GET, and /v1/query is a
// POST, so the frames are parsed here. Network reads split frames anywhere, even inside a
// "\r\n" pair or a multi-byte character, so the parser keeps whatever is incomplete.

const LINE_END = /\r\n|\n|\r/g;

/** Incremental parser: push() decoded text, get back every event that the text completed. */
export class SSEParser {
  constructor() {
    this.buffer = "";
    this.eventType = "";
    this.dataLines = [];
  }

  /** Returns the events ({event, data}) completed by `text`, in order; `isFinal` on the last. */
  push(text, isFinal = false) {
    this.buffer += text;
    const events = [];
    let start = 0;
    LINE_END.lastIndex = 0;
    for (let match = LINE_END.exec(this.buffer); match; match = LINE_END.exec(this.buffer)) {
      // A lone "\r" at the very end may be the first half of "\r\n": wait for the next read.
      if (!isFinal && match[0] === "\r" && match.index === this.buffer.length - 1) break;
      const event = this.line(this.buffer.slice(start, match.index));
      start = LINE_END.lastIndex;
      if (event) events.push(event);
    }
    this.buffer = this.buffer.slice(start);
    return events;
  }

  line(line) {
    if (line === "") return this.dispatch();
    if (line.startsWith(":")) return null; // a comment, e.g. a keep-alive
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") this.eventType = value;
    else if (field === "data") this.dataLines.push(value);
    return null;
  }

  dispatch() {
    const event = { event: this.eventType || "message", data: this.dataLines.join("\n") };
    const hasData = this.dataLines.length > 0;
    this.eventType = "";
    this.dataLines = [];
    return hasData ? event : null;
  }
}

/** Read an SSE response body to its end, calling onEvent(name, parsedJson) for each event. */
export async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder("utf-8");
  const parser = new SSEParser();
  for (;;) {
    const { done, value } = await reader.read();
    const text = done ? decoder.decode() : decoder.decode(value, { stream: true });
    for (const { event, data } of parser.push(text, done)) onEvent(event, JSON.parse(data));
    if (done) return;
  }
}

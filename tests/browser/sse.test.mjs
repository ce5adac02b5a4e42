// The page's SSE parser against events encoded here: whatever the line endings and however the
// byte stream is cut into reads, the events that come out are the events that went in.
import assert from "node:assert/strict";
import { test } from "node:test";

import { readEvents, SSEParser } from "../../app/static/sse.js";

const EVENTS = [
  { event: "citations", data: { citations: [{ n: 1, title: "a: b", text: "line\nbreak" }] } },
  { event: "delta", data: { text: "Héllo wörld — ✓ 日本語 🚀" } },
  { event: "delta", data: { text: "" } },
  { event: "delta", data: { text: "data: not a field\r\n\r\n" } },
  { event: "done", data: { answer: "x", usage: { cached_tokens: 3 } } },
];

function seededRandom(seed) {
  let state = seed >>> 0;
  return () => {
    state = (state * 1664525 + 1013904223) >>> 0;
    return state / 2 ** 32;
  };
}

// JSON.stringify escapes newlines, so a payload is one data line; a pretty-printed payload
// exercises multi-line data, which the parser must join with "\n".
function encode(events, eol, pretty) {
  const frames = events.map(({ event, data }) => {
    const json = pretty ? JSON.stringify(data, null, 1) : JSON.stringify(data);
    const lines = [": keep-alive", `event: ${event}`, ...json.split("\n").map((l) => `data:${l}`)];
    return lines.join(eol) + eol + eol;
  });
  return frames.join("");
}

function parseInPieces(text, cuts) {
  const parser = new SSEParser();
  const out = [];
  let last = 0;
  for (const cut of [...cuts, text.length]) {
    for (const e of parser.push(text.slice(last, cut), cut === text.length)) out.push({ event: e.event, data: JSON.parse(e.data) });
    last = cut;
  }
  return out;
}

for (const eol of ["\n", "\r\n", "\r"]) {
  for (const pretty of [false, true]) {
    test(`every single cut, eol=${JSON.stringify(eol)} pretty=${pretty}`, () => {
      const text = encode(EVENTS, eol, pretty);
      for (let cut = 0; cut <= text.length; cut++) {
        assert.deepEqual(parseInPieces(text, [cut]), EVENTS, `cut at ${cut}`);
      }
    });
  }
}

test("random cuts, one character at a time included", () => {
  const random = seededRandom(7);
  const text = encode(EVENTS, "\r\n", true);
  assert.deepEqual(parseInPieces(text, [...text].map((_, i) => i)), EVENTS);
  for (let trial = 0; trial < 200; trial++) {
    const cuts = [...new Set(Array.from({ length: 8 }, () => Math.floor(random() * text.length)))];
    assert.deepEqual(parseInPieces(text, cuts.sort((a, b) => a - b)), EVENTS);
  }
});

test("an event without data is not dispatched, an unfinished one waits", () => {
  const parser = new SSEParser();
  assert.deepEqual(parser.push("event: ping\n\n"), []);
  assert.deepEqual(parser.push('event: delta\ndata: {"text": "a"}\n'), []);
  assert.deepEqual(parser.push("\n"), [{ event: "delta", data: '{"text": "a"}' }]);
  assert.deepEqual(parser.push("data: 1\n\n"), [{ event: "message", data: "1" }]);
});

test("readEvents decodes UTF-8 split inside a character", async () => {
  const bytes = new TextEncoder().encode(encode(EVENTS, "\n", false));
  const random = seededRandom(11);
  for (let trial = 0; trial < 50; trial++) {
    const pieces = [];
    for (let at = 0; at < bytes.length; ) {
      const size = 1 + Math.floor(random() * 7);
      pieces.push(bytes.slice(at, at + size));
      at += size;
    }
    const body = new ReadableStream({
      start(controller) {
        for (const piece of pieces) controller.enqueue(piece);
        controller.close();
      },
    });
    const seen = [];
    await readEvents(new Response(body), (event, data) => seen.push({ event, data }));
    assert.deepEqual(seen, EVENTS);
  }
});

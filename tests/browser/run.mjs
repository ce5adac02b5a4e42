// End-to-end check of the web page in Debian's chromium, driven by playwright-core.
// Usage: node run.mjs BASE_URL OUT_DIR DOCUMENT_PATH QUESTION [API_KEY]
// With API_KEY the server needs a key: the page must ask for it, then work once it is entered.
// Exits non-zero with a message on the first expectation that fails; writes page.png to OUT_DIR.
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { basename, join } from "node:path";

import { chromium } from "playwright-core";

const [baseUrl, outDir, documentPath, question, key] = process.argv.slice(2);
if (!question) throw new Error("usage: node run.mjs BASE_URL OUT_DIR DOCUMENT_PATH QUESTION");
const STEP_MS = 60_000;
const ANSWER_MS = 240_000;
// Without the background-networking flags chromium keeps dialing Google hosts on a closed network.
const ARGS = [
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
];

function check(condition, message) {
  if (!condition) throw new Error(`expectation failed: ${message}`);
}

async function signsIn(page, apiKey) {
  const field = page.locator("#api-key");
  await page.locator("#api-key[aria-invalid=true]").waitFor({ timeout: STEP_MS });
  const refused = await page.locator("#doc-summary").textContent();
  check(/401/.test(refused), `the list says a key is needed, got ${JSON.stringify(refused)}`);
  await field.fill(apiKey);
  await field.press("Tab"); // commits the field: "change" saves the key and reloads the list
  await page.locator("#doc-summary", { hasText: /No documents/ }).waitFor({ timeout: STEP_MS });
  check((await field.getAttribute("aria-invalid")) === null, "the key field is no longer flagged");
  console.log("api key: asked for after a 401, accepted once entered");
}

async function rejectsUnsupportedFile(page) {
  await page.setInputFiles("#file-input", {
    name: "picture.png",
    mimeType: "image/png",
    buffer: Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0, 0, 0, 0]),
  });
  const error = page.locator("#docs-error");
  await error.waitFor({ state: "visible", timeout: STEP_MS });
  const text = await error.innerText();
  check(/415/.test(text) && /picture\.png/.test(text), `the 415 error is shown, got ${JSON.stringify(text)}`);
  console.log(`upload error shown: ${text}`);
}

// A real drop event carrying a File, the way a person drags one onto the page.
async function dropFile(page, name, text) {
  await page.evaluate(
    ([fileName, content]) => {
      const data = new DataTransfer();
      data.items.add(new File([content], fileName, { type: "text/plain" }));
      const zone = document.querySelector("#dropzone");
      zone.dispatchEvent(new DragEvent("dragover", { dataTransfer: data, bubbles: true, cancelable: true }));
      zone.dispatchEvent(new DragEvent("drop", { dataTransfer: data, bubbles: true, cancelable: true }));
    },
    [name, text],
  );
}

async function waitReady(page, title) {
  const row = page.locator(".doc", { hasText: title });
  await row.waitFor({ timeout: STEP_MS });
  const seen = new Set([await row.getAttribute("data-status")]);
  await page.locator(".doc[data-status=ready]", { hasText: title }).waitFor({ timeout: STEP_MS });
  console.log(`document ${title}: ready (first seen as ${[...seen].join(", ")})`);
}

// Records each distinct answer text while the answer is still busy, to prove it streamed.
async function watchAnswer(page) {
  await page.evaluate(() => {
    window.__answerTexts = [];
    new MutationObserver(() => {
      const answer = document.querySelector(".turn .answer");
      if (!answer || answer.getAttribute("aria-busy") !== "true") return;
      const text = answer.innerText.replace("▍", "").trim();
      const seen = window.__answerTexts;
      if (text && !text.startsWith("Retrieving") && !text.startsWith("Generating") && seen.at(-1) !== text) {
        seen.push(text);
      }
    }).observe(document.querySelector("#answers"), { subtree: true, childList: true, characterData: true });
  });
}

async function ask(page) {
  await watchAnswer(page);
  await page.locator(".options summary").click();
  await page.fill("#max-tokens", "24");
  await page.fill("#question", question);
  await page.click("#ask-button");
  const turn = page.locator(".turn").first();
  await turn.locator(".answer[aria-busy=false]").waitFor({ timeout: ANSWER_MS });
  const failure = await turn.locator(".notice").innerText();
  check(!(await turn.evaluate((el) => el.classList.contains("failed"))), `the answer failed: ${failure}`);
  const streamed = await page.evaluate(() => window.__answerTexts);
  const answer = await turn.locator(".answer").innerText();
  check(answer.trim().length > 0, "the answer has text");
  check(streamed.length >= 2, `the answer arrived in pieces, saw ${streamed.length} partial texts`);
  console.log(`answer streamed in ${streamed.length} updates: ${JSON.stringify(answer)}`);
  const refuses = /\b(documents?|sources?|context|text)\s+(do|does|did)\s*(not|n't)\b/i.test(answer);
  if (!/\[\d+\]/.test(answer) && !refuses) {
    const support = turn.locator(".support");
    check(await support.isVisible(), "an answer that cites no source shows why, with the best evidence line");
    const line = await support.locator(".support-text").innerText();
    check(line.trim().length > 0, "the evidence line under an ungrounded answer has text");
    check((await support.locator(".cite-ref").count()) === 1, "it links to its source");
  }
  return turn;
}

async function checkCitationsAndStats(turn, title) {
  const citations = turn.locator(".citation");
  check((await citations.count()) >= 1, "at least one citation");
  const first = citations.first();
  check((await first.locator(".cite-n").innerText()) === "[1]", "citations are numbered from [1]");
  check((await first.locator(".cite-title").innerText()) === title, "the citation names the document");
  check(!(await first.locator(".cite-text").isVisible()), "the source text starts collapsed");
  await first.locator("summary").click();
  await first.locator(".cite-text").waitFor({ state: "visible", timeout: STEP_MS });
  const source = await first.locator(".cite-text").innerText();
  check(source.trim().length > 0, "the expanded citation shows its source text");
  const cached = await turn.locator("[data-stat=cached]").innerText();
  const ttft = await turn.locator("[data-stat=ttft]").innerText();
  check(/^\d+ of \d+ \(\d+%\)$/.test(cached), `cached tokens are shown, got ${JSON.stringify(cached)}`);
  check(/^[\d.]+ (ms|s)$/.test(ttft), `TTFT is shown, got ${JSON.stringify(ttft)}`);
  const reused = await turn.locator("[data-stat=reused]").innerText();
  check(/^\d+% \(\d+ blended, \d+ recomputed\)$/.test(reused), `the reused share is shown, got ${JSON.stringify(reused)}`);
  console.log(`${await citations.count()} citations; cached ${cached}; TTFT ${ttft}`);
}

// A follow-up question: its prompt repeats the first turn, so the cache serves what the first
// turn computed; then "New conversation" clears the answers and the history.
async function followUp(page, first) {
  const figures = async (turn) => {
    const [cached, prompt] = (await turn.locator("[data-stat=cached]").innerText()).match(/\d+/g).map(Number);
    return { cached, prompt, completion: Number(await turn.locator("[data-stat=completion]").innerText()) };
  };
  const before = await figures(first);
  check(!(await page.locator("#new-conversation").isDisabled()), "New conversation is enabled after an answer");
  await page.fill("#question", `Tell me more: ${question}`);
  await page.click("#ask-button");
  await page.locator(".turn").nth(1).waitFor({ timeout: STEP_MS });
  const turn = page.locator(".turn").first();
  await turn.locator(".answer[aria-busy=false]").waitFor({ timeout: ANSWER_MS });
  const after = await figures(turn);
  // The whole first prompt, in whole blocks, at least: its answer's own tokens are reused too
  // (tests/app/test_query.py counts them), but a completion cut at a stop string such as
  // "\nQuestion:" counts tokens that the answer, and so the follow-up, leaves out.
  check(after.cached >= Math.floor(before.prompt / 16) * 16, `the follow-up reuses the first turn: ${JSON.stringify({ before, after })}`);
  console.log(`follow-up: cached ${after.cached} of ${after.prompt} (first turn ${before.prompt} + ${before.completion})`);
  await page.click("#new-conversation");
  check((await page.locator(".turn").count()) === 0, "New conversation clears the answers");
  check(await page.locator("#new-conversation").isDisabled(), "New conversation is disabled with no history");
}

async function deletes(page, title) {
  await page.getByRole("button", { name: `Delete ${title}` }).click();
  await page.locator(".doc", { hasText: title }).waitFor({ state: "detached", timeout: STEP_MS });
  console.log(`document ${title}: deleted`);
}

async function main() {
  const profile = mkdtempSync(join(tmpdir(), "prefixrag-chromium-"));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    headless: true,
    args: ARGS,
    viewport: { width: 1280, height: 900 },
  });
  const pageErrors = [];
  try {
    const page = context.pages()[0] || (await context.newPage());
    page.on("pageerror", (err) => pageErrors.push(err.message));
    await page.goto(baseUrl);
    await page.locator(".component-ok[data-component=llm]").waitFor({ timeout: STEP_MS });
    const llmItem = await page.locator(".component-ok[data-component=llm]").textContent();
    check(/^llm: \S/.test(llmItem), `the status bar names the model that answers (got ${llmItem})`);
    if (key) await signsIn(page, key);
    await rejectsUnsupportedFile(page);
    const title = basename(documentPath); // a text file is titled by its file name
    await page.setInputFiles("#file-input", documentPath);
    await dropFile(page, "dropped-note.txt", "A note dropped on the page, to be deleted again.");
    await waitReady(page, title);
    await waitReady(page, "dropped-note.txt");
    await deletes(page, "dropped-note.txt");
    check((await page.locator("#docs-error").isHidden()), "the upload error clears after good uploads");
    const turn = await ask(page);
    await checkCitationsAndStats(turn, title);
    const screenshot = join(outDir, "page.png");
    await page.screenshot({ path: screenshot, fullPage: true });
    console.log(`screenshot: ${screenshot}`);
    await followUp(page, turn);
    await page.setViewportSize({ width: 390, height: 844 });
    const narrow = await page.evaluate(() => document.documentElement.scrollWidth);
    check(narrow <= 390, `no sideways scrolling on a phone-sized screen (page is ${narrow}px wide)`);
    await page.screenshot({ path: join(outDir, "page-narrow.png"), fullPage: true });
    check(pageErrors.length === 0, `no uncaught errors in the page: ${pageErrors.join("; ")}`);
  } finally {
    await context.close();
    rmSync(profile, { recursive: true, force: true });
  }
}

main().catch((err) => {
  console.error(err.stack || String(err));
  process.exit(1);
});

// Small wrappers over fetch() that turn any non-2xx answer into an ApiError with a readable
// message, whichever error shape the route uses.

const STATUS_HINTS = {
  401: "API key needed",
  409: "Conflict",
  413: "File too large",
  415: "Unsupported file type",
  422: "Invalid input",
  429: "Busy, retry in a moment",
  503: "Service not ready",
};

const KEY_STORAGE = "prefixrag.apiKey";

/** The API key this browser sends ("" for none), kept in localStorage across visits. */
export function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

/** Remember `key` for every later request ("" forgets it). */
export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

function withKey(options) {
  const key = apiKey();
  if (!key) return options;
  const headers = new Headers(options.headers || {});
  headers.set("Authorization", `Bearer ${key}`);
  return { ...options, headers };
}

/** An HTTP error from the API: `status` is the code, `message` is meant for people. */
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

/** The human-readable message of an error response (FastAPI, service or OpenAI shape). */
export async function errorMessage(response) {
  const hint = STATUS_HINTS[response.status] || `HTTP ${response.status}`;
  const text = await response.text();
  let detail = text.trim();
  try {
    detail = describe(JSON.parse(text)) || detail;
  } catch {
    // not JSON: keep the raw text
  }
  return detail ? `${hint} (${response.status}): ${detail}` : `${hint} (${response.status})`;
}

function describe(body) {
  if (typeof body?.detail === "string") return body.detail;
  if (Array.isArray(body?.detail)) {
    return body.detail
      .map((e) => `${(e.loc || []).slice(1).join(".") || "body"}: ${e.msg}`)
      .join("; ");
  }
  if (typeof body?.error?.message === "string") return body.error.message;
  return "";
}

/** fetch() that throws ApiError on a non-2xx answer; returns the Response. */
export async function request(url, options = {}) {
  let response;
  try {
    response = await fetch(url, withKey(options));
  } catch (err) {
    throw new ApiError(0, `Cannot reach the server: ${err.message}`);
  }
  if (!response.ok) {
    const error = new ApiError(response.status, await errorMessage(response));
    if (response.status === 401) document.dispatchEvent(new CustomEvent("prefixrag:unauthorized"));
    throw error;
  }
  return response;
}

/** request() that parses the JSON body (null for 204 No Content). */
export async function requestJSON(url, options = {}) {
  const response = await request(url, options);
  return response.status === 204 ? null : response.json();
}

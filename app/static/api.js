// Small wrappers over fetch() that turn any non-2xx answer into an ApiError with a readable
// message, whichever error shape the route uses.

const STATUS_HINTS = {
  409: "Conflict",
  413: "File too large",
  415: "Unsupported file type",
  422: "Invalid input",
  503: "Service not ready",
};

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
    response = await fetch(url, options);
  } catch (err) {
    throw new ApiError(0, `Cannot reach the server: ${err.message}`);
  }
  if (!response.ok) throw new ApiError(response.status, await errorMessage(response));
  return response;
}

/** request() that parses the JSON body (null for 204 No Content). */
export async function requestJSON(url, options = {}) {
  const response = await request(url, options);
  return response.status === 204 ? null : response.json();
}

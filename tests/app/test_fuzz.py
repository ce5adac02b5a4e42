"""Schemathesis fuzzing of every operation in the app's own OpenAPI schema, over real HTTP.

The server runs with the LLM loaded (answers capped at a few tokens so generation is cheap) and
a few documents ingested, so search and Q&A do real work. For every generated request, valid
and invalid alike: no 5xx, every 4xx is JSON that says what is wrong, and schemathesis' own
checks (status codes, content types and bodies as documented) hold. Examples are derandomized
and bounded per operation, so a CI run is reproducible and short.
Run alone: `pytest tests/app/test_fuzz.py` (PostgreSQL too with PREFIXRAG_TEST_DATABASE_URL).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import APIOperation, Case, GenerationMode, Response
from schemathesis.specs.openapi.checks import positive_data_acceptance

from prefixrag.app.main import create_app
from prefixrag.app.schemas.openai import OPENAI_PATHS
from tests.app.conftest import DATABASES, fresh_database
from tests.app.live_server import live_server
from tests.app.qa_helpers import ingest_docs, qa_settings

MAX_EXAMPLES = 25
MAX_TOKENS = 8
REQUEST_TIMEOUT_S = 60

FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    deadline=None,
    # a live server is slow next to in-process code, and its fixture outlives each example
    suppress_health_check=list(HealthCheck),
    database=None,
)


@pytest.fixture(scope="module", params=DATABASES)
def fuzz_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A live server on a fresh database with the LLM loaded and the Q&A documents ingested."""
    tmp = tmp_path_factory.mktemp(f"fuzz-{request.param}")
    with contextmanager(fresh_database)(request.param, tmp) as database_url:
        app_settings = qa_settings(
            tmp / "data",
            request,
            database_url=database_url,
            max_tokens_cap=MAX_TOKENS,
            default_max_tokens=MAX_TOKENS,
            answer_max_tokens=MAX_TOKENS,
            max_upload_bytes=16 * 1024,
        )
        with live_server(create_app(app_settings)) as base:
            with httpx.Client(base_url=base, timeout=REQUEST_TIMEOUT_S) as client:
                ingest_docs(client)
            yield base


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_server: str) -> schemathesis.BaseSchema:
    """The schema the server publishes, aimed at that server."""
    return schemathesis.openapi.from_url(f"{fuzz_server}/openapi.json")


def test_no_operation_fails_or_answers_vaguely(fuzz_schema: schemathesis.BaseSchema) -> None:
    """Every operation, valid and invalid inputs; deletes run last, once the searches over the
    ingested documents are done. All failing operations are reported together."""
    operations = [result.ok() for result in fuzz_schema.get_all_operations()]
    operations.sort(key=lambda op: op.method.upper() == "DELETE")
    assert len(operations) >= 10, [op.label for op in operations]
    failures = []
    for operation in operations:
        try:
            fuzz_operation(operation)
        # collected, so that one bad route does not hide the others
        except (Exception, BaseExceptionGroup) as exc:
            failures.append(f"{operation.label}:\n{exc}")
    assert not failures, "\n\n".join(failures)


def fuzz_operation(operation: APIOperation) -> None:
    """Run MAX_EXAMPLES generated requests, schema-valid and schema-invalid, on `operation`."""
    cases = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )

    @FUZZ_SETTINGS
    @given(cases)
    def run(case: Case) -> None:
        check_case(case)

    run()


def check_case(case: Case) -> None:
    """Send `case`, then check our error contract and schemathesis' built-in checks."""
    response = case.call(timeout=REQUEST_TIMEOUT_S)
    check_error_contract(case, response)
    # NOTE: "schema-valid means accepted" does not hold here: the schema cannot say which bytes
    # are a parseable document of a supported type (415) or which model names are loaded (404).
    case.validate_response(response, excluded_checks=[positive_data_acceptance])


def check_error_contract(case: Case, response: Response) -> None:
    """No 5xx; a 4xx is a JSON body with a non-empty message in the route's error shape."""
    where = f"{case.method} {case.formatted_path} -> {response.status_code}\n"
    where += case.as_curl_command()
    assert response.status_code < 500, f"server error: {where}\n{response.text[:2000]}"
    if response.status_code < 400:
        return
    content_type = response.headers.get("content-type", [""])[0]
    assert content_type.startswith("application/json"), f"{content_type!r} error body: {where}"
    body = json.loads(response.content)
    message = error_message(case.formatted_path, body)
    assert message.strip(), f"error body says nothing: {where}\n{body}"


def error_message(path: str, body: object) -> str:
    """The human-readable part of an error body: OpenAI's error.message, or FastAPI's detail
    (a string, or validation errors each with a msg)."""
    if not isinstance(body, dict):
        return ""
    if path in OPENAI_PATHS:
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        return message if isinstance(message, str) else ""
    detail = body.get("detail")
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list) and detail:
        msgs = [item.get("msg") if isinstance(item, dict) else None for item in detail]
        if all(isinstance(m, str) and m.strip() for m in msgs):
            return "; ".join(str(m) for m in msgs)
    return ""


def test_error_message_reads_both_error_shapes() -> None:
    """The contract checker itself: it must reject bodies that say nothing."""
    assert error_message("/v1/search", {"detail": "top_k too big"}) == "top_k too big"
    assert error_message("/v1/search", {"detail": [{"msg": "a"}, {"msg": "b"}]}) == "a; b"
    assert error_message("/v1/search", {"detail": [{"msg": ""}]}) == ""
    assert error_message("/v1/search", {"detail": []}) == ""
    assert error_message("/v1/search", ["detail"]) == ""
    assert error_message("/v1/completions", {"error": {"message": "bad model"}}) == "bad model"
    assert error_message("/v1/completions", {"detail": "bad model"}) == ""

"""The web page as files the app serves: the page, its assets, module imports, no network."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from prefixrag.app.api.routes.web import STATIC_DIR
from prefixrag.app.main import create_app
from tests.app.conftest import make_settings

REPO = Path(__file__).resolve().parents[2]
# Elements the scripts look up by id; a rename in one place must not silently break the other.
REQUIRED_IDS = {
    "collection", "components", "dropzone", "file-input", "upload-status", "docs-error",
    "doc-list", "doc-summary", "ask-form", "question", "top-k", "max-tokens", "temperature",
    "ask-button", "stop-button", "ask-error", "answers", "turn-template", "doc-template",
}  # fmt: skip
JS_IMPORT = re.compile(r"""^\s*import\s[^'"]*['"]([^'"]+)['"]""", re.MULTILINE)
# A quoted or url(...) address with a scheme or a protocol-relative "//host".
REMOTE_URL = re.compile(r"""['"(]\s*(?:[a-z][a-z0-9+.-]*:)?//""", re.I)


class _PageParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.assets: list[str] = []
        self.labelled: set[str] = set()
        self.inputs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if found.get("id"):
            self.ids.add(str(found["id"]))
        if tag == "script" and found.get("src"):
            self.assets.append(str(found["src"]))
        if tag == "link" and found.get("rel") == "stylesheet":
            self.assets.append(str(found["href"]))
        if tag == "label" and found.get("for"):
            self.labelled.add(str(found["for"]))
        if tag in ("input", "textarea", "select") and found.get("id"):
            self.inputs.append(str(found["id"]))


@pytest.fixture
def client(tmp_path: Path) -> TestClient:
    """The app without its lifespan: serving static files needs no database or model."""
    settings = make_settings(tmp_path, f"sqlite:///{tmp_path / 'web.db'}")
    return TestClient(create_app(settings))


def _page(client: TestClient) -> _PageParser:
    response = client.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    parser = _PageParser()
    parser.feed(response.text)
    return parser


def test_page_has_every_element_the_scripts_use(client: TestClient) -> None:
    page = _page(client)
    assert page.ids >= REQUIRED_IDS, f"missing ids: {REQUIRED_IDS - page.ids}"
    for element_id in sorted(REQUIRED_IDS):
        assert f"#{element_id}" in _all_scripts(), f"no script uses #{element_id}"


def test_every_form_control_has_a_label(client: TestClient) -> None:
    page = _page(client)
    assert page.inputs, "the page has no form controls"
    unlabelled = set(page.inputs) - page.labelled
    assert not unlabelled, f"form controls without a <label for>: {unlabelled}"


def test_assets_and_module_imports_resolve_with_their_types(client: TestClient) -> None:
    page = _page(client)
    pending = list(page.assets)
    seen: set[str] = set()
    while pending:
        url = pending.pop()
        if url in seen:
            continue
        seen.add(url)
        response = client.get(url)
        assert response.status_code == 200, url
        expected = "text/css" if url.endswith(".css") else "javascript"
        assert expected in response.headers["content-type"], url
        if url.endswith(".js"):
            base = url.rsplit("/", 1)[0]
            imports = JS_IMPORT.findall(response.text)
            pending += [f"{base}/{name.removeprefix('./')}" for name in imports]
    # every shipped script is reachable from the page, so none is dead weight
    shipped = {f"/static/{p.name}" for p in STATIC_DIR.iterdir() if p.suffix in (".js", ".css")}
    assert seen == shipped


def test_no_asset_is_fetched_from_another_host() -> None:
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        assert not REMOTE_URL.search(text), f"{path.name} loads something from the network"


def test_static_route_does_not_leave_the_static_folder(client: TestClient) -> None:
    assert client.get("/static/../settings.py").status_code == 404
    assert client.get("/static/%2e%2e/settings.py").status_code == 404
    assert client.get("/static/no-such-file.js").status_code == 404


def test_page_is_not_in_the_api_schema(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert "/" not in paths
    assert not any(path.startswith("/static") for path in paths)


def test_sse_parser_in_node() -> None:
    """Runs tests/browser/sse.test.mjs: the page's SSE parser on frames cut at every offset."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (apt-get install -y nodejs)")
    result = subprocess.run(
        [node, "--test", "sse.test.mjs"],
        cwd=REPO / "tests" / "browser",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^# pass [1-9]", result.stdout, re.MULTILINE), result.stdout


def _all_scripts() -> str:
    return "\n".join(p.read_text() for p in STATIC_DIR.glob("*.js"))

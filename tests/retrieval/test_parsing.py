"""Parsing of each supported type, and the errors for bad input."""

from __future__ import annotations

import pytest
from fpdf import FPDF

from prefixrag.retrieval.parsing import (
    DocumentParseError,
    UnsupportedMediaTypeError,
    detect_media_type,
    parse_document,
)


def make_pdf(pages: list[str], title: str | None = None) -> bytes:
    pdf = FPDF()
    if title:
        pdf.set_title(title)
    pdf.set_font("Helvetica", size=12)
    for body in pages:
        pdf.add_page()
        pdf.multi_cell(0, 8, body)
    return bytes(pdf.output())


@pytest.mark.parametrize(
    ("filename", "declared", "expected"),
    [
        ("notes.TXT", None, "text/plain"),
        ("a.text", "application/octet-stream", "text/plain"),
        ("readme.md", "text/plain", "text/markdown"),
        ("x.markdown", None, "text/markdown"),
        ("page.HTM", None, "text/html"),
        ("paper.pdf", "text/html", "application/pdf"),
        (None, "text/html; charset=utf-8", "text/html"),
        ("blob", "application/pdf", "application/pdf"),
    ],
)
def test_detect_media_type(filename: str | None, declared: str | None, expected: str) -> None:
    assert detect_media_type(filename, declared) == expected


@pytest.mark.parametrize(
    ("filename", "declared"), [("a.docx", None), (None, "image/png"), (None, None)]
)
def test_detect_media_type_rejects(filename: str | None, declared: str | None) -> None:
    with pytest.raises(UnsupportedMediaTypeError):
        detect_media_type(filename, declared)


def test_pdf_pages_and_title() -> None:
    pages = [f"Page {n} talks about topic number {n} in some detail." for n in range(1, 5)]
    doc = parse_document(make_pdf(pages, title="Four Topics"), "application/pdf")
    assert doc.title == "Four Topics"
    assert doc.page_starts is not None and len(doc.page_starts) == 4
    assert doc.page_starts[0] == 0 and doc.page_starts == sorted(doc.page_starts)
    bounds = [*doc.page_starts, len(doc.text)]
    for n, body in enumerate(pages):
        assert body in doc.text[bounds[n] : bounds[n + 1]]


@pytest.mark.parametrize(
    "data", [b"%PDF-1.4\nthis is not really a pdf", b"\x00\x01garbage", make_pdf([""])]
)
def test_bad_pdf_raises(data: bytes) -> None:
    with pytest.raises(DocumentParseError):
        parse_document(data, "application/pdf")


def test_html_drops_chrome_and_keeps_structure() -> None:
    html = b"""<html><head><title>Guide</title><style>p {color: red}</style></head><body>
    <nav><a href="/">Home</a> menu entry</nav>
    <script>var secret = "do not index";</script>
    <h1>Install<a class="headerlink" href="#i">\xc2\xb6</a></h1>
    <p>Run the   <b>installer</b>
    twice.</p><div>Then reboot.</div>
    <h2>Options</h2><ul><li>fast</li><li>safe</li></ul>
    <h3>Advanced</h3><p>Tune it.</p></body></html>"""
    doc = parse_document(html, "text/html")
    assert doc.title == "Guide"
    for gone in ("secret", "menu entry", "color: red", "\xb6"):
        assert gone not in doc.text
    assert "Run the installer twice." in doc.text
    assert "twice.\n\nThen reboot." in doc.text  # blocks become paragraphs
    assert [(s.level, s.title) for s in doc.sections] == [
        (1, "Install"),
        (2, "Options"),
        (3, "Advanced"),
    ]
    for section in doc.sections:
        assert doc.text[section.start :].startswith(section.title)


def test_html_title_falls_back_to_h1() -> None:
    doc = parse_document(b"<body><h1>Main heading</h1><p>text</p></body>", "text/html")
    assert doc.title == "Main heading"


def test_markdown_headings() -> None:
    text = (
        "\ufeff# Manual\n\nIntro.\n\nSetup\n-----\n\nSteps here.\n\n```\n# not a heading\n```\n\n"
        "### Deep ###\n\nMore.\n\nAppendix\n========\n"
    )
    doc = parse_document(text.encode("utf-8"), "text/markdown")
    assert doc.text.startswith("# Manual")  # the BOM is gone, the text is kept
    assert [(s.level, s.title) for s in doc.sections] == [
        (1, "Manual"),
        (2, "Setup"),
        (3, "Deep"),
        (1, "Appendix"),
    ]
    for section in doc.sections:
        assert doc.text[section.start :].lstrip("# ").startswith(section.title)
    assert doc.title == "Manual"


def test_plain_text_utf8_and_newlines() -> None:
    doc = parse_document("caf\u00e9\r\nline two".encode(), "text/plain")
    assert doc.text == "caf\u00e9\nline two"
    assert doc.sections == [] and doc.page_starts is None


@pytest.mark.parametrize(
    ("media_type", "data"),
    [
        (media_type, data)
        for media_type in ("text/plain", "text/markdown", "text/html")
        for data in (b"", b"   \n\t  ")
    ]
    + [("text/html", b"<html><script>x()</script><nav>menu</nav></html>")],
)
def test_empty_documents_raise(media_type: str, data: bytes) -> None:
    with pytest.raises(DocumentParseError):
        parse_document(data, media_type)


def test_undecodable_text_raises_clearly() -> None:
    with pytest.raises(DocumentParseError, match="UTF-8"):
        parse_document(b"caf\xe9 au lait", "text/plain")


def test_unknown_media_type() -> None:
    with pytest.raises(UnsupportedMediaTypeError):
        parse_document(b"hello", "image/png")


API_HTML = (
    "<h1>Built-in Functions</h1><p>Intro.</p>"
    '<dl class="py function"><dt class="sig" id="enumerate"><span>enumerate</span>'
    "(<em>iterable</em>, <em>start</em>=<span>0</span>)</dt>"
    "<dd><p>Return an enumerate object.</p></dd></dl>"
    '<dl class="py class"><dt id="Path"><em>class</em> <span>Path</span>(<em>*parts</em>)</dt>'
    "<dd><p>A path.</p>"
    '<dl class="py method"><dt id="Path.glob">glob(<em>pattern</em>)</dt>'
    "<dd><p>Glob it.</p></dd></dl></dd></dl>"
    "<dl><dt>plain term</dt><dd>no anchor, no section</dd></dl>"
)


def test_anchored_definitions_are_sections_below_the_headings() -> None:
    doc = parse_document(API_HTML.encode(), "text/html")
    found = [(s.level, s.title) for s in doc.sections]
    assert found == [
        (1, "Built-in Functions"),
        (7, "enumerate(iterable, start=0)"),
        (7, "class Path(*parts)"),
        (8, "glob(pattern)"),
    ]
    # each section's title is where its text begins, so chunks of the entry start with it
    for s in doc.sections:
        assert doc.text[s.start :].startswith(s.title)
    assert "plain term" in doc.text

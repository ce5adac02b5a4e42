"""Turn uploaded bytes (plain text, Markdown, HTML, PDF) into one text with headings and pages."""

from __future__ import annotations

import io
import logging
import re
from dataclasses import dataclass, field
from pathlib import PurePath

from prefixrag.retrieval.html_text import html_to_text

logger = logging.getLogger(__name__)

SUPPORTED_MEDIA_TYPES: frozenset[str] = frozenset(
    {"text/plain", "text/markdown", "text/html", "application/pdf"}
)

_EXTENSIONS = {
    ".txt": "text/plain",
    ".text": "text/plain",
    ".md": "text/markdown",
    ".markdown": "text/markdown",
    ".html": "text/html",
    ".htm": "text/html",
    ".pdf": "application/pdf",
}
_DECLARED_ALIASES = {
    "text/x-markdown": "text/markdown",
    "application/xhtml+xml": "text/html",
    "application/x-pdf": "application/pdf",
}


class UnsupportedMediaTypeError(ValueError):
    """The file's type is none of SUPPORTED_MEDIA_TYPES."""


class DocumentParseError(ValueError):
    """The bytes can't be turned into text: malformed, undecodable, or no text at all."""


@dataclass(slots=True)
class Section:
    """A heading of depth `level` (1 = top) whose line begins at char offset `start` of the text."""

    start: int
    level: int
    title: str


@dataclass(slots=True)
class ParsedDocument:
    """The plain text of a document plus where its PDF pages and its sections begin."""

    text: str
    media_type: str
    page_starts: list[int] | None = None
    sections: list[Section] = field(default_factory=list)
    title: str | None = None


def detect_media_type(filename: str | None, declared: str | None = None) -> str:
    """The media type by file extension first, then by the declared content type."""
    if filename:
        suffix = PurePath(filename).suffix.lower()
        if suffix in _EXTENSIONS:
            return _EXTENSIONS[suffix]
    if declared:
        base = declared.split(";", 1)[0].strip().lower()
        base = _DECLARED_ALIASES.get(base, base)
        if base in SUPPORTED_MEDIA_TYPES:
            return base
    raise UnsupportedMediaTypeError(
        f"unsupported file type (filename={filename!r}, content type={declared!r}); "
        f"supported: {', '.join(sorted(_EXTENSIONS))}"
    )


def parse_document(data: bytes, media_type: str) -> ParsedDocument:
    """Extract the text, sections, pages and title of `data`, which has type `media_type`."""
    if media_type not in SUPPORTED_MEDIA_TYPES:
        raise UnsupportedMediaTypeError(f"unsupported media type {media_type!r}")
    if not data:
        raise DocumentParseError("the document is empty (0 bytes)")
    if media_type == "application/pdf":
        doc = _parse_pdf(data)
    elif media_type == "text/html":
        text, headings, title = html_to_text(data)
        sections = [Section(start, level, name) for start, level, name in headings]
        doc = ParsedDocument(text, media_type, None, sections, title)
    elif media_type == "text/markdown":
        text = _decode_text(data)
        sections = markdown_sections(text)
        title = next((s.title for s in sections if s.level == 1), None)
        doc = ParsedDocument(text, media_type, None, sections, title)
    else:
        doc = ParsedDocument(_decode_text(data), media_type)
    if not doc.text.strip():
        raise DocumentParseError(f"the {media_type} document contains no text")
    return doc


def _decode_text(data: bytes) -> str:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DocumentParseError(
            f"the text is not valid UTF-8 (bad byte at offset {exc.start}); save it as UTF-8"
        ) from exc
    if "\x00" in text:
        raise DocumentParseError("the text contains NUL bytes; is it a binary file?")
    return text.replace("\r\n", "\n").replace("\r", "\n")


_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")


def markdown_sections(text: str) -> list[Section]:
    """ATX (`# Title`) and setext (`Title` over `===`/`---`) headings outside code fences."""
    sections: list[Section] = []
    offset = 0
    in_fence = False
    # (start, line) of a one-line paragraph so far; a setext underline turns it into a heading
    prev: tuple[int, str] | None = None
    para_lines = 0
    for line in text.split("\n"):
        start, offset = offset, offset + len(line) + 1
        if _FENCE.match(line):
            in_fence, prev, para_lines = not in_fence, None, 0
            continue
        if in_fence:
            continue
        atx = _ATX.match(line)
        setext = _SETEXT.match(line)
        if atx:
            sections.append(Section(start, len(atx.group(1)), (atx.group(2) or "").strip()))
            prev = None
        elif setext and prev is not None:
            sections.append(
                Section(prev[0], 1 if setext.group(1)[0] == "=" else 2, prev[1].strip())
            )
            prev = None
        elif line.strip():
            para_lines += 1
            prev = (start, line) if para_lines == 1 else None
            continue
        else:
            prev = None
        para_lines = 0
    return sections


def _parse_pdf(data: bytes) -> ParsedDocument:
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        page_texts = [page.extract_text() or "" for page in reader.pages]
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
        raise DocumentParseError(f"malformed PDF: {exc}") from exc
    if not page_texts:
        raise DocumentParseError("the PDF has no pages")
    parts: list[str] = []
    page_starts: list[int] = []
    offset = 0
    for page_text in page_texts:
        page_starts.append(offset)
        cleaned = page_text.replace("\r\n", "\n").strip("\n") + "\n\n"
        parts.append(cleaned)
        offset += len(cleaned)
    text = "".join(parts)
    return ParsedDocument(
        text, "application/pdf", page_starts, _pdf_outline(reader, page_starts), _pdf_title(reader)
    )


def _pdf_title(reader: object) -> str | None:
    try:
        meta = reader.metadata  # type: ignore[attr-defined]
        title = meta.title if meta is not None else None
    except Exception:  # NOTE: broken metadata must not fail an otherwise readable PDF
        return None
    return (str(title).strip() or None) if title else None


def _pdf_outline(reader: object, page_starts: list[int]) -> list[Section]:
    """Bookmarks become sections starting at their page; a broken outline is ignored."""
    sections: list[Section] = []

    def walk(items: list, level: int) -> None:
        for item in items:
            if isinstance(item, list):
                walk(item, level + 1)
                continue
            page = reader.get_destination_page_number(item)  # type: ignore[attr-defined]
            if page is not None and 0 <= page < len(page_starts):
                sections.append(Section(page_starts[page], level, str(item.title).strip()))

    try:
        walk(reader.outline, 1)  # type: ignore[attr-defined]
    except Exception as exc:  # NOTE: outlines are optional metadata; text is what matters
        logger.info("ignoring unreadable PDF outline: %s", exc)
        return []
    sections.sort(key=lambda s: (s.start, s.level))
    return sections

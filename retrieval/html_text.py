"""HTML to plain text that keeps block structure as paragraphs and h1-h6 as sections.

An anchored definition term (`<dt id=...>`, as API references write each function, class or
method signature) is a section too, one level below the headings and below any definition it is
nested in, so that a chunk never mixes two API entries and each entry's chunks carry its
signature in their heading path.
"""

from __future__ import annotations

import re

from bs4 import BeautifulSoup
from bs4.element import NavigableString, PreformattedString, Tag

_DROP_TAGS = frozenset(
    {"script", "style", "nav", "noscript", "template", "svg", "iframe", "head", "button"}
)
_BLOCK_TAGS = frozenset(
    {
        "address", "article", "aside", "blockquote", "caption", "dd", "details", "div", "dl",
        "dt", "fieldset", "figcaption", "figure", "footer", "form", "header", "hr", "li", "main",
        "ol", "p", "pre", "section", "summary", "table", "tbody", "thead", "tfoot", "ul",
    }
)  # fmt: skip
_LINE_TAGS = frozenset({"br", "tr"})
_HEADINGS = {f"h{n}": n for n in range(1, 7)}
_SPACE = re.compile(r"\s+")


# (char offset where it begins, level: 1-6 for h1-h6, 7+ for definitions, title)
Heading = tuple[int, int, str]


def html_to_text(
    data: bytes | str, *, definitions: bool = True
) -> tuple[str, list[Heading], str | None]:
    """The visible text of an HTML page, its headings, and its title (<title>, else first h1).

    With `definitions` (the default), anchored definition terms are headings too (see above).
    """
    soup = BeautifulSoup(data, "html.parser")
    title_tag = soup.find("title")
    title = _clean(title_tag.get_text(" ")) if title_tag is not None else None
    for tag in soup.find_all(_is_dropped):
        tag.decompose()
    writer = _TextWriter(definitions)
    writer.walk(soup)
    if not title:
        first_h1 = next((h for h in writer.sections if h[1] == 1), None)
        title = first_h1[2] if first_h1 is not None else None
    return writer.text(), writer.sections, title or None


def _is_dropped(tag: Tag) -> bool:
    if tag.name in _DROP_TAGS or tag.get("role") == "navigation":
        return True
    # Sphinx-style "¶" permalinks would otherwise end every heading
    return "headerlink" in (tag.get("class") or [])


def _is_definition_term(tag: Tag) -> bool:
    """An anchored <dt> that starts an entry (not an overload listed right after another dt)."""
    if tag.name != "dt" or not tag.get("id"):
        return False
    previous = tag.find_previous_sibling(True)
    return previous is None or previous.name != "dt"


def _section_level(tag: Tag) -> int:
    if tag.name in _HEADINGS:
        return _HEADINGS[tag.name]
    # below h6, one level deeper per enclosing definition list (a class's methods sit in its dd)
    return 6 + sum(1 for _ in tag.find_parents("dl"))


def _clean(text: str) -> str:
    return _SPACE.sub(" ", text).strip()


class _TextWriter:
    """Appends text with collapsed whitespace and emits breaks lazily, so none pile up."""

    def __init__(self, definitions: bool) -> None:
        self.definitions = definitions
        self.parts: list[str] = []
        self.length = 0
        self.sections: list[Heading] = []
        self._pending = ""  # the break owed before the next text: "", "\n" or "\n\n"
        self._space = False  # a collapsed space is owed before the next word

    def text(self) -> str:
        return "".join(self.parts) + ("\n" if self.parts else "")

    def walk(self, root: Tag) -> None:
        # iterative walk: real pages nest deeper than Python's recursion limit allows
        stack: list[tuple[object, bool]] = [(root, True)]
        while stack:
            node, entering = stack.pop()
            if isinstance(node, PreformattedString):
                continue
            if isinstance(node, NavigableString):
                self._write_inline(str(node))
                continue
            if not isinstance(node, Tag):
                continue
            if entering:
                self._open(node)
                stack.append((node, False))
                if node.name == "pre" or self._is_heading(node):
                    continue  # written whole by _open
                stack.extend((child, True) for child in reversed(node.contents))
            else:
                self._close(node)

    def _open(self, tag: Tag) -> None:
        name = tag.name
        if self._is_heading(tag):
            # NOTE: a signature's inline parts carry their own spacing; a separator would turn
            # "f(x, y=0)" into "f ( x , y = 0 )"
            title = _clean(tag.get_text(" " if name in _HEADINGS else ""))
            if title:
                self._break("\n\n")
                self._flush_break()
                self.sections.append((self.length, _section_level(tag), title))
                self._emit(title)
                self._break("\n\n")
        elif name == "pre":
            body = tag.get_text().strip("\n")
            if body.strip():
                self._break("\n\n")
                self._flush_break()
                self._emit(body)
                self._break("\n\n")
        elif name in _BLOCK_TAGS:
            self._break("\n\n")
        elif name in _LINE_TAGS:
            self._break("\n")
        elif name in ("td", "th"):
            self._space = True

    def _is_heading(self, tag: Tag) -> bool:
        return tag.name in _HEADINGS or (self.definitions and _is_definition_term(tag))

    def _close(self, tag: Tag) -> None:
        if tag.name in _BLOCK_TAGS:
            self._break("\n\n")
        elif tag.name == "tr":
            self._break("\n")

    def _write_inline(self, raw: str) -> None:
        words = _clean(raw)
        if not words:
            self._space = self._space or bool(raw)
            return
        at_line_start = self._pending != "" or not self.parts
        self._flush_break()
        if (self._space or raw[0].isspace()) and not at_line_start:
            self._emit(" ")
        self._emit(words)
        self._space = raw[-1].isspace()

    def _break(self, kind: str) -> None:
        if self.parts and len(kind) > len(self._pending):
            self._pending = kind
        self._space = False

    def _flush_break(self) -> None:
        if self._pending and self.parts:
            self._emit(self._pending)
        self._pending = ""

    def _emit(self, s: str) -> None:
        self.parts.append(s)
        self.length += len(s)

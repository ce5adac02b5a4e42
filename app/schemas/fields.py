"""Field types shared by the request bodies: collection names, row ids and texts that must hold
more than whitespace."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from pydantic import AfterValidator, Field

COLLECTION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}$"
# Row ids are 32-bit on PostgreSQL: a bigger one is refused here rather than by the database.
MAX_ROW_ID = 2**31 - 1
RowId = Annotated[int, Field(ge=1, le=MAX_ROW_ID)]


def _not_blank(label: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        if not value.strip():
            raise ValueError(f"{label} is empty (only whitespace)")
        return value

    return check


DocumentText = Annotated[str, Field(min_length=1), AfterValidator(_not_blank("text"))]
SearchQuery = Annotated[
    str, Field(min_length=1, max_length=4000), AfterValidator(_not_blank("query"))
]
Question = Annotated[str, Field(min_length=1), AfterValidator(_not_blank("question"))]
EarlierQuestion = Annotated[
    str, Field(min_length=1), AfterValidator(_not_blank("an earlier question"))
]

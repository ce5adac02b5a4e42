"""Field types shared by the request bodies: collection names and row ids."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

COLLECTION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}$"
# Row ids are 32-bit on PostgreSQL: a bigger one is refused here rather than by the database.
MAX_ROW_ID = 2**31 - 1
RowId = Annotated[int, Field(ge=1, le=MAX_ROW_ID)]

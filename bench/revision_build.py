"""A C kernel library built from the sources of another git revision, beside today's.

A shared host's speed drifts by a third within an hour, so a kernel change is measured in one
process: today's build and a revision's, interleaved. The revision's ``kernels/csrc`` is taken
with ``git archive`` into a temporary folder and built there; today's sources, build cache and
loaded libraries are left as they were.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from prefixrag.kernels import native_build

T = TypeVar("T")


def built_at(rev: str, build: Callable[[], T]) -> T:
    """What ``build`` returns (a library loaded through native_build.load_library) when the
    sources are those of git revision ``rev`` of this checkout. Raises
    subprocess.CalledProcessError for a revision git does not know."""
    repo = Path(__file__).resolve().parents[1]
    archive = subprocess.run(
        ["git", "archive", rev, "kernels/csrc"], cwd=repo, capture_output=True, check=True
    ).stdout
    where = Path(tempfile.mkdtemp(prefix="csrc-"))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(where, filter="data")
    saved = native_build.CSRC
    native_build.CSRC = where / "kernels" / "csrc"
    native_build.load_library.cache_clear()  # today's libraries stay loaded, out of the cache
    try:
        return build()
    finally:
        native_build.CSRC = saved
        native_build.load_library.cache_clear()

"""Builds and loads the C kernels in kernels/csrc on first use, cached by source and flags.

The library is compiled for the machine it runs on (``-march=native``), so the cache key holds
the source hash, the flags and the host's CPU flags; each build is written to a temp file and
renamed, so a half-written library is never loaded. ``PREFIXRAG_KERNEL_CACHE`` moves the cache
(default ``~/.cache/prefixrag/kernels``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

# torch first: the library's libgomp.so.1 must resolve to the copy torch loaded (one OpenMP pool)
import torch  # noqa: F401

CSRC = Path(__file__).parent / "csrc"
DEFAULT_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")


class NativeBuildError(RuntimeError):
    """The C compiler is missing or rejected the source; the message holds its output."""


def cache_dir() -> Path:
    """Where built libraries live."""
    default = Path.home() / ".cache" / "prefixrag" / "kernels"
    return Path(os.environ.get("PREFIXRAG_KERNEL_CACHE", default))


def _cpu_flags_line() -> str:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    return next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo is missing)."""
    return frozenset(_cpu_flags_line().partition(":")[2].split())


def _cpu_ident() -> str:
    return f"{platform.machine()}|{_cpu_flags_line()}"


@functools.cache
def load_library(source: str, flags: tuple[str, ...] = DEFAULT_FLAGS) -> ctypes.CDLL:
    """The shared library built from ``csrc/<source>`` with ``flags`` (built once per key)."""
    src = CSRC / source
    # the headers too: a source may include any of them
    text = src.read_bytes() + b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
    key = hashlib.sha256(text + repr(flags).encode() + _cpu_ident().encode()).hexdigest()[:20]
    out = cache_dir() / f"{src.stem}-{key}.so"
    if not out.is_file():
        _compile(src, out, flags)
    return ctypes.CDLL(str(out))


def _compile(src: Path, out: Path, flags: tuple[str, ...]) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NativeBuildError("no C compiler (cc or gcc) found to build the CPU kernels")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{src.stem}-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, str(src), "-o", tmp], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise NativeBuildError(f"{compiler} failed on {src.name}:\n{done.stderr}")
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)

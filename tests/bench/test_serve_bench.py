"""The serve bench's readings of a process: peak RSS and bytes written from /proc, and the
biggest file a start left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serve_bench import biggest_file, proc_field

pytestmark = pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc")


def test_peak_rss_grows_by_what_a_process_touches() -> None:
    # A fresh process, read from outside as the bench reads the server: this one may hold freed
    # pages that a new array reuses without its RSS growing (CI saw 182 MiB for 256).
    code = (
        "import sys, numpy as np\n"
        "print(flush=True); sys.stdin.readline()\n"
        "block = np.ones(256 * 2**20, dtype=np.uint8)  # every page written\n"
        "print(flush=True); sys.stdin.readline()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        child.stdout.readline()
        resident = proc_field(child.pid, "status", "VmRSS")
        child.stdin.write("\n")
        child.stdin.flush()
        child.stdout.readline()  # the array is made
        peak = proc_field(child.pid, "status", "VmHWM")
        assert peak - resident >= 200 * 2**20
        assert proc_field(child.pid, "status", "VmRSS") <= peak
    finally:
        child.kill()
        child.wait()


def test_bytes_written_count_a_file_written_through(tmp_path: Path) -> None:
    before = proc_field(os.getpid(), "io", "write_bytes")
    path = tmp_path / "blob"
    with path.open("wb") as f:
        f.write(os.urandom(8 * 2**20))
        f.flush()
        os.fsync(f.fileno())
    assert proc_field(os.getpid(), "io", "write_bytes") - before >= 8 * 2**20
    with pytest.raises(KeyError, match="no NoSuchField"):
        proc_field(os.getpid(), "status", "NoSuchField")


def test_the_biggest_file_is_found_at_any_depth(tmp_path: Path) -> None:
    assert biggest_file(tmp_path) == ("", 0)
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "deep" / "er").mkdir(parents=True)
    (tmp_path / "deep" / "er" / "weights.bin").write_bytes(b"x" * 1000)
    assert biggest_file(tmp_path) == ("deep/er/weights.bin", 1000)

"""The serve bench's readings of a process: peak RSS and bytes written from /proc, and the
biggest file a start left behind."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from bench.serve_bench import biggest_file, proc_field

pytestmark = pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc")


def test_peak_rss_grows_by_what_a_process_touches() -> None:
    resident = proc_field(os.getpid(), "status", "VmRSS")
    block = np.ones(256 * 2**20, dtype=np.uint8)  # 256 MiB, every page written
    peak = proc_field(os.getpid(), "status", "VmHWM")
    assert peak - resident >= 200 * 2**20
    assert proc_field(os.getpid(), "status", "VmRSS") <= peak
    del block


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

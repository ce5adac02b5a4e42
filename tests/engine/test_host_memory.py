"""retain_freed_memory: a prefill-sized buffer comes from the heap, not a mapping of its own, and
once a prefill's buffers have been through the heap a later prefill gets them back without page
faults.

Each case runs in a fresh interpreter, since glibc's thresholds are process-wide and the test
process has its own history of allocations. The control case (glibc's own thresholds, where a
24 MiB block is mapped per use) shows the test can fail."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")

BUFFERS, FLOATS, ROUNDS = 5, 6 << 20, 6  # five 24 MiB activations live at once, six prefills
PAGES_PER_ROUND = BUFFERS * FLOATS * 4 // 4096

SCRIPT = f"""
import ctypes, json, resource, sys
import torch
from prefixrag.engine.host_memory import retain_freed_memory
took = retain_freed_memory() if sys.argv[1] == "retain" else None
sbrk = ctypes.CDLL(None).sbrk
sbrk.argtypes, sbrk.restype = [ctypes.c_long], ctypes.c_void_p
first = torch.empty({FLOATS})
in_heap = first.data_ptr() < sbrk(0)  # the heap ends at the program break; mappings lie above
del first
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
per_round = []
for _ in range({ROUNDS}):
    before = faults()
    live = [torch.empty({FLOATS}).fill_(1.0) for _ in range({BUFFERS})]
    del live
    per_round.append(faults() - before)
print(json.dumps({{"took": took, "in_heap": in_heap, "faults": per_round}}))
"""


def _run(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_prefill_buffers_stay_in_the_heap_and_come_back_without_page_faults():
    retained = _run("retain")
    assert retained["took"] is True
    assert retained["in_heap"], retained
    # the first rounds may still fault while the heap settles (aligned blocks split their
    # neighbours); the last two must not
    assert sum(retained["faults"][-2:]) < PAGES_PER_ROUND // 20, retained
    assert not _run("default")["in_heap"]  # glibc's own threshold: a mapping per buffer

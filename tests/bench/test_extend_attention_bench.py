"""extend_attention_bench --against: a revision's kernels built and called beside today's."""

from __future__ import annotations

import subprocess

import pytest
import torch

from bench import extend_attention_bench as bench
from prefixrag.kernels import cpu_ops, native_build
from tests.bench.helpers import RecordingLibrary


def test_a_revisions_kernels_run_beside_todays_and_leave_them_in_place():
    today, source, build = cpu_ops.build(), native_build.CSRC, cpu_ops.build
    lib = bench.library_at("HEAD")
    assert source == native_build.CSRC  # today's sources, builds and libraries left in place
    assert cpu_ops.build is build and cpu_ops.build() is today
    case = bench.Case(300, 40)
    case.sdpa()  # writes the new rows' keys and values, as every run of the bench does first
    case.tiles()
    want = case.out.clone()
    case.out.zero_()
    bench.run_with(lib, case.tiles)()
    # HEAD's kernels are today's in a clean checkout: the same bits
    assert torch.equal(case.out, want)
    assert cpu_ops.build is build


def test_an_unknown_revision_is_refused():
    with pytest.raises(subprocess.CalledProcessError):
        bench.library_at("no-such-revision")
    assert native_build.CSRC.name == "csrc" and native_build.CSRC.parent.name == "kernels"


def test_run_with_routes_the_kernel_call_to_the_library_given():
    lib, build = RecordingLibrary(), cpu_ops.build
    bench.run_with(lib, bench.Case(64, 8).tiles)()
    assert lib.calls == ["paged_extend_attention"]
    assert cpu_ops.build is build

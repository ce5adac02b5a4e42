"""kernel_flags_ab: variants parse strictly, and their flags reach every C call of the engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import kernel_flags_ab as ab
from prefixrag.engine import quant
from prefixrag.kernels import decode_step
from prefixrag.kernels.native_build import DEFAULT_FLAGS


def test_variants_parse_in_order_with_their_flags():
    got = ab.parse_variants(["base=", "far=-DBLOCK_PREFETCH_ROWS=16 -O2"])
    assert list(got) == ["base", "far"]
    assert got["base"] == ()
    assert got["far"] == ("-DBLOCK_PREFETCH_ROWS=16", "-O2")


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["base=", "pf"], "NAME=FLAGS"),
        (["base=", "=-DX=1"], "NAME=FLAGS"),
        (["a=", "a=-DX=1"], "twice"),
        (["alone="], "at least two"),
    ],
)
def test_bad_variants_are_refused(specs, message):
    with pytest.raises(ValueError, match=message):
        ab.parse_variants(specs)


def test_a_build_routes_the_decode_step_and_the_matmuls(monkeypatch):
    # restore the module attributes use_build replaces when the test ends
    monkeypatch.setattr(decode_step, "build", decode_step.build)
    monkeypatch.setattr(quant, "block_quant_matmul", quant.block_quant_matmul)
    monkeypatch.setattr(quant, "fixed_order_matmul", quant.fixed_order_matmul)
    ab.use_build(("-DBLOCK_PREFETCH_ROWS=4",))
    want = (*DEFAULT_FLAGS, "-DBLOCK_PREFETCH_ROWS=4")
    assert decode_step.build.args == (want,)  # type: ignore[attr-defined]
    assert quant.block_quant_matmul.keywords == {"flags": want}  # type: ignore[attr-defined]
    assert quant.fixed_order_matmul.keywords == {"flags": want}  # type: ignore[attr-defined]
    ab.use_build(())
    assert decode_step.build.args == (DEFAULT_FLAGS,)  # type: ignore[attr-defined]


def test_each_variant_goes_first_in_turn():
    names = ["a", "b", "c"]
    orders = [ab.rotated(names, rep) for rep in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_the_ratio_is_the_median_of_each_repeats_own():
    # the host halves its speed after the first repeat: per-repeat ratios see b 10% faster in
    # every repeat, where a ratio of medians would read the drift into it
    got = ab.summarize({"a": [100.0, 50.0, 52.0], "b": [110.0, 55.0, 57.2]})
    assert got["a"]["median_tok_s"] == 52.0
    assert got["b"]["vs_first"] == pytest.approx(1.1)
    assert got["b"]["vs_first_range"] == pytest.approx([1.1, 1.1])
    assert got["b"]["repeats_faster_than_first"] == 3
    assert got["b"]["samples_tok_s"] == [110.0, 55.0, 57.2]
    assert got["a"]["vs_first"] == 1.0


@pytest.mark.slow
def test_two_builds_of_the_packaged_model_decode_the_same_tokens(tmp_path):
    out = tmp_path / "ab.json"
    cmd = [
        sys.executable, "-m", "bench.kernel_flags_ab", "base=", "near=-DBLOCK_PREFETCH_ROWS=1",
        "--repeats", "1", "--new-tokens", "8", "--out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    # the run ends only when both builds decoded the same tokens; each reports its own speed
    assert result["variants"] == {"base": [], "near": ["-DBLOCK_PREFETCH_ROWS=1"]}
    assert all(r["median_tok_s"] > 0 for r in result["results"].values())
    assert result["results"]["base"]["vs_first"] == 1.0

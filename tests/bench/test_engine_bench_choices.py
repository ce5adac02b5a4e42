"""engine_bench's choice of llama.cpp's flash attention: each probe part counts alike."""

from __future__ import annotations

from bench.engine_bench import flash_attn_choice


def _probe(cold: float, warm: float, decode: float) -> dict:
    return {"cold_s": cold, "warm_s": warm, "decode_s": decode}


def test_a_faster_cold_prefill_does_not_outvote_slower_warm_and_decode():
    # the Xeon probe that a sum of seconds got wrong: on wins the sum (7.44 s to 7.80 s)
    timed = {"on": _probe(5.61, 0.691, 1.143), "off": _probe(6.84, 0.289, 0.665)}
    assert flash_attn_choice(timed) == "off"


def test_the_setting_faster_in_every_part_wins():
    assert flash_attn_choice({"on": _probe(1, 1, 1), "off": _probe(2, 2, 2)}) == "on"
    assert flash_attn_choice({"on": _probe(2, 2, 2), "off": _probe(1, 1, 1)}) == "off"

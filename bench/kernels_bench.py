"""Kernel benchmark in a Llama-3-8B-shaped setting (32 q heads, 8 KV heads, head_dim 128, bf16).

Reports paged decode attention's achieved memory bandwidth against the device's peak and against
torch SDPA over gathered KV (1k/8k/32k context), and extend attention TFLOP/s against torch SDPA for
a 2k-token suffix on an 8k cached prefix. Every kernel is first checked against its reference on a
small shape, so a wrong kernel is never timed. Then our engine end to end on a Llama-3.1-8B-shaped
model with random bf16 weights (bench/kernels_engine.py): decode tokens/s at batch 1/16/64 against
the bandwidth bound, and TTFT of a 16k prompt cold vs with 15k cached. Writes
bench/results/kernels_bench.json and a PNG.

    python -m bench.kernels_bench [--peak-tbps 4.8] [--no-engine] [--out PATH.json]

Needs a CUDA GPU (about 3 minutes on an H100/H200); on CPU it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.kernels_engine import bench_engine
from prefixrag.kernels.extend_attention import extend_attention, extend_attention_reference
from prefixrag.kernels.kv_write import write_kv, write_kv_reference
from prefixrag.kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference
from prefixrag.kernels.rms_norm import rms_norm, rms_norm_reference
from prefixrag.kernels.rope import apply_rope_, apply_rope_reference_, build_cos_sin_cache

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 32, 8, 128, 32
HIDDEN, INTERMEDIATE, BLOCK_SIZE = 4096, 14336, 16
DTYPE = torch.bfloat16
DECODE_CASES = [(1024, 16), (8192, 8), (32768, 2)]  # (context, batch)
EXTEND_PREFIX, EXTEND_NEW = 8192, 2048
# Peak HBM bandwidth in TB/s, matched by substring of torch.cuda.get_device_name().
PEAK_TBPS = [("H200", 4.8), ("H100 PCIe", 2.0), ("H100", 3.35), ("A100", 2.0)]


@dataclass(slots=True)
class DecodeResult:
    """One decode-attention measurement (per layer, whole batch)."""

    context: int
    batch: int
    triton_ms: float
    torch_gather_sdpa_ms: float
    torch_sdpa_only_ms: float
    kv_bytes: int
    triton_tbps: float
    fraction_of_peak: float
    speedup_vs_torch: float


def _ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def _paged_cache(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random bf16 K/V caches and shuffled block tables holding sequences of the given lengths."""
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    shape = (sum(blocks), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
    order = torch.randperm(sum(blocks), device="cuda").int()
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = order[start : start + n]
        start += n
    return k_cache, v_cache, tables


def _close(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    if not torch.allclose(actual.float(), expected.float(), atol=2e-2, rtol=2e-2):
        diff = (actual.float() - expected.float()).abs().max().item()
        raise SystemExit(f"correctness pre-check FAILED for {name}: max abs diff {diff:.3g}")


def precheck() -> None:
    """Run each kernel against its reference on one small bf16 shape; exit non-zero on mismatch."""
    lens = [37, 300, 1]
    k_cache, v_cache, tables = _paged_cache(lens)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    args = (q, k_cache, v_cache, tables, seq_lens, HEAD_DIM**-0.5)
    expected = paged_decode_attention_reference(*args)
    for num_splits in (None, 1, 4):
        _close("paged_decode", paged_decode_attention(*args, num_splits=num_splits), expected)
    prefix = torch.tensor([0, 280, 1], dtype=torch.int32, device="cuda")
    new = seq_lens - prefix
    cu = torch.nn.functional.pad(new.cumsum(0), (1, 0)).int()
    q = torch.randn(int(new.sum()), NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    args = (q, k_cache, v_cache, tables, prefix, new, cu, HEAD_DIM**-0.5)
    _close("extend", extend_attention(*args), extend_attention_reference(*args))
    x, res = (torch.randn(9, HIDDEN, device="cuda", dtype=DTYPE) for _ in range(2))
    w = torch.randn(HIDDEN, device="cuda", dtype=DTYPE)
    _close("rms_norm", rms_norm(x, w, 1e-5, res)[0], rms_norm_reference(x, w, 1e-5, res)[0])
    cache = build_cos_sin_cache(HEAD_DIM, 4096, 500000.0, device="cuda")
    pos = torch.randint(0, 4096, (9,), device="cuda")
    qk = [torch.randn(9, h, HEAD_DIM, device="cuda", dtype=DTYPE) for h in (32, 8, 32, 8)]
    qk[2].copy_(qk[0])
    qk[3].copy_(qk[1])
    apply_rope_(qk[0], qk[1], pos, cache)
    apply_rope_reference_(qk[2], qk[3], pos, cache)
    _close("rope", torch.cat([qk[0], qk[1]], 1), torch.cat([qk[2], qk[3]], 1))
    kc, vc = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    kr, vr = kc.clone(), vc.clone()
    kv = torch.randn(2, 50, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    slots = torch.randperm(kc.shape[0] * BLOCK_SIZE, device="cuda")[:50]
    write_kv(kv[0], kv[1], kc, vc, slots)
    write_kv_reference(kv[0], kv[1], kr, vr, slots)
    _close("write_kv", torch.stack([kc, vc]), torch.stack([kr, vr]))
    print("correctness pre-check passed (decode, extend, rms_norm, rope, write_kv)")


def bench_decode(context: int, batch: int, peak_tbps: float, layouts: int = 3) -> DecodeResult:
    """Time one layer's decode attention for `batch` sequences of `context` tokens: the median
    over ``layouts`` fresh caches, each with its own random block placement."""
    runs = sorted(
        (_bench_decode_once(context, batch, peak_tbps) for _ in range(layouts)),
        key=lambda r: r.triton_ms,
    )
    return runs[len(runs) // 2]


def _bench_decode_once(context: int, batch: int, peak_tbps: float) -> DecodeResult:
    k_cache, v_cache, tables = _paged_cache([context] * batch)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    scale = HEAD_DIM**-0.5
    triton_ms = _ms(lambda: paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale))

    def gather() -> tuple[torch.Tensor, torch.Tensor]:
        k = k_cache[tables.long()].flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
        v = v_cache[tables.long()].flatten(1, 2).transpose(1, 2)
        return k, v

    q4 = q[:, :, None, :]
    k, v = gather()
    sdpa = lambda k, v: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)  # noqa: E731
    gather_ms = _ms(lambda: sdpa(*gather()))
    sdpa_ms = _ms(lambda: sdpa(k, v))
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    tbps = kv_bytes / (triton_ms * 1e-3) / 1e12
    return DecodeResult(
        context, batch, triton_ms, gather_ms, sdpa_ms, kv_bytes, tbps, tbps / peak_tbps,
        gather_ms / triton_ms,
    )  # fmt: skip


SWEEP_SPLITS = (None, 8, 16, 32, 64)
# (num_warps, num_stages, block_n)
SWEEP_LAUNCH = ((4, None, 64), (4, None, 32), (4, None, 128), (8, None, 128), (8, 4, 128))


def sweep_decode(context: int, batch: int, peak_tbps: float) -> list[dict[str, object]]:
    """Decode attention's bandwidth over split counts and launch settings, for tuning the
    split heuristic (None is today's choice)."""
    k_cache, v_cache, tables = _paged_cache([context] * batch)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    args = (q, k_cache, v_cache, tables, seq_lens, HEAD_DIM**-0.5)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    rows = []
    for splits in SWEEP_SPLITS:
        for warps, stages, block_n in SWEEP_LAUNCH:
            kwargs = {"num_splits": splits, "num_warps": warps, "num_stages": stages,
                      "block_n": block_n}  # fmt: skip
            ms = _ms(lambda kwargs=kwargs: paged_decode_attention(*args, **kwargs))
            tbps = kv_bytes / (ms * 1e-3) / 1e12
            rows.append({**kwargs, "context": context, "batch": batch, "ms": ms,
                         "tbps": tbps, "fraction_of_peak": tbps / peak_tbps})  # fmt: skip
    return rows


def bench_extend() -> dict[str, float]:
    """Time prefix-prefill of EXTEND_NEW tokens on an EXTEND_PREFIX cached prefix (one layer)."""
    total = EXTEND_PREFIX + EXTEND_NEW
    k_cache, v_cache, tables = _paged_cache([total])
    prefix = torch.tensor([EXTEND_PREFIX], dtype=torch.int32, device="cuda")
    new = torch.tensor([EXTEND_NEW], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, EXTEND_NEW], dtype=torch.int32, device="cuda")
    q = torch.randn(EXTEND_NEW, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    scale = HEAD_DIM**-0.5
    args = (q, k_cache, v_cache, tables, prefix, new, cu, scale)
    triton_ms = _ms(lambda: extend_attention(*args))
    k = k_cache[tables[0].long()].flatten(0, 1)[:total].transpose(0, 1)[None]  # [1, Hkv, L, D]
    v = v_cache[tables[0].long()].flatten(0, 1)[:total].transpose(0, 1)[None]
    q4 = q.transpose(0, 1)[None]
    mask = (
        torch.arange(total, device="cuda")[None]
        <= EXTEND_PREFIX + torch.arange(EXTEND_NEW, device="cuda")[:, None]
    )
    sdpa_ms = _ms(
        lambda: F.scaled_dot_product_attention(
            q4, k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
    )
    reference_ms = _ms(lambda: extend_attention_reference(*args))
    visible = EXTEND_NEW * EXTEND_PREFIX + EXTEND_NEW * (EXTEND_NEW + 1) / 2
    flops = 4 * NUM_Q_HEADS * HEAD_DIM * visible  # QK^T and PV, 2 flops per multiply-add
    return {
        "prefix": EXTEND_PREFIX,
        "new_tokens": EXTEND_NEW,
        "triton_ms": triton_ms,
        "torch_sdpa_masked_ms": sdpa_ms,
        "torch_reference_ms": reference_ms,
        "triton_tflops": flops / (triton_ms * 1e-3) / 1e12,
        "torch_sdpa_tflops": flops / (sdpa_ms * 1e-3) / 1e12,
    }


def _peak_tbps(override: float | None) -> tuple[str, float]:
    name = torch.cuda.get_device_name()
    if override is not None:
        return name, override
    for key, tbps in PEAK_TBPS:
        if key in name:
            return name, tbps
    raise SystemExit(f"unknown peak bandwidth for {name!r}: pass --peak-tbps")


def _plot(decode: list[DecodeResult], peak: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.context // 1024}k x{r.batch}" for r in decode]
    torch_tbps = [r.kv_bytes / (r.torch_gather_sdpa_ms * 1e-3) / 1e12 for r in decode]
    xs = range(len(decode))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([x - 0.2 for x in xs], [r.triton_tbps for r in decode], 0.4, label="Triton paged")
    ax.bar([x + 0.2 for x in xs], torch_tbps, 0.4, label="torch gather + SDPA")
    ax.axhline(peak, color="k", linestyle="--", label=f"peak {peak} TB/s")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("KV read bandwidth (TB/s)")
    ax.set_title("Paged decode attention, Llama-3-8B heads, bf16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _weight_bytes() -> int:
    per_layer = HIDDEN * (HIDDEN + 2 * NUM_KV_HEADS * HEAD_DIM) + HIDDEN * HIDDEN
    per_layer += 3 * HIDDEN * INTERMEDIATE
    return NUM_LAYERS * per_layer * DTYPE.itemsize


def _print_engine(engine: dict) -> None:
    print(f"engine end to end ({engine['backend']}), Llama-3.1-8B shape, random bf16 weights:")
    for mode, rows in (("eager", engine["decode_eager"]), ("graphs", engine["decode"])):
        if isinstance(rows, str):
            print(f"  decode with {mode}: {rows}")
            continue
        for r in rows:
            print(
                f"  decode {mode:>6} batch {r['batch']:>2}: {r['tokens_per_s']:8.0f} tok/s, "
                f"{r['ms_per_step']:.2f} ms/step, {r['fraction_of_bound']:.0%} of the bandwidth "
                f"bound ({r['bandwidth_bound_tokens_per_s']:.0f} tok/s)"
            )
    t = engine["ttft_16k"]
    print(
        f"  TTFT {t['prompt_tokens']} tokens: cold {t['ttft_cold_s']:.3f} s, "
        f"{t['cached_tokens_warm']} cached {t['ttft_cached_s']:.3f} s ({t['speedup']:.1f}x)"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, write JSON and PNG, print a summary; exit 0 with a message on CPU."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-tbps", type=float, default=None, help="override peak HBM TB/s")
    parser.add_argument("--out", type=Path, default=Path("bench/results/kernels_bench.json"))
    parser.add_argument("--no-engine", action="store_true", help="skip the end-to-end part")
    parser.add_argument(
        "--sweep-decode", action="store_true", help="also time decode over splits and launches"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "kernels_bench: no CUDA device here; the Triton kernels are benchmarked on a GPU only."
        )
        return 0
    torch.manual_seed(0)
    device, peak = _peak_tbps(args.peak_tbps)
    precheck()
    decode = [bench_decode(ctx, batch, peak) for ctx, batch in DECODE_CASES]
    sweep = (
        [row for ctx, batch in DECODE_CASES[1:] for row in sweep_decode(ctx, batch, peak)]
        if args.sweep_decode
        else []
    )
    extend = bench_extend()
    engine = None if args.no_engine else bench_engine(peak)
    result = {
        "device": device,
        "peak_tbps": peak,
        "shape": {"q_heads": NUM_Q_HEADS, "kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                  "layers": NUM_LAYERS, "block_size": BLOCK_SIZE, "dtype": str(DTYPE)},
        "decode": [asdict(r) for r in decode],
        "decode_sweep": sweep,
        "extend": extend,
        "weight_bytes": _weight_bytes(),
        "engine_end_to_end": engine if engine is not None else "skipped (--no-engine)",
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    _plot(decode, peak, args.out.with_suffix(".png"))
    print(f"{device}, peak {peak} TB/s; per layer, bf16")
    for r in decode:
        print(
            f"decode {r.context:>6} ctx x{r.batch:<2}: triton {r.triton_ms:.3f} ms "
            f"{r.triton_tbps:.2f} TB/s ({r.fraction_of_peak:.0%} of peak); torch gather+SDPA "
            f"{r.torch_gather_sdpa_ms:.3f} ms (Triton {r.speedup_vs_torch:.1f}x faster), "
            f"SDPA on contiguous KV {r.torch_sdpa_only_ms:.3f} ms"
        )
    for ctx, batch in DECODE_CASES:
        rows = [r for r in sweep if r["context"] == ctx and r["batch"] == batch]
        if rows:
            best = max(rows, key=lambda r: r["tbps"])
            print(
                f"  sweep {ctx:>6} x{batch:<2}: best {best['tbps']:.2f} TB/s "
                f"({best['fraction_of_peak']:.0%}) at splits={best['num_splits']} "
                f"warps={best['num_warps']} stages={best['num_stages']} "
                f"block_n={best['block_n']}"
            )
    print(
        f"extend {EXTEND_NEW} new on {EXTEND_PREFIX} prefix: triton {extend['triton_ms']:.2f} ms "
        f"{extend['triton_tflops']:.0f} TFLOP/s; torch masked SDPA "
        f"{extend['torch_sdpa_masked_ms']:.2f} ms {extend['torch_sdpa_tflops']:.0f} TFLOP/s"
    )
    if engine is not None:
        _print_engine(engine)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

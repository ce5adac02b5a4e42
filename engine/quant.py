"""Weight-only int8 quantization of the model's linear layers (CPU decode is bandwidth-bound).

Each weight row (output channel) gets one symmetric scale, ``max|row| / 127``; the int8 matrix
is a quarter of the fp32 bytes. The matmul runs ``torch._weight_int8pack_mm``, which takes
bfloat16 activations and scales and returns bfloat16: on CPU its fp32 variant is not vectorized
(slower than fp32 ``F.linear``), while the bf16 one reads the int8 weights 3-5x faster.
So an int8 linear computes ``bf16(x) @ dequantize(w).T`` with float32 accumulation, rounded to
bf16, and hands back the caller's dtype.

Every batch size takes the same kernel. Its rows are computed independently (a row's result does
not depend on how many rows share the call), so a token gets the same logits whether it is
prefilled in a big chunk, recomputed after a preemption or decoded alone: greedy output stays
identical with the prefix cache on and off. (Switching to a dequantize-then-float GEMM for big
batches, which is up to ~15% faster at 512+ rows, would break that.)
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from prefixrag.engine.packed_gemm import pack_weight, packed_linear
from prefixrag.kernels.block_quant_matmul import (
    MAX_K,
    QBLOCK,
    BlockQuantWeight,
    amx_ready,
    block_quant_dequantize_into,
    block_quant_matmul,
    block_quant_matmul_amx,
    block_quant_rows,
    fixed_order_matmul,
    q8_activations_fast,
    tile_min_rows,
)
from prefixrag.kernels.block_stack import BlockStack
from prefixrag.kernels.native_build import NativeBuildError, cpu_flags, load_library

WEIGHT_QUANTS = ("auto", "none", "int8", "gguf")
log = logging.getLogger(__name__)
# NOTE: up to this many rows a block weight runs the fused kernel (decode: bandwidth-bound);
# past it, prefill is compute-bound and a float32 GEMM over the dequantized matrix wins.
BLOCK_KERNEL_MAX_ROWS = 16
# NOTE: a GGUF file's Q4_K / Q6_K rows keep the block kernel for more rows (a question of tens
# of tokens after cached documents), where widening every matrix for the GEMM costs more than
# the GEMM saves. Qwen2.5-Coder-1.5B Q4_K_M's layer matrices, 2 threads, 2-core AMD EPYC (AVX2),
# per layer: with int8 activations (q8k_act.h) 35 ms at 32 rows and 125-153 ms at 128 against
# the widening GEMM's 175 and 254 ms; with float32 activations 72 ms at 32 rows and 146-210 at
# 64 against 175 and 195 (/tmp microbenchmarks of session 23, in the closing note).
KQUANT_INT8_MAX_ROWS = 256
KQUANT_FLOAT_MAX_ROWS = 48
# NOTE: where the bfloat16 GEMM is native (bf16_prefill) it overtakes the int8 block kernel far
# sooner. The 1.5B's matrices, 2 threads, 2-core AMD EPYC with AVX512_BF16 (session 25,
# median of 7), bfloat16 over int8: up_proj 0.98x at 32 rows, 0.63x at 64, 0.47x at 128;
# down_proj (Q6_K) 2.22x, 0.85x, 0.52x; q_proj 0.86x, 0.49x, 0.45x. Half way: 48.
KQUANT_BF16_MAX_ROWS = 48
# NOTE: where the build has the block kernel's tiles (csrc/block_tiles.h, AVX-512), float32 rows
# of x up to this many (a new question of tens of tokens after cached documents) take them, with
# the bits a decode step gives each row. bench/prefill_matmul_bench.py, SmolLM2-135M Q4_1, 2
# threads, 2-core Xeon, four runs: over the layer matrices the tiles against the GEMM were
# 0.77-0.88x at 16 rows, 0.88-1.04x at 32, 0.87-1.09x at 48 and 0.94-1.17x at 64 (runs differ:
# the GEMM streams 5x the bytes, and this host's memory and cores slow down apart); the warm
# TTFT of 32 new tokens after 2,048 cached was 0.87-0.96x of the GEMM's.
TILE_KERNEL_MAX_ROWS = 32
# NOTE: on hosts with AMX (kernels/csrc/amx_matmul.h), float32 rows of x past
# BLOCK_KERNEL_MAX_ROWS and up to this many take AMX's bfloat16 tile products instead of the
# tiles or the GEMM, each operand split into three exact parts: float32 accuracy (closer to
# float64 than MKL's float32 GEMM), but not a decode step's bits, as the GEMM's. SmolLM2-135M
# Q4_1's layer matrices, 2 threads, 2-core Xeon, interleaved (bench/prefill_matmul_bench.py and
# session notes): against the GEMM 0.79x at 32 rows (the tiles 0.94x), 0.69x at 64, 0.73x at
# 128, 0.92x at 560 and 1.28x at 2,080, where x no longer fits in L2. Since each chunk up to 32
# rows is packed as the products reach it (amx_matmul_for): 0.55x at 32, 0.61x at 64 and 0.65x
# at 128 (bench/results/prefill_matmul_bench.json).
AMX_MAX_ROWS = 256
INT8_MAX = 127
# NOTE: torch 2.13's CPU kernel returns garbage or segfaults unless the reduction dimension is a
# multiple of 16 (measured on AVX-512); other shapes are padded with zeros up to one.
_PACK_MM_K_MULTIPLE = 16


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (int8 [N, K], float32 scales [N]) with
    ``|weight - q * scale| <= scale / 2`` element-wise. An all-zero row gets scale 1."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"expected a 2-D floating-point weight, got {weight.dim()}-D {weight.dtype}"
        )
    w = weight.float()
    absmax = w.abs().amax(dim=1)
    scales = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
    q = torch.round(w / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def dequantize(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] from int8 [N, K] and scales [N]."""
    return qweight.float() * scales.float()[:, None]


class Int8Weight(nn.Module):
    """An int8 weight matrix [N, K] with bfloat16 per-row scales, used as ``linear(x, self)``.

    The bf16 scales are what the kernel multiplies by, so :meth:`dequantize` uses them too.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        q, scales = quantize_per_channel(weight)
        self.in_features = q.shape[1]
        # zero columns up to the kernel's multiple of 16 (they add nothing to any dot product)
        self.pad = -self.in_features % _PACK_MM_K_MULTIPLE
        self.register_buffer("qweight", F.pad(q, (0, self.pad)))
        self.register_buffer("scales", scales.to(torch.bfloat16))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.qweight.shape[0], self.in_features))

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix this weight stands for."""
        return dequantize(self.qweight[:, : self.in_features], self.scales)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T``: x [..., K] -> [..., N] in x's dtype (through bf16 activations, see the
        module doc)."""
        lead, k = x.shape[:-1], x.shape[-1]
        if k != self.in_features:
            raise ValueError(f"expected {self.in_features} input features, got {k}")
        x2 = x.reshape(-1, k)
        if x2.device.type != "cpu":
            raise ValueError("int8 weights run on CPU only")
        if x2.shape[0] == 0:
            return x.new_zeros(*lead, self.qweight.shape[0])
        x2 = x2.to(torch.bfloat16)
        # the pad copies: only shapes off the kernel's multiple of 16 pay for it
        x2 = F.pad(x2, (0, self.pad)) if self.pad else x2.contiguous()
        out = torch._weight_int8pack_mm(x2, self.qweight, self.scales)
        return out.to(x.dtype).reshape(*lead, -1)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | Int8Weight | BlockQuantWeight | BlockStack,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear`` for a plain, an :class:`Int8Weight` or a :class:`BlockQuantWeight` matrix.

    A block weight of a file's K-quant rows keeps the block kernel up to
    block_kernel_max_rows (tens to hundreds of rows: a short extend). A float32 CPU matmul of up
    to BLOCK_KERNEL_MAX_ROWS rows (a decode step) runs the block
    kernel's C loop over the float32 rows (kernels/block_quant_matmul.py's fixed_order_matmul):
    it streams each weight row once at memory speed, where MKL's GEMV and small GEMM run at a
    third to a half of it on this path (bench/engine_bench.py's fp32 side). Past that many rows
    prefill is compute-bound and MKL's GEMM wins, as for block weights past
    TILE_KERNEL_MAX_ROWS (up to it, on builds with the block kernel's tiles, they keep the block
    kernel and a decode step's bits; on hosts with AMX, up to AMX_MAX_ROWS take its tile
    products instead, at float32 accuracy)."""
    if isinstance(weight, BlockStack):
        return _stack_linear(x, weight, bias)
    if isinstance(weight, BlockQuantWeight):
        rows = x.numel() // x.shape[-1]
        if rows <= block_kernel_max_rows(weight):
            out = block_quant_matmul(x, weight, int8_activations=weight.int8_activations)
        elif weight.is_kquant:  # the tiles and AMX read plane kinds only
            out = _widened_linear(x, weight)
        elif rows <= AMX_MAX_ROWS and _amx_build():
            out = block_quant_matmul_amx(x, weight)
        elif rows <= TILE_KERNEL_MAX_ROWS and _block_tiles_build():
            out = block_quant_matmul(x, weight)
        else:
            dense = weight.dense if weight.dense is not None else _widened(weight)
            out = packed_linear(x, dense)
        return out if bias is None else out + bias
    if isinstance(weight, Int8Weight):
        out = weight.matmul(x)
        return out if bias is None else out + bias
    if _small_float32_cpu_matmul(x, weight):
        out = fixed_order_matmul(x.reshape(-1, x.shape[-1]), weight)
        out = out.reshape(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


def block_kernel_max_rows(weight: BlockQuantWeight | BlockStack) -> int:
    """The most rows of x a block weight multiplies in the block kernel; past them, the GEMM
    over its widened matrix (see KQUANT_INT8_MAX_ROWS)."""
    parts = weight.parts if isinstance(weight, BlockStack) else (weight,)
    if not all(p.is_kquant for p in parts):
        return BLOCK_KERNEL_MAX_ROWS
    if not weight.int8_activations:
        return KQUANT_FLOAT_MAX_ROWS
    return KQUANT_BF16_MAX_ROWS if bf16_prefill() else KQUANT_INT8_MAX_ROWS


def _widened_linear(x: torch.Tensor, weight: BlockQuantWeight | BlockStack) -> torch.Tensor:
    """``x @ W.T`` for a prefill-sized x over a file's K-quant rows or a stack of them: over the
    kept float32 copy (see keep_dense_block_weights_), or over the matrix widened for this call,
    in bfloat16 where the CPU multiplies bfloat16 natively (bf16_prefill)."""
    if weight.dense is not None:
        return packed_linear(x, weight.dense)  # type: ignore[arg-type]
    parts = weight.parts if isinstance(weight, BlockStack) else (weight,)
    if not bf16_prefill() or not all(p.is_kquant for p in parts):
        return packed_linear(x, _widened(weight))
    return F.linear(x.to(torch.bfloat16), _widened(weight, torch.bfloat16)).float()


def _widened(
    weight: BlockQuantWeight | BlockStack, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The matrix of a block weight (its parts stacked for a BlockStack), float32 or rounded to
    bfloat16."""
    if isinstance(weight, BlockStack):
        return weight.dequantize(dtype)
    out = torch.empty(weight.shape, dtype=dtype)
    block_quant_dequantize_into(weight, out)
    return out


@functools.cache
def bf16_prefill() -> bool:
    """Whether a file's K-quant rows widened for a prefill-sized matmul are widened to bfloat16
    and multiplied by oneDNN's bfloat16 GEMM (float32 sums), not float32's. (Plane kinds, the
    packaged model's, keep float32: their prefill reads a kept float32 copy, tiles or AMX.)

    Where the CPU has AVX512_BF16 or AMX-BF16 that GEMM runs at 4-5x float32's (2-core AMD EPYC
    with AVX512_BF16, 2 threads, 512 rows by Qwen2.5-1.5B's 8,960 x 1,536 up projection: 17 ms
    against 81 for MKL's float32 GEMM and 33 for oneDNN's over a packed weight), and the widened
    matrix is half the bytes to write. Its rounding of x and W to 8 significant bits is the
    size of the int8 activations' rounding that llama.cpp's prefill makes (and ours at up to
    block_kernel_max_rows). PREFIXRAG_PREFILL_BF16=off keeps float32 everywhere."""
    if os.environ.get("PREFIXRAG_PREFILL_BF16", "auto").lower() in ("0", "off", "false", "no"):
        return False
    native = {"avx512_bf16", "amx_bf16"} & cpu_flags()
    return bool(native) and torch.backends.mkldnn.is_available()


def _stack_linear(x: torch.Tensor, weight: BlockStack, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows <= block_kernel_max_rows(weight):
        out = weight.matmul(x, int8_activations=weight.int8_activations)
    else:
        out = _widened_linear(x, weight)
    return out if bias is None else out + bias


def embedding(ids: torch.Tensor, table: torch.Tensor | BlockQuantWeight) -> torch.Tensor:
    """Rows ``ids`` of the embedding table, float32 for a block table (only the rows asked for
    are widened: a mapped model never holds its float32 table)."""
    if isinstance(table, BlockQuantWeight):
        return block_quant_rows(table, ids)
    return F.embedding(ids, table)


def _small_float32_cpu_matmul(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A decode-sized float32 matmul on CPU that the C kernel takes (see linear)."""
    k = x.shape[-1]
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and x.dtype == torch.float32
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.numel() // max(k, 1) <= BLOCK_KERNEL_MAX_ROWS
        and k % QBLOCK == 0
        and 0 < k <= MAX_K
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and _block_kernel_builds()
    )


def resolve_weight_quant(
    weight_quant: str,
    device: torch.device,
    dtype: torch.dtype,
    model_path: str | None = None,
) -> str:
    """``auto`` is ``gguf`` for a ``.gguf`` checkpoint on CPU in float32 (when the C kernels
    build), ``none`` otherwise; int8 needs CPU; ``gguf`` (keep a GGUF file's own
    Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K blocks) needs CPU and float32.

    Raises ValueError for an unknown choice, or int8 or gguf where they cannot run.
    """
    if weight_quant not in WEIGHT_QUANTS:
        raise ValueError(
            f"weight_quant must be one of {', '.join(WEIGHT_QUANTS)}; got {weight_quant!r}"
        )
    on_cpu_fp32 = device.type == "cpu" and dtype == torch.float32
    if weight_quant == "auto":
        is_gguf = model_path is not None and str(model_path).lower().endswith(".gguf")
        return "gguf" if on_cpu_fp32 and is_gguf and _block_kernel_builds() else "none"
    if weight_quant == "gguf" and not on_cpu_fp32:
        raise ValueError("gguf block weights run on CPU in float32 only")
    if weight_quant == "int8" and device.type != "cpu":
        raise ValueError(f"int8 weight quantization runs on CPU only, not {device.type}")
    return weight_quant


@functools.cache
def _block_kernel_builds() -> bool:
    # without a C compiler every model still runs, through torch alone
    try:
        load_library("block_quant_matmul.c")
    except NativeBuildError as err:
        log.warning(
            "no C compiler for the block kernels: GGUF weights load as float32 and float32 "
            "decode matmuls run in torch (slower): %s",
            err,
        )
        return False
    return True


@functools.cache
def _block_tiles_build() -> bool:
    return _block_kernel_builds() and tile_min_rows() > 0


@functools.cache
def _amx_build() -> bool:
    return _block_kernel_builds() and amx_ready()


def _block_weights(model: nn.Module) -> list[BlockQuantWeight | BlockStack]:
    """The model's matmul weights in blocks (the LM head once, though a tied table is both)."""
    seen: dict[int, BlockQuantWeight | BlockStack] = {}
    for module in model.modules():
        for name, value in vars(module).items():
            if name != "embed_weight" and isinstance(value, BlockQuantWeight | BlockStack):
                seen.setdefault(id(value), value)
    return list(seen.values())


def quantize_model_(model: nn.Module) -> None:
    """Replace the decoder's matmul weights (q/k/v, o, gate/up, down, LM head) with
    :class:`Int8Weight`; norms, biases and the embedding lookup table stay as they are.

    A tied LM head gets its own int8 copy: lookups read a few rows and keep full precision.
    """
    for layer in model.layers:
        for owner, name in ((layer.attn, "qkv_weight"), (layer.attn, "o_weight")):
            _swap(owner, name)
        for name in ("gate_up_weight", "down_weight"):
            _swap(layer.mlp, name)
    if model.lm_head_weight is None:
        model.lm_head_weight = Int8Weight(model.embed_weight.detach())
    else:
        _swap(model, "lm_head_weight")


def _swap(module: nn.Module, name: str) -> None:
    weight = getattr(module, name)
    delattr(module, name)
    setattr(module, name, Int8Weight(weight.detach()))


def keep_dense_block_weights_(model: nn.Module, max_bytes: int) -> int:
    """Keep the float32 matrix beside every block weight of ``model`` if all of them fit in
    ``max_bytes``; returns the bytes kept (0 when they do not fit).

    A prefill-sized matmul otherwise dequantizes each matrix again on every forward: a fixed
    cost per step that no prefix or chunk reuse can remove, and the larger share of a short
    prefill's time. Decode keeps reading the blocks (a fifth of the bytes). The matrix is kept in
    the prefill GEMM's packed layout (engine/packed_gemm.py), in the same bytes.
    """
    weights = _block_weights(model)
    total = dense_block_bytes(model)
    if not weights or total > max_bytes:
        return 0
    for weight in weights:
        weight.dense = pack_weight(_widened(weight))
    return total


def dense_block_bytes(model: nn.Module) -> int:
    """What keep_dense_block_weights_ would keep: float32 beside every block weight."""
    return sum(w.shape[0] * w.shape[1] * 4 for w in _block_weights(model))


def resolve_int8_activations(choice: bool | str, model: nn.Module) -> bool:
    """Whether the block weights of ``model`` take int8 activations, and set them so.

    ``auto`` turns them on where every block weight is a GGUF file's K-quant rows (a Q4_K_M or
    Q5_K_M file's matrices) and the host has AVX2 or AVX-512 VNNI: there llama.cpp's own
    arithmetic (q8k_act.h) decodes 2.3x faster than float32 activations on the 1.5B benchmark
    model, and it is what the file's users get from llama.cpp. Plane kinds (Q4_0, Q4_1, Q8_0, as
    the packaged model) keep float32, the dequantized model's logits."""
    if not (isinstance(choice, bool) or choice == "auto"):
        raise ValueError(f"int8_activations must be True, False or 'auto', got {choice!r}")
    if choice == "auto":
        weights = _block_weights(model)
        parts = [p for w in weights for p in (w.parts if isinstance(w, BlockStack) else (w,))]
        choice = bool(parts) and all(p.is_kquant for p in parts) and q8_activations_fast()
    return bool(choice) and use_int8_activations_(model)


def use_int8_activations_(model: nn.Module) -> bool:
    """Let every block weight of ``model`` take int8 activations in decode-sized matmuls
    (kernels/csrc/q8_act.h); False, changing nothing, when the model has no block weights.
    Warns where the host has neither AVX-512 VNNI nor AVX2: there the int8 path is portable C,
    slower than float32."""
    weights = _block_weights(model)
    if not weights:
        log.warning("int8_activations asked for, but the model has no GGUF block weights")
        return False
    if not q8_activations_fast():
        log.warning("int8_activations on a CPU without AVX2 or AVX-512 VNNI: slower than float32")
    for weight in weights:
        for part in weight.parts if isinstance(weight, BlockStack) else (weight,):
            part.int8_activations = True
    return True


def use_block_weights_(model: nn.Module, blocks: dict[str, BlockQuantWeight]) -> None:
    """Swap in block weights by attribute path (``layers.3.mlp.down_weight``); each must have
    the shape of the matrix it replaces."""
    for path, weight in blocks.items():
        *owner_path, name = path.split(".")
        owner = model.get_submodule(".".join(owner_path)) if owner_path else model
        current = getattr(owner, name, None)
        if name == "lm_head_weight" and current is None:
            current = model.embed_weight  # tied head: the lookup table stays float
        if current is None or tuple(current.shape) != tuple(weight.shape):
            raise ValueError(f"{path}: block weight {tuple(weight.shape)} fits no matrix there")
        if name in owner._parameters:
            delattr(owner, name)
        setattr(owner, name, weight)

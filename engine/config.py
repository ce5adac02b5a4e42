"""The engine's own configuration: plain values, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

# "reference": the Triton kernels' plain-torch references, for tests (slow); the service's
# settings do not offer it
ATTENTION_BACKENDS = ("auto", "torch", "native", "triton", "reference")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
WEIGHT_QUANTS = ("auto", "none", "int8", "gguf")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to start; raises ValueError on any invalid value.

    ``num_kv_blocks=None`` and ``kv_cache_gb=0`` let the model runner size the KV pool from
    memory (``gpu_memory_fraction`` of the device); ``max_model_len=None`` means the model's own
    limit. ``max_num_batched_tokens`` must cover one decode token for each of ``max_num_seqs``.
    ``weight_quant``: ``gguf`` keeps a GGUF checkpoint's own blocks for the matmuls (Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; CPU, float32): the same matrices as ``none``, a fifth to
    a third of the bytes to read per decode step; ``none`` keeps the weights in ``dtype``;
    ``auto`` (the default) is gguf for a .gguf model on CPU in float32, none elsewhere. ``int8``
    (per-channel int8, CPU only) is opt-in: its bf16 activations make greedy output depend on
    how tokens were batched, so prefix cache on and off are only exactly equal in ``none`` and
    ``gguf``.

    ``kv_cache_dtype``: the KV cache's storage. ``auto`` is float16 for a float32 model on CPU
    (half the bytes a long-context decode step reads; attention math stays float32, greedy
    output agrees with a float32 cache over hundreds of tokens, tests/engine/test_kv_dtype.py)
    and the model's dtype elsewhere; ``float32`` keeps full precision. A dtype other than the
    model's is CPU only.

    Chunk reuse (``enable_chunk_reuse``, only with the prefix cache on) keeps the KV of the
    source bodies a prompt names and places it at new positions in later prompts, recomputing
    ``chunk_recompute_fraction`` of those tokens from layer ``chunk_select_layer`` on (1.0 equals
    plain prefill). Entries evicted from the pool go to a host-RAM tier of ``chunk_host_bytes``
    and, with ``chunk_disk_dir``, to a disk tier of ``chunk_disk_bytes`` that survives restarts.

    ``int8_activations`` (GGUF block weights on CPU): block-kernel matmuls round their inputs
    to int8 and sum integer products, as llama.cpp's CPU decode does: per block of 32 against
    plane kinds (kernels/csrc/q8_act.h), per super-block of 256 against a file's Q4_K and Q6_K
    rows (q8k_act.h, llama.cpp's own Q8_K). ``auto`` (the default) turns them on where every
    block weight is a file's K-quant rows (engine/quant.py's resolve_int8_activations): llama.cpp's
    arithmetic for those files, 2.3x the float32 path's decode speed on the 1.5B benchmark
    model. Elsewhere they are off: the float32 path gives the dequantized model's logits, and int8
    inputs make a token's logits depend on how tokens were batched where a long prefill takes the
    GEMM.

    ``cuda_graphs`` (CUDA only) replays decode steps of up to ``max_num_seqs`` sequences from
    captured graphs, one launch per step instead of hundreds (engine/decode_graphs.py).
    """

    model: str
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_gb: float = 0.0
    gpu_memory_fraction: float = 0.85
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_cache: bool = True
    attention_backend: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    weight_quant: str = "auto"
    device: str = "auto"
    cache_dir: str | None = None
    max_model_len: int | None = None
    enable_chunk_reuse: bool = True
    chunk_recompute_fraction: float = 0.3
    chunk_select_layer: int = 1
    chunk_host_bytes: int = 1 << 30
    chunk_disk_dir: str | None = None
    chunk_disk_bytes: int = 8 << 30
    cuda_graphs: bool = True
    int8_activations: bool | str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty path string, got {self.model!r}")
        _check_int("block_size", self.block_size, 1)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 1)
        if not _is_number(self.kv_cache_gb) or not self.kv_cache_gb >= 0:
            raise ValueError(f"kv_cache_gb must be >= 0 (0 = auto), got {self.kv_cache_gb}")
        if not _is_number(self.gpu_memory_fraction) or not 0 < self.gpu_memory_fraction <= 1:
            fraction = self.gpu_memory_fraction
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {fraction!r}")
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, self.max_num_seqs)
        if not isinstance(self.enable_prefix_cache, bool):
            raise ValueError(f"enable_prefix_cache must be a bool, got {self.enable_prefix_cache}")
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("weight_quant", self.weight_quant, WEIGHT_QUANTS)
        _check_choice("device", self.device, DEVICES)
        if self.cache_dir is not None and not isinstance(self.cache_dir, str):
            raise ValueError(f"cache_dir must be a path string or None, got {self.cache_dir!r}")
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        if not (isinstance(self.int8_activations, bool) or self.int8_activations == "auto"):
            raise ValueError(
                f"int8_activations must be True, False or 'auto', got {self.int8_activations!r}"
            )
        if not isinstance(self.enable_chunk_reuse, bool):
            raise ValueError(f"enable_chunk_reuse must be a bool, got {self.enable_chunk_reuse}")
        fraction = self.chunk_recompute_fraction
        if not _is_number(fraction) or not 0 <= fraction <= 1:
            raise ValueError(f"chunk_recompute_fraction must be in [0, 1], got {fraction!r}")
        _check_int("chunk_select_layer", self.chunk_select_layer, 1)
        _check_int("chunk_host_bytes", self.chunk_host_bytes, 0)
        _check_int("chunk_disk_bytes", self.chunk_disk_bytes, 0)
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be a bool, got {self.cuda_graphs}")
        if self.chunk_disk_dir is not None and not isinstance(self.chunk_disk_dir, str):
            disk_dir = self.chunk_disk_dir
            raise ValueError(f"chunk_disk_dir must be a path string or None, got {disk_dir!r}")

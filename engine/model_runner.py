"""The model runner: owns the model weights and the paged KV tensors, and runs one step at a time.

The scheduler hands it a list of :class:`StepItem` (new tokens of each sequence plus its block
table); it writes their K/V into the cache and returns logits for the items that want them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from prefixrag.engine.attention.cpu_backend import NativeAttention
from prefixrag.engine.attention.factory import make_backend
from prefixrag.engine.attention.metadata import (
    AttentionMetadata,
    SeqSpan,
    build_attention_metadata,
)
from prefixrag.engine.attention.scattered import (
    build_scattered_metadata,
    make_scattered_attention,
)
from prefixrag.engine.attention.torch_backend import TorchAttention
from prefixrag.engine.chunks.blend import (
    blend_forward,
    copy_slots,
    place_reused_kv,
    read_entry_kv,
    write_entry_kv,
)
from prefixrag.engine.chunks.reuse_plan import ReuseHit
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.decode_graphs import (
    Capture,
    CudaGraphCapture,
    DecodeGraphs,
    graph_batch_sizes,
)
from prefixrag.engine.host_memory import retain_freed_memory
from prefixrag.engine.memory_plan import MemoryPlan, available_memory, kv_budget_from_left
from prefixrag.engine.model import ForwardContext, LlamaModel
from prefixrag.engine.model_config import ModelConfig
from prefixrag.engine.native_decode import MAX_ROWS, native_decode_stack
from prefixrag.engine.quant import (
    embedding,
    keep_dense_block_weights_,
    quantize_model_,
    resolve_int8_activations,
    resolve_weight_quant,
)
from prefixrag.engine.tokenizer import Tokenizer
from prefixrag.engine.weights import MappedGGUF, check_checkpoint, load_checkpoint, map_gguf
from prefixrag.engine.weights.mapping import assign_mapped_weights

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The KV cache of a float32 model on CPU: at a long context a decode step reads about as many KV
# bytes as weight bytes, and 16 bits halve them (llama.cpp's default cache is float16 too).
# float16, not bfloat16: three more mantissa bits for the same bytes, and F16C widens it as fast
# as bfloat16's shift (bench/kv_dtype_bench.py: 296 vs 304 us per layer at 2k). Its range
# (+-65504) holds the packaged model's K/V; tests/engine/test_kv_dtype.py checks greedy output
# and logits against a float32 cache.
DEFAULT_CPU_KV_DTYPE = torch.float16
DEFAULT_CPU_KV_BYTES = 512 * 1024 * 1024
# float32 copies of GGUF block weights for prefill matmuls, when the whole model fits in this
DEFAULT_DENSE_PREFILL_BYTES = 1 << 30


@dataclass(slots=True)
class StepItem:
    """One sequence's share of a step.

    ``token_ids`` are the new tokens; ``start_pos`` is how many of the sequence's tokens are
    already in the KV cache; ``block_ids`` is its block table covering start_pos + len(token_ids).
    """

    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    needs_logits: bool = True

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a step item needs at least one new token")
        if self.start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {self.start_pos}")


def num_blocks_for_budget(budget_bytes: int, *, block_size: int, kv_bytes_per_token: int) -> int:
    """How many KV blocks fit in ``budget_bytes``; raises ValueError if not even one does."""
    num_blocks = int(budget_bytes) // (block_size * kv_bytes_per_token)
    if num_blocks < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds no block of {block_size} tokens "
            f"({kv_bytes_per_token} bytes per token)"
        )
    return num_blocks


def resolve_kv_dtype(
    kv_dtype: str | torch.dtype | None,
    model_dtype: torch.dtype,
    device: torch.device,
    *,
    can_narrow: bool = True,
) -> torch.dtype:
    """The KV cache's dtype: None is the model's; ``auto`` is float16 for a float32 model on CPU
    (see DEFAULT_CPU_KV_DTYPE) when the attention backend reads a narrower cache
    (``can_narrow``: native and torch do), else the model's. A dtype other than the model's is
    for CPU only, under such a backend (the Triton kernels read the cache in the model's
    dtype); ValueError otherwise."""
    if kv_dtype is None:
        return model_dtype
    if kv_dtype == "auto":
        is_cpu_f32 = device.type == "cpu" and model_dtype == torch.float32
        return DEFAULT_CPU_KV_DTYPE if is_cpu_f32 and can_narrow else model_dtype
    resolved = kv_dtype if isinstance(kv_dtype, torch.dtype) else _DTYPES.get(kv_dtype)
    if resolved is None:
        choices = ", ".join(_DTYPES)
        raise ValueError(f"unknown kv cache dtype {kv_dtype!r}; choose from auto, {choices}")
    if resolved != model_dtype and (device.type != "cpu" or not can_narrow):
        raise ValueError(
            f"a {resolved} KV cache under a {model_dtype} model runs on CPU only, with the "
            f"native or torch attention backend (here {device})"
        )
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``auto``/None means float32 on CPU and bfloat16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto`` means CUDA when there is a GPU, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class ModelRunner:
    """Loads a Llama-family checkpoint, allocates the KV pool and runs batched steps, as an
    :class:`EngineConfig` says.

    The pool holds ``num_kv_blocks`` blocks of ``block_size`` tokens; give ``num_kv_blocks`` or
    a budget ``kv_cache_gb`` (default: sized from available memory on CPU, ``gpu_memory_fraction``
    of free memory on CUDA). ``cache_dir`` keeps tokenizers so later starts are fast.
    ``weight_quant`` (see :func:`engine.quant.resolve_weight_quant`) picks how the matmul weights
    are stored: as loaded, per-channel int8, or a GGUF file's own blocks, mapped.
    ``int8_activations`` rounds the inputs of block-weight matmuls to int8. ``kv_cache_dtype``
    (see :func:`resolve_kv_dtype`) picks the KV cache's storage; on CPU it may be 16-bit under a
    float32 model (keys and values rounded on store, attention math in float32).
    :meth:`from_config` builds one with random weights instead (benchmarks).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        dense_prefill_bytes: int = DEFAULT_DENSE_PREFILL_BYTES,
        memory_limit_bytes: int | None = None,
    ) -> None:
        """The checkpoint ``config.model``, run as ``config`` says (its model, KV, device and
        chunk host fields; the scheduler's are not read). ``dense_prefill_bytes`` caps the dense
        copies kept beside GGUF blocks for prefill; ``memory_limit_bytes`` stands in for the
        host's available memory in the memory plan (tests, benchmarks)."""
        self.model_path = config.model
        self.cache_dir = config.cache_dir
        self._tokenizer: Tokenizer | None = None
        source = check_checkpoint(config.model)
        run_device = resolve_device(config.device)
        run_dtype = resolve_dtype(config.dtype, run_device)
        quant = resolve_weight_quant(config.weight_quant, run_device, run_dtype, self.model_path)
        weights: dict[str, torch.Tensor] | MappedGGUF
        if quant == "gguf":
            if source.is_dir():
                raise ValueError(f"weight_quant gguf needs a .gguf checkpoint, not {source}")
            # the file's blocks, mapped: nothing widened to float32 but norms and biases
            weights = map_gguf(source)
            model_config = weights.config
        else:
            model_config, weights = load_checkpoint(source, run_dtype)
        self._setup(
            model_config,
            weights,
            config,
            dense_prefill_bytes=dense_prefill_bytes,
            memory_limit_bytes=memory_limit_bytes,
        )

    @classmethod
    def from_config(
        cls,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        *,
        seed: int = 0,
    ) -> ModelRunner:
        """A runner of the shape ``model_config`` with random weights (norms one, the rest
        N(0, 0.02) from ``seed``), made on the device directly; nothing is read from disk, and
        ``config.model`` only names the runner. The chunk host tier is not planned for."""
        config = config or EngineConfig(model="<random weights>")
        runner = cls.__new__(cls)
        runner.model_path = f"<random weights, seed {seed}>"
        runner.cache_dir = None
        runner._tokenizer = tokenizer
        unplanned = dataclasses.replace(config, chunk_host_bytes=0)
        runner._setup(model_config, None, unplanned, seed=seed)
        return runner

    def _setup(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor] | MappedGGUF | None,
        engine: EngineConfig,
        *,
        seed: int = 0,
        dense_prefill_bytes: int = DEFAULT_DENSE_PREFILL_BYTES,
        memory_limit_bytes: int | None = None,
    ) -> None:
        self.device = resolve_device(engine.device)
        if self.device.type == "cpu":
            retain_freed_memory()  # prefill buffers come back without page faults
        self.dtype = resolve_dtype(engine.dtype, self.device)
        self.weight_quant = resolve_weight_quant(
            engine.weight_quant, self.device, self.dtype, self.model_path
        )
        self.block_size = block_size = engine.block_size
        self.model_config: ModelConfig = config
        self.dense_prefill_bytes = dense_prefill_bytes
        self.dense_weight_bytes = (
            0  # kept beside GGUF block weights (see keep_dense_block_weights_)
        )
        self.max_model_len = min(config.max_position_embeddings, engine.max_model_len or 1 << 62)
        # The backend comes first: a kernel backend also decides the model's norm and RoPE ops.
        self.backend = make_backend(engine.attention_backend, self.device, self.dtype)
        # blended prefill's later layers: queries at scattered positions over the paged cache
        self.scattered_backend = make_scattered_attention(engine.attention_backend, self.device)
        self.model = self._build_model(config, tensors, seed)
        self.int8_activations = resolve_int8_activations(engine.int8_activations, self.model)
        self.scale = config.head_dim**-0.5
        self.kv_dtype = resolve_kv_dtype(
            engine.kv_cache_dtype,
            self.dtype,
            self.device,
            can_narrow=isinstance(self.backend, NativeAttention | TorchAttention),
        )
        elem = self.kv_dtype.itemsize
        self.kv_bytes_per_token = (
            2 * config.num_layers * config.num_kv_heads * config.head_dim * elem
        )
        on_cpu = self.device.type == "cpu"
        available = memory_limit_bytes or (available_memory() if on_cpu else 0)
        fixed = MemoryPlan(
            self.mapped_weight_bytes, self.copied_weight_bytes, self.dense_weight_bytes, 0,
            engine.chunk_host_bytes, self._scratch_bytes(config), available,
        )  # fmt: skip
        num_blocks = engine.num_kv_blocks
        if num_blocks is None:
            block_bytes = block_size * self.kv_bytes_per_token
            budget = int(engine.kv_cache_gb * 2**30) or (
                kv_budget_from_left(
                    available,
                    fixed.total,
                    fraction=0.5,
                    cap=DEFAULT_CPU_KV_BYTES,
                    floor=block_bytes,
                )
                if on_cpu
                else self._default_kv_budget(engine.gpu_memory_fraction)
            )
            num_blocks = num_blocks_for_budget(
                budget, block_size=block_size, kv_bytes_per_token=self.kv_bytes_per_token
            )
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        kv_pool = num_blocks * block_size * self.kv_bytes_per_token if on_cpu else 0
        self.memory_plan = dataclasses.replace(fixed, kv_pool=kv_pool)
        if on_cpu:
            # refused before the pool is allocated, never an OOM kill in mid-request
            self.memory_plan.check()
            log.info("%s", self.memory_plan.summary())
        self.num_blocks = num_blocks
        self.kv_caches = self._allocate_kv(config, num_blocks)
        # GGUF block weights or float32 matrices under the native backend: small decode steps
        # run as one C call
        self.decode_stack = (
            native_decode_stack(
                self.model, self.kv_caches, self.scale, int8_activations=self.int8_activations
            )
            if isinstance(self.backend, NativeAttention)
            else None
        )
        self.decode_graphs: DecodeGraphs | None = None  # see capture_decode_graphs

    def _build_model(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor] | MappedGGUF | None,
        seed: int,
    ) -> LlamaModel:
        with torch.device("meta"):
            model = LlamaModel(config, self.max_model_len, self.backend.fused_ops)
        self.mapped_weight_bytes = self.copied_weight_bytes = 0
        if isinstance(tensors, MappedGGUF):
            assign_mapped_weights(model, tensors)
            self.mapped_weight_bytes = tensors.mapped_bytes
            self.copied_weight_bytes = tensors.copied_bytes
        elif tensors is None:
            _random_init_(model, self.device, self.dtype, seed)
        else:
            model.load_hf_weights(tensors)
        model = model.to(device=self.device, dtype=self.dtype).eval()
        if not isinstance(tensors, MappedGGUF):
            self.copied_weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if self.weight_quant == "gguf":
            if not isinstance(tensors, MappedGGUF):
                raise ValueError(
                    f"weight_quant gguf needs a .gguf checkpoint, not {self.model_path}"
                )
            self.dense_weight_bytes = keep_dense_block_weights_(model, self.dense_prefill_bytes)
        if self.weight_quant == "int8":
            quantize_model_(model)
        return model

    def _scratch_bytes(self, config: ModelConfig, step_tokens: int = 2048) -> int:
        """A prefill step's float32 activations (hidden, q/k/v, gate/up and attention for
        ``step_tokens``) and the largest matrix widened for it where no dense copy is kept."""
        c = config
        width = 4 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        activations = step_tokens * (width + 3 * c.intermediate_size) * 4
        widened = 0 if self.dense_weight_bytes else 2 * c.intermediate_size * c.hidden_size * 4
        return activations + widened + c.vocab_size * 4 * 16

    def _default_kv_budget(self, fraction: float) -> int:
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_BYTES
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free * fraction)

    def _allocate_kv(self, config: ModelConfig, num_blocks: int) -> list[tuple[torch.Tensor, ...]]:
        # one allocation; per layer k_cache, v_cache: [num_blocks, block_size, Hkv, D]
        shape = (2, config.num_layers, num_blocks, self.block_size, config.num_kv_heads)
        # zeros, not empty: masked-out padding rows must never hold NaN (0 * NaN poisons SDPA).
        pool = torch.zeros(*shape, config.head_dim, dtype=self.kv_dtype, device=self.device)
        self.kv_pool = pool
        return [(pool[0, i], pool[1, i]) for i in range(config.num_layers)]

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        """How many of this runner's KV blocks ``budget_bytes`` would hold."""
        return num_blocks_for_budget(
            budget_bytes, block_size=self.block_size, kv_bytes_per_token=self.kv_bytes_per_token
        )

    def kv_fingerprint(self) -> dict[str, str | int]:
        """What makes this runner's KV what it is: KV saved by a runner of another fingerprint
        (the chunk disk tier's files) is not valid here."""
        config = self.model_config
        fingerprint: dict[str, str | int] = {
            "model": f"{self.model_path}|{self.weight_quant}",
            "dtype": str(self.dtype).removeprefix("torch."),
            "block_size": self.block_size,
            "num_layers": config.num_layers,
            "num_kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
        }
        # only when it differs, so that caches written with the KV in the model's dtype keep
        # their fingerprint (and their files)
        if self.kv_dtype != self.dtype:
            fingerprint["kv_dtype"] = str(self.kv_dtype).removeprefix("torch.")
        if self.int8_activations:  # short prefills' KV differs in the last bits
            fingerprint["activations"] = "int8"
        return fingerprint

    @property
    def tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer (loaded on first use, cached under ``cache_dir``)."""
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_model_path(self.model_path, cache_dir=self.cache_dir)
        return self._tokenizer

    @property
    def can_capture_graphs(self) -> bool:
        """Whether decode steps can be captured as CUDA graphs: a CUDA device and a backend
        whose launches never read device values on the host (the Triton kernels)."""
        return self.device.type == "cuda" and getattr(self.backend, "graph_safe", False)

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head, i.e. the width of the returned logits."""
        return self.model_config.vocab_size

    @torch.inference_mode()
    def run(self, items: list[StepItem], *, all_logits: bool = False) -> torch.Tensor:
        """Run one step and return float32 logits, one row per item with ``needs_logits``, in
        item order (its last new token; with ``all_logits``, every new token of those items).

        Single-token items go through the decode path, the rest through extend.
        """
        if not items:
            raise ValueError("run() needs at least one step item")
        for item in items:
            self._check_item(item)
        order = [i for i, it in enumerate(items) if len(it.token_ids) == 1]
        order += [i for i, it in enumerate(items) if len(it.token_ids) > 1]
        token_ids: list[int] = []
        positions: list[int] = []
        first_row = [0] * len(items)
        for i in order:
            item = items[i]
            first_row[i] = len(token_ids)
            token_ids.extend(item.token_ids)
            positions.extend(range(item.start_pos, item.start_pos + len(item.token_ids)))
        num_decode = sum(len(items[i].token_ids) == 1 for i in order)
        spans = [
            SeqSpan(items[i].start_pos, len(items[i].token_ids), items[i].block_ids) for i in order
        ]
        meta = build_attention_metadata(
            spans[:num_decode],
            spans[num_decode:],
            block_size=self.block_size,
            scale=self.scale,
            device=self.device,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        if self.decode_stack is not None and num_decode == len(token_ids) <= MAX_ROWS:
            hidden = self.decode_stack.run(
                embedding(input_ids, self.model.embed_weight),
                pos,
                meta.slot_mapping,
                meta.decode_block_tables,
                meta.decode_seq_lens,
            )
        elif self.decode_graphs is not None and self.decode_graphs.can_run(meta):
            hidden = self.decode_graphs.run(input_ids, pos, meta)
        else:
            ctx = ForwardContext(self.backend, meta, self.kv_caches)
            hidden = self.model(input_ids, pos, ctx)  # [T, hidden]
        rows = self._logit_rows(items, first_row, all_logits)
        if not rows:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        return self.model.logits(hidden[torch.tensor(rows, device=self.device)])

    @torch.inference_mode()
    def capture_decode_graphs(self, max_batch: int, capture: Capture | None = None) -> None:
        """Capture decode steps of up to ``max_batch`` sequences as CUDA graphs, which
        :meth:`run` then replays for every decode-only step that fits (engine/decode_graphs.py).
        ``capture`` defaults to CUDA graph capture; tests pass another. Runs once per runner."""
        if self.decode_graphs is not None and self.decode_graphs.max_batch >= max_batch:
            return
        if capture is None:
            if not self.can_capture_graphs:
                raise ValueError("CUDA graphs need a CUDA device and the Triton backend")
            capture = CudaGraphCapture()

        def forward(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
            return self.model(ids, pos, ForwardContext(self.backend, meta, self.kv_caches))

        self.decode_graphs = DecodeGraphs(
            forward,
            batch_sizes=graph_batch_sizes(max_batch),
            max_blocks=-(-self.max_model_len // self.block_size),
            scale=self.scale,
            device=self.device,
            capture=capture,
        )

    @torch.inference_mode()
    def run_blend(
        self, item: StepItem, hits: list[ReuseHit], *, fraction: float, select_layer: int
    ) -> tuple[torch.Tensor, int]:
        """Prefill ``item`` (the rest of one prompt) placing the cached bodies ``hits`` instead
        of computing them, recomputing ``fraction`` of their tokens (see engine/chunks/blend.py).

        Returns the last token's float32 logits [1, vocab] and how many reused tokens were
        recomputed.
        """
        self._check_item(item)
        start, n = item.start_pos, len(item.token_ids)
        for hit in hits:
            if hit.start < start or hit.end >= start + n:
                raise ValueError(
                    f"reused body {hit.start}:{hit.end} is not inside {start}:{start + n}"
                )
        select_layer = min(select_layer, self.model_config.num_layers - 1)
        cos_sin = self.model.cos_sin_cache
        place_reused_kv(
            self.kv_pool, hits, item.block_ids, first_layer=select_layer, cos_sin_cache=cos_sin
        )
        reused = torch.zeros(n, dtype=torch.bool, device=self.device)
        for hit in hits:
            reused[hit.start - start : hit.end - start] = True
        meta = build_attention_metadata(
            [],
            [SeqSpan(start, n, item.block_ids)],
            block_size=self.block_size,
            scale=self.scale,
            device=self.device,
        )
        positions = torch.arange(start, start + n, device=self.device)

        def scattered_ctx(rows: torch.Tensor) -> ForwardContext:
            sub_meta = build_scattered_metadata(
                positions.index_select(0, rows).tolist(),
                item.block_ids,
                block_size=self.block_size,
                scale=self.scale,
                device=self.device,
            )
            return ForwardContext(self.scattered_backend, sub_meta, self.kv_caches)  # type: ignore[arg-type]

        input_ids = torch.tensor(item.token_ids, dtype=torch.int64, device=self.device)
        result = blend_forward(
            self.model,
            input_ids,
            positions,
            reused,
            ForwardContext(self.backend, meta, self.kv_caches),
            scattered_ctx,
            fraction=fraction,
            select_layer=select_layer,
        )
        return self.model.logits(result.last_hidden), result.num_recomputed

    @torch.inference_mode()
    def copy_chunk(
        self, src_block_ids: list[int], start: int, num_tokens: int, dst_block_ids: list[int]
    ) -> None:
        """Copy the K/V of tokens ``start:start + num_tokens`` of a sequence into the start of
        a chunk entry's blocks."""
        copy_slots(self.kv_pool, src_block_ids, start, num_tokens, dst_block_ids)

    @torch.inference_mode()
    def read_chunk(
        self, block_ids: list[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk entry's K and V, copied out of the pool to host memory."""
        k, v = read_entry_kv(self.kv_pool, block_ids, num_tokens)
        return k.cpu(), v.cpu()

    @torch.inference_mode()
    def write_chunk(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Fill a chunk entry's blocks with K and V from a slower tier."""
        write_entry_kv(self.kv_pool, block_ids, k, v)

    @staticmethod
    def _logit_rows(items: list[StepItem], first_row: list[int], all_logits: bool) -> list[int]:
        rows: list[int] = []
        for item, start in zip(items, first_row, strict=True):
            if not item.needs_logits:
                continue
            end = start + len(item.token_ids)
            rows.extend(range(start, end) if all_logits else (end - 1,))
        return rows

    def _check_item(self, item: StepItem) -> None:
        end = item.start_pos + len(item.token_ids)
        if end > self.max_model_len:
            raise ValueError(f"sequence of {end} tokens exceeds max_model_len {self.max_model_len}")
        if len(item.block_ids) * self.block_size < end:
            raise ValueError(f"{len(item.block_ids)} blocks cannot hold {end} tokens")
        if min(item.block_ids) < 0 or max(item.block_ids) >= self.num_blocks:
            raise ValueError(f"block ids must lie in [0, {self.num_blocks})")
        if min(item.token_ids) < 0 or max(item.token_ids) >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")


def _random_init_(model: LlamaModel, device: torch.device, dtype: torch.dtype, seed: int) -> None:
    # Made in the target dtype on the target device: an 8B model never exists in fp32 or on CPU.
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            value = torch.empty(param.shape, dtype=dtype, device=device)
            if name == "weight" and param.dim() == 1:  # RMSNorm scales
                value.fill_(1.0)
            else:
                value.normal_(0.0, 0.02, generator=gen)
            setattr(module, name, nn.Parameter(value, requires_grad=False))

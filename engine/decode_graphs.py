"""Decode steps replayed from captured CUDA graphs, one graph per padded batch size.

A decode step of a Llama-8B-shaped model launches about ten kernels per layer, some 300 in all.
On the GPU each runs for microseconds, but launching one from Python costs about as long, so an
eager step at batch 1 is bound by the host, not by memory bandwidth. A captured step is one
launch (vLLM and SGLang capture decode the same way).

A graph reads fixed addresses, so every input lives in a static buffer sized for the largest
batch: token ids, positions, slot mapping, sequence lengths and block tables as wide as
``max_model_len`` needs. A step copies its own values in. Rows past the real batch are padding:
they write no KV (slot -1), attend to the first position of block 0, and their output is
dropped. The paged decode kernel sizes its splits from the table's width, so the captured launch
stays valid for any context up to ``max_model_len``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from prefixrag.engine.attention.metadata import AttentionMetadata

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
# Turns a zero-argument forward into its replay; on CUDA, capture_cuda_graph.
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes to capture: 1, 2, 4, 8, then every multiple of 16 up to
    ``max_batch`` (and ``max_batch`` itself), so padding wastes at most 15 rows past 8."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted({*sizes, max_batch})


class CudaGraphCapture:
    """Captures forwards into CUDA graphs that share one memory pool (the largest first, so the
    smaller ones fit in its memory)."""

    def __init__(self) -> None:
        self._pool: object | None = None

    def __call__(self, forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        forward()  # compiles the Triton kernels and warms the allocator outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = forward()
        self._pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class DecodeGraphs:
    """Replays of ``forward`` (ids [B], positions [B], metadata -> hidden [B, H]) for decode
    batches of up to ``max(batch_sizes)`` sequences with contexts of up to ``max_blocks``
    blocks."""

    def __init__(
        self,
        forward: Forward,
        *,
        batch_sizes: list[int],
        max_blocks: int,
        scale: float,
        device: torch.device,
        capture: Capture,
    ) -> None:
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {batch_sizes}")
        self.batch_sizes = sorted(batch_sizes)
        self.max_batch = self.batch_sizes[-1]
        self.max_blocks = max_blocks
        b = self.max_batch

        def buffer(*shape: int, dtype: torch.dtype, fill: int) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.input_ids = buffer(b, dtype=torch.int64, fill=0)
        self.positions = buffer(b, dtype=torch.int64, fill=0)
        self.slot_mapping = buffer(b, dtype=torch.int64, fill=-1)
        self.seq_lens = buffer(b, dtype=torch.int32, fill=1)
        self.block_tables = buffer(b, max_blocks, dtype=torch.int32, fill=0)
        empty = buffer(0, dtype=torch.int32, fill=0)
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        for size in reversed(self.batch_sizes):
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:size],
                scale=scale,
                num_decode_tokens=size,
                decode_block_tables=self.block_tables[:size],
                decode_seq_lens=self.seq_lens[:size],
                extend_block_tables=empty.reshape(0, 0),
                extend_prefix_lens=empty,
                extend_lens=empty,
                cu_extend=buffer(1, dtype=torch.int32, fill=0),
                decode_seq_lens_host=[],
                extend_prefix_lens_host=[],
                extend_lens_host=[],
            )
            ids, pos = self.input_ids[:size], self.positions[:size]
            self._replays[size] = capture(
                lambda ids=ids, pos=pos, meta=meta: forward(ids, pos, meta)
            )

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured batch size that holds ``num_seqs`` sequences, or None if none does."""
        return next((b for b in self.batch_sizes if b >= num_seqs), None)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Whether a decode-only step with this metadata fits a captured graph."""
        return (
            meta.num_decode_tokens == meta.slot_mapping.shape[0]
            and self.padded_size(meta.num_decode_tokens) is not None
            and meta.decode_block_tables.shape[1] <= self.max_blocks
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [n, H] of a decode-only step (see :meth:`can_run`). The result is a
        view of the graph's output, valid until the next replay."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        if size is None or not self.can_run(meta):
            raise ValueError(f"no captured graph fits a decode step of {n} sequences")
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.decode_seq_lens)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables)
        if size > n:  # padding rows: no KV write, one position of block 0
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].zero_()
        return self._replays[size]()[:n]

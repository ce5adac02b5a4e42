"""How close a decode runs to memory speed: the weight bytes a step reads times tokens/s, over
what a plain streaming read of those bytes reaches on this machine in the same run.

At batch 1 a decode step reads every matrix once, so tok/s x weight bytes is the bandwidth a
decode gets out of the machine; csrc/cpu_ops.c's stream_sum reads the file's tensor bytes (the
same mapped pages the engine reads) with the same threads, and that is the ceiling.
"""

from __future__ import annotations

import time
import warnings

import torch

from prefixrag.engine.weights import read_gguf_file
from prefixrag.kernels.cpu_ops import stream_sum


def weight_bytes_per_token(path: str) -> int:
    """Bytes of weights one batch-1 decode step reads from a GGUF file: every tensor, but the
    embedding only when it is also the LM head (tied); else a step reads one row of it."""
    tensors = read_gguf_file(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(t.nbytes for t in tensors if tied or t.name != "token_embd.weight")


def stream_gb_per_s(path: str, reads: int = 5) -> list[float]:
    """GB/s of ``reads`` streaming reads over the file's tensor bytes (after one untimed read
    that faults the pages in)."""
    file = read_gguf_file(path)
    start = min(t.offset for t in file.tensors)
    with warnings.catch_warnings():  # a read-only map; nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(file.data[start:])
    stream_sum(data)
    speeds = []
    for _ in range(reads):
        began = time.perf_counter()
        stream_sum(data)
        speeds.append(data.numel() / (time.perf_counter() - began) / 1e9)
    return speeds


def bandwidth_rows(metrics: dict, bytes_per_token: int, stream_gbps: float) -> dict:
    """For each decode metric (tok/s at batch 1): GB/s each side drew and its share of the
    streaming read."""
    rows = {}
    for key, row in metrics.items():
        if not key.startswith("decode_b1_") or row.get("ours") is None:
            continue
        rows[key] = {
            who: {
                "gb_per_s": row[who] * bytes_per_token / 1e9,
                "of_stream": row[who] * bytes_per_token / 1e9 / stream_gbps,
            }
            for who in ("ours", "theirs")
            if isinstance(row.get(who), float)
        }
    return rows

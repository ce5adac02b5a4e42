"""What the engine will hold in memory, added up at start, before any request runs.

A mapped GGUF file's pages count: a step reads every weight, so the file must stay resident or
decode reads it from disk. A plan that does not fit in the memory available is refused with a
message that names the numbers and the settings that change them, rather than an OOM kill in
the middle of a request. Pure Python: sizes in, a verdict out.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)
MIB = 1 << 20
# NOTE: the interpreter, torch, the tokenizer and the service's own state: measured at about
# 400 MiB resident for the packaged model's service before its weights (VmRSS), rounded up
RUNTIME_BYTES = 512 * MIB


class MemoryPlanError(ValueError):
    """The model and its caches do not fit in the memory available."""


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Bytes by use: ``weights_mapped`` read in place from the file's map, ``weights_copied``
    made at load (planes, norms, float matrices), ``dense_prefill`` float32 copies kept for
    prefill, ``kv_pool``, ``chunk_host`` (the chunk KV host tier's cap), ``scratch`` (a prefill
    step's activations and widened matrix), ``runtime`` (see RUNTIME_BYTES); ``available`` is
    what the host offers."""

    weights_mapped: int
    weights_copied: int
    dense_prefill: int
    kv_pool: int
    chunk_host: int
    scratch: int
    available: int
    runtime: int = RUNTIME_BYTES

    @property
    def total(self) -> int:
        return (
            self.weights_mapped + self.weights_copied + self.dense_prefill + self.kv_pool
            + self.chunk_host + self.scratch + self.runtime
        )  # fmt: skip

    def as_dict(self) -> dict[str, int]:
        """Every field in bytes, and the total (for /readyz)."""
        return {**asdict(self), "total": self.total}

    def summary(self) -> str:
        """One line for the start log."""
        parts = ", ".join(
            f"{k} {v / MIB:,.0f}" for k, v in asdict(self).items() if k != "available"
        )
        total, available = self.total / MIB, self.available / MIB
        return f"memory plan (MiB): {parts}; total {total:,.0f} of {available:,.0f} available"

    def check(self) -> None:
        """Raise MemoryPlanError when the plan does not fit."""
        if self.total <= self.available:
            return
        raise MemoryPlanError(
            f"the model does not fit: {self.summary()}. Lower PREFIXRAG_KV_CACHE_GB (the KV pool), "
            "PREFIXRAG_CHUNK_HOST_GB (the chunk host tier) or PREFIXRAG_MAX_MODEL_LEN, or pick a "
            "smaller model (PREFIXRAG_LLM)"
        )


def kv_budget_from_left(
    available: int, fixed: int, *, fraction: float, cap: int, floor: int
) -> int:
    """A CPU KV pool sized from what is left once ``fixed`` bytes are planned: ``fraction`` of it,
    at most ``cap`` and at least ``floor`` (one block: check() then refuses what cannot fit)."""
    left = max(available - fixed, 0)
    return max(min(int(left * fraction), cap), floor)


def available_memory(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int:
    """What this process may still take: MemAvailable, lowered to the cgroup's limit left."""
    available = _meminfo_available(Path(meminfo))
    limit = _cgroup_left(Path(cgroup))
    return min(available, limit) if limit is not None else available


def _meminfo_available(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{path} has no MemAvailable line")


def _cgroup_left(root: Path) -> int | None:
    limit_file, used_file = root / "memory.max", root / "memory.current"
    try:
        limit = limit_file.read_text().strip()
        used = int(used_file.read_text().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(int(limit) - used, 0)

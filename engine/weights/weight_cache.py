"""A disk cache of converted weights, so a GGUF is dequantized once and later loads are fast.

Entries are safetensors files named by a hash of (format version, absolute source path, size,
mtime). A changed source file gets a new key; a half-written entry never exists because each is
written to a temporary file in the same directory and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from prefixrag.engine.model_config import ModelConfig

CACHE_FORMAT_VERSION = 1


def cache_key(source: str | Path) -> str:
    """A hex key that changes whenever the source file's path, size or mtime changes."""
    stat = Path(source).stat()
    ident = f"{CACHE_FORMAT_VERSION}|{Path(source).resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


class WeightCache:
    """Stores and finds converted checkpoints (config + float32 tensors) under ``cache_dir``."""

    def __init__(self, cache_dir: str | Path) -> None:
        self.cache_dir = Path(cache_dir)

    def path_for(self, source: str | Path) -> Path:
        """Where the converted copy of ``source`` lives (whether or not it exists yet)."""
        return self.cache_dir / f"weights-{cache_key(source)}.safetensors"

    def load(self, source: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]] | None:
        """The cached conversion of ``source``, or None when there is none (or it is unreadable)."""
        path = self.path_for(source)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                config = ModelConfig.from_dict(json.loads(meta["config"]))
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        except (OSError, KeyError, TypeError, ValueError, SafetensorError):
            return None
        return config, tensors

    def store(
        self, source: str | Path, config: ModelConfig, tensors: dict[str, torch.Tensor]
    ) -> Path:
        """Write the conversion of ``source`` atomically and return its path."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        path = self.path_for(source)
        meta = {"config": json.dumps(config.to_dict()), "source": str(Path(source).resolve())}
        fd, tmp = tempfile.mkstemp(dir=self.cache_dir, prefix=".weights-", suffix=".tmp")
        os.close(fd)
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=meta)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

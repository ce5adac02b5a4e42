"""Checkpoint loading: a GGUF file or a Hugging Face safetensors directory, by path."""

from __future__ import annotations

from pathlib import Path

import torch

from prefixrag.engine.model_config import ModelConfig
from prefixrag.engine.weights.gguf_loader import load_gguf
from prefixrag.engine.weights.hf_loader import load_hf_dir
from prefixrag.engine.weights.weight_cache import WeightCache


def load_checkpoint(
    path: str | Path, cache_dir: str | Path | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and HF-named tensors of the checkpoint at ``path``.

    A ``.gguf`` file is dequantized to float32; with ``cache_dir`` the result is cached there and
    later calls read the cache instead. A directory is read as config.json + safetensors.
    """
    source = Path(path)
    if source.is_dir():
        return load_hf_dir(source)
    if not source.is_file():
        raise ValueError(f"no model checkpoint at {source}")
    if source.suffix.lower() != ".gguf":
        raise ValueError(f"{source} is neither a .gguf file nor a Hugging Face directory")
    cache = WeightCache(cache_dir) if cache_dir is not None else None
    if cache is not None and (hit := cache.load(source)) is not None:
        return hit
    config, tensors = load_gguf(str(source))
    if cache is not None:
        cache.store(source, config, tensors)
    return config, tensors


__all__ = ["WeightCache", "load_checkpoint", "load_gguf", "load_hf_dir"]

"""Checkpoint loading: a GGUF file (mapped, see gguf_blocks) or a Hugging Face safetensors
directory, by path. Nothing is converted to disk."""

from __future__ import annotations

from pathlib import Path

import torch

from prefixrag.engine.model_config import ModelConfig
from prefixrag.engine.weights.gguf_blocks import MappedGGUF, check_gguf, map_gguf
from prefixrag.engine.weights.gguf_file import GGUFFile, read_gguf_file
from prefixrag.engine.weights.gguf_loader import load_gguf
from prefixrag.engine.weights.hf_loader import load_hf_dir


def check_checkpoint(path: str | Path) -> Path:
    """``path`` as a checkpoint: a ``.gguf`` file or a directory; ValueError otherwise."""
    source = Path(path)
    if source.is_dir():
        return source
    if not source.is_file():
        raise ValueError(f"no model checkpoint at {source}")
    if source.suffix.lower() != ".gguf":
        raise ValueError(f"{source} is neither a .gguf file nor a Hugging Face directory")
    return source


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and HF-named dense tensors of the checkpoint at ``path``: a ``.gguf`` file is
    dequantized tensor by tensor to ``dtype`` (for runners that do not read blocks: CUDA, int8,
    or no C compiler); a directory is read as config.json + safetensors."""
    source = check_checkpoint(path)
    if source.is_dir():
        return load_hf_dir(source)
    return load_gguf(str(source), dtype)


__all__ = [
    "GGUFFile",
    "MappedGGUF",
    "check_checkpoint",
    "check_gguf",
    "load_checkpoint",
    "load_gguf",
    "load_hf_dir",
    "map_gguf",
    "read_gguf_file",
]

"""Read a Hugging Face checkpoint directory: config.json plus one or more safetensors files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from prefixrag.engine.model_config import ModelConfig


def load_hf_dir(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and HF-named tensors (in their stored dtype) of a safetensors checkpoint directory."""
    root = Path(path)
    config_file = root / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{root} has no config.json")
    config = ModelConfig.from_hf_config(json.loads(config_file.read_text()))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root} has no *.safetensors weight files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return config, tensors
